// libFuzzer target: SafetensorsFile::Parse on arbitrary bytes.
//
// A refused input must get an error naming the file. An accepted one must
// describe tensors that lie inside the input and agree with their shape and
// dtype; every byte of every view is read (checksummed) so that a view
// reaching outside the input is caught by AddressSanitizer.
//
// The entry point is LLVMFuzzerTestOneInput for the fuzzer; the corpus replay
// test compiles this file with -DPDSERVE_FUZZ_ENTRY=<name> so that it can link
// both targets into one binary.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "model/safetensors.h"

#ifndef PDSERVE_FUZZ_ENTRY
#define PDSERVE_FUZZ_ENTRY LLVMFuzzerTestOneInput
#endif

namespace {

constexpr absl::string_view kDisplayName = "fuzz-input.safetensors";

// Keeps the checksum observable so the reads are not optimised away.
volatile uint64_t g_checksum_sink = 0;

// A broken promise of the parser: say which, then crash for the fuzzer.
[[noreturn]] void Fail(const char* what, absl::string_view detail) {
  std::fprintf(stderr, "safetensors_fuzz: %s: %.*s\n", what, static_cast<int>(detail.size()),
               detail.data());
  std::abort();
}

}  // namespace

extern "C" int PDSERVE_FUZZ_ENTRY(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto file = pdserve::SafetensorsFile::Parse(bytes, std::string(kDisplayName));
  if (!file.ok()) {
    if (!absl::StartsWith(file.status().message(), kDisplayName)) {
      Fail("error does not name the file", file.status().message());
    }
    return 0;
  }
  const uintptr_t input_begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t input_end = input_begin + size;
  uint64_t checksum = 0;
  for (const pdserve::TensorView& t : (*file)->tensors()) {
    const auto* p = static_cast<const uint8_t*>(t.data);
    const uintptr_t view_begin = reinterpret_cast<uintptr_t>(p);
    if (view_begin < input_begin || t.num_bytes > input_end - view_begin) {
      Fail("view outside the input", t.name);
    }
    if (static_cast<uint64_t>(t.NumElements()) * pdserve::DTypeSize(t.dtype) != t.num_bytes) {
      Fail("shape and dtype disagree with the byte count", t.name);
    }
    if ((*file)->Find(t.name) != &t) Fail("Find does not return the tensor", t.name);
    for (size_t i = 0; i < t.num_bytes; ++i) checksum = checksum * 31 + p[i];
  }
  g_checksum_sink = checksum;
  return 0;
}
