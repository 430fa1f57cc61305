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

v1::GenerateRequest Request(int max_tokens) {
  v1::GenerateRequest r;
  r.set_text("In the beginning God created");
  r.set_max_tokens(max_tokens);
  r.mutable_sampling()->set_temperature(0.8f);
  r.mutable_sampling()->set_seed(77);
  return r;
}

TEST(FaultTest, PrefillWorkerKilledMidHandoffIsRetriedElsewhere) {
  const std::string dir = TempDir();
  // The reference: the same request through an undisturbed cluster.
  Output want;
  {
    Cluster calm;
    ASSERT_TRUE(calm.Start(dir + "/calm", false).ok());
    want = calm.Generate(Request(24));
    ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  }
  Cluster c;
  // Each handoff stalls 1.5 s between the first token and the commit.
  absl::Status s = c.Start(dir + "/faulty", false, {}, {}, /*num_prefill=*/2, {"--fault_stall_before_commit_ms", "1500"});
  ASSERT_TRUE(s.ok()) << s;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = c.stub()->Generate(&ctx, Request(24));
  v1::GenerateResponse m;
  Output got;
  ASSERT_TRUE(reader->Read(&m));  // The first token: prefill worker 0 is now stalled before its commit.
  ASSERT_TRUE(m.has_chunk());
  got.tokens.assign(m.chunk().token_ids().begin(), m.chunk().token_ids().end());
  got.text = m.chunk().text();
  c.prefill(0).Kill();  // kill -9 mid-handoff.
  while (reader->Read(&m)) {
    if (m.has_chunk()) {
      got.tokens.insert(got.tokens.end(), m.chunk().token_ids().begin(), m.chunk().token_ids().end());
      got.text += m.chunk().text();
    } else if (m.has_final()) {
      got.final = m.final();
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(got.final.finish_reason(), v1::FINISH_REASON_LENGTH) << got.final.error() << "\n" << c.Logs();
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.text, want.text);
  // The dead sender's reservation was freed on the decode side.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  int used = -1;
  while (absl::Now() < deadline) {
    used = c.Status().decode(0).kv_blocks_used();
    if (used == 0) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(used, 0) << c.Logs();
}

// Reads a stream to its end into `got`.
void Drain(grpc::ClientReader<v1::GenerateResponse>& reader, Output& got) {
  v1::GenerateResponse m;
  while (reader.Read(&m)) {
    if (m.has_chunk()) {
      got.tokens.insert(got.tokens.end(), m.chunk().token_ids().begin(), m.chunk().token_ids().end());
      got.text += m.chunk().text();
    } else if (m.has_final()) {
      got.final = m.final();
    }
  }
  got.status = reader.Finish();
}

class DecodeDeathTest : public ::testing::TestWithParam<bool> {};

TEST_P(DecodeDeathTest, DecodeWorkerKilledMidStreamMigrates) {
  const bool colocated = GetParam();
  const std::string dir = TempDir();
  v1::GenerateRequest req = Request(480);
  req.set_ignore_eos(true);
  Output want;
  {
    Cluster calm;
    ASSERT_TRUE(calm.Start(dir + "/calm", colocated).ok());
    want = calm.Generate(req);
    ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  }
  Cluster c;
  absl::Status s = c.Start(dir + "/faulty", colocated, {}, {}, 1, {}, /*num_decode=*/2);
  ASSERT_TRUE(s.ok()) << s;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = c.stub()->Generate(&ctx, req);
  v1::GenerateResponse m;
  Output got;
  while (got.tokens.size() < 20 && reader->Read(&m)) {
    if (!m.has_chunk()) continue;
    got.tokens.insert(got.tokens.end(), m.chunk().token_ids().begin(), m.chunk().token_ids().end());
    got.text += m.chunk().text();
  }
  ASSERT_GE(got.tokens.size(), 20u);
  // kill -9 whichever decode worker holds the sequence.
  const v1::ClusterStatusResponse st = c.Status();
  const int victim = st.decode(0).kv_blocks_used() > 0 ? 0 : 1;
  ASSERT_GT(st.decode(victim).kv_blocks_used(), 0) << st.ShortDebugString();
  c.decode(victim).Kill();
  Drain(*reader, got);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.final.finish_reason(), v1::FINISH_REASON_LENGTH) << got.final.error() << "\n" << c.Logs();
  EXPECT_EQ(got.tokens, want.tokens) << "a token repeated, lost or changed";
  EXPECT_EQ(got.text, want.text);
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
  v1::GenerateRequest req = Request(480);
  req.set_ignore_eos(true);
  Output want;
  {
    Cluster calm;
    ASSERT_TRUE(calm.Start(dir + "/calm", false).ok());
    want = calm.Generate(req);
    ASSERT_TRUE(want.status.ok());
  }
  Cluster c;
  absl::Status s = c.Start(dir + "/drain", false, {"--drain_grace_s", short_grace ? "0.05" : "30"}, {}, 1, {}, 2);
  ASSERT_TRUE(s.ok()) << s;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = c.stub()->Generate(&ctx, req);
  v1::GenerateResponse m;
  Output got;
  while (got.tokens.size() < 20 && reader->Read(&m)) {
    if (!m.has_chunk()) continue;
    got.tokens.insert(got.tokens.end(), m.chunk().token_ids().begin(), m.chunk().token_ids().end());
    got.text += m.chunk().text();
  }
  const v1::ClusterStatusResponse st = c.Status();
  const int victim = st.decode(0).kv_blocks_used() > 0 ? 0 : 1;
  c.decode(victim).Signal(SIGTERM);
  // A request sent during the drain is served by the other worker.
  absl::SleepFor(absl::Milliseconds(300));
  const Output during = c.Generate(Request(8));
  EXPECT_TRUE(during.status.ok()) << during.status.error_message();
  EXPECT_EQ(during.final.finish_reason(), v1::FINISH_REASON_LENGTH) << during.final.error();
  Drain(*reader, got);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.final.finish_reason(), v1::FINISH_REASON_LENGTH) << got.final.error() << "\n" << c.Logs();
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.text, want.text);
  EXPECT_EQ(c.decode(victim).Wait(absl::Seconds(10)), 0) << c.Logs();
}

INSTANTIATE_TEST_SUITE_P(Grace, DrainTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "ShortGraceMigrates" : "LongGraceFinishesInPlace";
                         });

TEST(FaultTest, DecodeWorkerKilledDuringTheHandoffMigrates) {
  const std::string dir = TempDir();
  Output want;
  {
    Cluster calm;
    ASSERT_TRUE(calm.Start(dir + "/calm", false).ok());
    want = calm.Generate(Request(24));
    ASSERT_TRUE(want.status.ok());
  }
  Cluster c;
  // The prefill worker holds each handoff 1 s before committing.
  absl::Status s = c.Start(dir + "/faulty", false, {}, {}, 1, {"--fault_stall_before_commit_ms", "1000"}, 2);
  ASSERT_TRUE(s.ok()) << s;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = c.stub()->Generate(&ctx, Request(24));
  v1::GenerateResponse m;
  Output got;
  ASSERT_TRUE(reader->Read(&m));  // First token; the handoff is pending.
  got.tokens.assign(m.chunk().token_ids().begin(), m.chunk().token_ids().end());
  got.text = m.chunk().text();
  const v1::ClusterStatusResponse st = c.Status();
  const int victim = st.decode(0).kv_blocks_used() > 0 ? 0 : 1;
  ASSERT_GT(st.decode(victim).kv_blocks_used(), 0) << st.ShortDebugString();
  c.decode(victim).Kill();
  Drain(*reader, got);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.final.finish_reason(), v1::FINISH_REASON_LENGTH) << got.final.error() << "\n" << c.Logs();
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.text, want.text);
}

TEST(FaultTest, RestartedDecodeWorkerServesAgain) {
  const std::string dir = TempDir();
  Cluster c;
  ASSERT_TRUE(c.Start(dir + "/restart", false).ok());
  const Output before = c.Generate(Request(12));
  ASSERT_TRUE(before.status.ok());
  absl::Status s = c.RestartDecode(0);
  ASSERT_TRUE(s.ok()) << s;
  // The router notices it within a poll period and learns its new KV port.
  Output after;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    absl::SleepFor(absl::Milliseconds(200));
    after = c.Generate(Request(12));
  } while (!(after.status.ok() && after.final.finish_reason() == v1::FINISH_REASON_LENGTH) && absl::Now() < deadline);
  ASSERT_TRUE(after.status.ok()) << after.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(after.final.finish_reason(), v1::FINISH_REASON_LENGTH) << after.final.error();
  EXPECT_EQ(after.tokens, before.tokens);
}

TEST(FaultTest, NoLivePrefillWorkerIsUnavailableWithinSeconds) {
  const std::string dir = TempDir();
  Cluster c;
  ASSERT_TRUE(c.Start(dir + "/dead", false).ok());
  c.prefill(0).Kill();
  const absl::Time t0 = absl::Now();
  const Output got = c.Generate(Request(8));
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::UNAVAILABLE) << got.status.error_message();
  EXPECT_FALSE(got.status.error_message().empty());
  EXPECT_LT(absl::Now() - t0, absl::Seconds(5));
}

}  // namespace
}  // namespace pdserve
