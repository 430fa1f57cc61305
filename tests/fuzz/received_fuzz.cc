// libFuzzer target: parsing messages that workers send the router
// (proto/received.h), bytes that arrive from the network.
//
// The first input byte picks the message type (DecodeEvent, PrefillEvent,
// WorkerInfo), the rest is the message. Promises: no crash; a refusal is
// INTERNAL and names the message type; whatever is accepted serializes to
// bytes that are accepted again.
//
// The entry point is LLVMFuzzerTestOneInput for the fuzzer; the corpus replay
// test compiles this file with -DPDSERVE_FUZZ_ENTRY=<name>.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "pdserve/v1/worker.pb.h"
#include "proto/received.h"

#ifndef PDSERVE_FUZZ_ENTRY
#define PDSERVE_FUZZ_ENTRY LLVMFuzzerTestOneInput
#endif

namespace {
[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "received_fuzz: %s\n", what);
  std::abort();
}
}  // namespace

extern "C" int PDSERVE_FUZZ_ENTRY(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  std::unique_ptr<google::protobuf::Message> msg;
  switch (data[0] % 3) {
    case 0: msg = std::make_unique<pdserve::worker::v1::DecodeEvent>(); break;
    case 1: msg = std::make_unique<pdserve::worker::v1::PrefillEvent>(); break;
    default: msg = std::make_unique<pdserve::worker::v1::WorkerInfo>(); break;
  }
  const absl::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  const absl::Status s = pdserve::rpc::ParseReceived(bytes, msg.get());
  if (!s.ok()) {
    if (s.code() != absl::StatusCode::kInternal) Fail("a refusal that is not INTERNAL");
    if (s.message().find(msg->GetDescriptor()->full_name()) == absl::string_view::npos) {
      Fail("a refusal that does not name the message type");
    }
    return 0;
  }
  std::unique_ptr<google::protobuf::Message> again(msg->New());
  if (!pdserve::rpc::ParseReceived(msg->SerializeAsString(), again.get()).ok()) {
    Fail("an accepted message re-serializes to bytes that are refused");
  }
  return 0;
}
