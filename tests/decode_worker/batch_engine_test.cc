// The continuous-batching engine against the one-sequence-at-a-time
// generator on the shipped model: batching, chunked prefill, queueing,
// preemption with recomputation, handed-off sequences and cancellation must
// not change a single token or byte of text.
#include "decode_worker/batch_engine.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/generation.h"
#include "common/model.h"
#include "common/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "tests/support/default_model.h"

namespace pdserve {
namespace {


struct Output {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason finish = FinishReason::kNone;
  absl::Status status;
};

class BatchEngineTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<testing_support::DefaultModel> m = testing_support::LoadDefaultModel(2);
    ASSERT_TRUE(m.ok()) << m.status();
    loaded_ = new testing_support::DefaultModel(*std::move(m));
    model_ = loaded_->model.get();
    tokenizer_ = loaded_->tokenizer.get();
  }

  std::unique_ptr<KvManager> MakeKv(int32_t blocks) {
    auto kv = KvManager::Create(model_->MakeKvSpec(DType::kF32, 16, blocks));
    EXPECT_TRUE(kv.ok());
    return *std::move(kv);
  }

  GenerationRequest Request(const std::string& text, int max_tokens, float temperature,
                            uint64_t seed, std::vector<std::string> stops = {}) {
    GenerationRequest r;
    r.prompt = *tokenizer_->Encode(text);
    r.params.temperature = temperature;
    r.params.top_p = temperature > 0 ? 0.9f : 1.0f;
    r.params.max_tokens = max_tokens;
    r.params.seed = seed;
    r.stop_strings = std::move(stops);
    r.eos_ids = model_->config().eos_token_ids;
    return r;
  }

  // The reference: one sequence, whole-prompt prefill, then decode.
  Output Alone(const GenerationRequest& req) {
    auto manager = MakeKv(64);
    Generation gen(req, tokenizer_);
    SequenceKv kv = manager->NewSequence();
    Output out;
    std::vector<int32_t> feed = req.prompt;
    while (!gen.finished()) {
      ForwardSequence fs{&kv, feed, LogitsMode::kLast};
      auto r = ForwardGrowing(*model_, *manager, {&fs, 1});
      EXPECT_TRUE(r.ok()) << r.status();
      auto ev = gen.Accept(r->Last(0));
      EXPECT_TRUE(ev.ok());
      out.tokens.push_back(ev->token);
      out.text += ev->text;
      out.finish = ev->finish;
      feed.assign(1, ev->token);
    }
    kv.Release();
    return out;
  }

  static EventSink Collect(Output* out) {
    return [out](const EngineEvent& e) {
      if (!e.status.ok()) {
        out->status = e.status;
        return;
      }
      out->tokens.push_back(e.token.token);
      out->text += e.token.text;
      out->finish = e.token.finish;
    };
  }

  static void RunToIdle(BatchEngine& engine) {
    for (int i = 0; i < 100000; ++i) {
      auto r = engine.Step();
      ASSERT_TRUE(r.ok()) << r.status();
      if (!*r) return;
    }
    FAIL() << "engine never went idle";
  }

  std::vector<GenerationRequest> Mixed() {
    std::vector<GenerationRequest> reqs;
    reqs.push_back(Request("In the beginning God created", 24, 0, 1));
    reqs.push_back(Request("And the LORD said unto Moses,", 30, 0.8f, 7));
    // Longer than one prefill chunk (the engine's budget below is 48 tokens).
    reqs.push_back(Request("And it came to pass, when men began to multiply on the face of the earth, "
                           "and daughters were born unto them, that the sons of God saw the daughters "
                           "of men that they were fair; and they took them wives of all which they chose.",
                           20, 0, 3));
    reqs.push_back(Request("Blessed are the", 16, 1.0f, 99));
    reqs.push_back(Request("The LORD is my shepherd;", 28, 0.7f, 5, {"LORD"}));
    reqs.push_back(Request("Then", 12, 0, 11));
    return reqs;
  }

  static testing_support::DefaultModel* loaded_;
  static Model* model_;
  static tok::Tokenizer* tokenizer_;
};

testing_support::DefaultModel* BatchEngineTest::loaded_ = nullptr;
Model* BatchEngineTest::model_ = nullptr;
tok::Tokenizer* BatchEngineTest::tokenizer_ = nullptr;

void ExpectSame(const Output& got, const Output& want, int i) {
  EXPECT_TRUE(got.status.ok()) << "request " << i << ": " << got.status;
  EXPECT_EQ(got.tokens, want.tokens) << "request " << i;
  EXPECT_EQ(got.text, want.text) << "request " << i;
  EXPECT_EQ(got.finish, want.finish) << "request " << i;
}

TEST_F(BatchEngineTest, BatchedStreamsEqualOneAtATime) {
  const auto reqs = Mixed();
  auto kv = MakeKv(128);
  BatchEngine engine(*model_, *kv, {.max_batch = 4, .prefill_chunk_tokens = 48});
  std::vector<Output> got(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    engine.SubmitPrefill(i, std::make_unique<Generation>(reqs[i], tokenizer_), Collect(&got[i]));
  }
  RunToIdle(engine);
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Alone(reqs[i]), static_cast<int>(i));
  EXPECT_EQ(kv->Counts().used, 0);
  EXPECT_EQ(engine.stats().preemptions, 0);
}

TEST_F(BatchEngineTest, PreemptedSequencesRecomputeAndContinueUnchanged) {
  const auto reqs = Mixed();
  // 7 blocks of 16 positions: the longest request alone needs 6 at its end,
  // all six together about 25.
  auto kv = MakeKv(7);
  BatchEngine engine(*model_, *kv, {.max_batch = 6, .prefill_chunk_tokens = 48});
  std::vector<Output> got(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    engine.SubmitPrefill(i, std::make_unique<Generation>(reqs[i], tokenizer_), Collect(&got[i]));
  }
  RunToIdle(engine);
  EXPECT_GT(engine.stats().preemptions, 0);
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Alone(reqs[i]), static_cast<int>(i));
  EXPECT_EQ(kv->Counts().used, 0);
}

// With the prefix cache on, preempted sequences publish their blocks and
// recompute from them, and a second turn of a conversation (the first
// turn's prompt + output + more) prefills only what is new: no token changes.
TEST_F(BatchEngineTest, PrefixCacheReusesPublishedBlocksWithoutChangingATokenEvenUnderPreemption) {
  const auto reqs = Mixed();
  auto kv = MakeKv(7);
  BatchEngine engine(*model_, *kv, {.max_batch = 6, .prefill_chunk_tokens = 48, .prefix_cache = true});
  std::vector<Output> got(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    engine.SubmitPrefill(i, std::make_unique<Generation>(reqs[i], tokenizer_), Collect(&got[i]));
  }
  RunToIdle(engine);
  EXPECT_GT(engine.stats().preemptions, 0);
  EXPECT_GT(kv->Counts().prefix.hit_blocks, 0) << "recomputes found nothing cached";
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Alone(reqs[i]), static_cast<int>(i));
  EXPECT_EQ(kv->Counts().used, 0);

  // Turn two of request 2 (the long one): prompt + its output + new text.
  auto big = MakeKv(64);
  BatchEngine engine2(*model_, *big, {.max_batch = 4, .prefill_chunk_tokens = 48, .prefix_cache = true});
  Output turn1;
  engine2.SubmitPrefill(1, std::make_unique<Generation>(reqs[2], tokenizer_), Collect(&turn1));
  RunToIdle(engine2);
  GenerationRequest next = reqs[2];
  next.prompt.insert(next.prompt.end(), turn1.tokens.begin(), turn1.tokens.end());
  const std::vector<int32_t> more = *tokenizer_->Encode(" And God said,");
  next.prompt.insert(next.prompt.end(), more.begin(), more.end());
  Output turn2;
  int32_t cached = -1;
  EventSink sink = [&](const EngineEvent& e) {
    if (cached < 0 && e.status.ok()) cached = e.cached_tokens;
    Collect(&turn2)(e);
  };
  engine2.SubmitPrefill(2, std::make_unique<Generation>(next, tokenizer_), sink);
  RunToIdle(engine2);
  // Everything the first turn wrote, in whole blocks.
  const int32_t written = static_cast<int32_t>(reqs[2].prompt.size() + turn1.tokens.size()) - 1;
  EXPECT_EQ(cached, written / 16 * 16);
  ExpectSame(turn2, Alone(next), 2);
  EXPECT_EQ(big->Counts().used, 0);
}

TEST_F(BatchEngineTest, HandedOffSequencesContinueFromTheirFirstToken) {
  const auto reqs = Mixed();
  auto kv = MakeKv(128);
  BatchEngine engine(*model_, *kv, {.max_batch = 8});
  std::vector<Output> got(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    // What a prefill worker does: prefill, sample the first token.
    Generation prefill_side(reqs[i], tokenizer_);
    SequenceKv seq = kv->NewSequence();
    ForwardSequence fs{&seq, reqs[i].prompt, LogitsMode::kLast};
    auto r = ForwardGrowing(*model_, *kv, {&fs, 1});
    ASSERT_TRUE(r.ok());
    auto first = prefill_side.Accept(r->Last(0));
    ASSERT_TRUE(first.ok());
    // The decode side replays it and takes over the KV.
    auto gen = std::make_unique<Generation>(reqs[i], tokenizer_);
    auto replayed = gen->Replay(*first);
    ASSERT_TRUE(replayed.ok());
    EXPECT_EQ(replayed->text, first->text);
    got[i].tokens.push_back(first->token);
    got[i].text += first->text;
    got[i].finish = first->finish;
    engine.SubmitDecode(i, std::move(gen), std::move(seq), Collect(&got[i]));
  }
  RunToIdle(engine);
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Alone(reqs[i]), static_cast<int>(i));
  EXPECT_EQ(kv->Counts().used, 0);
}

TEST_F(BatchEngineTest, CancelFreesTheKvAtOnce) {
  auto kv = MakeKv(64);
  BatchEngine engine(*model_, *kv, {});
  Output a, b;
  engine.SubmitPrefill(1, std::make_unique<Generation>(Request("In the beginning", 200, 0, 1), tokenizer_),
                       Collect(&a));
  engine.SubmitPrefill(2, std::make_unique<Generation>(Request("And God said", 6, 0, 1), tokenizer_),
                       Collect(&b));
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(engine.Step().ok());
  EXPECT_GT(kv->Counts().used, 0);
  engine.Cancel(1);
  ASSERT_TRUE(engine.Step().ok());
  EXPECT_EQ(a.status.code(), absl::StatusCode::kCancelled);
  const size_t a_tokens = a.tokens.size();
  RunToIdle(engine);
  EXPECT_EQ(a.tokens.size(), a_tokens) << "tokens after cancel";
  EXPECT_TRUE(b.status.ok());
  EXPECT_EQ(b.tokens.size(), 6u);
  EXPECT_EQ(kv->Counts().used, 0);
}

TEST_F(BatchEngineTest, PromptLargerThanThePoolIsRefused) {
  auto kv = MakeKv(2);  // 32 positions.
  BatchEngine engine(*model_, *kv, {.prefill_chunk_tokens = 16});
  Output a;
  std::string long_text;
  for (int i = 0; i < 12; ++i) long_text += "and the LORD said unto Moses ";
  engine.SubmitPrefill(1, std::make_unique<Generation>(Request(long_text, 4, 0, 1), tokenizer_), Collect(&a));
  RunToIdle(engine);
  EXPECT_EQ(a.status.code(), absl::StatusCode::kResourceExhausted) << a.status;
  EXPECT_EQ(kv->Counts().used, 0);
}

}  // namespace
}  // namespace pdserve
