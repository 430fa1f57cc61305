// Operating the cluster with real processes: prefill workers killed or
// drained mid-prefill, workers whose health check fails (a KV leak, a
// wedged transport) ejected, and a decode pool behind a DNS name that grows
// and shrinks under load without a router restart.
#include <signal.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/support/realtime.h"
#include "router/api_keys.h"
#include "tests/cluster/cluster_harness.h"
#include "tests/support/dnsmasq.h"

namespace pdserve {
namespace {

// A prefill worker killed while it computes (its reservation on the decode
// side already made): the router prefills again on the other one.
TEST(OperationsTest, PrefillWorkerKilledMidPrefillIsRetriedElsewhere) {
  const std::string dir = TempDir();
  const Output want = Undisturbed(dir, false, SeededRequest(24));
  Cluster c;
  // Every forward waits 1.5 s first: the kill lands inside the prefill.
  absl::Status s = c.Start(dir + "/faulty", false, {}, {}, /*num_prefill=*/2, {"--fault_stall_prefill_ms", "1500"});
  ASSERT_TRUE(s.ok()) << s;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = c.stub()->Generate(&ctx, SeededRequest(24));
  absl::SleepFor(absl::Milliseconds(600));
  const v1::ClusterStatusResponse st = c.Status();
  const int victim = st.prefill(0).running() > 0 ? 0 : 1;
  ASSERT_GT(st.prefill(victim).running(), 0) << st.ShortDebugString();
  c.prefill(victim).Kill();
  Output got;
  ReadToEnd(*reader, got);
  ExpectUndisturbed(got, want, c);
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString() << "\n" << c.Logs();
}

// The output of `pdctl status` for the cluster: its decode row's last
// column, the age of the oldest request in that worker's engine (-1 when
// there is no such row).
double OldestDecodeRequestSeconds(Cluster& c, std::string* out) {
  const std::string cmd =
      absl::StrCat(kBin, "/tools/pdctl/pdctl status --tls_ca ", TestTls("router").ca, " --router ", c.address(), " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  out->clear();
  while (fgets(buf, sizeof(buf), p) != nullptr) out->append(buf);
  pclose(p);
  for (absl::string_view line : absl::StrSplit(*out, '\n')) {
    if (!absl::StartsWith(line, "decode ")) continue;
    std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    double v = -1;
    if (!fields.empty() && absl::SimpleAtod(fields.back(), &v)) return v;
  }
  return -1;
}

// `pdctl status` shows how old the oldest request in each worker is: about
// the time since a long generation started while it runs, 0 after.
TEST(OperationsTest, StatusShowsTheOldestRequestsAge) {
  const std::string dir = TempDir();
  Cluster c;
  // 20 ms a step: 100 tokens take about 2 s.
  ASSERT_TRUE(c.Start(dir, /*colocated=*/true, {"--fault_step_delay_ms", "20"}).ok());
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  const absl::Time start = absl::Now();
  auto reader = c.stub()->Generate(&ctx, SeededRequest(100));
  absl::SleepFor(absl::Milliseconds(700));
  std::string out;
  const double oldest = OldestDecodeRequestSeconds(c, &out);
  const double elapsed = absl::ToDoubleSeconds(absl::Now() - start);
  EXPECT_GT(oldest, 0.3) << out;
  EXPECT_LE(oldest, elapsed) << out;
  EXPECT_NE(out.find("oldest s"), std::string::npos) << out;
  Output got;
  ReadToEnd(*reader, got);
  EXPECT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens.size(), 100u);
  // Idle: the column reads 0 (the engine publishes its stats once its last
  // request has left).
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(OldestDecodeRequestSeconds(c, &out), 0) << out;
}

// SIGTERM to a prefill worker with a request inside its prefill: with a
// long grace period the request finishes there and the worker exits
// cleanly; with a short one the rest goes to the other prefill worker.
// Either way the stream is the undisturbed one and no KV is left behind.
class PrefillDrainTest : public ::testing::TestWithParam<bool> {};

TEST_P(PrefillDrainTest, SigtermFinishesOrHandsOverTheRequest) {
  const bool short_grace = GetParam();
  const std::string dir = TempDir();
  const Output want = Undisturbed(dir, false, SeededRequest(24));
  Cluster c;
  absl::Status s = c.Start(dir + "/drain", false, {}, {}, 2,
                           {"--fault_stall_prefill_ms", "1000", "--drain_grace_s", short_grace ? "0.1" : "30"});
  ASSERT_TRUE(s.ok()) << s;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = c.stub()->Generate(&ctx, SeededRequest(24));
  absl::SleepFor(absl::Milliseconds(400));
  const v1::ClusterStatusResponse st = c.Status();
  const int victim = st.prefill(0).running() > 0 ? 0 : 1;
  ASSERT_GT(st.prefill(victim).running(), 0) << st.ShortDebugString();
  c.prefill(victim).Signal(SIGTERM);
  Output got;
  ReadToEnd(*reader, got);
  ExpectUndisturbed(got, want, c);
  EXPECT_EQ(c.prefill(victim).Wait(absl::Seconds(10)), 0) << c.Logs();
  // New work goes to the survivor.
  const Output after = c.Generate(SeededRequest(8));
  EXPECT_TRUE(after.status.ok()) << after.status.error_message();
  EXPECT_EQ(after.final.finish_reason(), v1::FINISH_REASON_LENGTH) << after.final.error();
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString();
}

INSTANTIATE_TEST_SUITE_P(Grace, PrefillDrainTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "ShortGraceHandsOver" : "LongGraceFinishesInPlace";
                         });

// A decode worker whose health check fails is NOT_SERVING (gRPC health and
// the Status RPC, with the reason) and the router sends its work elsewhere.
struct SickWorker {
  const char* name;
  std::vector<std::string> flags;
  const char* reason;
  const char* metric_reason;  // pdserve_worker_unhealthy{reason=...}
};

class UnhealthyWorkerTest : public ::testing::TestWithParam<SickWorker> {};

TEST_P(UnhealthyWorkerTest, IsNotServingAndGetsNoWork) {
  const std::string dir = TempDir();
  Cluster c;
  c.extra_decode_flags[0] = GetParam().flags;
  absl::Status s = c.Start(dir + "/sick", false, {}, {}, 1, {}, /*num_decode=*/2);
  ASSERT_TRUE(s.ok()) << s;
  const std::string sick = c.Status().decode(0).address();
  v1::WorkerStatus status;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  do {
    absl::SleepFor(absl::Milliseconds(100));
    status = c.Status().decode(0);
  } while (status.healthy() && absl::Now() < deadline);
  EXPECT_FALSE(status.healthy()) << status.ShortDebugString();
  EXPECT_NE(status.unhealthy_reason().find(GetParam().reason), std::string::npos) << status.ShortDebugString();
  EXPECT_EQ(GrpcHealth(sick), 2) << "gRPC health should be NOT_SERVING";
  EXPECT_EQ(GrpcHealth(c.Status().decode(1).address()), 1);
  // The reason as a metric, for alerts; the healthy worker's are all 0.
  const std::string page = HttpGet(c.decode_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(page, absl::StrCat("pdserve_worker_unhealthy{reason=\"", GetParam().metric_reason, "\"}")), 1)
      << page;
  EXPECT_EQ(MetricValue(page, "pdserve_worker_unhealthy{reason=\"draining\"}"), 0) << page;
  absl::SleepFor(absl::Milliseconds(300));  // The router's probe has seen it.
  for (int i = 0; i < 4; ++i) {
    const Output got = c.Generate(SeededRequest(8));
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(got.final.finish_reason(), v1::FINISH_REASON_LENGTH) << got.final.error() << "\n" << c.Logs();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Faults, UnhealthyWorkerTest,
    ::testing::Values(SickWorker{"KvLeak", {"--fault_leak_kv_blocks", "3", "--leak_grace_s", "0.5"}, "KV pool leak: 3",
                                 "kv_leak"},
                      SickWorker{"WedgedTransport",
                                 {"--fault_wedge_kv_after_s", "0.5", "--wedge_after_s", "1"},
                                 "wedged", "kv_wedged"}),
    [](const ::testing::TestParamInfo<SickWorker>& i) { return std::string(i.param.name); });

// The KV transport's loop runs in SCHED_FIFO by default where the process
// may, and the worker says which class it got (a metric, and a log line
// naming the reason when it was refused); --kv_loop_realtime=false keeps it
// in the normal class. Handoffs work either way.
TEST(OperationsTest, TheKvLoopsSchedulingClassIsChosenByFlagAndReported) {
  const std::string dir = TempDir();
  Cluster c;
  absl::Status s = c.Start(dir + "/rt", false, {}, {}, 1, {"--kv_loop_realtime=false"});
  ASSERT_TRUE(s.ok()) << s;
  const Output got = c.Generate(SeededRequest(8));
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.final.finish_reason(), v1::FINISH_REASON_LENGTH) << got.final.error() << "\n" << c.Logs();
  const bool permitted = testing_support::RealtimePermitted();
  const std::string decode = HttpGet(c.decode_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(decode, "pdserve_kv_loop_realtime"), permitted ? 1 : 0) << decode;
  EXPECT_EQ(MetricValue(HttpGet(c.prefill_metrics(), "/metrics"), "pdserve_kv_loop_realtime"), 0);
  std::ifstream f(dir + "/rt/decode0.log");
  const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(absl::StrContains(log, "kv_loop_scheduling")) << log;
  EXPECT_TRUE(absl::StrContains(log, permitted ? "fifo" : "not permitted")) << log;
}

// A port free on both addresses (the pods of a headless Service share one).
int PortFreeOn(const std::vector<std::string>& ips) {
  for (int attempt = 0; attempt < 20; ++attempt) {
    int port = 0;
    bool ok = true;
    for (const std::string& ip : ips) {
      const int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<uint16_t>(port));
      inet_pton(AF_INET, ip.c_str(), &a.sin_addr);
      socklen_t len = sizeof(a);
      ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
           getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
      port = ntohs(a.sin_port);
      close(fd);
      if (!ok) break;
    }
    if (ok) return port;
  }
  return 0;
}

// Decode workers behind a DNS name: one added to the name takes load, one
// removed and sent SIGTERM drains, with requests flowing all along and none
// failing, and the router never restarted.
TEST(OperationsTest, DecodePoolScalesBehindADnsName) {
  if (!testing_support::DnsmasqAvailable()) GTEST_SKIP() << "dnsmasq not installed (deploy/bootstrap.sh installs it)";
  const std::string dir = TempDir();
  testing_support::Dnsmasq dns;
  ASSERT_TRUE(dns.Start(dir).ok());
  const int port = PortFreeOn({"127.0.0.2", "127.0.0.3"});
  ASSERT_GT(port, 0);
  const std::string name = "decode.pdserve.test";
  auto start_decode = [&](Subprocess& p, const std::string& ip) -> absl::Status {
    const std::string ready = absl::StrCat(dir, "/decode-", ip, ".ready");
    std::vector<std::string> argv = {kBin + "/decode_worker/pdserve-decode-worker", "--model", kModel, "--ready_file",
                                     ready, "--listen", absl::StrCat(ip, ":", port), "--drain_grace_s", "5"};
    for (std::string& a : TlsArgs("decode")) argv.push_back(std::move(a));
    absl::Status s = p.Start(argv, absl::StrCat(dir, "/decode-", ip, ".log"));
    if (!s.ok()) return s;
    return p.WaitReady(ready, absl::Seconds(60)).status();
  };
  Subprocess d1, d2, prefill, router;
  ASSERT_TRUE(start_decode(d1, "127.0.0.2").ok()) << d1.LogTail();
  ASSERT_TRUE(dns.SetHosts({{name, {"127.0.0.2"}}}).ok());
  ASSERT_TRUE(prefill
                  .Start({kBin + "/prefill_worker/pdserve-prefill-worker", "--model", kModel, "--ready_file",
                          dir + "/prefill.ready", "--tls_cert", TestTls("prefill").cert, "--tls_key",
                          TestTls("prefill").key, "--tls_ca", TestTls("prefill").ca},
                         dir + "/prefill.log")
                  .ok());
  absl::StatusOr<int> pport = prefill.WaitReady(dir + "/prefill.ready", absl::Seconds(60));
  ASSERT_TRUE(pport.ok()) << pport.status();
  ASSERT_TRUE(router
                  .Start({kBin + "/router/pdserve-router", "--model", kModel, "--http_listen", "127.0.0.1:0", "--ready_file",
                          dir + "/router.ready",
                          "--prefill", absl::StrCat("127.0.0.1:", *pport), "--decode",
                          absl::StrCat("dns://", dns.server(), "/", name, ":", port), "--resolve_interval_s", "0.2",
                          "--tls_cert", TestTls("router").cert, "--tls_key", TestTls("router").key, "--tls_ca",
                          TestTls("router").ca, "--kv_grant_key", TestCertsDir() + "/kv_grant.key"},
                         dir + "/router.log")
                  .ok());
  absl::StatusOr<int> rport = router.WaitReady(dir + "/router.ready", absl::Seconds(60));
  ASSERT_TRUE(rport.ok()) << rport.status();
  auto stub = v1::Generation::NewStub(TestChannel(absl::StrCat("127.0.0.1:", *rport)));
  auto logs = [&] {
    return absl::StrCat("router:\n", router.LogTail(), "\nd1:\n", d1.LogTail(), "\nd2:\n", d2.LogTail());
  };

  // Steady load: two clients, one request after another.
  std::atomic<bool> stop{false};
  std::atomic<int> completed{0};
  absl::Mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> clients;
  for (int i = 0; i < 2; ++i) {
    clients.emplace_back([&] {
      while (!stop) {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        v1::CompleteResponse out;
        const grpc::Status st = stub->Complete(&ctx, SeededRequest(16), &out);
        if (st.ok() && out.final().finish_reason() == v1::FINISH_REASON_LENGTH) {
          ++completed;
        } else {
          absl::MutexLock lock(&mu);
          failures.push_back(st.ok() ? out.final().error() : st.error_message());
        }
      }
    });
  }
  auto wait_completed = [&](int more) {
    const int target = completed + more;
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (completed < target && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  };
  wait_completed(5);

  // Scale out: the second worker joins the name and takes work.
  ASSERT_TRUE(start_decode(d2, "127.0.0.3").ok()) << d2.LogTail();
  ASSERT_TRUE(dns.SetHosts({{name, {"127.0.0.2", "127.0.0.3"}}}).ok());
  const int d2_metrics = MetricsPort(dir + "/decode-127.0.0.3.ready");
  double d2_served = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while ((d2_served = MetricValue(HttpGet(d2_metrics, "/metrics"), "pdserve_handoff_transfers_total")) < 3 &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_GE(d2_served, 3) << "the added worker took no load\n" << logs();

  // Scale in: the first leaves the name and gets SIGTERM, as a pod deletion does.
  ASSERT_TRUE(dns.SetHosts({{name, {"127.0.0.3"}}}).ok());
  d1.Signal(SIGTERM);
  EXPECT_EQ(d1.Wait(absl::Seconds(15)), 0) << logs();
  wait_completed(5);
  stop = true;
  for (std::thread& t : clients) t.join();
  EXPECT_GT(completed, 10);
  absl::MutexLock lock(&mu);
  EXPECT_TRUE(failures.empty()) << failures.size() << " requests failed, first: " << failures.front() << "\n"
                                << logs();
  // The router drops the departed worker at its next resolution (every
  // 0.2 s here), which can come after the last requests completed: wait
  // for it rather than race it.
  v1::ClusterStatusResponse st;
  const absl::Time status_deadline = absl::Now() + absl::Seconds(10);
  do {
    grpc::ClientContext sctx;
    st.Clear();
    ASSERT_TRUE(stub->ClusterStatus(&sctx, {}, &st).ok());
    if (st.decode_size() == 1) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < status_deadline);
  ASSERT_EQ(st.decode_size(), 1) << st.ShortDebugString() << "\n" << logs();
  EXPECT_EQ(st.decode(0).address(), absl::StrCat("127.0.0.3:", port));
}

// Admission control with a bounded queue: with every prefill held up, at
// most --max_queued requests wait for their first token; the rest end at once
// with RESOURCE_EXHAUSTED saying why, and the admitted ones complete.
TEST(OperationsTest, ApiKeysGateTheClientApiAndAreReadAgainWhenTheFileChanges) {
  const std::string dir = TempDir();
  const std::string keys = dir + "/api_keys";
  std::filesystem::create_directories(dir);
  std::ofstream(keys) << "# id:sha256 of the key\nalice:" << router::Sha256Hex("sk-test-alice") << "\n";
  Cluster c;
  c.extra_router_flags = {"--api_keys_file", keys};
  absl::Status s = c.Start(dir + "/keys", false);
  ASSERT_TRUE(s.ok()) << s;
  const Output none = c.Generate(SeededRequest(4));
  EXPECT_EQ(none.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(absl::StartsWith(none.status.error_message(), "no API key")) << none.status.error_message();
  const Output wrong = c.Generate(SeededRequest(4), "Bearer sk-test-mallory");
  EXPECT_EQ(wrong.status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(wrong.status.error_message(), "invalid API key");
  const Output ok = c.Generate(SeededRequest(4), "Bearer sk-test-alice");
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.tokens.size(), 4u);
  // Rotation: a new file (as a Secret update writes it) is read within a
  // second or so, without a signal.
  {
    std::ofstream(keys + ".new") << "bob:" << router::Sha256Hex("sk-test-bob") << "\n";
    std::filesystem::rename(keys + ".new", keys);
  }
  Output rotated;
  rotated.status = grpc::Status(grpc::StatusCode::UNKNOWN, "not tried");
  for (int i = 0; i < 40 && !rotated.status.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    rotated = c.Generate(SeededRequest(2), "Bearer sk-test-bob");
  }
  EXPECT_TRUE(rotated.status.ok()) << rotated.status.error_message();
  EXPECT_EQ(c.Generate(SeededRequest(2), "Bearer sk-test-alice").status.error_code(),
            grpc::StatusCode::UNAUTHENTICATED);
  // Keys never reach the logs; refusals are counted.
  EXPECT_FALSE(absl::StrContains(c.Logs(), "sk-test-")) << c.Logs();
  const std::string metrics = HttpGet(c.router_metrics(), "/metrics");
  // Two before the rotation, the tries that came before it was read, one after.
  const std::string key = "pdserve_requests_total{outcome=\"unauthenticated\"} ";
  const size_t at = metrics.find(key);
  ASSERT_NE(at, std::string::npos) << metrics;
  EXPECT_GE(std::stod(metrics.substr(at + key.size())), 3) << metrics;
}

TEST(OperationsTest, AdmissionRejectsBeyondTheQueueBound) {
  const std::string dir = TempDir();
  Cluster c;
  c.extra_router_flags = {"--admission", "--max_queued", "2"};
  absl::Status s = c.Start(dir + "/admission", false, {}, {}, 1, {"--fault_stall_prefill_ms", "1500"});
  ASSERT_TRUE(s.ok()) << s;
  constexpr int kRequests = 6;
  std::vector<Output> outs(kRequests);
  std::vector<std::thread> clients;
  for (int i = 0; i < kRequests; ++i) {
    clients.emplace_back([&c, &outs, i] { outs[i] = c.Generate(SeededRequest(4)); });
    absl::SleepFor(absl::Milliseconds(50));  // All arrive while the first two wait.
  }
  for (std::thread& t : clients) t.join();
  int admitted = 0, rejected = 0;
  for (const Output& o : outs) {
    if (o.status.ok()) {
      ++admitted;
      EXPECT_EQ(o.final.finish_reason(), v1::FINISH_REASON_LENGTH) << o.final.error();
    } else {
      ++rejected;
      EXPECT_EQ(o.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << o.status.error_message();
      EXPECT_NE(o.status.error_message().find("queue"), std::string::npos) << o.status.error_message();
    }
  }
  EXPECT_EQ(admitted, 2) << c.Logs();
  EXPECT_EQ(rejected, kRequests - 2);
  const std::string metrics = HttpGet(c.router_metrics(), "/metrics");
  EXPECT_NE(metrics.find("pdserve_requests_total{outcome=\"rejected\"} 4"), std::string::npos) << metrics;
}

// The prefill selection policy by flag: sequential requests (every worker
// idle each time) all go to the first worker under least_loaded and
// alternate under round_robin.
class SelectionPolicyTest : public ::testing::TestWithParam<bool> {};

TEST_P(SelectionPolicyTest, PrefillPolicyDecidesWhereRequestsGo) {
  const bool round_robin = GetParam();
  const std::string dir = TempDir() + "/policy";
  Cluster c;
  c.extra_router_flags = {"--prefill_policy", round_robin ? "round_robin" : "least_loaded"};
  absl::Status s = c.Start(dir, false, {}, {}, /*num_prefill=*/2);
  ASSERT_TRUE(s.ok()) << s;
  for (int i = 0; i < 4; ++i) {
    const Output got = c.Generate(SeededRequest(4));
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  }
  std::vector<double> served;
  for (int p = 0; p < 2; ++p) {
    const int port = MetricsPort(absl::StrCat(dir, "/prefill", p, ".ready"));
    served.push_back(MetricValue(HttpGet(port, "/metrics"), "pdserve_handoff_transfers_total"));
  }
  EXPECT_EQ(served, round_robin ? (std::vector<double>{2, 2}) : (std::vector<double>{4, 0})) << c.Logs();
}

INSTANTIATE_TEST_SUITE_P(Policies, SelectionPolicyTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "RoundRobin" : "LeastLoaded";
                         });

}  // namespace
}  // namespace pdserve
