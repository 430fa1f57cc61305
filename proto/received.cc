#include "proto/received.h"

#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/common.h"
#include "google/protobuf/unknown_field_set.h"

namespace pdserve::rpc {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::UnknownField;
using google::protobuf::UnknownFieldSet;

bool ValidUtf8(absl::string_view s) {
  return google::protobuf::internal::IsStructurallyValidUTF8(s.data(), static_cast<int>(s.size()));
}

}  // namespace

std::string DescribeParseFailure(const Descriptor& type, absl::string_view bytes) {
  UnknownFieldSet fields;
  if (!fields.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::StrCat(type.full_name(), ": malformed wire data");
  }
  for (int i = 0; i < fields.field_count(); ++i) {
    const UnknownField& f = fields.field(i);
    const FieldDescriptor* fd = type.FindFieldByNumber(f.number());
    if (fd == nullptr || f.type() != UnknownField::TYPE_LENGTH_DELIMITED) continue;
    const std::string& payload = f.length_delimited();
    if (fd->type() == FieldDescriptor::TYPE_STRING && fd->file()->syntax() == google::protobuf::FileDescriptor::SYNTAX_PROTO3 && !ValidUtf8(payload)) {
      return absl::StrCat(fd->full_name(), ": not valid UTF-8");
    }
    if (fd->type() == FieldDescriptor::TYPE_MESSAGE) {
      std::string inner = DescribeParseFailure(*fd->message_type(), payload);
      if (!inner.empty()) {
        // Name the path from the outer field down.
        return inner.rfind(fd->message_type()->full_name() + ": malformed", 0) == 0
                   ? absl::StrCat(fd->full_name(), ": malformed wire data")
                   : inner;
      }
    }
  }
  return "";
}

absl::Status ParseReceived(absl::string_view bytes, google::protobuf::Message* msg) {
  if (msg->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) return absl::OkStatus();
  std::string why = DescribeParseFailure(*msg->GetDescriptor(), bytes);
  if (why.empty()) why = "the data does not parse";
  return absl::InternalError(absl::StrCat("unparseable ", msg->GetDescriptor()->full_name(), " (", bytes.size(),
                                          " bytes): ", why));
}

void MakeUnparseable(google::protobuf::Message* msg) {
  msg->Clear();
  // A length-delimited field 1 whose content is a truncated varint tag.
  msg->GetReflection()->MutableUnknownFields(msg)->AddLengthDelimited(1, "\x08\xff");
}

}  // namespace pdserve::rpc
