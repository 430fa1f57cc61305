#include "engine/sampling.h"

#include <cmath>
#include <map>
#include <vector>

#include "engine/philox.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

using ::testing::HasSubstr;

// Published known-answer vectors of Philox4x32-10 (Random123's kat_vectors).
TEST(PhiloxTest, KnownAnswerVectors) {
  EXPECT_EQ(Philox4x32_10({0, 0, 0, 0}, {0, 0}),
            (PhiloxCounter{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(Philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (PhiloxCounter{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(Philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (PhiloxCounter{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(PhiloxTest, UniformIsTheTop24BitsOfTheFirstWord) {
  const PhiloxCounter out = Philox4x32_10({7, 0, 0, 0}, {42, 0});
  EXPECT_EQ(PhiloxUniform(42, 7), static_cast<float>(out[0] >> 8) / 16777216.0f);
  for (uint64_t p = 0; p < 1000; ++p) {
    const float u = PhiloxUniform(123, p);
    EXPECT_GE(u, 0.0f);
    EXPECT_LT(u, 1.0f);
  }
}

std::vector<double> Softmax(const std::vector<float>& l) {
  double m = -1e30, s = 0;
  for (float v : l) m = std::max<double>(m, v);
  std::vector<double> p;
  for (float v : l) s += std::exp(v - m);
  for (float v : l) p.push_back(std::exp(v - m) / s);
  return p;
}

// Pearson chi-square of `n` draws against `want` (zero-probability tokens
// must never appear). Draws are deterministic (seeded), so this never flakes.
double ChiSquare(const std::vector<float>& logits, const SamplingParams& params,
                 const std::vector<double>& want, int n, const PenaltyState& pen) {
  std::vector<int> count(logits.size(), 0);
  for (int i = 0; i < n; ++i) ++count[SampleToken(logits, params, pen, 99, i).token];
  double chi = 0;
  for (size_t t = 0; t < want.size(); ++t) {
    if (want[t] == 0) {
      EXPECT_EQ(count[t], 0) << "token " << t << " must never be drawn";
      continue;
    }
    const double e = want[t] * n;
    chi += (count[t] - e) * (count[t] - e) / e;
  }
  return chi;
}

const std::vector<float> kLogits = {1.0f, 2.5f, 0.2f, 2.0f, -1.0f, 1.5f};
const PenaltyState kNoPenalty({});
// Chi-square critical value for 5 degrees of freedom at p = 0.001.
constexpr double kChi5 = 20.5;

TEST(SamplingTest, AFilterLeavesOnlyItsTokensAndItsExtraIds) {
  std::vector<float> logits = {5, 4, 3, 2, 1, 0, -1, -2};
  const std::vector<uint64_t> bits = {(1u << 2) | (1u << 5)};
  const std::vector<int32_t> extra = {7};
  const TokenFilter filter{bits, extra};
  SamplingParams greedy;
  greedy.temperature = 0;
  PenaltyState none({});
  EXPECT_EQ(SampleToken(logits, greedy, none, 1, 0, &filter).token, 2);
  SamplingParams p;
  p.temperature = 1.5f;
  std::map<int32_t, int> seen;
  for (int64_t pos = 0; pos < 400; ++pos) ++seen[SampleToken(logits, p, none, 3, pos, &filter).token];
  EXPECT_EQ(seen.size(), 3u);
  for (const auto& [t, n] : seen) EXPECT_TRUE(t == 2 || t == 5 || t == 7) << t;
  // The logprob is still the model's, over the whole vocabulary.
  const SampledToken t = SampleToken(logits, greedy, none, 1, 0, &filter);
  double z = 0;
  for (float l : logits) z += std::exp(l - 5.0);
  EXPECT_NEAR(t.logprob, 3 - 5 - std::log(z), 1e-5);
}

TEST(SamplingTest, TemperatureMatchesSoftmax) {
  SamplingParams p;
  p.temperature = 0.7f;
  std::vector<float> scaled;
  for (float v : kLogits) scaled.push_back(v / 0.7f);
  EXPECT_LT(ChiSquare(kLogits, p, Softmax(scaled), 40000, kNoPenalty), kChi5);
}

TEST(SamplingTest, TopKKeepsTheKBest) {
  SamplingParams p;
  p.top_k = 3;
  std::vector<double> want = Softmax({-100, 2.5f, -100, 2.0f, -100, 1.5f});
  want[0] = want[2] = want[4] = 0;
  EXPECT_LT(ChiSquare(kLogits, p, want, 30000, kNoPenalty), kChi5);
}

TEST(SamplingTest, TopPKeepsTheShortestSufficientPrefix) {
  SamplingParams p;
  p.top_p = 0.6f;
  const std::vector<double> full = Softmax(kLogits);
  // Sorted: 1 (2.5), 3 (2.0), 5 (1.5), ...; p1 + p3 = 0.38 + 0.23 > 0.6? Compute.
  std::vector<int> order = {1, 3, 5, 0, 2, 4};
  double cum = 0;
  std::vector<double> want(6, 0.0);
  for (int t : order) {
    want[t] = full[t];
    cum += full[t];
    if (cum >= 0.6) break;
  }
  for (double& w : want) w /= cum;
  EXPECT_LT(ChiSquare(kLogits, p, want, 30000, kNoPenalty), kChi5);
}

TEST(SamplingTest, MinPDropsUnlikelyTokens) {
  SamplingParams p;
  p.min_p = 0.3f;
  const std::vector<double> full = Softmax(kLogits);
  const double best = full[1];
  std::vector<double> want(6, 0.0);
  double kept = 0;
  for (int t = 0; t < 6; ++t) {
    if (full[t] >= 0.3 * best) kept += (want[t] = full[t]);
  }
  for (double& w : want) w /= kept;
  EXPECT_LT(ChiSquare(kLogits, p, want, 30000, kNoPenalty), kChi5);
}

TEST(SamplingTest, RepetitionAndPresencePenalties) {
  SamplingParams p;
  p.repetition_penalty = 1.8f;
  p.presence_penalty = 0.5f;
  PenaltyState pen(std::vector<int32_t>{1, 4});  // Prompt tokens.
  pen.AddGenerated(3);
  std::vector<float> l = kLogits;
  l[1] = l[1] / 1.8f;        // Positive: divided.
  l[4] = l[4] * 1.8f;        // Negative: multiplied.
  l[3] = l[3] / 1.8f - 0.5f; // Generated: repetition, then presence.
  EXPECT_LT(ChiSquare(kLogits, p, Softmax(l), 40000, pen), kChi5);
}

TEST(SamplingTest, FrequencyPenaltyCountsEachOccurrenceAfterPresence) {
  SamplingParams p;
  p.repetition_penalty = 1.5f;
  p.presence_penalty = 0.25f;
  p.frequency_penalty = 0.5f;
  PenaltyState pen(std::vector<int32_t>{2});  // The prompt: repetition only.
  pen.AddGenerated(3);
  pen.AddGenerated(3);
  pen.AddGenerated(0);
  std::vector<float> l = kLogits;
  l[2] = l[2] > 0 ? l[2] / 1.5f : l[2] * 1.5f;
  // Generated: repetition, then presence once, then frequency per count.
  l[3] = (l[3] > 0 ? l[3] / 1.5f : l[3] * 1.5f) - 0.25f - 2 * 0.5f;
  l[0] = (l[0] > 0 ? l[0] / 1.5f : l[0] * 1.5f) - 0.25f - 1 * 0.5f;
  EXPECT_LT(ChiSquare(kLogits, p, Softmax(l), 40000, pen), kChi5);
}

TEST(SamplingTest, FrequencyPenaltyOutOfRangeIsRefusedNamingIt) {
  SamplingParams p;
  p.frequency_penalty = 2.5f;
  const absl::Status st = ValidateSamplingParams(p, 100);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("frequency_penalty"), std::string::npos) << st;
}

TEST(SamplingTest, SeededRunsRepeatAndSeedsDiffer) {
  SamplingParams p;
  std::vector<int32_t> a, b, c;
  for (int i = 0; i < 200; ++i) {
    a.push_back(SampleToken(kLogits, p, kNoPenalty, 5, i).token);
    b.push_back(SampleToken(kLogits, p, kNoPenalty, 5, i).token);
    c.push_back(SampleToken(kLogits, p, kNoPenalty, 6, i).token);
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(SamplingTest, GreedyTiesGoToTheLowerId) {
  SamplingParams p;
  p.temperature = 0;
  EXPECT_EQ(SampleToken({1.0f, 3.0f, 3.0f, 2.0f}, p, kNoPenalty, 1, 0).token, 1);
  p.temperature = 1e-6f;  // Nearly greedy: candidates sorted with ties to the lower id.
  p.top_k = 1;
  EXPECT_EQ(SampleToken({1.0f, 3.0f, 3.0f, 2.0f}, p, kNoPenalty, 1, 0).token, 1);
}

TEST(SamplingTest, LogprobsAreTheModelsLogSoftmax) {
  SamplingParams p;
  p.temperature = 0;
  p.logprobs = 3;
  p.repetition_penalty = 2.0f;
  PenaltyState pen(std::vector<int32_t>{1});
  const SampledToken s = SampleToken(kLogits, p, pen, 1, 0);
  const std::vector<double> sm = Softmax(kLogits);
  EXPECT_EQ(s.token, 3);  // 2.5 / 2 < 2.0.
  EXPECT_NEAR(s.logprob, std::log(sm[3]), 1e-5);
  ASSERT_EQ(s.top_logprobs.size(), 3u);
  EXPECT_EQ(s.top_logprobs[0].first, 1);
  EXPECT_EQ(s.top_logprobs[1].first, 3);
  EXPECT_EQ(s.top_logprobs[2].first, 5);
  EXPECT_NEAR(s.top_logprobs[0].second, std::log(sm[1]), 1e-5);
}

TEST(SamplingTest, ValidationNamesTheField) {
  SamplingParams p;
  p.top_p = 0;
  EXPECT_THAT(ValidateSamplingParams(p, 10).message(), HasSubstr("'top_p'"));
  p = {};
  p.temperature = -1;
  EXPECT_THAT(ValidateSamplingParams(p, 10).message(), HasSubstr("'temperature'"));
  p = {};
  p.stop_token_ids = {10};
  EXPECT_THAT(ValidateSamplingParams(p, 10).message(), HasSubstr("'stop_token_ids'"));
  p = {};
  p.max_tokens = 0;
  EXPECT_EQ(ValidateSamplingParams(p, 10).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateSamplingParams({}, 10).ok());
}

TEST(SamplingTest, FinishReasons) {
  SamplingParams p;
  p.max_tokens = 3;
  p.stop_token_ids = {7};
  const std::vector<int32_t> eos = {2};
  EXPECT_EQ(CheckFinish(p, eos, 7, 1), FinishReason::kStop);
  EXPECT_EQ(CheckFinish(p, eos, 2, 1), FinishReason::kStop);
  EXPECT_EQ(CheckFinish(p, eos, 5, 2), FinishReason::kNone);
  EXPECT_EQ(CheckFinish(p, eos, 5, 3), FinishReason::kLength);
  p.ignore_eos = true;
  EXPECT_EQ(CheckFinish(p, eos, 2, 1), FinishReason::kNone);
}

}  // namespace
}  // namespace pdserve
