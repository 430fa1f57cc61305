// The state of one generation request, independent of where its forward
// passes run: sampling (keyed by seed and position, so any worker that holds
// the same KV continues the same stream), penalties, stop conditions, and the
// streamed text (incremental detokenization with stop strings matched across
// token boundaries). The in-process generator, the prefill worker (first
// token) and the decode worker (the rest) all drive this one class, which is
// what makes a disaggregated stream equal the in-process one token for token.
//
// Thread safety: one owner at a time; not thread-safe.
#ifndef PDSERVE_ENGINE_GENERATION_H_
#define PDSERVE_ENGINE_GENERATION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"
#include "engine/sampling.h"
#include "grammar/constraint.h"
#include "grammar/grammar.h"
#include "text/detokenizer.h"
#include "text/stop_strings.h"
#include "text/tokenizer.h"

namespace pdserve {

struct GenerationRequest {
  std::vector<int32_t> prompt;  // Token ids, non-empty.
  SamplingParams params;        // Validated; params.seed set (see ResolveSeed).
  std::vector<std::string> stop_strings;
  std::vector<int32_t> eos_ids;  // The model's EOS ids (ignored if params.ignore_eos).
  // Seeds the prefix cache's hash chain for this request (block_hash.h):
  // requests share cached blocks only under the same salt. Zero: shared.
  CacheSalt cache_salt;
  // A response format (JSON mode, a JSON Schema): every sampled token
  // keeps the output a prefix of a document it allows, the end tokens
  // (EOS, stop ids) only where a document may end, and generation stops as
  // soon as the document is complete. Null: unconstrained.
  std::shared_ptr<const grammar::Constraint> constraint;
};

// One streamed token.
struct TokenEvent {
  int32_t token = -1;
  int32_t index = 0;  // 0 for the first generated token.
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top_logprobs;
  std::string text;  // Text this token releases (may be empty; stop strings withheld).
  FinishReason finish = FinishReason::kNone;
};

// A seed for requests that did not set one (reported back to the client).
uint64_t ResolveSeed(const SamplingParams& params);

class Generation {
 public:
  // `tokenizer` may be null (ids only: no text, no stop strings).
  // REQUIRES: request.params.seed has a value; tokenizer outlives this.
  Generation(GenerationRequest request, const tok::Tokenizer* tokenizer);

  // Samples the next token from the logits of the last position fed to the
  // model, which must hold prompt + generated()[0 .. n-1) (the token fed
  // last is generated().back(), or the prompt's last token at first).
  // REQUIRES: !finished().
  absl::StatusOr<TokenEvent> Accept(absl::Span<const float> logits);

  // Replays a token sampled elsewhere (e.g. the first token, sampled by the
  // prefill worker) so the state continues exactly as if sampled here.
  // Under a response format, a token the format refuses is an error
  // (FAILED_PRECONDITION): the two processes disagree.
  absl::StatusOr<TokenEvent> Replay(const TokenEvent& sampled);

  // The response format's state after the tokens so far, as a digest that
  // any process holding the same tokens computes alike (the handoff sends
  // it and the receiver checks it); 0 when unconstrained.
  uint64_t grammar_digest() const { return matcher_.has_value() ? matcher_->Digest() : 0; }

  const GenerationRequest& request() const { return request_; }
  const std::vector<int32_t>& generated() const { return generated_; }
  bool finished() const { return finish_ != FinishReason::kNone; }
  FinishReason finish() const { return finish_; }
  uint64_t seed() const { return *request_.params.seed; }
  // The position the next sampled token will take in the sequence.
  int64_t next_position() const {
    return static_cast<int64_t>(request_.prompt.size() + generated_.size());
  }
  // Prompt + generated: prefilling all of it (logits of the last row) gives
  // the next token's logits again, e.g. after a preemption dropped the KV.
  std::vector<int32_t> AllTokens() const;

 private:
  absl::StatusOr<TokenEvent> Record(SampledToken t);
  bool IsEndToken(int32_t token) const;

  GenerationRequest request_;
  PenaltyState penalties_;
  std::vector<int32_t> generated_;
  FinishReason finish_ = FinishReason::kNone;
  std::optional<tok::IncrementalDetokenizer> detok_;
  std::optional<tok::StopStringMatcher> stops_;
  std::optional<grammar::Matcher> matcher_;
  std::vector<int32_t> end_tokens_;  // EOS (unless ignored) and stop ids: allowed where the format may end.
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_GENERATION_H_
