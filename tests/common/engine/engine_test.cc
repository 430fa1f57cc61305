// The engine against the one-sequence-at-a-time generator on the shipped
// model: batching, chunked prefill, queueing, preemption with
// recomputation, prefill-only requests handing off, handed-off sequences
// and cancellation must not change a single token or byte of text, and
// every request must end in the state its path leads to.
#include "engine/engine.h"

#include <stdlib.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/generation.h"
#include "kv/kv_checksum.h"
#include "kv/tier2_store.h"
#include "model/model.h"
#include "text/tokenizer.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/default_model.h"

namespace pdserve::engine {
namespace {


struct Output {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason finish = FinishReason::kNone;
  absl::Status status;
};

class EngineTest : public ::testing::Test {
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

  GenerationRequest MakeReq(const std::string& text, int max_tokens, float temperature,
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

  static RequestCallbacks Collect(Output* out) {
    RequestCallbacks c;
    c.on_token = [out](const TokenEvent& t, int32_t) {
      out->tokens.push_back(t.token);
      out->text += t.text;
      out->finish = t.finish;
    };
    c.on_end = [out](const absl::Status& s) { out->status = s; };
    return c;
  }

  // A request that prefills and decodes here.
  std::shared_ptr<Request> Local(int id, const GenerationRequest& req, RequestCallbacks callbacks) {
    return std::make_shared<Request>(RequestId(absl::StrCat("r", id)), RequestMode::kLocal,
                                     std::make_unique<Generation>(req, tokenizer_), std::move(callbacks));
  }

  static void RunToIdle(Engine& engine) {
    for (int i = 0; i < 100000; ++i) {
      auto r = engine.Step();
      ASSERT_TRUE(r.ok()) << r.status();
      if (!*r) return;
    }
    FAIL() << "engine never went idle";
  }

  std::vector<GenerationRequest> Mixed() {
    std::vector<GenerationRequest> reqs;
    reqs.push_back(MakeReq("In the beginning God created", 24, 0, 1));
    reqs.push_back(MakeReq("And the LORD said unto Moses,", 30, 0.8f, 7));
    // Longer than one prefill chunk (the engine's budget below is 48 tokens).
    reqs.push_back(MakeReq("And it came to pass, when men began to multiply on the face of the earth, "
                           "and daughters were born unto them, that the sons of God saw the daughters "
                           "of men that they were fair; and they took them wives of all which they chose.",
                           20, 0, 3));
    reqs.push_back(MakeReq("Blessed are the", 16, 1.0f, 99));
    reqs.push_back(MakeReq("The LORD is my shepherd;", 28, 0.7f, 5, {"LORD"}));
    reqs.push_back(MakeReq("Then", 12, 0, 11));
    return reqs;
  }

  static testing_support::DefaultModel* loaded_;
  static Model* model_;
  static tok::Tokenizer* tokenizer_;
};

testing_support::DefaultModel* EngineTest::loaded_ = nullptr;
Model* EngineTest::model_ = nullptr;
tok::Tokenizer* EngineTest::tokenizer_ = nullptr;

void ExpectSame(const Output& got, const Output& want, int i) {
  EXPECT_TRUE(got.status.ok()) << "request " << i << ": " << got.status;
  EXPECT_EQ(got.tokens, want.tokens) << "request " << i;
  EXPECT_EQ(got.text, want.text) << "request " << i;
  EXPECT_EQ(got.finish, want.finish) << "request " << i;
}

TEST_F(EngineTest, BatchedStreamsEqualOneAtATime) {
  const auto reqs = Mixed();
  auto kv = MakeKv(128);
  Engine engine(*model_, *kv, {.max_batch = 4, .chunk_tokens = 48});
  std::vector<Output> got(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    engine.Submit(Local(i, reqs[i], Collect(&got[i])));
  }
  RunToIdle(engine);
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Alone(reqs[i]), static_cast<int>(i));
  EXPECT_EQ(kv->Counts().used, 0);
  EXPECT_EQ(engine.stats().preemptions, 0);
  EXPECT_EQ(engine.stats().running + engine.stats().waiting, 0);
}

TEST_F(EngineTest, PreemptedSequencesRecomputeAndContinueUnchanged) {
  const auto reqs = Mixed();
  // 7 blocks of 16 positions: the longest request alone needs 6 at its end,
  // all six together about 25.
  auto kv = MakeKv(7);
  Engine engine(*model_, *kv, {.max_batch = 6, .chunk_tokens = 48});
  std::vector<Output> got(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    engine.Submit(Local(i, reqs[i], Collect(&got[i])));
  }
  RunToIdle(engine);
  EXPECT_GT(engine.stats().preemptions, 0);
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Alone(reqs[i]), static_cast<int>(i));
  EXPECT_EQ(kv->Counts().used, 0);
}

// With the prefix cache on, preempted sequences publish their blocks and
// recompute from them, and a second turn of a conversation (the first
// turn's prompt + output + more) prefills only what is new: no token changes.
TEST_F(EngineTest, PrefixCacheReusesPublishedBlocksWithoutChangingATokenEvenUnderPreemption) {
  const auto reqs = Mixed();
  auto kv = MakeKv(7);
  Engine engine(*model_, *kv, {.max_batch = 6, .chunk_tokens = 48, .prefix_cache = true});
  std::vector<Output> got(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    engine.Submit(Local(i, reqs[i], Collect(&got[i])));
  }
  RunToIdle(engine);
  EXPECT_GT(engine.stats().preemptions, 0);
  EXPECT_GT(kv->Counts().prefix.hit_blocks, 0) << "recomputes found nothing cached";
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Alone(reqs[i]), static_cast<int>(i));
  EXPECT_EQ(kv->Counts().used, 0);

  // Turn two of request 2 (the long one): prompt + its output + new text.
  auto big = MakeKv(64);
  Engine engine2(*model_, *big, {.max_batch = 4, .chunk_tokens = 48, .prefix_cache = true});
  Output turn1;
  engine2.Submit(Local(1, reqs[2], Collect(&turn1)));
  RunToIdle(engine2);
  GenerationRequest next = reqs[2];
  next.prompt.insert(next.prompt.end(), turn1.tokens.begin(), turn1.tokens.end());
  const std::vector<int32_t> more = *tokenizer_->Encode(" And God said,");
  next.prompt.insert(next.prompt.end(), more.begin(), more.end());
  Output turn2;
  int32_t cached = -1;
  RequestCallbacks sink = Collect(&turn2);
  sink.on_token = [&, collect = sink.on_token](const TokenEvent& t, int32_t c) {
    if (cached < 0) cached = c;
    collect(t, c);
  };
  engine2.Submit(Local(2, next, sink));
  RunToIdle(engine2);
  // Everything the first turn wrote, in whole blocks.
  const int32_t written = static_cast<int32_t>(reqs[2].prompt.size() + turn1.tokens.size()) - 1;
  EXPECT_EQ(cached, written / 16 * 16);
  ExpectSame(turn2, Alone(next), 2);
  EXPECT_EQ(big->Counts().used, 0);
}

// The prefix cache's second tier (kv/tier2_store.h): a fresh pool (as after
// a restart, or once the pool evicted the prefix) reads the prefix back from
// the tier instead of computing it, and no token changes; a block that fails
// its check is computed instead, and still no token changes.
class EngineTier2Test : public EngineTest {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/pdserve-engine-tier2-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::unique_ptr<Tier2Store> OpenStore(const KvManager& kv) {
    auto store = Tier2Store::Open(model_->identity(), kv.spec(), {.dir = dir_, .capacity_bytes = 64 << 20});
    EXPECT_TRUE(store.ok()) << store.status();
    return store.ok() ? *std::move(store) : nullptr;
  }

  // Steps until idle with no read of the tier outstanding.
  static void RunToIdleWith(Engine& engine, Tier2Store& store) {
    for (int i = 0; i < 1000; ++i) {
      RunToIdle(engine);
      store.Flush();
      auto r = engine.Step();
      ASSERT_TRUE(r.ok()) << r.status();
      if (!*r) return;
    }
    FAIL() << "engine never went idle";
  }

  // One request through a fresh pool and engine over `store`; its cached
  // token count is the first token's.
  Output Serve(Tier2Store& store, const GenerationRequest& req, int32_t* cached) {
    auto kv = MakeKv(32);
    Engine engine(*model_, *kv, {.max_batch = 4, .chunk_tokens = 48, .prefix_cache = true, .tier2 = &store});
    Output out;
    RequestCallbacks sink = Collect(&out);
    *cached = -1;
    sink.on_token = [cached, collect = sink.on_token](const TokenEvent& t, int32_t c) {
      if (*cached < 0) *cached = c;
      collect(t, c);
    };
    engine.Submit(Local(1, req, sink));
    RunToIdleWith(engine, store);
    store.Flush();  // The blocks it published are written.
    EXPECT_EQ(kv->Counts().used, 0);
    return out;
  }

  std::vector<GenerationRequest> LongPrompts() {
    const std::string text =
        "And it came to pass, when men began to multiply on the face of the earth, and daughters were born "
        "unto them, that the sons of God saw the daughters of men that they were fair; and they took them "
        "wives of all which they chose.";
    return {MakeReq(text, 20, 0, 3), MakeReq(text, 20, 0.8f, 7)};
  }

  std::string dir_;
};

TEST_F(EngineTier2Test, AFreshPoolReadsThePrefixBackFromTheTierAndNoTokenChanges) {
  for (const GenerationRequest& req : LongPrompts()) {
    auto probe = MakeKv(32);
    std::unique_ptr<Tier2Store> store = OpenStore(*probe);
    ASSERT_NE(store, nullptr);
    const Output want = Alone(req);
    int32_t cached = 0;
    const Output first = Serve(*store, req, &cached);
    ExpectSame(first, want, 0);
    EXPECT_EQ(cached, 0);
    const int32_t full_blocks = static_cast<int32_t>(req.prompt.size() - 1) / 16;
    ASSERT_GE(full_blocks, 2);
    EXPECT_GE(store->Stats().blocks, full_blocks) << "the prompt's blocks are written";
    const Output second = Serve(*store, req, &cached);
    ExpectSame(second, want, 1);
    EXPECT_EQ(cached, full_blocks * 16) << "the whole prefix came from the tier";
    EXPECT_EQ(store->Stats().restored_blocks, full_blocks);
    EXPECT_EQ(store->Stats().checksum_failures, 0);
    store.reset();
    std::filesystem::remove_all(dir_);
  }
}

TEST_F(EngineTier2Test, ABlockThatFailsItsCheckIsComputedAndNoTokenChanges) {
  const GenerationRequest req = LongPrompts()[0];
  const Output want = Alone(req);
  auto probe = MakeKv(32);
  std::unique_ptr<Tier2Store> store = OpenStore(*probe);
  ASSERT_NE(store, nullptr);
  int32_t cached = 0;
  ExpectSame(Serve(*store, req, &cached), want, 0);
  // Corrupt the second block's file: one payload byte.
  const std::vector<BlockHash> hashes =
      BlockHasher(model_->identity(), DType::kF32, 16).FullBlockHashes(absl::MakeConstSpan(req.prompt).first(32));
  ASSERT_EQ(hashes.size(), 2u);
  const std::string path = dir_ + "/" + hashes[1].ToHex() + ".kvb";
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good()) << path;
    f.seekg(Tier2Store::kHeaderBytes + 5);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x40);
    f.seekp(Tier2Store::kHeaderBytes + 5);
    f.write(&c, 1);
  }
  ExpectSame(Serve(*store, req, &cached), want, 1);
  EXPECT_EQ(cached, 16) << "the first block came from the tier, the rest was computed";
  EXPECT_EQ(store->Stats().checksum_failures, 1);
  EXPECT_EQ(store->Stats().restored_blocks, 1);
}

TEST_F(EngineTier2Test, ARequestCancelledWhileItsPrefixIsReadEndsCancelledAndFreesItsKv) {
  const GenerationRequest req = LongPrompts()[0];
  auto probe = MakeKv(32);
  std::unique_ptr<Tier2Store> store = OpenStore(*probe);
  ASSERT_NE(store, nullptr);
  int32_t cached = 0;
  Serve(*store, req, &cached);
  auto kv = MakeKv(32);
  Engine engine(*model_, *kv, {.max_batch = 4, .chunk_tokens = 48, .prefix_cache = true, .tier2 = store.get()});
  Output out;
  std::shared_ptr<Request> r = Local(1, req, Collect(&out));
  engine.Submit(r);
  ASSERT_TRUE(engine.Step().ok());  // Starts the read.
  engine.Cancel(r, absl::CancelledError("client went away"));
  RunToIdleWith(engine, *store);
  EXPECT_TRUE(absl::IsCancelled(out.status)) << out.status;
  EXPECT_TRUE(out.tokens.empty());
  EXPECT_EQ(kv->Counts().used, 0);
  EXPECT_EQ(engine.stats().waiting, 0);
}

TEST_F(EngineTest, HandedOffSequencesContinueFromTheirFirstToken) {
  const auto reqs = Mixed();
  auto kv = MakeKv(128);
  Engine engine(*model_, *kv, {.max_batch = 8});
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
    auto req = std::make_shared<Request>(RequestId(absl::StrCat("r", i)), RequestMode::kDecodeOnly, std::move(gen),
                                         Collect(&got[i]));
    req->kv = std::move(seq);
    ASSERT_TRUE(req->lifecycle.Transition(RequestState::kWaitingForKv).ok());
    engine.Submit(req);
  }
  RunToIdle(engine);
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Alone(reqs[i]), static_cast<int>(i));
  EXPECT_EQ(kv->Counts().used, 0);
}

// A handed-off request whose KV does not hash to its producer's checksums
// computes its context here instead, and no token changes; one whose KV
// matches decodes from it, and its blocks are published once checked.
TEST_F(EngineTest, HandedOffKvThatFailsItsCheckIsComputedHereAndNoTokenChanges) {
  const GenerationRequest req = MakeReq(
      "And it came to pass, when men began to multiply on the face of the earth, and daughters were born "
      "unto them,",
      12, 0.8f, 7);
  const Output want = Alone(req);
  const int32_t positions = static_cast<int32_t>(req.prompt.size());
  ASSERT_GE(positions, 17);
  for (const bool corrupt : {false, true}) {
    SCOPED_TRACE(corrupt ? "corrupted" : "intact");
    auto kv = MakeKv(64);
    // The prefill side, in the same pool: its KV and first token.
    Generation prefill_side(req, tokenizer_);
    SequenceKv seq = kv->NewSequence();
    ForwardSequence fs{&seq, req.prompt, LogitsMode::kLast};
    auto fwd = ForwardGrowing(*model_, *kv, {&fs, 1});
    ASSERT_TRUE(fwd.ok()) << fwd.status();
    auto first = prefill_side.Accept(fwd->Last(0));
    ASSERT_TRUE(first.ok());
    KvCheck check{.first_block = 0, .end_block = (positions + 15) / 16, .producer = "10.0.0.9"};
    for (int32_t l = 0; l < kv->spec().num_layers; ++l) {
      check.layer_checksums.push_back(LayerChecksum(kv->storage(), l, seq.block_table(), 0, check.end_block));
    }
    if (corrupt) {  // One byte of one layer changed on the way.
      char* byte = static_cast<char*>(kv->storage().BlockData(1, BlockId{seq.block_table()[1]})) + 9;
      *byte = static_cast<char>(*byte ^ 0x04);
    }
    auto gen = std::make_unique<Generation>(req, tokenizer_);
    ASSERT_TRUE(gen->Replay(*first).ok());
    Output got;
    got.tokens.push_back(first->token);
    got.text += first->text;
    got.finish = first->finish;
    auto r = std::make_shared<Request>(RequestId("d"), RequestMode::kDecodeOnly, std::move(gen), Collect(&got));
    r->kv = std::move(seq);
    r->kv_check = check;
    ASSERT_TRUE(r->lifecycle.Transition(RequestState::kWaitingForKv).ok());
    Engine engine(*model_, *kv, {.max_batch = 4, .prefix_cache = true});
    engine.Submit(r);
    RunToIdle(engine);
    ExpectSame(got, want, corrupt ? 1 : 0);
    EXPECT_EQ(engine.stats().kv_checked, 1);
    EXPECT_EQ(engine.stats().kv_checksum_failures, corrupt ? 1 : 0);
    EXPECT_EQ(engine.stats().kv_recomputed_positions, corrupt ? positions : 0);
    EXPECT_EQ(kv->Counts().used, 0);
  }
}

TEST_F(EngineTest, CancelFreesTheKvAtOnce) {
  auto kv = MakeKv(64);
  Engine engine(*model_, *kv, {});
  Output a, b;
  auto first = Local(1, MakeReq("In the beginning", 200, 0, 1), Collect(&a));
  engine.Submit(first);
  engine.Submit(Local(2, MakeReq("And God said", 6, 0, 1), Collect(&b)));
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(engine.Step().ok());
  EXPECT_GT(kv->Counts().used, 0);
  engine.Cancel(first, absl::CancelledError("cancelled by the test"));
  ASSERT_TRUE(engine.Step().ok());
  EXPECT_EQ(a.status.code(), absl::StatusCode::kCancelled);
  const size_t a_tokens = a.tokens.size();
  RunToIdle(engine);
  EXPECT_EQ(a.tokens.size(), a_tokens) << "tokens after cancel";
  EXPECT_EQ(first->lifecycle.end_reason(), EndReason::kCancelled);
  EXPECT_TRUE(b.status.ok());
  EXPECT_EQ(b.tokens.size(), 6u);
  EXPECT_EQ(kv->Counts().used, 0);
}

// A paused sequence leaves the batch with its KV (nothing decodes it, its
// blocks stay held, the other sequence goes on), and one resumed continues
// to the same tokens; a sequence still prefilling is not paused.
TEST_F(EngineTest, APausedSequenceKeepsItsKvOutOfTheBatchAndResumesUnchanged) {
  auto kv = MakeKv(64);
  Engine engine(*model_, *kv, {});
  const GenerationRequest ra = MakeReq("In the beginning", 40, 0.8f, 5), rb = MakeReq("And God said", 20, 0, 1);
  Output a, b;
  auto first = Local(1, ra, Collect(&a));
  engine.Submit(first);
  engine.Submit(Local(2, rb, Collect(&b)));
  std::optional<bool> paused;
  engine.Pause(first, [&paused](bool out) { paused = out; });
  ASSERT_TRUE(engine.Step().ok());
  EXPECT_EQ(paused, false) << "a sequence that has not prefilled is not paused";
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(engine.Step().ok());
  paused.reset();
  engine.Pause(first, [&paused](bool out) { paused = out; });
  ASSERT_TRUE(engine.Step().ok());
  ASSERT_EQ(paused, true);
  const size_t at_pause = a.tokens.size();
  EXPECT_EQ(first->kv.num_positions(), first->gen->next_position() - 1) << "every fed position has its KV";
  const int32_t held = kv->Counts().used;
  RunToIdle(engine);  // The other sequence finishes; the paused one waits.
  EXPECT_EQ(a.tokens.size(), at_pause) << "tokens while paused";
  EXPECT_TRUE(b.status.ok());
  EXPECT_GT(kv->Counts().used, 0);
  EXPECT_LE(kv->Counts().used, held);
  engine.Resume(first);
  RunToIdle(engine);
  ExpectSame(a, Alone(ra), 1);
  ExpectSame(b, Alone(rb), 2);
  EXPECT_EQ(kv->Counts().used, 0);
}

// The prefill role: kPrefillOnly requests are batched and chunked like any
// other, report every layer's KV during their last chunk's forward, and
// hand their KV over after the first token; a decode-only engine then
// continues each one from that KV to the same tokens as one process.
TEST_F(EngineTest, PrefillOnlyRequestsHandOffAndDecodeOnlyRequestsContinueThem) {
  const auto reqs = Mixed();
  auto kv = MakeKv(128);
  const int32_t layers = static_cast<int32_t>(model_->config().num_layers);
  struct HandedOff {
    std::vector<int32_t> layers_seen;
    int32_t positions_at_first_layer = -1;
    TokenEvent first;
    SequenceKv kv;
    bool handed = false;
    RequestState state_at_handoff = RequestState::kWaiting;
    Output out;
  };
  std::vector<HandedOff> h(reqs.size());
  std::vector<std::shared_ptr<Request>> prefills;
  {
    Engine prefill(*model_, *kv, {.max_batch = 4, .chunk_tokens = 48, .prefix_cache = true});
    for (size_t i = 0; i < reqs.size(); ++i) {
      RequestCallbacks c = Collect(&h[i].out);
      c.on_layer_written = [&h, i](int32_t layer, const SequenceKv& seq) {
        if (h[i].layers_seen.empty()) h[i].positions_at_first_layer = static_cast<int32_t>(seq.block_table().size());
        h[i].layers_seen.push_back(layer);
        return absl::OkStatus();
      };
      c.on_handoff = [&h, i, &prefills](const TokenEvent& first, SequenceKv seq) {
        h[i].first = first;
        h[i].kv = std::move(seq);
        h[i].handed = true;
        h[i].state_at_handoff = prefills[i]->lifecycle.state();
      };
      prefills.push_back(std::make_shared<Request>(RequestId(absl::StrCat("p", i)), RequestMode::kPrefillOnly,
                                                   std::make_unique<Generation>(reqs[i], tokenizer_), c));
    }
    for (auto& r : prefills) prefill.Submit(r);
    RunToIdle(prefill);
  }
  Engine decode(*model_, *kv, {.max_batch = 8});
  std::vector<Output> got(reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    SCOPED_TRACE(i);
    ASSERT_TRUE(h[i].handed) << h[i].out.status;
    EXPECT_EQ(h[i].state_at_handoff, RequestState::kHandingOff);
    std::vector<int32_t> want(layers);
    for (int32_t l = 0; l < layers; ++l) want[l] = l;
    EXPECT_EQ(h[i].layers_seen, want) << "every layer once, in order";
    EXPECT_GE(h[i].positions_at_first_layer * 16, static_cast<int32_t>(reqs[i].prompt.size()));
    EXPECT_EQ(h[i].kv.num_positions(), static_cast<int32_t>(reqs[i].prompt.size()));
    EXPECT_EQ(h[i].out.tokens, std::vector<int32_t>{h[i].first.token});
    // The owner commits, then the request is done on the prefill side.
    ASSERT_TRUE(prefills[i]->lifecycle.Transition(RequestState::kFinished, EndReason::kHandedOff).ok());

    auto gen = std::make_unique<Generation>(reqs[i], tokenizer_);
    ASSERT_TRUE(gen->Replay(h[i].first).ok());
    got[i].tokens.push_back(h[i].first.token);
    got[i].text += h[i].first.text;
    got[i].finish = h[i].first.finish;
    auto r = std::make_shared<Request>(RequestId(absl::StrCat("d", i)), RequestMode::kDecodeOnly, std::move(gen),
                                       Collect(&got[i]));
    r->kv = std::move(h[i].kv);
    ASSERT_TRUE(r->lifecycle.Transition(RequestState::kWaitingForKv).ok());
    decode.Submit(r);
  }
  RunToIdle(decode);
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Alone(reqs[i]), static_cast<int>(i));
  EXPECT_EQ(kv->Counts().used, 0);
}

// A layer report that fails ends its request with that error after the
// forward, and nothing is handed off.
TEST_F(EngineTest, AFailedLayerReportEndsThePrefillOnlyRequest) {
  auto kv = MakeKv(64);
  Engine engine(*model_, *kv, {});
  Output out;
  bool handed = false;
  RequestCallbacks c = Collect(&out);
  c.on_layer_written = [](int32_t layer, const SequenceKv&) {
    return layer == 1 ? absl::UnavailableError("the decode worker went away") : absl::OkStatus();
  };
  c.on_handoff = [&handed](const TokenEvent&, SequenceKv) { handed = true; };
  auto r = std::make_shared<Request>(RequestId("p"), RequestMode::kPrefillOnly,
                                     std::make_unique<Generation>(MakeReq("In the beginning", 8, 0, 1), tokenizer_), c);
  engine.Submit(r);
  RunToIdle(engine);
  EXPECT_FALSE(handed);
  EXPECT_EQ(out.status.code(), absl::StatusCode::kUnavailable) << out.status;
  EXPECT_EQ(r->lifecycle.end_reason(), EndReason::kError);
  EXPECT_EQ(kv->Counts().used, 0);
}

// On its own thread: work submitted from other threads is served, and Stop
// ends what is still inside with UNAVAILABLE, its KV freed.
TEST_F(EngineTest, TheEngineThreadServesOtherThreadsAndStopEndsTheRest) {
  const auto reqs = Mixed();
  auto kv = MakeKv(128);
  Engine engine(*model_, *kv, {.max_batch = 8, .chunk_tokens = 48});
  engine.Start();
  std::vector<Output> got(reqs.size());
  std::vector<absl::Notification> done(reqs.size());
  std::vector<std::thread> submitters;
  for (size_t i = 0; i < reqs.size(); ++i) {
    submitters.emplace_back([&, i] {
      RequestCallbacks c = Collect(&got[i]);
      c.on_end = [&, i](const absl::Status& s) {
        got[i].status = s;
        done[i].Notify();
      };
      engine.Submit(Local(static_cast<int>(i), reqs[i], c));
    });
  }
  for (auto& t : submitters) t.join();
  for (auto& d : done) ASSERT_TRUE(d.WaitForNotificationWithTimeout(absl::Seconds(60)));
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Alone(reqs[i]), static_cast<int>(i));

  Output endless;
  absl::Notification started, ended;
  RequestCallbacks c = Collect(&endless);
  c.on_token = [&](const TokenEvent&, int32_t) {
    if (!started.HasBeenNotified()) started.Notify();
  };
  c.on_end = [&](const absl::Status& s) {
    endless.status = s;
    ended.Notify();
  };
  auto r = Local(99, MakeReq("In the beginning", 2000, 0, 1), c);
  engine.Submit(r);
  ASSERT_TRUE(started.WaitForNotificationWithTimeout(absl::Seconds(60)));
  engine.Stop();
  ASSERT_TRUE(ended.HasBeenNotified());
  EXPECT_EQ(endless.status.code(), absl::StatusCode::kUnavailable) << endless.status;
  EXPECT_EQ(r->lifecycle.state(), RequestState::kFinished);
  EXPECT_EQ(kv->Counts().used, 0);
}

// KV freed by another owner (a decode worker's released handoff, a stream
// ended on another thread) wakes the engine's thread: a request waiting for
// room starts once the blocks come back, with no tick to notice them.
TEST_F(EngineTest, KvFreedOnAnotherThreadStartsARequestWaitingForRoom) {
  auto kv = MakeKv(8);
  SequenceKv holder = kv->NewSequence();
  ASSERT_TRUE(kv->Grow(holder, 8 * 16).ok());  // every block
  Engine engine(*model_, *kv, {.max_batch = 8, .chunk_tokens = 48});
  engine.Start();
  const GenerationRequest req = MakeReq("In the beginning God created", 24, 0, 1);
  Output got;
  absl::Notification done;
  std::atomic<bool> released{false};
  std::atomic<bool> token_before_release{false};
  RequestCallbacks c = Collect(&got);
  c.on_token = [&, inner = c.on_token](const TokenEvent& t, int32_t n) {
    if (!released.load()) token_before_release.store(true);
    inner(t, n);
  };
  c.on_end = [&](const absl::Status& s) {
    got.status = s;
    done.Notify();
  };
  engine.Submit(Local(1, req, c));
  EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(200))) << "it ran with no room";
  std::thread freer([&] {
    released.store(true);
    holder.Release();
  });
  freer.join();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_FALSE(token_before_release.load());
  ExpectSame(got, Alone(req), 1);
  engine.Stop();
  EXPECT_EQ(kv->Counts().used, 0);
}

// A forward that fails (here a tensor-parallel rank's collective) stops the
// engine: its requests end with the error, and so does every request
// submitted afterwards, at once (none may wait for a thread that is gone).
// A cluster run lost a stream to exactly that: a handoff committed just
// after the failure queued its request forever.
TEST_F(EngineTest, RequestsSubmittedAfterTheEngineFailedEndWithItsError) {
  std::vector<std::unique_ptr<kernels::cpu::CpuBackend>> backends;
  ModelOptions o;
  o.tp = 2;
  for (int r = 0; r < 2; ++r) {
    backends.push_back(*kernels::cpu::CpuBackend::Create({.num_threads = 1, .isa = std::nullopt,
                                                          .matrix_path = kernels::cpu::MatrixPath::kF32}));
  }
  o.rank_backends = {backends[1].get()};
  auto sharded = Model::Load(std::string(PDSERVE_SOURCE_DIR) + "/deploy/models/kjv-tiny", o, backends[0].get());
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  auto kv = *KvManager::Create((*sharded)->MakeKvSpec(DType::kF32, 16, 64));
  (*sharded)->tp_group()->InjectFailure(30, absl::UnavailableError("injected: rank link down"));
  Engine engine(**sharded, *kv, {.max_batch = 8, .chunk_tokens = 48});
  engine.Start();
  auto run = [&](int id) {
    auto out = std::make_shared<Output>();
    auto ended = std::make_shared<absl::Notification>();
    RequestCallbacks c = Collect(out.get());
    c.on_end = [out, ended](const absl::Status& s) {
      out->status = s;
      ended->Notify();
    };
    engine.Submit(Local(id, MakeReq("In the beginning God created", 40, 0, 1), c));
    return std::make_pair(out, ended);
  };
  auto [first, first_ended] = run(1);
  ASSERT_TRUE(first_ended->WaitForNotificationWithTimeout(absl::Seconds(60)));
  EXPECT_EQ(first->status.message(), "injected: rank link down");
  ASSERT_TRUE(engine.failed());
  auto [late, late_ended] = run(2);
  EXPECT_TRUE(late_ended->HasBeenNotified());  // Ended inside Submit.
  EXPECT_EQ(late->status.message(), "injected: rank link down");
  engine.Stop();
  EXPECT_EQ(kv->Counts().used, 0);
}

// The life bound's tests run on a fake clock that the test moves between
// steps: 100 ms + 1 ms for the one token's allowance.
EngineOptions FakeClockLife(absl::Time* now) {
  return {.life_base = absl::Milliseconds(100),
          .life_step_factor = 0,
          .life_min_per_token = absl::Milliseconds(1),
          .clock = [now] { return *now; }};
}
constexpr absl::Duration kFakeLifeBound = absl::Milliseconds(101);

// Steps until idle, `tick` of the fake clock before each step.
void RunToIdleTicking(Engine& engine, absl::Time& now, absl::Duration tick) {
  for (int i = 0; i < 100000; ++i) {
    now += tick;
    auto r = engine.Step();
    ASSERT_TRUE(r.ok()) << r.status();
    if (!*r) return;
  }
  FAIL() << "engine never went idle";
}

// Only a computing request's silence counts: queued, preempted and
// finished ones have none.
TEST(TimeWithoutProgressTest, CountsOnlyWhilePrefillingOrDecoding) {
  Request r(RequestId("r1"), RequestMode::kLocal, nullptr, {});
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  EXPECT_EQ(TimeWithoutProgress(r, t0), absl::ZeroDuration());  // Waiting; never stamped.
  ASSERT_TRUE(r.lifecycle.Transition(RequestState::kPrefilling).ok());
  r.last_progress = t0;
  EXPECT_EQ(TimeWithoutProgress(r, t0 + absl::Seconds(3)), absl::Seconds(3));
  ASSERT_TRUE(r.lifecycle.Transition(RequestState::kDecoding).ok());
  EXPECT_EQ(TimeWithoutProgress(r, t0 + absl::Seconds(5)), absl::Seconds(5));
  ASSERT_TRUE(r.lifecycle.Transition(RequestState::kPreempted).ok());
  EXPECT_EQ(TimeWithoutProgress(r, t0 + absl::Hours(1)), absl::ZeroDuration());
  ASSERT_TRUE(r.lifecycle.Transition(RequestState::kFinished, EndReason::kCancelled).ok());
  EXPECT_EQ(TimeWithoutProgress(r, t0 + absl::Hours(1)), absl::ZeroDuration());
}

// A request queued far longer than the bound (behind a batch of one) then
// runs to the same tokens as alone; so does the one ahead of it, whose
// stream lives many bounds.
TEST_F(EngineTest, TimeQueuedNeverCountsAgainstTheLifeBound) {
  auto kv = MakeKv(64);
  absl::Time now = absl::FromUnixSeconds(1000);
  EngineOptions options = FakeClockLife(&now);
  options.max_batch = 1;
  Engine engine(*model_, *kv, options);
  const GenerationRequest first_req = MakeReq("In the beginning God created", 24, 0, 1);
  const GenerationRequest queued_req = MakeReq("And God said", 6, 0.8f, 7);
  Output first, queued;
  engine.Submit(Local(1, first_req, Collect(&first)));
  auto q = Local(2, queued_req, Collect(&queued));
  engine.Submit(q);
  const absl::Time submitted = now;
  for (int i = 0; i < 10; ++i) {
    now += absl::Milliseconds(50);
    ASSERT_TRUE(engine.Step().ok());
  }
  ASSERT_EQ(q->lifecycle.state(), RequestState::kWaiting);
  ASSERT_GT(now - submitted, 4 * kFakeLifeBound);
  RunToIdleTicking(engine, now, absl::Milliseconds(50));
  ExpectSame(first, Alone(first_req), 1);
  ExpectSame(queued, Alone(queued_req), 2);
  EXPECT_EQ(engine.stats().expired, 0);
  EXPECT_EQ(kv->Counts().used, 0);
}

// A stream that makes progress at every step, chunked prefill included,
// lives far past base + max_tokens x per token and is never ended.
TEST_F(EngineTest, AStreamMakingProgressIsNeverEndedByItsLifeBound) {
  auto kv = MakeKv(64);
  absl::Time now = absl::FromUnixSeconds(1000);
  EngineOptions options = FakeClockLife(&now);
  options.chunk_tokens = 16;
  Engine engine(*model_, *kv, options);
  const GenerationRequest req = Mixed()[2];  // A prompt of several chunks.
  ASSERT_GT(req.prompt.size(), 32u);
  Output out;
  engine.Submit(Local(1, req, Collect(&out)));
  const absl::Time start = now;
  RunToIdleTicking(engine, now, absl::Milliseconds(90));  // Each gap just under the bound.
  ExpectSame(out, Alone(req), 1);
  EXPECT_GT(now - start, 10 * (absl::Milliseconds(100) + req.params.max_tokens * absl::Milliseconds(1)));
  EXPECT_EQ(engine.stats().expired, 0);
  EXPECT_EQ(kv->Counts().used, 0);
}

// A partial prefill wedged on KV that never frees ends once it has made no
// progress for the bound, and its KV is freed; the request queued behind
// it is not ended for its wait and then runs on that KV.
TEST_F(EngineTest, APrefillThatStopsMakingProgressEndsAfterTheLifeBound) {
  auto kv = MakeKv(8);
  absl::Time now = absl::FromUnixSeconds(1000);
  EngineOptions options = FakeClockLife(&now);
  options.chunk_tokens = 16;
  Engine engine(*model_, *kv, options);
  const GenerationRequest queued_req = MakeReq("And God said", 3, 0, 1);
  Output wedged, queued;
  auto w = Local(1, Mixed()[2], Collect(&wedged));
  engine.Submit(w);
  engine.Submit(Local(2, queued_req, Collect(&queued)));
  ASSERT_TRUE(engine.Step().ok());  // The first chunk: 16 positions, one block.
  ASSERT_EQ(w->lifecycle.state(), RequestState::kPrefilling);
  // Every other block goes to a holder that never gives it back.
  SequenceKv hog = kv->NewSequence();
  ASSERT_TRUE(kv->Grow(hog, kv->Counts().free * kv->spec().block_size).ok());
  const int32_t hogged = kv->Counts().used - 1;

  now += kFakeLifeBound;  // Silent for exactly the bound: it stays.
  ASSERT_TRUE(engine.Step().ok());
  EXPECT_EQ(w->lifecycle.state(), RequestState::kPrefilling);
  now += absl::Milliseconds(1);
  ASSERT_TRUE(engine.Step().ok());
  EXPECT_EQ(wedged.status.code(), absl::StatusCode::kDeadlineExceeded) << wedged.status;
  EXPECT_EQ(wedged.status.message(),
            "request r1 made no progress for 0.1 s while prefilling (bound 0.1 s + 1 token x 1 ms)");
  EXPECT_EQ(w->lifecycle.end_reason(), EndReason::kError);
  EXPECT_EQ(engine.stats().expired, 1);

  RunToIdleTicking(engine, now, absl::Milliseconds(50));
  EXPECT_EQ(kv->Counts().used, hogged);
  hog.Release();
  ExpectSame(queued, Alone(queued_req), 2);
  EXPECT_EQ(engine.stats().expired, 1);
  EXPECT_EQ(engine.stats().oldest_request_seconds, 0);
  EXPECT_EQ(kv->Counts().used, 0);
}

// A decoding request the engine stops serving (here: no step for longer
// than the bound) ends at the next step, its KV freed.
TEST_F(EngineTest, ADecodeThatGoesSilentEndsAfterTheLifeBound) {
  auto kv = MakeKv(64);
  absl::Time now = absl::FromUnixSeconds(1000);
  Engine engine(*model_, *kv, FakeClockLife(&now));
  Output out;
  auto r = Local(1, MakeReq("In the beginning", 200, 0, 1), Collect(&out));
  engine.Submit(r);
  for (int i = 0; i < 3; ++i) {
    now += absl::Milliseconds(50);
    ASSERT_TRUE(engine.Step().ok());
  }
  ASSERT_EQ(r->lifecycle.state(), RequestState::kDecoding);
  EXPECT_GT(engine.stats().oldest_request_seconds, 0);
  now += absl::Seconds(2);
  ASSERT_TRUE(engine.Step().ok());
  EXPECT_EQ(out.status.code(), absl::StatusCode::kDeadlineExceeded) << out.status;
  EXPECT_EQ(out.status.message(),
            "request r1 made no progress for 2.0 s while decoding (bound 0.1 s + 1 token x 1 ms)");
  EXPECT_EQ(out.tokens.size(), 3u);
  EXPECT_EQ(engine.stats().expired, 1);
  EXPECT_EQ(engine.stats().oldest_request_seconds, 0);
  EXPECT_EQ(kv->Counts().used, 0);
}

// The bound's one-token allowance follows the measured p99 step time (x
// the factor) once that exceeds the floor.
TEST_F(EngineTest, TheLifeBoundFollowsTheMeasuredP99StepTime) {
  auto kv = MakeKv(64);
  Engine engine(*model_, *kv,
                {.life_base = absl::Seconds(1),
                 .life_step_factor = 10,
                 .life_min_per_token = absl::Milliseconds(1),
                 .fault_stall_forward = absl::Milliseconds(10)});
  EXPECT_EQ(engine.LifeBound(), absl::Seconds(1) + absl::Milliseconds(1));
  Output out;
  engine.Submit(Local(1, MakeReq("In the beginning", 20, 0, 1), Collect(&out)));
  RunToIdle(engine);
  ASSERT_TRUE(out.status.ok()) << out.status;
  EXPECT_GE(engine.stats().p99_step_seconds, 0.010);
  // Every step took at least 10 ms: at least 10 x 10 ms.
  EXPECT_GE(engine.LifeBound(), absl::Seconds(1) + absl::Milliseconds(100));
}

TEST_F(EngineTest, PromptLargerThanThePoolIsRefused) {
  auto kv = MakeKv(2);  // 32 positions.
  Engine engine(*model_, *kv, {.chunk_tokens = 16});
  Output a;
  std::string long_text;
  for (int i = 0; i < 12; ++i) long_text += "and the LORD said unto Moses ";
  engine.Submit(Local(1, MakeReq(long_text, 4, 0, 1), Collect(&a)));
  RunToIdle(engine);
  EXPECT_EQ(a.status.code(), absl::StatusCode::kResourceExhausted) << a.status;
  EXPECT_EQ(kv->Counts().used, 0);
}

}  // namespace
}  // namespace pdserve::engine
