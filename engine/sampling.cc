#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "engine/philox.h"

namespace pdserve {
namespace {

absl::Status Bad(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("sampling: '", field, "' ", what));
}

// Indices of the n best logits, best first, ties to the lower id.
std::vector<int32_t> TopIds(absl::Span<const float> l, int32_t n) {
  std::vector<int32_t> ids(l.size());
  std::iota(ids.begin(), ids.end(), 0);
  auto better = [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
  n = std::min<int32_t>(n, static_cast<int32_t>(ids.size()));
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), better);
  ids.resize(n);
  return ids;
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& p, int64_t vocab_size) {
  if (!(p.temperature >= 0) || !std::isfinite(p.temperature)) {
    return Bad("temperature", "must be a finite number >= 0");
  }
  if (p.top_k < 0) return Bad("top_k", "must be >= 0 (0 = off)");
  if (!(p.top_p > 0 && p.top_p <= 1)) return Bad("top_p", "must be in (0, 1]");
  if (!(p.min_p >= 0 && p.min_p <= 1)) return Bad("min_p", "must be in [0, 1]");
  if (!(p.repetition_penalty > 0) || !std::isfinite(p.repetition_penalty)) {
    return Bad("repetition_penalty", "must be a finite number > 0");
  }
  if (!(p.presence_penalty >= -2 && p.presence_penalty <= 2)) {
    return Bad("presence_penalty", "must be in [-2, 2]");
  }
  if (!(p.frequency_penalty >= -2 && p.frequency_penalty <= 2)) {
    return Bad("frequency_penalty", "must be in [-2, 2]");
  }
  if (p.max_tokens < 1) return Bad("max_tokens", "must be at least 1");
  if (p.logprobs < 0 || p.logprobs > 20) return Bad("logprobs", "must be in [0, 20]");
  for (int32_t t : p.stop_token_ids) {
    if (t < 0 || t >= vocab_size) {
      return Bad("stop_token_ids", absl::StrCat("has ", t, ", outside the vocabulary [0, ",
                                                vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

PenaltyState::PenaltyState(absl::Span<const int32_t> prompt) {
  for (int32_t t : prompt) ++seen_[t];
}

void PenaltyState::AddGenerated(int32_t token) {
  ++seen_[token];
  ++generated_[token];
}

SampledToken SampleToken(absl::Span<const float> logits, const SamplingParams& p,
                         const PenaltyState& penalties, uint64_t seed, int64_t position,
                         const TokenFilter* filter) {
  const int32_t vocab = static_cast<int32_t>(logits.size());
  SampledToken out;

  // Model logprobs: log-softmax of the raw logits.
  float raw_max = -INFINITY;
  for (float v : logits) raw_max = std::max(raw_max, v);
  double raw_sum = 0;
  for (float v : logits) raw_sum += std::exp(static_cast<double>(v) - raw_max);
  const float log_z = raw_max + static_cast<float>(std::log(raw_sum));

  std::vector<float> l(logits.begin(), logits.end());
  if (filter != nullptr) {
    for (int32_t w = 0; w * 64 < vocab; ++w) {
      const uint64_t bits = w < static_cast<int32_t>(filter->bits.size()) ? filter->bits[w] : 0;
      if (bits == ~uint64_t{0}) continue;
      const int32_t end = std::min(vocab, (w + 1) * 64);
      for (int32_t i = w * 64; i < end; ++i) {
        if (((bits >> (i & 63)) & 1) == 0) l[i] = -INFINITY;
      }
    }
    for (int32_t t : filter->extra) {
      if (t >= 0 && t < vocab) l[t] = logits[t];
    }
  }
  if (p.repetition_penalty != 1.0f) {
    for (const auto& [t, n] : penalties.seen()) {
      l[t] = l[t] > 0 ? l[t] / p.repetition_penalty : l[t] * p.repetition_penalty;
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    for (const auto& [t, n] : penalties.generated()) {
      l[t] -= p.presence_penalty + p.frequency_penalty * static_cast<float>(n);
    }
  }

  if (p.temperature == 0.0f) {
    int32_t best = 0;
    for (int32_t i = 1; i < vocab; ++i) {
      if (l[i] > l[best]) best = i;  // -inf (filtered) never wins over an allowed token.
    }
    out.token = best;
  } else {
    const float inv_t = 1.0f / p.temperature;
    float best = -INFINITY;
    for (float& v : l) {
      v *= inv_t;
      best = std::max(best, v);
    }
    std::vector<int32_t> cand;
    for (int32_t i = 0; i < vocab; ++i) {
      if (l[i] >= best - 88.0f) cand.push_back(i);
    }
    auto better = [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
    if (p.top_k > 0 && p.top_k < static_cast<int32_t>(cand.size())) {
      std::partial_sort(cand.begin(), cand.begin() + p.top_k, cand.end(), better);
      cand.resize(p.top_k);
    } else {
      std::sort(cand.begin(), cand.end(), better);
    }
    std::vector<float> prob(cand.size());
    float sum = 0;
    for (size_t i = 0; i < cand.size(); ++i) sum += (prob[i] = std::exp(l[cand[i]] - best));
    size_t keep = cand.size();
    if (p.top_p < 1.0f) {
      const float target = p.top_p * sum;
      float cum = 0;
      for (size_t i = 0; i < cand.size(); ++i) {
        cum += prob[i];
        if (cum >= target) {
          keep = i + 1;
          break;
        }
      }
    }
    if (p.min_p > 0.0f) {
      const float floor = p.min_p * prob[0];
      size_t k = 1;
      while (k < keep && prob[k] >= floor) ++k;
      keep = k;
    }
    float kept = 0;
    for (size_t i = 0; i < keep; ++i) kept += prob[i];
    const float target = PhiloxUniform(seed, static_cast<uint64_t>(position)) * kept;
    float cum = 0;
    out.token = cand[keep - 1];
    for (size_t i = 0; i < keep; ++i) {
      cum += prob[i];
      if (cum > target) {
        out.token = cand[i];
        break;
      }
    }
  }
  out.logprob = logits[out.token] - log_z;
  if (p.logprobs > 0) {
    for (int32_t id : TopIds(logits, p.logprobs)) out.top_logprobs.push_back({id, logits[id] - log_z});
  }
  return out;
}

FinishReason CheckFinish(const SamplingParams& params, absl::Span<const int32_t> eos_ids,
                         int32_t token, int32_t generated) {
  if (std::find(params.stop_token_ids.begin(), params.stop_token_ids.end(), token) !=
      params.stop_token_ids.end()) {
    return FinishReason::kStop;
  }
  if (!params.ignore_eos && std::find(eos_ids.begin(), eos_ids.end(), token) != eos_ids.end()) {
    return FinishReason::kStop;
  }
  if (generated >= params.max_tokens) return FinishReason::kLength;
  return FinishReason::kNone;
}

}  // namespace pdserve
