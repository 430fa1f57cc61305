// Faults with real processes: a prefill worker killed mid-handoff (the
// router prefills again on another one and the stream is unchanged), and a
// pool with no live worker (UNAVAILABLE within seconds, never a hang).
#include <signal.h>

#include <memory>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {
namespace {

// The decode worker whose pool holds the (only) running sequence.
int DecodeHoldingTheSequence(Cluster& c) {
  const v1::ClusterStatusResponse st = c.Status();
  const int victim = st.decode(0).kv_blocks_used() > 0 ? 0 : 1;
  EXPECT_GT(st.decode(victim).kv_blocks_used(), 0) << st.ShortDebugString();
  return victim;
}

std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> Open(Cluster& c, grpc::ClientContext& ctx,
                                                               const v1::GenerateRequest& req) {
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  return c.stub()->Generate(&ctx, req);
}

TEST(FaultTest, PrefillWorkerKilledMidHandoffIsRetriedElsewhere) {
  const std::string dir = TempDir();
  const Output want = Undisturbed(dir, false, SeededRequest(24));
  Cluster c;
  // Each handoff stalls 1.5 s between the first token and the commit.
  absl::Status s = c.Start(dir + "/faulty", false, {}, {}, /*num_prefill=*/2, {"--fault_stall_before_commit_ms", "1500"});
  ASSERT_TRUE(s.ok()) << s;
  grpc::ClientContext ctx;
  auto reader = Open(c, ctx, SeededRequest(24));
  Output got;
  ReadAtLeast(*reader, 1, got);  // The first token: prefill worker 0 is now stalled before its commit.
  ASSERT_EQ(got.tokens.size(), 1u);
  c.prefill(0).Kill();  // kill -9 mid-handoff.
  ReadToEnd(*reader, got);
  ExpectUndisturbed(got, want, c);
  // The dead sender's reservation was freed on the decode side.
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString() << "\n" << c.Logs();
}

class DecodeDeathTest : public ::testing::TestWithParam<bool> {};

TEST_P(DecodeDeathTest, DecodeWorkerKilledMidStreamMigrates) {
  const bool colocated = GetParam();
  const std::string dir = TempDir();
  v1::GenerateRequest req = SeededRequest(480);
  req.set_ignore_eos(true);
  const Output want = Undisturbed(dir, colocated, req);
  Cluster c;
  absl::Status s = c.Start(dir + "/faulty", colocated, {}, {}, 1, {}, /*num_decode=*/2);
  ASSERT_TRUE(s.ok()) << s;
  grpc::ClientContext ctx;
  auto reader = Open(c, ctx, req);
  Output got;
  ReadAtLeast(*reader, 20, got);
  ASSERT_GE(got.tokens.size(), 20u);
  c.decode(DecodeHoldingTheSequence(c)).Kill();  // kill -9 mid-stream.
  ReadToEnd(*reader, got);
  ExpectUndisturbed(got, want, c);
  // The survivors hold no KV blocks once the stream is over.
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString() << "\n" << c.Logs();
  EXPECT_EQ(got.final.usage().completion_tokens(), 480);
}

INSTANTIATE_TEST_SUITE_P(Modes, DecodeDeathTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "Colocated" : "Disaggregated";
                         });

// SIGTERM to the decode worker holding a stream: with a short grace period
// the stream migrates at the deadline; with a long one it finishes where it
// is and the worker exits cleanly afterwards. Either way the client sees
// the undisturbed stream, and new requests go to the other worker.
class DrainTest : public ::testing::TestWithParam<bool> {};

TEST_P(DrainTest, SigtermDrainsThenMigratesAtTheDeadline) {
  const bool short_grace = GetParam();
  const std::string dir = TempDir();
  v1::GenerateRequest req = SeededRequest(480);
  req.set_ignore_eos(true);
  const Output want = Undisturbed(dir, false, req);
  Cluster c;
  absl::Status s = c.Start(dir + "/drain", false, {"--drain_grace_s", short_grace ? "0.05" : "30"}, {}, 1, {}, 2);
  ASSERT_TRUE(s.ok()) << s;
  grpc::ClientContext ctx;
  auto reader = Open(c, ctx, req);
  Output got;
  ReadAtLeast(*reader, 20, got);
  const int victim = DecodeHoldingTheSequence(c);
  c.decode(victim).Signal(SIGTERM);
  // A request sent during the drain is served by the other worker.
  absl::SleepFor(absl::Milliseconds(300));
  const Output during = c.Generate(SeededRequest(8));
  EXPECT_TRUE(during.status.ok()) << during.status.error_message();
  EXPECT_EQ(during.final.finish_reason(), v1::FINISH_REASON_LENGTH) << during.final.error();
  ReadToEnd(*reader, got);
  ExpectUndisturbed(got, want, c);
  // The survivors hold no KV blocks once the stream is over.
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString() << "\n" << c.Logs();
  EXPECT_EQ(c.decode(victim).Wait(absl::Seconds(10)), 0) << c.Logs();
}

INSTANTIATE_TEST_SUITE_P(Grace, DrainTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "ShortGraceMigrates" : "LongGraceFinishesInPlace";
                         });

TEST(FaultTest, DecodeWorkerKilledDuringTheHandoffMigrates) {
  const std::string dir = TempDir();
  const Output want = Undisturbed(dir, false, SeededRequest(24));
  Cluster c;
  // The prefill worker holds each handoff 1 s before committing.
  absl::Status s = c.Start(dir + "/faulty", false, {}, {}, 1, {"--fault_stall_before_commit_ms", "1000"}, 2);
  ASSERT_TRUE(s.ok()) << s;
  grpc::ClientContext ctx;
  auto reader = Open(c, ctx, SeededRequest(24));
  Output got;
  ReadAtLeast(*reader, 1, got);  // First token; the handoff is pending.
  ASSERT_EQ(got.tokens.size(), 1u);
  c.decode(DecodeHoldingTheSequence(c)).Kill();
  ReadToEnd(*reader, got);
  ExpectUndisturbed(got, want, c);
  // The survivors hold no KV blocks once the stream is over.
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString() << "\n" << c.Logs();
}

TEST(FaultTest, RestartedDecodeWorkerServesAgain) {
  const std::string dir = TempDir();
  Cluster c;
  ASSERT_TRUE(c.Start(dir + "/restart", false).ok());
  const Output before = c.Generate(SeededRequest(12));
  ASSERT_TRUE(before.status.ok());
  absl::Status s = c.RestartDecode(0);
  ASSERT_TRUE(s.ok()) << s;
  // The router notices it within a poll period and learns its new KV port.
  Output after;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    absl::SleepFor(absl::Milliseconds(200));
    after = c.Generate(SeededRequest(12));
  } while (!(after.status.ok() && after.final.finish_reason() == v1::FINISH_REASON_LENGTH) && absl::Now() < deadline);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(after.final.finish_reason(), v1::FINISH_REASON_LENGTH) << after.final.error();
  EXPECT_EQ(after.tokens, before.tokens);
}

// A pool with no live worker: the request waits briefly for one to come
// back, then ends with UNAVAILABLE and a message (the contract: within 5 s).
class DeadPoolTest : public ::testing::TestWithParam<bool> {};

TEST_P(DeadPoolTest, IsUnavailableWithinSeconds) {
  const bool prefill_pool = GetParam();
  const std::string dir = TempDir();
  Cluster c;
  ASSERT_TRUE(c.Start(dir + "/dead", false).ok());
  if (prefill_pool) {
    c.prefill(0).Kill();
  } else {
    c.decode(0).Kill();
  }
  const absl::Time t0 = absl::Now();
  const Output got = c.Generate(SeededRequest(8));
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::UNAVAILABLE) << got.status.error_message();
  EXPECT_NE(got.status.error_message().find(prefill_pool ? "prefill" : "decode"), std::string::npos)
      << got.status.error_message();
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
}

INSTANTIATE_TEST_SUITE_P(Pools, DeadPoolTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "Prefill" : "Decode"; });

}  // namespace
}  // namespace pdserve
