#include "engine/generation.h"

#include <random>

namespace pdserve {

uint64_t ResolveSeed(const SamplingParams& params) {
  if (params.seed.has_value()) return *params.seed;
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

Generation::Generation(GenerationRequest request, const tok::Tokenizer* tokenizer)
    : request_(std::move(request)), penalties_(request_.prompt) {
  if (tokenizer != nullptr) {
    detok_.emplace(*tokenizer, request_.prompt, /*skip_special_tokens=*/true);
    stops_.emplace(request_.stop_strings);
  }
}

absl::StatusOr<TokenEvent> Generation::Accept(absl::Span<const float> logits) {
  SampledToken t =
      SampleToken(logits, request_.params, penalties_, seed(), next_position());
  return Record(std::move(t));
}

absl::StatusOr<TokenEvent> Generation::Replay(const TokenEvent& sampled) {
  SampledToken t;
  t.token = sampled.token;
  t.logprob = sampled.logprob;
  t.top_logprobs = sampled.top_logprobs;
  return Record(std::move(t));
}

absl::StatusOr<TokenEvent> Generation::Record(SampledToken t) {
  TokenEvent e;
  e.token = t.token;
  e.index = static_cast<int32_t>(generated_.size());
  e.logprob = t.logprob;
  e.top_logprobs = std::move(t.top_logprobs);
  generated_.push_back(t.token);
  penalties_.AddGenerated(t.token);
  FinishReason finish = CheckFinish(request_.params, request_.eos_ids, t.token,
                                    static_cast<int32_t>(generated_.size()));
  if (detok_.has_value()) {
    absl::StatusOr<std::string> delta = detok_->Add(t.token);
    if (!delta.ok()) return delta.status();
    if (finish != FinishReason::kNone) {
      absl::StatusOr<std::string> rest = detok_->Finish();
      if (!rest.ok()) return rest.status();
      *delta += *rest;
    }
    tok::StopStringMatcher::Result r = stops_->Feed(*delta);
    if (r.stopped) {
      finish = FinishReason::kStop;
    } else if (finish != FinishReason::kNone) {
      r.text += stops_->Flush();
    }
    e.text = std::move(r.text);
  }
  e.finish = finish;
  finish_ = finish;
  return e;
}

std::vector<int32_t> Generation::AllTokens() const {
  std::vector<int32_t> ids = request_.prompt;
  ids.insert(ids.end(), generated_.begin(), generated_.end());
  return ids;
}

}  // namespace pdserve
