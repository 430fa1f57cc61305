#include "engine/generation.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"

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
  if (request_.constraint != nullptr) {
    matcher_.emplace(request_.constraint->grammar);
    if (!request_.params.ignore_eos) end_tokens_ = request_.eos_ids;
    end_tokens_.insert(end_tokens_.end(), request_.params.stop_token_ids.begin(),
                       request_.params.stop_token_ids.end());
  }
}

bool Generation::IsEndToken(int32_t token) const {
  return std::find(end_tokens_.begin(), end_tokens_.end(), token) != end_tokens_.end();
}

absl::StatusOr<TokenEvent> Generation::Accept(absl::Span<const float> logits) {
  if (!matcher_.has_value()) {
    return Record(SampleToken(logits, request_.params, penalties_, seed(), next_position()));
  }
  const grammar::State& state = matcher_->state();
  std::shared_ptr<const grammar::TokenMask> mask = request_.constraint->masker->MaskFor(state);
  const bool any = std::any_of(mask->begin(), mask->end(), [](uint64_t w) { return w != 0; });
  if (!any && !(state.can_end && !end_tokens_.empty())) {
    return absl::FailedPreconditionError(
        "response format: no token of the vocabulary continues the output (the grammar needs bytes no token writes)");
  }
  TokenFilter filter{*mask, state.can_end ? absl::MakeConstSpan(end_tokens_) : absl::Span<const int32_t>()};
  return Record(SampleToken(logits, request_.params, penalties_, seed(), next_position(), &filter));
}

absl::StatusOr<TokenEvent> Generation::Replay(const TokenEvent& sampled) {
  SampledToken t;
  t.token = sampled.token;
  t.logprob = sampled.logprob;
  t.top_logprobs = sampled.top_logprobs;
  return Record(std::move(t));
}

absl::StatusOr<TokenEvent> Generation::Record(SampledToken t) {
  bool format_complete = false;
  if (matcher_.has_value()) {
    if (matcher_->state().can_end && IsEndToken(t.token)) {
      // Ends the output where the format may end: nothing to match.
    } else {
      const std::string* bytes = request_.constraint->masker->vocab().bytes(t.token);
      if (bytes == nullptr || !matcher_->Advance(*bytes)) {
        return absl::FailedPreconditionError(absl::StrCat("response format: token ", t.token, " at output index ",
                                                          generated_.size(), " does not follow the format"));
      }
      format_complete = matcher_->state().complete();
    }
  }
  TokenEvent e;
  e.token = t.token;
  e.index = static_cast<int32_t>(generated_.size());
  e.logprob = t.logprob;
  e.top_logprobs = std::move(t.top_logprobs);
  generated_.push_back(t.token);
  penalties_.AddGenerated(t.token);
  FinishReason finish = CheckFinish(request_.params, request_.eos_ids, t.token,
                                    static_cast<int32_t>(generated_.size()));
  if (format_complete && finish == FinishReason::kNone) finish = FinishReason::kStop;
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
