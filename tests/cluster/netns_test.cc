// The KV handoff link cut mid-handoff, with real processes in network
// namespaces. The prefill worker P1 (namespace PF) and decode worker D1
// (namespace DC) share a veth link that carries only D1's KV receiver; a
// second decode worker D2 (root namespace) is reached over P1's link to the
// root namespace. Cutting the handoff link while P1 holds a handoff to D1
// before its commit makes that handoff fail while P1 stays healthy: the
// router prefills again toward D2 and the client's stream is unchanged.
//
//   root: router, D2 ──(link 1)── PF: bridge, P1 ──(handoff link)── DC: D1
//     └──────────────────────(link 2: D1's gRPC)────────────────────────┘
//
// P1 has one address, on a bridge in PF over link 1 and the handoff link,
// so the KV addresses share one subnet, 10.77.(2k+1).0/24 (root .1, P1 .2,
// D1 .3), and link 2 is 10.77.(2k+2).0/24 (root .1, DC .2), with
// k = pid % 120 (third octets 1..240) so that parallel runs rarely share a
// subnet. (One subnet is also what UCX 1.13's tcp transport needs, which
// counts every device as reaching every peer, for a cluster run with
// --kv_transport=ucx.) Namespaces are "pdnc-{pf,dc}-PID", interfaces
// "pdncPID" plus two letters; leftovers of runs whose PID is gone are
// removed first. The KV transport is the workers' default, TCP: the kernel
// routes each connection over the link to its address.
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {
namespace {

constexpr char kPrefix[] = "pdnc";
// P1 holds each handoff this long between the first token and its commit:
// the window in which the test cuts the link. D1's lease must outlive it
// (the lease is renewed only while layers are being sent).
constexpr int kStallMs = 1000;
constexpr char kD1LeaseS[] = "2";
constexpr char kKvTimeoutS[] = "2";

// Runs `script` with sh; true when it exits 0. Output goes to `log`.
bool Sh(const std::string& script, const std::string& log = "/dev/null") {
  return std::system(absl::StrCat("(", script, ") >>", log, " 2>&1").c_str()) == 0;
}

std::string IpBinary() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (std::filesystem::exists(p)) return p;
  }
  return "ip";
}

// The PID in a name made by this test ("pdnc-pf-123", "pdnc123rp"), or 0.
pid_t OwnerPid(const std::string& name) {
  if (!absl::StartsWith(name, kPrefix)) return 0;
  std::string digits;
  for (char c : name.substr(sizeof(kPrefix) - 1)) {
    if (c >= '0' && c <= '9') {
      digits += c;
    } else if (!digits.empty()) {
      break;
    }
  }
  int pid = 0;
  return absl::SimpleAtoi(digits, &pid) ? pid : 0;
}

bool Alive(pid_t pid) { return kill(pid, 0) == 0 || errno != ESRCH; }

// Namespaces and root-side links left by runs whose process is gone.
void RemoveLeftovers() {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/run/netns", ec)) {
    const std::string name = e.path().filename();
    if (const pid_t pid = OwnerPid(name); pid > 0 && !Alive(pid)) Sh("ip netns del " + name);
  }
  for (const auto& e : std::filesystem::directory_iterator("/sys/class/net", ec)) {
    const std::string name = e.path().filename();
    if (const pid_t pid = OwnerPid(name); pid > 0 && !Alive(pid)) Sh("ip link del " + name);
  }
}

v1::GenerateRequest Request() {
  v1::GenerateRequest r;
  r.set_text("In the beginning God created");
  r.set_max_tokens(24);
  r.mutable_sampling()->set_temperature(0.8f);
  r.mutable_sampling()->set_seed(77);
  return r;
}

// Reads chunks into `got` until it holds at least `n` tokens (or the stream
// ends); n = SIZE_MAX reads to the end and finishes the call.
void Read(grpc::ClientReader<v1::GenerateResponse>& reader, size_t n, Output& got) {
  v1::GenerateResponse m;
  while (got.tokens.size() < n && reader.Read(&m)) {
    if (m.has_chunk()) {
      got.tokens.insert(got.tokens.end(), m.chunk().token_ids().begin(), m.chunk().token_ids().end());
      got.text += m.chunk().text();
    } else if (m.has_final()) {
      got.final = m.final();
    }
  }
  if (n == SIZE_MAX) got.status = reader.Finish();
}

// The router's JSON log events named `event`.
std::vector<nlohmann::json> RouterEvents(const std::string& log, const std::string& event) {
  std::vector<nlohmann::json> out;
  std::ifstream f(log);
  for (std::string line; std::getline(f, line);) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("event", "") == event) out.push_back(std::move(j));
  }
  return out;
}

class HandoffLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
    RemoveLeftovers();
    const pid_t pid = getpid();
    const int k = pid % 120;
    pf_ = absl::StrCat(kPrefix, "-pf-", pid);
    dc_ = absl::StrCat(kPrefix, "-dc-", pid);
    const std::string dev = absl::StrCat(kPrefix, pid);
    bridge_ = dev + "br", root_pf_ = dev + "rp", pf_root_ = dev + "pr", root_dc_ = dev + "rd", dc_root_ = dev + "dr";
    pf_dc_ = dev + "pd", dc_pf_ = dev + "dp";
    const std::string kv_net = absl::StrCat("10.77.", 2 * k + 1, "."),
                      grpc_net = absl::StrCat("10.77.", 2 * k + 2, ".");
    d2_kv_ip_ = kv_net + "1", p1_ip_ = kv_net + "2", d1_kv_ip_ = kv_net + "3", d1_ip_ = grpc_net + "2";
    dir_ = TempDir();
    const std::string pf = "ip -n " + pf_ + " ", dc = "ip -n " + dc_ + " ";
    const std::string script = absl::StrCat(
        "set -e; ip netns add ", pf_, "; ip netns add ", dc_, "; ", pf, "link set lo up; ", dc, "link set lo up; ",
        // P1's address, on a bridge over link 1 and the handoff link.
        pf, "link add ", bridge_, " type bridge; ", pf, "addr add ", p1_ip_, "/24 dev ", bridge_, "; ", pf, "link set ",
        bridge_, " up; ",
        // Link 1: root <-> PF.
        "ip link add ", root_pf_, " type veth peer name ", pf_root_, " netns ", pf_, "; ip addr add ", d2_kv_ip_,
        "/24 dev ", root_pf_, "; ip link set ", root_pf_, " up; ", pf, "link set ", pf_root_, " master ", bridge_,
        " up; ",
        // The handoff link: PF <-> DC.
        pf, "link add ", pf_dc_, " type veth peer name ", dc_pf_, " netns ", dc_, "; ", pf, "link set ", pf_dc_,
        " master ", bridge_, " up; ", dc, "addr add ", d1_kv_ip_, "/24 dev ", dc_pf_, "; ", dc, "link set ", dc_pf_,
        " up; ",
        // Link 2: root <-> DC.
        "ip link add ", root_dc_, " type veth peer name ", dc_root_, " netns ", dc_, "; ip addr add ", grpc_net,
        "1/24 dev ", root_dc_, "; ip link set ", root_dc_, " up; ", dc, "addr add ", d1_ip_, "/24 dev ", dc_root_, "; ",
        dc, "link set ", dc_root_, " up");
    created_ = true;
    if (!Sh(script, dir_ + "/netns.log")) {
      GTEST_SKIP() << "cannot create network namespaces with veth pairs here (ip netns): " << dir_ << "/netns.log";
    }
  }

  void TearDown() override {
    // Servers first: a namespace with a process in it outlives its name.
    router_.Kill();
    p1_.Kill();
    d1_.Kill();
    d2_.Kill();
    if (!created_) return;
    // Deleting a namespace deletes the veth ends in it, and so their peers.
    Sh(absl::StrCat("ip netns del ", pf_, "; ip netns del ", dc_, "; ip link del ", root_pf_, "; ip link del ",
                    root_dc_));
  }

  // Starts `args` in namespace `ns` (root if empty) and waits for its ready
  // file; the gRPC port.
  absl::StatusOr<int> StartServer(Subprocess& proc, const std::string& name, const std::string& ns,
                                  std::vector<std::string> args, const std::map<std::string, std::string>& env) {
    const std::string ready = absl::StrCat(dir_, "/", name, ".ready");
    args.insert(args.end(), {"--model", kModel, "--ready_file", ready});
    if (!ns.empty()) args.insert(args.begin(), {IpBinary(), "netns", "exec", ns});
    if (absl::Status s = proc.Start(args, absl::StrCat(dir_, "/", name, ".log"), env); !s.ok()) return s;
    return proc.WaitReady(ready, absl::Seconds(60));
  }

  // D1, D2, P1 and the router.
  absl::Status StartCluster() {
    absl::StatusOr<int> d1 = StartServer(d1_, "d1", dc_,
                                         {kBin + "/decode_worker/pdserve-decode-worker", "--listen", d1_ip_ + ":0",
                                          "--kv_host", d1_kv_ip_, "--kv_lease_s", kD1LeaseS, "--kv_quarantine_s", "2",
                                          "--prefill_chunk", "32", "--tls_cert", TestTls("decode").cert, "--tls_key", TestTls("decode").key, "--tls_ca", TestTls("decode").ca, "--kv_grant_key", TestCertsDir() + "/kv_grant.key"},
                                         {});
    if (!d1.ok()) return d1.status();
    absl::StatusOr<int> d2 = StartServer(d2_, "d2", "",
                                         {kBin + "/decode_worker/pdserve-decode-worker", "--listen", "127.0.0.1:0",
                                          "--kv_host", d2_kv_ip_, "--prefill_chunk", "32", "--tls_cert", TestTls("decode").cert, "--tls_key", TestTls("decode").key, "--tls_ca", TestTls("decode").ca, "--kv_grant_key", TestCertsDir() + "/kv_grant.key"},
                                         {});
    if (!d2.ok()) return d2.status();
    absl::StatusOr<int> p1 =
        StartServer(p1_, "p1", pf_,
                    {kBin + "/prefill_worker/pdserve-prefill-worker", "--listen", p1_ip_ + ":0", "--prefill_chunk",
                     "32", "--fault_stall_before_commit_ms", absl::StrCat(kStallMs), "--kv_timeout_s", kKvTimeoutS, "--tls_cert", TestTls("prefill").cert, "--tls_key", TestTls("prefill").key, "--tls_ca", TestTls("prefill").ca},
                    {});
    if (!p1.ok()) return p1.status();
    d1_address_ = absl::StrCat(d1_ip_, ":", *d1);
    d2_address_ = absl::StrCat("127.0.0.1:", *d2);
    absl::StatusOr<int> router =
        StartServer(router_, "router", "",
                    {kBin + "/router/pdserve-router", "--listen", "127.0.0.1:0", "--http_listen", "127.0.0.1:0", "--prefill",
                     absl::StrCat(p1_ip_, ":", *p1), "--decode", absl::StrCat(d1_address_, ",", d2_address_), "--tls_cert", TestTls("router").cert, "--tls_key", TestTls("router").key, "--tls_ca", TestTls("router").ca, "--kv_grant_key", TestCertsDir() + "/kv_grant.key"},
                    {});
    if (!router.ok()) return router.status();
    stub_ = v1::Generation::NewStub(TestChannel(absl::StrCat("127.0.0.1:", *router)));
    return absl::OkStatus();
  }

  std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> Open(grpc::ClientContext& ctx) {
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return stub_->Generate(&ctx, Request());
  }

  Output Generate() {
    grpc::ClientContext ctx;
    Output out;
    Read(*Open(ctx), SIZE_MAX, out);
    return out;
  }

  // D1's used KV blocks as the router reads them now; -1 when its Status
  // call did not answer (the router then reports zeros).
  int D1KvUsed() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ClusterStatusResponse st;
    EXPECT_TRUE(stub_->ClusterStatus(&ctx, {}, &st).ok());
    for (const v1::WorkerStatus& w : st.decode()) {
      if (w.address() == d1_address_) return w.kv_blocks_total() > 0 ? w.kv_blocks_used() : -1;
    }
    ADD_FAILURE() << "no " << d1_address_ << " in " << st.ShortDebugString();
    return -1;
  }

  std::string Logs() {
    return absl::StrCat("logs in ", dir_, "\nrouter:\n", router_.LogTail(), "\np1:\n", p1_.LogTail(), "\nd1:\n",
                        d1_.LogTail(), "\nd2:\n", d2_.LogTail());
  }

  std::string pf_, dc_, bridge_, root_pf_, pf_root_, root_dc_, dc_root_, pf_dc_, dc_pf_;
  std::string d2_kv_ip_, p1_ip_, d1_kv_ip_, d1_ip_;
  std::string dir_, d1_address_, d2_address_;
  bool created_ = false;
  Subprocess d1_, d2_, p1_, router_;
  std::unique_ptr<v1::Generation::Stub> stub_;
};

TEST_F(HandoffLinkTest, LinkCutMidHandoffCompletesThroughAnotherDecodeWorker) {
  ASSERT_TRUE(StartCluster().ok()) << Logs();

  // Undisturbed: the request goes to D1 (first listed, both idle) over the
  // handoff link, with no migration.
  const Output want = Generate();
  ASSERT_TRUE(want.status.ok()) << want.status.error_message() << "\n" << Logs();
  ASSERT_EQ(want.final.finish_reason(), v1::FINISH_REASON_LENGTH) << want.final.error() << "\n" << Logs();
  ASSERT_EQ(want.tokens.size(), 24u);
  ASSERT_TRUE(RouterEvents(dir_ + "/router.log", "migrating").empty()) << Logs();

  grpc::ClientContext ctx;
  auto reader = Open(ctx);
  Output got;
  Read(*reader, 1, got);  // The first token: P1 now holds the handoff to D1 before its commit.
  ASSERT_EQ(got.tokens.size(), 1u) << Logs();
  ASSERT_TRUE(Sh(absl::StrCat("ip -n ", dc_, " link set ", dc_pf_, " down"))) << "cannot cut the handoff link";
  const absl::Time cut = absl::Now();
  EXPECT_GT(D1KvUsed(), 0) << "no handoff was pending on D1\n" << Logs();
  Read(*reader, SIZE_MAX, got);

  ASSERT_TRUE(got.status.ok()) << got.status.error_message() << "\n" << Logs();
  EXPECT_EQ(got.final.finish_reason(), v1::FINISH_REASON_LENGTH) << got.final.error() << "\n" << Logs();
  EXPECT_EQ(got.tokens, want.tokens) << "a token repeated, lost or changed";
  EXPECT_EQ(got.text, want.text);
  const std::vector<nlohmann::json> migrations = RouterEvents(dir_ + "/router.log", "migrating");
  ASSERT_EQ(migrations.size(), 1u) << Logs();
  EXPECT_EQ(migrations[0].value("to", ""), d2_address_) << Logs();

  // D1 frees the dead handoff's blocks within seconds, though no answer can
  // come back over the cut link: its lease runs out, the handoff is
  // quarantined, and when the sender has neither acknowledged nor
  // disconnected after --kv_quarantine_s the connection is dropped.
  int used = -1;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((used = D1KvUsed()) != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(used, 0) << "D1 still holds the reservation " << absl::FormatDuration(absl::Now() - cut)
                     << " after the cut\n"
                     << Logs();
}

}  // namespace
}  // namespace pdserve
