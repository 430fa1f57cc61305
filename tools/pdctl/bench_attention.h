// `pdctl bench-attention`: decode attention alone, the KV cache-resident
// and streamed from DRAM, beside the read limit measured in the same run.
//
// Two rates per (batch B, history H), KV bytes read per second:
//   resident: the same B x H decode call again and again (its KV, B * H *
//     the per-position bytes, stays in the caches when it fits them): the
//     kernel's compute ceiling, what no prefetching can beat (marked "*",
//     and not a ceiling, when that KV is over half the last-level cache);
//   streamed: the same call over enough distinct copies of the KV (at
//     least `stream_bytes` in all, in one region from the engine's KV
//     allocator) that each call reads from DRAM.
// and the rate a kernel that overlaps nothing would reach,
//   1 / (1 / resident + 1 / read limit),
// so a streamed rate at that figure says memory and compute take turns.
// The geometry is the 125M shape's (12 query heads, 4 KV heads, head
// dimension 64) unless given; blocks are scattered in the pool as a
// serving worker's are (or, with in_order_blocks, laid out one after the
// other, as a fresh pool hands them out and bench-engine reads them).
// Beside the streamed rate, the same blocks read whole by a bare reader
// in the same order (CpuBackend::ReadBlocks): what the placement allows.
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_ATTENTION_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_ATTENTION_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pdserve::pdctl {

struct BenchAttentionOptions {
  std::vector<int> batches = {1, 8};
  std::vector<int> histories = {512, 4096};
  int threads = 1;
  std::string isa;      // "" = the best supported
  std::string kv = "bf16";  // bf16 or f32
  int heads = 12;
  int kv_heads = 4;
  int head_dim = 64;
  int block_size = 16;
  double stream_bytes = 512.0 * (1 << 20);
  bool in_order_blocks = false;  // Each sequence's blocks consecutive, the sequences one after another.
  // Prompt lengths whose causal attention (one sequence, no cache, every
  // row) is timed alone, in FLOP/s against the F32 FMA peak; none: empty.
  std::vector<int> prompts;
  double seconds = 0.3;  // timed per rate
  bool json = false;
};

absl::Status RunBenchAttention(const BenchAttentionOptions& options);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_ATTENTION_H_
