// The request lengths of `pdctl bench --trace FILE.jsonl`: one JSON object a
// line,
//
//   {"prompt_tokens": 512, "output_tokens": 128}
//   {"prompt_tokens": 900, "output_tokens": 64, "prefix_group": 3, "prefix_tokens": 768}
//
// prompt_tokens is the whole prompt; with prefix_group, its first
// prefix_tokens tokens are the group's shared prefix (requests of one group
// share min(their prefix_tokens) leading tokens; different groups share
// none). Blank lines are skipped; other keys are ignored, so traces that
// carry more (timestamps, ids) load as they are.
//
// The file is untrusted input (tests/fuzz/bench_trace_fuzz.cc fuzzes the
// parser): every error is INVALID_ARGUMENT and starts with the source, then
// names the line and the field: "trace.jsonl line 7: 'output_tokens' must be
// an integer in [1, 1048576], got -3". Pure functions; thread-safe.
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_TRACE_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_TRACE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdserve::pdctl {

// Largest prompt_tokens, output_tokens and prefix_tokens a trace may ask for
// (far past any context length; it bounds what a hostile file can make the
// benchmark allocate per request).
inline constexpr int32_t kMaxTraceTokens = 1 << 20;

struct TraceEntry {
  int32_t prompt_tokens = 0;  // In [1, kMaxTraceTokens].
  int32_t output_tokens = 0;  // In [1, kMaxTraceTokens].
  int64_t prefix_group = -1;  // -1: no shared prefix; else >= 0.
  int32_t prefix_tokens = 0;  // In [0, prompt_tokens]; 0 when prefix_group is -1.
};

// Parses JSONL `text`; `source` (a file name) prefixes every error. An input
// with no entries is an error.
absl::StatusOr<std::vector<TraceEntry>> ParseTraceJsonl(absl::string_view text, absl::string_view source);

// Reads and parses the file at `path` (NOT_FOUND when it cannot be read).
absl::StatusOr<std::vector<TraceEntry>> ReadTraceFile(const std::string& path);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_TRACE_H_
