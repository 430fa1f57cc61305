// Token sampling: penalties, temperature, top-k, top-p, min-p and a
// reproducible draw, plus logprobs.
//
// The pipeline, in this order (fixed; the router, both workers and a future
// GPU sampler must agree):
//   1. penalties on the logits: repetition (HF/vLLM form: a positive logit is
//      divided by the penalty, a negative one multiplied) over the prompt and
//      the generated tokens; then, over generated tokens, presence (subtracted
//      once) and frequency (subtracted once per occurrence): the OpenAI form
//      logit -= presence * (count > 0) + frequency * count;
//   2. temperature (0 = greedy: argmax of the penalised logits);
//   3. candidates sorted by (logit desc, id asc) — ties go to the lower id;
//      top-k keeps the first k;
//   4. softmax over the candidates; top-p keeps the shortest prefix whose
//      probability reaches top_p;
//   5. min-p drops candidates below min_p * (best candidate's probability);
//   6. draw: u = PhiloxUniform(seed, position); the chosen candidate is the
//      first whose cumulative probability (F32, summed in candidate order)
//      exceeds u * (sum of kept probabilities).
// Candidates whose logit is more than 88 below the best (probability ratio
// under e^-88, below F32's smallest normal) are never considered: they
// cannot change an F32 sum taken in descending order.
//
// Logprobs are the model's: log-softmax of the raw logits, before penalties
// and temperature (what vLLM reports by default).
//
// Thread safety: pure functions.
#ifndef PDSERVE_ENGINE_SAMPLING_H_
#define PDSERVE_ENGINE_SAMPLING_H_

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/types/span.h"

namespace pdserve {

struct SamplingParams {
  float temperature = 1.0f;  // 0 = greedy.
  int32_t top_k = 0;         // 0 = all.
  float top_p = 1.0f;        // (0, 1].
  float min_p = 0.0f;        // [0, 1].
  float repetition_penalty = 1.0f;  // > 0; 1 = off.
  float presence_penalty = 0.0f;    // [-2, 2]; 0 = off.
  float frequency_penalty = 0.0f;   // [-2, 2]; 0 = off.
  std::optional<uint64_t> seed;     // Unset: the engine assigns one (and reports it).
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int32_t max_tokens = 16;
  int32_t logprobs = 0;  // Top-n alternatives to report (0..20).
};

// INVALID_ARGUMENT naming the field for out-of-range values.
absl::Status ValidateSamplingParams(const SamplingParams& p, int64_t vocab_size);

// Tokens seen so far by one request, for the penalties.
class PenaltyState {
 public:
  explicit PenaltyState(absl::Span<const int32_t> prompt);
  void AddGenerated(int32_t token);
  const absl::flat_hash_map<int32_t, int32_t>& seen() const { return seen_; }       // Prompt + output.
  const absl::flat_hash_map<int32_t, int32_t>& generated() const { return generated_; }

 private:
  absl::flat_hash_map<int32_t, int32_t> seen_;
  absl::flat_hash_map<int32_t, int32_t> generated_;
};

struct SampledToken {
  int32_t token = -1;
  float logprob = 0;  // Model logprob of `token`.
  std::vector<std::pair<int32_t, float>> top_logprobs;  // Best first, ties to the lower id.
};

// The tokens a response format allows at one step (grammar/token_mask.h):
// those whose bit is set in `bits` (bit id % 64 of word id / 64), and the
// `extra` ids (the end tokens, when the format may end there). Every other
// token's logit is -inf before anything else of the pipeline runs, so
// penalties, top-k, top-p and the draw see only allowed tokens, and a
// constrained stream stays reproducible by (seed, position).
struct TokenFilter {
  absl::Span<const uint64_t> bits;
  absl::Span<const int32_t> extra;
};

// Samples the token for sequence position `position` (the index the token
// will have in the sequence) of a request with `seed`; only tokens the
// filter allows, when there is one.
// REQUIRES: params validated; logits.size() == vocab; a filter allows at
// least one token.
SampledToken SampleToken(absl::Span<const float> logits, const SamplingParams& params,
                         const PenaltyState& penalties, uint64_t seed, int64_t position,
                         const TokenFilter* filter = nullptr);

// Why generation stops after `token`, if it does: a stop id (or EOS unless
// ignore_eos) or max_tokens reached with `generated` tokens so far.
enum class FinishReason { kNone, kStop, kLength };
FinishReason CheckFinish(const SamplingParams& params, absl::Span<const int32_t> eos_ids,
                         int32_t token, int32_t generated);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_SAMPLING_H_
