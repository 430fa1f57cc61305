// The requests of `pdctl bench`, made before anything is sent: their prompts
// (random token ids), output lengths and arrival gaps, from random lengths,
// from a shared-prefix recipe, or from a trace (bench_trace.h). Deciding the
// workload is separate from driving it (bench_serving.cc), so it is tested
// without a cluster. Pure functions of their arguments; thread-safe.
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_WORKLOAD_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_WORKLOAD_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "tools/pdctl/bench_trace.h"

namespace pdserve::pdctl {

struct WorkloadRequest {
  std::vector<int32_t> prompt;  // Token ids in [0, vocab_size).
  int32_t max_tokens = 0;
  int64_t prefix_group = -1;  // -1: none (the group's index otherwise).
  int32_t prefix_tokens = 0;  // Leading prompt tokens shared with the group.
  // Multi-turn: the conversation and the turn (from 0); -1 otherwise.
  int32_t conversation = -1;
  int32_t turn = -1;
  // A draw of Exp(1): the gap before the next arrival is unit_gap / rate, so
  // that every rate of a sweep replays the same requests in the same order,
  // only faster or slower.
  double unit_gap = 0;
};

struct WorkloadOptions {
  int32_t vocab_size = 0;                  // REQUIRES: > 0.
  int requests = 64;                       // Ignored with a trace (one request a line).
  int prompt_min = 128, prompt_max = 128;  // Uniform in [min, max]; with
  int output_min = 64, output_max = 64;    // shared prefixes, the suffix.
  // Shared prefixes: each request belongs to a group drawn uniformly at
  // random (seeded; not i % groups, which a round-robin router would map
  // onto its workers in lockstep, giving it perfect affinity by accident)
  // and its prompt is the group's `prefix_tokens` tokens, then a suffix of
  // its own whose first token tells it apart from the other
  // requests of its group (the shared part is exactly prefix_tokens long
  // while a group has at most vocab_size requests). 0 groups: off.
  int shared_prefix_groups = 0;
  int shared_prefix_tokens = 0;
  // Multi-turn chat: `multi_turn_turns` turns per conversation, each a
  // request that resends the conversation's whole history: its system
  // prompt (one of shared_prefix_groups, 64 by default, of
  // multi_turn_system_tokens tokens each), then every earlier user turn
  // and reply, then the new user turn (prompt_min..prompt_max tokens). A
  // reply's tokens are drawn (as long as the earlier turn's max_tokens):
  // the workload is made before anything is sent. Turns go out round by
  // round: every conversation's turn 1 (in a shuffled order), then every
  // turn 2, and so on, so a conversation's turns are a whole round apart.
  // `requests` rounds up to whole conversations. 0 turns: off.
  int multi_turn_turns = 0;
  int multi_turn_system_tokens = 0;
  // Lengths (and prefix groups) one request a line; empty: random lengths.
  std::vector<TraceEntry> trace;
  bool draw_gaps = false;  // Draw unit_gap (Poisson arrivals are wanted).
  uint64_t seed = 1;
};

// Makes the workload. Different prefix groups' prefixes differ in their first
// token, so groups never share a cached block. INVALID_ARGUMENT on options
// that cannot be met (more groups than vocabulary ids, empty ranges).
// Random lengths without prefixes draw from one stream in a fixed order
// (prompt length, prompt, output length, gap), so a seed gives the same
// requests from one build to the next, sweep or not.
absl::StatusOr<std::vector<WorkloadRequest>> MakeWorkload(const WorkloadOptions& options);

// Arrival times, in seconds after the start, at `rate` requests per second:
// the first at 0, each next one unit_gap / rate after the one before.
// REQUIRES: rate > 0.
std::vector<double> ArrivalTimes(const std::vector<WorkloadRequest>& work, double rate);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_WORKLOAD_H_
