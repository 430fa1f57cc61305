// `pdctl bench-engine`: prefill and decode speed of the in-process engine,
// each beside the machine limit measured in the same run on the same
// instruction path and threads (CpuBackend::SamplePeakFlops / ReadProbe),
// sampled between the timed runs; all figures are medians.
//
// Prefill: one sequence of S tokens from an empty cache; FLOPs counted as
//   2 * (linear-layer parameters) * S + 2 * hidden * vocab (one logits row)
//   + attention 4 * head_dim * heads * layers * S(S+1)/2.
// Decode: B sequences, each with H cached positions, one token each per step;
//   bytes per step = weight bytes one step reads + the KV bytes the attention
//   kernels counted (about B * H * c_kv),
//   judged against the read bandwidth of a buffer of that size. The other
//   sequences' histories are copies of one prefilled sequence's KV blocks
//   (timing does not depend on the values).
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_ENGINE_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_ENGINE_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/model_stack.h"

namespace pdserve::pdctl {

struct BenchEngineOptions {
  ModelStackOptions engine;
  std::vector<int> prefill_lengths = {128, 512, 2048};
  std::vector<int> decode_batches = {1, 8, 32};
  std::vector<int> decode_histories = {128, 512, 4096};
  int decode_steps = 16;
  // Prefix hit: `prefix_hit_new` tokens after `prefix_hit_cached` cached
  // (0 = skip).
  int prefix_hit_cached = 2048;
  int prefix_hit_new = 64;
  // Shared-prefix decode (DESIGN.md fact 8): `shared_requests` requests whose
  // first `shared_prefix` tokens sit in the same physical blocks, each with
  // `shared_private` tokens of its own; decode steps with cascade attention
  // on and off (0 requests = skip).
  int shared_requests = 8;
  int shared_prefix = 2048;
  int shared_private = 64;
  // Response formats (bench_grammar.h): the mask's cost per token at the
  // vocabulary of each of these tokenizer directories, beside the batch-1
  // step. Empty: the model's own tokenizer.
  std::vector<std::string> mask_tokenizers;
  bool json = false;
};

absl::Status RunBenchEngine(const BenchEngineOptions& options);

// Grows `seq` to `positions` and copies `proto`'s KV blocks (every layer,
// every rank's pool) into it: a decode history without a prefill each
// (timing does not depend on the values).
// REQUIRES: proto holds at least `positions` positions.
absl::Status CopyHistory(KvManager& kv, const SequenceKv& proto, SequenceKv& seq, int32_t positions);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_ENGINE_H_
