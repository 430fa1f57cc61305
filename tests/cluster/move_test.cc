// Running sequences moved between decode workers with their KV (a drain,
// and the rebalance's pauses forced by --fault_move_at_token), on real
// processes: every stream equals the same request through an undisturbed
// cluster, token for token and byte for byte, whether the move happens
// while a stop string is half matched or a character is half sent; a move
// recomputes nothing; a target that dies mid-move leaves the sequence
// decoding on its source, and a source that dies mid-move leaves it to
// the router's replay.
#include <signal.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "text/detokenizer.h"
#include "text/tokenizer.h"
#include "tests/cluster/byte_model.h"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {
namespace {

std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> Open(Cluster& c, grpc::ClientContext& ctx,
                                                               const v1::GenerateRequest& req) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return c.stub()->Generate(&ctx, req);
}

v1::GenerateRequest Request(const std::string& text, int max_tokens, float temperature, uint64_t seed) {
  v1::GenerateRequest r;
  r.set_text(text);
  r.set_max_tokens(max_tokens);
  r.set_ignore_eos(true);
  r.mutable_sampling()->set_temperature(temperature);
  r.mutable_sampling()->set_seed(seed);
  return r;
}

double RouterMetric(Cluster& c, const std::string& series) {
  return MetricValue(HttpGet(c.router_metrics(), "/metrics"), series);
}

std::string Moves(const char* reason, const char* outcome) {
  return absl::StrCat("pdserve_decode_moves_total{reason=\"", reason, "\",outcome=\"", outcome, "\"}");
}

// The text each generated token completes (the detokenizer's output per
// token, as a decode worker's Generation emits it before stop strings).
std::vector<std::string> TextPerToken(const std::string& model, const std::vector<int32_t>& prompt,
                                      const std::vector<int32_t>& tokens) {
  std::unique_ptr<tok::Tokenizer> t = *tok::Tokenizer::Load(model);
  tok::IncrementalDetokenizer d(*t, prompt, /*skip_special_tokens=*/true);
  std::vector<std::string> out;
  for (int32_t id : tokens) out.push_back(*d.Add(id));
  return out;
}

// SIGTERM to a decode worker with streams running on both: its sequences
// move to the other worker with their KV (longest first), nothing is
// recomputed (the prefill pool prefills each prompt once, no migration),
// every stream is exact, and the drained worker exits cleanly.
TEST(MoveTest, ADrainMovesEveryRunningSequenceWithItsKvAndNothingIsRecomputed) {
  const std::string dir = TempDir();
  const std::vector<v1::GenerateRequest> requests = {
      Request("In the beginning God created", 160, 0.0f, 1),
      Request("And God said, Let there be light", 160, 0.8f, 7),
      Request("And the LORD spake unto Moses, saying", 160, 0.0f, 2),
      Request("Blessed are the poor in spirit", 160, 1.0f, 9),
  };
  std::vector<Output> want;
  {
    Cluster calm;
    ASSERT_TRUE(calm.Start(dir + "/calm", false).ok());
    for (const auto& r : requests) want.push_back(calm.Generate(r));
  }
  Cluster c;
  // Slow steps: the streams are still running when the drain comes.
  ASSERT_TRUE(c.Start(dir + "/drain", false, {"--drain_grace_s", "30", "--fault_step_delay_ms", "15"}, {}, 1, {}, 2)
                  .ok());
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>>> readers;
  std::vector<Output> got(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    ctxs.push_back(std::make_unique<grpc::ClientContext>());
    readers.push_back(Open(c, *ctxs.back(), requests[i]));
  }
  for (size_t i = 0; i < requests.size(); ++i) ReadAtLeast(*readers[i], 8, got[i]);
  const v1::ClusterStatusResponse st = c.Status();
  ASSERT_EQ(st.decode_size(), 2);
  const int victim = st.decode(0).kv_blocks_used() >= st.decode(1).kv_blocks_used() ? 0 : 1;
  ASSERT_GT(st.decode(victim).kv_blocks_used(), 0) << st.ShortDebugString();
  c.decode(victim).Signal(SIGTERM);
  std::vector<std::thread> readers_done;
  for (size_t i = 0; i < requests.size(); ++i) {
    readers_done.emplace_back([&, i] { ReadToEnd(*readers[i], got[i]); });
  }
  for (std::thread& t : readers_done) t.join();
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("stream ", i));
    ExpectUndisturbed(got[i], want[i], c);
  }
  EXPECT_EQ(c.decode(victim).Wait(absl::Seconds(20)), 0) << c.Logs();
  EXPECT_GE(RouterMetric(c, Moves("drain", "moved")), 1) << c.Logs();
  EXPECT_EQ(RouterMetric(c, Moves("drain", "replayed")), 0) << c.Logs();
  EXPECT_EQ(RouterMetric(c, "pdserve_migrations_total"), 0) << c.Logs();
  // Each prompt prefilled once: no context was computed again.
  int64_t prompts = 0;
  for (const Output& w : want) prompts += w.final.usage().prompt_tokens();
  EXPECT_EQ(RouterMetric(c, "pdserve_prefill_context_tokens_total"), prompts);
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString();
}

// A move while the stop-string matcher holds text back (the text so far
// ends with the start of a stop string that never completes): the target's
// matcher holds the same text, and the stream is exact.
TEST(MoveTest, AMoveWhileAStopStringIsHalfMatchedKeepsTheStreamExact) {
  const std::string dir = TempDir();
  constexpr int kMoveAt = 24;
  v1::GenerateRequest req = Request("In the beginning God created", 64, 0.0f, 3);
  Output plain;
  {
    Cluster calm;
    ASSERT_TRUE(calm.Start(dir + "/calm", false).ok());
    plain = calm.Generate(req);
    ASSERT_TRUE(plain.status.ok());
    ASSERT_EQ(plain.tokens.size(), 64u);
    std::unique_ptr<tok::Tokenizer> t = *tok::Tokenizer::Load(kModel);
    const std::vector<int32_t> prompt = *t->Encode(req.text(), false);
    std::string through;  // The text of the first kMoveAt tokens.
    const std::vector<std::string> pieces = TextPerToken(kModel, prompt, plain.tokens);
    for (int i = 0; i < kMoveAt; ++i) through += pieces[i];
    ASSERT_GE(through.size(), 4u);
    // Half of a stop string at the move: its last 4 characters, then one
    // the shipped model never writes.
    req.add_stop(through.substr(through.size() - 4) + "#");
    plain = calm.Generate(req);
    ASSERT_TRUE(plain.status.ok());
  }
  Cluster c;
  ASSERT_TRUE(c.Start(dir + "/move", false, {"--fault_move_at_token", absl::StrCat(kMoveAt)}, {}, 1, {}, 2).ok());
  const Output got = c.Generate(req);
  ExpectUndisturbed(got, plain, c);
  EXPECT_EQ(RouterMetric(c, Moves("rebalance", "moved")), 1) << c.Logs();
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString();
}

// A move while the detokenizer holds the first bytes of a character (a
// byte-fallback model whose head favours byte tokens): the target holds
// the same bytes, and the character comes out whole, once.
TEST(MoveTest, AMoveWhileACharacterIsHalfSentKeepsTheStreamExact) {
  const std::string dir = TempDir();
  const std::string model = MakeByteFallbackModel(dir + "/model");
  v1::GenerateRequest req;
  for (int id : {1, 450, 937, 310, 278, 3186}) req.mutable_token_ids()->add_ids(id);
  req.set_max_tokens(96);
  req.set_ignore_eos(true);
  req.mutable_sampling()->set_temperature(1.0f);
  req.mutable_sampling()->set_seed(5);
  Output plain;
  {
    Cluster calm;
    calm.model = model;
    ASSERT_TRUE(calm.Start(dir + "/calm", false).ok());
    plain = calm.Generate(req);
    ASSERT_TRUE(plain.status.ok()) << plain.status.error_message();
  }
  const std::vector<int32_t> prompt(req.token_ids().ids().begin(), req.token_ids().ids().end());
  const std::vector<std::string> pieces = TextPerToken(model, prompt, plain.tokens);
  // The first token after which the detokenizer holds a partial character.
  int move_at = 0;
  for (size_t i = 1; i + 1 < pieces.size() && move_at == 0; ++i) {
    const int32_t id = plain.tokens[i];
    if (pieces[i].empty() && id >= kFirstByteToken && id < kFirstByteToken + 256 && (id - kFirstByteToken) >= 0xC0) {
      move_at = static_cast<int>(i) + 1;
    }
  }
  ASSERT_GT(move_at, 1) << "no stream token starts a multi-byte character; pick another seed";
  Cluster c;
  c.model = model;
  ASSERT_TRUE(c.Start(dir + "/move", false, {"--fault_move_at_token", absl::StrCat(move_at)}, {}, 1, {}, 2).ok());
  const Output got = c.Generate(req);
  ExpectUndisturbed(got, plain, c);
  EXPECT_EQ(RouterMetric(c, Moves("rebalance", "moved")), 1) << c.Logs();
}

// One decode worker much slower than the other (its every step waits
// 60 ms): once it has been hot for the sustain period the router moves
// sequences off it, and every stream is exact.
TEST(MoveTest, TheRebalanceMovesSequencesOffASlowWorkerAndStreamsStayExact) {
  const std::string dir = TempDir();
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < 4; ++i) requests.push_back(Request("And God said, Let there be light", 200, 0.7f, 40 + i));
  std::vector<Output> want;
  {
    Cluster calm;
    ASSERT_TRUE(calm.Start(dir + "/calm", false).ok());
    for (const auto& r : requests) want.push_back(calm.Generate(r));
  }
  Cluster c;
  c.extra_decode_flags[0] = {"--fault_step_delay_ms", "60"};
  c.extra_router_flags = {"--decode_policy", "round_robin", "--rebalance_sustain_s", "0.5"};
  ASSERT_TRUE(c.Start(dir + "/rebalance", false, {}, {}, 1, {}, 2).ok());
  std::vector<Output> got(requests.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < requests.size(); ++i) clients.emplace_back([&, i] { got[i] = c.Generate(requests[i]); });
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("stream ", i));
    ExpectUndisturbed(got[i], want[i], c);
  }
  EXPECT_GE(RouterMetric(c, Moves("rebalance", "moved")), 1) << c.Logs();
  EXPECT_EQ(RouterMetric(c, "pdserve_migrations_total"), 0) << c.Logs();
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString();
}

// The fault tests' cluster: every sequence pauses at its 10th token, and
// each move waits 1.5 s before sending, long enough to kill a worker.
struct StalledMove {
  static constexpr int kMoveAt = 10;
  Cluster c;
  v1::GenerateRequest req = Request("In the beginning God created", 120, 0.8f, 11);
  Output want;
  Output got;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader;
  int source = -1;

  void Start(const std::string& dir) {
    {
      Cluster calm;
      ASSERT_TRUE(calm.Start(dir + "/calm", false).ok());
      want = calm.Generate(req);
    }
    ASSERT_TRUE(c.Start(dir + "/stalled", false,
                        {"--fault_move_at_token", absl::StrCat(kMoveAt), "--fault_stall_move_ms", "1500"}, {}, 1, {}, 2)
                    .ok());
    reader = Open(c, ctx, req);
    ReadAtLeast(*reader, kMoveAt, got);
    ASSERT_EQ(static_cast<int>(got.tokens.size()), kMoveAt) << "the stream ran past its pause";
    absl::SleepFor(absl::Milliseconds(300));  // The move is stalled on the source now.
    const v1::ClusterStatusResponse st = c.Status();
    source = st.decode(0).kv_blocks_used() > 0 ? 0 : 1;
    ASSERT_GT(st.decode(source).kv_blocks_used(), 0) << st.ShortDebugString();
  }
  void Finish() { ReadToEnd(*reader, got); }
};

TEST(MoveTest, ATargetThatDiesMidMoveLeavesTheSequenceDecodingOnItsSource) {
  StalledMove m;
  ASSERT_NO_FATAL_FAILURE(m.Start(TempDir()));
  m.c.decode(1 - m.source).Kill();
  m.Finish();
  ExpectUndisturbed(m.got, m.want, m.c);
  EXPECT_EQ(RouterMetric(m.c, Moves("rebalance", "resumed")), 1) << m.c.Logs();
  EXPECT_EQ(RouterMetric(m.c, "pdserve_migrations_total"), 0) << m.c.Logs();
  EXPECT_EQ(AllKvUsedAfterSettling(m.c), 0) << m.c.Status().ShortDebugString();
}

TEST(MoveTest, ASourceThatDiesMidMoveLeavesTheSequenceToTheReplay) {
  StalledMove m;
  ASSERT_NO_FATAL_FAILURE(m.Start(TempDir()));
  m.c.decode(m.source).Kill();
  m.Finish();
  ExpectUndisturbed(m.got, m.want, m.c);
  EXPECT_EQ(RouterMetric(m.c, Moves("rebalance", "replayed")), 1) << m.c.Logs();
  EXPECT_EQ(RouterMetric(m.c, "pdserve_migrations_total"), 1) << m.c.Logs();
  EXPECT_EQ(AllKvUsedAfterSettling(m.c), 0) << m.c.Status().ShortDebugString();
}

}  // namespace
}  // namespace pdserve
