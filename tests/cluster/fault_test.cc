// Faults with real processes: a prefill worker killed mid-handoff (the
// router prefills again on another one and the stream is unchanged), a
// pool with no live worker (UNAVAILABLE within seconds, never a hang), and
// a decode worker whose KV transport cannot work (NOT_SERVING with UCX's
// reason, which a request's error carries).
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "pdserve/v1/worker.grpc.pb.h"
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

// SIGTERM to the decode worker holding a stream, with moves off
// (--kv_moves=false; tests/cluster/move_test.cc drains with them): with a
// short grace period the stream migrates at the deadline; with a long one
// it finishes where it is and the worker exits cleanly afterwards. Either
// way the client sees the undisturbed stream, and new requests go to the
// other worker.
class DrainTest : public ::testing::TestWithParam<bool> {};

TEST_P(DrainTest, SigtermDrainsThenMigratesAtTheDeadline) {
  const bool short_grace = GetParam();
  const std::string dir = TempDir();
  v1::GenerateRequest req = SeededRequest(480);
  req.set_ignore_eos(true);
  const Output want = Undisturbed(dir, false, req);
  Cluster c;
  absl::Status s = c.Start(dir + "/drain", false, {"--drain_grace_s", short_grace ? "0.05" : "30", "--kv_moves=false"}, {}, 1,
                           {}, 2);
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

std::string UnshareBinary() {
  for (const char* p : {"/usr/bin/unshare", "/bin/unshare"}) {
    if (std::filesystem::exists(p)) return p;
  }
  return "";
}

// Why a process cannot be started with an empty /sys here ("" if it can):
// it needs root, unshare(1), and a mount namespace with a tmpfs over /sys.
std::string CannotEmptySys() {
  if (geteuid() != 0) return "needs root (a mount namespace with a tmpfs over /sys)";
  const std::string unshare = UnshareBinary();
  if (unshare.empty()) return "unshare(1) is not installed";
  const std::string probe =
      unshare + " -m sh -c 'mount -t tmpfs none /sys && test ! -e /sys/class/net' >/dev/null 2>&1";
  if (std::system(probe.c_str()) != 0) return "unshare -m with a tmpfs mounted over /sys is not permitted here";
  return "";
}

// Starts `argv` plus --ready_file DIR/NAME.ready (log: DIR/NAME.log) and
// returns its gRPC address once it serves.
absl::StatusOr<std::string> StartServer(Subprocess& p, const std::string& dir, const std::string& name,
                                        std::vector<std::string> argv) {
  const std::string ready = absl::StrCat(dir, "/", name, ".ready");
  argv.push_back("--ready_file");
  argv.push_back(ready);
  if (absl::Status s = p.Start(argv, absl::StrCat(dir, "/", name, ".log")); !s.ok()) return s;
  absl::StatusOr<int> port = p.WaitReady(ready, absl::Seconds(60));
  if (!port.ok()) return port.status();
  return absl::StrCat("127.0.0.1:", *port);
}

// The decode worker's Status RPC (healthy, unhealthy_reason).
worker::v1::WorkerInfo DecodeInfo(const std::string& address) {
  auto stub = worker::v1::DecodeWorker::NewStub(TestChannel(address, "decode"));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  worker::v1::WorkerInfo info;
  EXPECT_TRUE(stub->Status(&ctx, {}, &info).ok());
  return info;
}

// UCX (--kv_transport=ucx) lists its network devices once, from
// /sys/class/net. Without /sys it
// finds none: its KV listener still binds, but UCX refuses every connection
// request, so without a self-check the worker would serve while every
// handoff to it failed. It is NOT_SERVING, with UCX's reason, as soon as
// it serves. A request through a router whose other decode worker is gone
// fails with an error that carries that reason.
TEST(FaultTest, DecodeWorkerWithoutSysIsNotServingWithUcxReason) {
  if (const std::string why = CannotEmptySys(); !why.empty()) GTEST_SKIP() << why;
  const std::string dir = TempDir();
  const std::string decode_bin = kBin + "/decode_worker/pdserve-decode-worker";
  Subprocess broken;
  absl::StatusOr<std::string> broken_address =
      StartServer(broken, dir, "broken",
                  {UnshareBinary(), "-m", "sh", "-c", "mount -t tmpfs none /sys && exec \"$0\" \"$@\"", decode_bin,
                   "--model", kModel, "--kv_transport", "ucx", "--tls_cert", TestTls("decode").cert, "--tls_key",
                   TestTls("decode").key, "--tls_ca", TestTls("decode").ca, "--kv_grant_key",
                   TestCertsDir() + "/kv_grant.key"});
  ASSERT_TRUE(broken_address.ok()) << broken_address.status();
  const absl::Time serving = absl::Now();
  // Polled: the verdict is another process's.
  worker::v1::WorkerInfo info = DecodeInfo(*broken_address);
  while (info.status().healthy() && absl::Now() - serving < absl::Seconds(2)) {
    absl::SleepFor(absl::Milliseconds(50));
    info = DecodeInfo(*broken_address);
  }
  EXPECT_LT(absl::Now() - serving, absl::Seconds(2));
  EXPECT_FALSE(info.status().healthy()) << info.ShortDebugString() << "\n" << broken.LogTail();
  EXPECT_TRUE(absl::StrContains(info.unhealthy_reason(), "KV handoff self-check")) << info.unhealthy_reason();
  EXPECT_TRUE(absl::StrContains(info.unhealthy_reason(), "UCX")) << info.unhealthy_reason();
  EXPECT_EQ(GrpcHealth(*broken_address), 2) << "gRPC health should be NOT_SERVING";
  EXPECT_EQ(broken.Wait(absl::ZeroDuration()), -1) << "the worker must keep running:\n" << broken.LogTail();

  // A router needs one serving decode worker to start: a healthy one,
  // killed once the router is up, leaves only the broken one.
  Subprocess healthy, prefill, router;
  absl::StatusOr<std::string> healthy_address = StartServer(healthy, dir, "healthy", {decode_bin, "--model", kModel, "--tls_cert", TestTls("decode").cert, "--tls_key",
                                            TestTls("decode").key, "--tls_ca", TestTls("decode").ca, "--kv_grant_key", TestCertsDir() + "/kv_grant.key"});
  ASSERT_TRUE(healthy_address.ok()) << healthy_address.status();
  absl::StatusOr<std::string> prefill_address =
      StartServer(prefill, dir, "prefill",
                  {kBin + "/prefill_worker/pdserve-prefill-worker", "--model", kModel, "--tls_cert",
                   TestTls("prefill").cert, "--tls_key", TestTls("prefill").key, "--tls_ca", TestTls("prefill").ca});
  ASSERT_TRUE(prefill_address.ok()) << prefill_address.status();
  absl::StatusOr<std::string> router_address = StartServer(
      router, dir, "router",
      {kBin + "/router/pdserve-router", "--model", kModel, "--http_listen", "127.0.0.1:0", "--decode",
       absl::StrCat(*broken_address, ",", *healthy_address), "--prefill", *prefill_address, "--pick_wait_s", "1",
       "--tls_cert", TestTls("router").cert, "--tls_key", TestTls("router").key, "--tls_ca", TestTls("router").ca, "--kv_grant_key", TestCertsDir() + "/kv_grant.key"});
  ASSERT_TRUE(router_address.ok()) << router_address.status();
  healthy.Kill();
  // Once the router's own probe has ejected it (the broken worker was never
  // admitted, so this is the first ejection).
  const int router_metrics = MetricsPort(dir + "/router.ready");
  const std::string ejections = "pdserve_worker_ejections_total{role=\"decode\"}";
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (MetricValue(HttpGet(router_metrics, "/metrics"), ejections) < 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_EQ(MetricValue(HttpGet(router_metrics, "/metrics"), ejections), 1) << router.LogTail();

  auto stub = v1::Generation::NewStub(TestChannel(*router_address));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto reader = stub->Generate(&ctx, SeededRequest(8));
  v1::GenerateResponse ignored;
  while (reader->Read(&ignored)) {
  }
  const grpc::Status got = reader->Finish();
  EXPECT_EQ(got.error_code(), grpc::StatusCode::UNAVAILABLE) << got.error_message();
  // "no healthy decode worker (127.0.0.1:B: KV handoff self-check over ...
  // failed: ... (transport log: UCX: ...); 127.0.0.1:H: ...)"
  EXPECT_TRUE(absl::StrContains(got.error_message(), *broken_address + ": KV handoff self-check"))
      << got.error_message() << "\n"
      << router.LogTail();
  EXPECT_TRUE(absl::StrContains(got.error_message(), "UCX")) << got.error_message();
}

}  // namespace
}  // namespace pdserve
