// Parsing what another process sent: a message that does not parse is an
// INTERNAL error naming the field at fault.
#include "proto/received.h"

#include <string>

#include "gtest/gtest.h"
#include "pdserve/v1/worker.pb.h"

namespace pdserve::rpc {
namespace {

TEST(ReceivedTest, ValidMessageParses) {
  worker::v1::DecodeEvent ev;
  ev.mutable_chunk()->add_token_ids(7);
  ev.mutable_chunk()->set_text("caf\xc3\xa9");
  worker::v1::DecodeEvent got;
  ASSERT_TRUE(ParseReceived(ev.SerializeAsString(), &got).ok());
  EXPECT_EQ(got.chunk().text(), "caf\xc3\xa9");
}

TEST(ReceivedTest, InvalidUtf8NamesTheNestedStringField) {
  worker::v1::DecodeEvent ev;
  ev.mutable_chunk()->add_token_ids(7);
  ev.mutable_chunk()->set_text("caf\xc3");  // Serializes (with a logged error), does not parse.
  worker::v1::DecodeEvent got;
  const absl::Status s = ParseReceived(ev.SerializeAsString(), &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("pdserve.worker.v1.DecodeEvent"), std::string::npos) << s;
  EXPECT_NE(s.message().find("pdserve.v1.TokenChunk.text: not valid UTF-8"), std::string::npos) << s;
}

TEST(ReceivedTest, MalformedSubmessageNamesItsField) {
  worker::v1::PrefillEvent ev;
  ev.mutable_first()->mutable_token()->set_token_id(3);
  MakeUnparseable(&ev);
  worker::v1::PrefillEvent got;
  const absl::Status s = ParseReceived(ev.SerializeAsString(), &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("pdserve.worker.v1.PrefillEvent.first: malformed wire data"), std::string::npos) << s;
}

TEST(ReceivedTest, GarbageIsMalformedWireData) {
  worker::v1::DecodeEvent got;
  const absl::Status s = ParseReceived(std::string("\xff\xff\xff", 3), &got);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_NE(s.message().find("pdserve.worker.v1.DecodeEvent: malformed wire data"), std::string::npos) << s;
}

TEST(ReceivedTest, FaultCountsStreams) {
  UnparseableFault none(0), two(2), all(-1);
  EXPECT_FALSE(none.Take());
  EXPECT_TRUE(two.Take());
  EXPECT_TRUE(two.Take());
  EXPECT_FALSE(two.Take());
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(all.Take());
}

}  // namespace
}  // namespace pdserve::rpc
