// libFuzzer target: the JSONL trace parser of `pdctl bench --trace`
// (tools/pdctl/bench_trace.h), which reads a file the user was handed.
//
// Promises: ParseTraceJsonl never crashes; a refused input's error names the
// source; an accepted trace has at most one entry per line and every entry
// within the documented bounds (so the benchmark never allocates more than
// kMaxTraceTokens tokens for one request).
//
// The entry point is LLVMFuzzerTestOneInput for the fuzzer; the corpus replay
// test compiles this file with -DPDSERVE_FUZZ_ENTRY=<name>.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "tools/pdctl/bench_trace.h"

#ifndef PDSERVE_FUZZ_ENTRY
#define PDSERVE_FUZZ_ENTRY LLVMFuzzerTestOneInput
#endif

namespace {

constexpr absl::string_view kSource = "fuzz/trace.jsonl";

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "bench_trace_fuzz: %s\n", what);
  std::abort();
}

}  // namespace

extern "C" int PDSERVE_FUZZ_ENTRY(const uint8_t* data, size_t size) {
  using pdserve::pdctl::kMaxTraceTokens;
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  const auto trace = pdserve::pdctl::ParseTraceJsonl(text, kSource);
  if (!trace.ok()) {
    if (!absl::StartsWith(trace.status().message(), kSource)) Fail("an error does not name the source");
    return 0;
  }
  const size_t lines = static_cast<size_t>(std::count(text.begin(), text.end(), '\n')) + 1;
  if (trace->empty() || trace->size() > lines) Fail("accepted a trace with no entries or more entries than lines");
  for (const pdserve::pdctl::TraceEntry& e : *trace) {
    if (e.prompt_tokens < 1 || e.prompt_tokens > kMaxTraceTokens) Fail("prompt_tokens out of bounds");
    if (e.output_tokens < 1 || e.output_tokens > kMaxTraceTokens) Fail("output_tokens out of bounds");
    if (e.prefix_group < -1) Fail("negative prefix_group");
    if (e.prefix_tokens < 0 || e.prefix_tokens > e.prompt_tokens) Fail("prefix_tokens out of bounds");
    if (e.prefix_group == -1 && e.prefix_tokens != 0) Fail("prefix_tokens without a group");
  }
  return 0;
}
