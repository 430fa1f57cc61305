// libFuzzer target: the KV handoff's control-message decoder (kv_transfer/
// wire.h), which reads bytes from the network.
//
// Promises: Decode never crashes on any input; whatever it accepts encodes
// back to bytes that decode again to a message that encodes identically
// (a stable round trip), so nothing accepted is half-understood.
//
// The entry point is LLVMFuzzerTestOneInput for the fuzzer; the corpus replay
// test compiles this file with -DPDSERVE_FUZZ_ENTRY=<name>.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "kv_transfer/wire.h"

#ifndef PDSERVE_FUZZ_ENTRY
#define PDSERVE_FUZZ_ENTRY LLVMFuzzerTestOneInput
#endif

extern "C" int PDSERVE_FUZZ_ENTRY(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<pdserve::kv::Message> m = pdserve::kv::Decode(bytes);
  if (!m.ok()) return 0;
  const std::string once = pdserve::kv::Encode(*m);
  absl::StatusOr<pdserve::kv::Message> again = pdserve::kv::Decode(once);
  if (!again.ok()) {
    std::fprintf(stderr, "wire_fuzz: an accepted message re-encodes to bytes Decode refuses\n");
    std::abort();
  }
  if (pdserve::kv::Encode(*again) != once) {
    std::fprintf(stderr, "wire_fuzz: the round trip is not stable\n");
    std::abort();
  }
  return 0;
}
