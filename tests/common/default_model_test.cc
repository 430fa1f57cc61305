// The shipped default model (deploy/models/kjv-tiny): the engine agrees with
// the training framework's own forward and perplexity, clears the quality
// bar, and greedy generation gives the committed text.
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "model/model.h"
#include "model/model_config.h"
#include "text/tokenizer.h"
#include "gtest/gtest.h"
#include "tests/support/default_model.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

const std::string& kModel = testing_support::kDefaultModelDir;

class DefaultModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<testing_support::DefaultModel> m = testing_support::LoadDefaultModel(2);
    ASSERT_TRUE(m.ok()) << m.status();
    loaded_ = *std::move(m);
    model_ = loaded_.model.get();
    auto kv = KvManager::Create(model_->MakeKvSpec(DType::kF32, 16, 64));
    ASSERT_TRUE(kv.ok());
    kv_ = *std::move(kv);
  }
  testing_support::DefaultModel loaded_;
  Model* model_ = nullptr;
  std::unique_ptr<KvManager> kv_;
};

TEST_F(DefaultModelTest, LogitsMatchTheTrainingFrameworksForward) {
  EXPECT_EQ(model_->weight_dtype(), DType::kBF16);
  const nlohmann::json ref = nlohmann::json::parse(*ReadFileToString(kModel + "/reference/logits.json"));
  ASSERT_GE(ref["cases"].size(), 3u);
  for (const auto& c : ref["cases"]) {
    const auto ids = c["token_ids"].get<std::vector<int32_t>>();
    const auto want = c["logits"].get<std::vector<std::vector<double>>>();
    SequenceKv seq = kv_->NewSequence();
    ForwardSequence fs{&seq, ids, LogitsMode::kAll};
    auto r = ForwardGrowing(*model_, *kv_, {&fs, 1});
    ASSERT_TRUE(r.ok()) << r.status();
    double max_abs = 0, worst = 0;
    for (const auto& row : want) {
      for (double v : row) max_abs = std::max(max_abs, std::abs(v));
    }
    for (size_t p = 0; p < ids.size(); ++p) {
      absl::Span<const float> got = r->Row(static_cast<int64_t>(p));
      for (size_t v = 0; v < got.size(); ++v) worst = std::max(worst, std::abs(got[v] - want[p][v]));
    }
    EXPECT_LE(worst, 1e-4 * max_abs);
    seq.Release();
  }
}

// Mean next-token NLL over fresh windows: window i feeds ids[iL, (i+1)L) and
// predicts ids[iL+1, (i+1)L+1], as tools/train/train_model.py evaluates.
TEST_F(DefaultModelTest, HeldOutPerplexityMatchesTrainingAndClearsTheBar) {
  const nlohmann::json ref = nlohmann::json::parse(*ReadFileToString(kModel + "/reference/heldout_ppl.json"));
  std::vector<int32_t> ids;
  for (absl::string_view s : absl::StrSplit(*ReadFileToString(kModel + "/reference/heldout_ids.txt"), ',',
                                            absl::SkipWhitespace())) {
    int32_t v;
    ASSERT_TRUE(absl::SimpleAtoi(absl::StripAsciiWhitespace(s), &v));
    ids.push_back(v);
  }
  const int L = ref.value("window", 256);
  const size_t windows = (ids.size() - 1) / L;
  double nll = 0;
  int64_t count = 0;
  for (size_t w = 0; w < windows; ++w) {
    SequenceKv seq = kv_->NewSequence();
    ForwardSequence fs{&seq, absl::MakeConstSpan(ids).subspan(w * L, L), LogitsMode::kAll};
    auto r = ForwardGrowing(*model_, *kv_, {&fs, 1});
    ASSERT_TRUE(r.ok()) << r.status();
    for (int i = 0; i < L; ++i) {
      absl::Span<const float> l = r->Row(i);
      double mx = -1e30, z = 0;
      for (float v : l) mx = std::max<double>(mx, v);
      for (float v : l) z += std::exp(v - mx);
      nll += mx + std::log(z) - l[ids[w * L + i + 1]];
      ++count;
    }
    seq.Release();
  }
  ASSERT_EQ(count, ref["tokens"].get<int64_t>());
  const double ppl = std::exp(nll / count);
  std::printf("engine held-out perplexity %.4f (training script %.4f, unigram %.2f)\n", ppl,
              ref["perplexity"].get<double>(), ref["unigram_perplexity"].get<double>());
  EXPECT_NEAR(nll / count, ref["mean_nll"].get<double>(), 1e-3);
  EXPECT_LE(ppl, ref["unigram_perplexity"].get<double>() / 5);
}

TEST_F(DefaultModelTest, GreedyGenerationGivesTheCommittedText) {
  const nlohmann::json want = nlohmann::json::parse(*ReadFileToString(kModel + "/reference/greedy.json"));
  auto tok = tok::Tokenizer::Load(kModel);
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::vector<int32_t> prompt = *(*tok)->Encode(want["prompt"].get<std::string>(), true);
  SequenceKv seq = kv_->NewSequence();
  std::vector<int32_t> feed = prompt, out;
  for (int i = 0; i < want["max_tokens"].get<int>(); ++i) {
    ForwardSequence fs{&seq, feed, LogitsMode::kLast};
    auto r = ForwardGrowing(*model_, *kv_, {&fs, 1});
    ASSERT_TRUE(r.ok());
    absl::Span<const float> l = r->Last(0);
    const int32_t next = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
    out.push_back(next);
    feed.assign(1, next);
  }
  EXPECT_EQ(*(*tok)->Decode(out, true), want["text"].get<std::string>());
  seq.Release();
}

}  // namespace
}  // namespace pdserve
