// A cluster of real processes for tests: a decode worker, N prefill
// workers (none when colocated) and a router, on loopback with ports from
// their ready files, killed when the Cluster goes away.
#ifndef PDSERVE_TESTS_CLUSTER_CLUSTER_HARNESS_H_
#define PDSERVE_TESTS_CLUSTER_CLUSTER_HARNESS_H_

#include <stdlib.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "base/health_check.h"
#include "base/tls.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "tests/support/http_get.h"
#include "tests/support/subprocess.h"

namespace pdserve {

using testing_support::Subprocess;

inline const std::string kModel = std::string(PDSERVE_SOURCE_DIR) + "/deploy/models/kjv-tiny";
inline const std::string kBin = PDSERVE_BINARY_DIR;

inline std::string TempDir() {
  char tmpl[] = "/tmp/pdserve-cluster-XXXXXX";
  return mkdtemp(tmpl);
}

// The default model in `parent`/kjv-tiny (the served name is the
// directory's) with its context raised to `context` positions (its other
// files linked): for tests whose prompts pass its 512,
// such as a chat with tools (a one-line question with two small tools is
// a 480-token prompt). RoPE positions past those it was trained on make its words
// worse; its mechanics, which these tests check, are the same.
inline std::string LongContextModel(const std::string& parent, int context) {
  const std::string dir = parent + "/kjv-tiny";
  std::filesystem::create_directories(dir);
  for (const auto& entry : std::filesystem::directory_iterator(kModel)) {
    const std::string name = entry.path().filename().string();
    if (name == "config.json" || !entry.is_regular_file()) continue;
    std::filesystem::create_symlink(entry.path(), dir + "/" + name);
  }
  nlohmann::json config = nlohmann::json::parse(std::ifstream(kModel + "/config.json"));
  config["max_position_embeddings"] = context;
  std::ofstream(dir + "/config.json") << config.dump(2);
  return dir;
}

// A development CA and a certificate per role (deploy/make_certs.sh), made
// once per test process.
inline const std::string& TestCertsDir() {
  static const std::string dir = [] {
    const std::string d = TempDir() + "/certs";
    const std::string cmd = absl::StrCat("'", PDSERVE_SOURCE_DIR, "/deploy/make_certs.sh' '", d, "' > /dev/null");
    if (std::system(cmd.c_str()) != 0) ADD_FAILURE() << "deploy/make_certs.sh failed";
    return d;
  }();
  return dir;
}

// `dir`: another deploy/make_certs.sh output ("" = TestCertsDir()).
inline TlsFiles TestTls(const std::string& role, const std::string& dir = "") {
  const std::string& d = dir.empty() ? TestCertsDir() : dir;
  TlsFiles f;
  f.cert = absl::StrCat(d, "/", role, ".pem");
  f.key = absl::StrCat(d, "/", role, ".key");
  f.ca = d + "/ca.pem";
  return f;
}

// A server's TLS flags for `role`: its certificate from TestCertsDir, or
// --insecure when `tls` is off.
// The router and both worker roles also get the grant key (make_certs.sh's
// kv_grant.key): KV grants (handoffs, prefix pulls) are on wherever TLS is.
inline std::vector<std::string> TlsArgs(const std::string& role, bool tls = true, const std::string& dir = "") {
  if (!tls) return {"--insecure"};
  const TlsFiles f = TestTls(role, dir);
  std::vector<std::string> args = {"--tls_cert", f.cert, "--tls_key", f.key, "--tls_ca", f.ca};
  if (role == "router" || role == "decode" || role == "prefill") {
    args.push_back("--kv_grant_key");
    args.push_back(absl::StrCat(dir.empty() ? TestCertsDir() : dir, "/kv_grant.key"));
  }
  return args;
}

// A channel to a pdserve server as the test's `as_role` would dial it:
// the router's client API (server_role "") with the CA only, a worker
// ("prefill"/"decode") with the router's certificate. Plaintext when
// `tls` is off.
inline std::shared_ptr<grpc::Channel> TestChannel(const std::string& address, const std::string& server_role = "",
                                                  bool tls = true, grpc::ChannelArguments args = {},
                                                  const std::string& dir = "") {
  if (!tls) return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  TlsFiles f = TestTls("router", dir);
  if (server_role.empty()) f.cert = f.key = "";
  return grpc::CreateCustomChannel(address, ChannelTlsCredentials(f, server_role, &args), args);
}

// A port a server wrote in its ready file (0 if none).
inline int ReadyPort(const std::string& ready_file, const std::string& key) {
  std::ifstream f(ready_file);
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  return j.is_object() && j.contains(key) ? j[key].get<int>() : 0;
}
inline int MetricsPort(const std::string& ready_file) { return ReadyPort(ready_file, "metrics_port"); }

using testing_support::HttpGet;

// The value of the sample `series` (with its labels, as exposed) in a
// Prometheus text page, or -1 if absent.
inline double MetricValue(const std::string& page, const std::string& series) {
  const std::string key = "\n" + series + " ";
  const size_t at = ("\n" + page).find(key);
  if (at == std::string::npos) return -1;
  return std::strtod(page.c_str() + at + series.size() + 1, nullptr);
}

// grpc.health.v1.Health/Check for the whole server (an empty request): the
// answer's status field, 1 SERVING or 2 NOT_SERVING; -1 if the call failed.
// `server_role`: how TestChannel dials it ("" the router; "none":
// plaintext, a health-only port).
inline int GrpcHealth(const std::string& address, const std::string& server_role = "decode") {
  absl::StatusOr<HealthStatus> s = CheckHealth(
      server_role == "none" ? TestChannel(address, "", false) : TestChannel(address, server_role), absl::Seconds(2));
  return s.ok() ? static_cast<int>(*s) : -1;
}

struct Output {
  std::vector<int32_t> tokens;
  std::string text;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  grpc::Status status;
  v1::GenerateFinal final;
};

// One router + its workers.
class Cluster {
 public:
  // Flags for one decode worker only (by index), set before Start.
  std::map<int, std::vector<std::string>> extra_decode_flags;
  // Flags for prefill worker i alone (after prefill_flags).
  std::map<int, std::vector<std::string>> extra_prefill_flags;
  std::vector<std::string> extra_router_flags;
  // The model directory every process serves, set before Start.
  std::string model = kModel;
  // Mutual TLS between the processes and TLS to the router (the default),
  // or --insecure everywhere; the certificates from `certs_dir` (""
  // TestCertsDir()). Set before Start.
  bool tls = true;
  std::string certs_dir;

  // colocated: router --colocated, no prefill worker.
  absl::Status Start(const std::string& dir, bool colocated, const std::vector<std::string>& decode_flags = {},
                     const std::map<std::string, std::string>& env = {}, int num_prefill = 1,
                     const std::vector<std::string>& prefill_flags = {}, int num_decode = 1) {
    // Every server of every cluster a test starts runs one matrix path
    // (unless the test set one: ClusterTest pins the path its in-process
    // reference took): tests compare streams across clusters and restarted
    // workers, and each server's start-up probe under the suite's load
    // could otherwise pick a different path (different arithmetic).
    setenv("PDSERVE_MATRIX_PATH", "f32", /*overwrite=*/0);
    std::filesystem::create_directories(dir);
    std::string decode_list;
    for (int i = 0; i < num_decode; ++i) {
      decode_.push_back(std::make_unique<Subprocess>());
      const std::string ready = absl::StrCat(dir, "/decode", i, ".ready");
      std::vector<std::string> dargs = {kBin + "/decode_worker/pdserve-decode-worker", "--model", model,
                                        "--ready_file", ready, "--prefill_chunk", "32"};
      for (std::string& a : TlsArgs("decode", tls, certs_dir)) dargs.push_back(std::move(a));
      dargs.insert(dargs.end(), decode_flags.begin(), decode_flags.end());
      if (auto it = extra_decode_flags.find(i); it != extra_decode_flags.end()) {
        dargs.insert(dargs.end(), it->second.begin(), it->second.end());
      }
      if (absl::Status s = decode_.back()->Start(dargs, absl::StrCat(dir, "/decode", i, ".log"), env); !s.ok()) {
        return s;
      }
      absl::StatusOr<int> dport = decode_.back()->WaitReady(ready, absl::Seconds(60));
      if (!dport.ok()) return dport.status();
      decode_args_.push_back(dargs);
      decode_ports_.push_back(*dport);
      decode_env_ = env;
      dir_ = dir;
      absl::StrAppend(&decode_list, decode_list.empty() ? "" : ",", "127.0.0.1:", *dport);
    }
    std::vector<std::string> rargs = {kBin + "/router/pdserve-router", "--model", model, "--ready_file",
                                      dir + "/router.ready", "--decode", decode_list, "--http_listen",
                                      "127.0.0.1:0"};
    for (std::string& a : TlsArgs("router", tls, certs_dir)) rargs.push_back(std::move(a));
    if (colocated) {
      rargs.push_back("--colocated");
    } else {
      std::string list;
      for (int i = 0; i < num_prefill; ++i) {
        prefill_.push_back(std::make_unique<Subprocess>());
        const std::string ready = absl::StrCat(dir, "/prefill", i, ".ready");
        std::vector<std::string> pargs = {kBin + "/prefill_worker/pdserve-prefill-worker", "--model", model,
                                          "--ready_file", ready, "--prefill_chunk", "32"};
        for (std::string& a : TlsArgs("prefill", tls, certs_dir)) pargs.push_back(std::move(a));
        pargs.insert(pargs.end(), prefill_flags.begin(), prefill_flags.end());
        if (auto it = extra_prefill_flags.find(i); it != extra_prefill_flags.end()) {
          pargs.insert(pargs.end(), it->second.begin(), it->second.end());
        }
        if (absl::Status s = prefill_.back()->Start(pargs, absl::StrCat(dir, "/prefill", i, ".log"), env); !s.ok()) {
          return s;
        }
        absl::StatusOr<int> pport = prefill_.back()->WaitReady(ready, absl::Seconds(60));
        if (!pport.ok()) return pport.status();
        absl::StrAppend(&list, list.empty() ? "" : ",", "127.0.0.1:", *pport);
      }
      rargs.push_back("--prefill");
      rargs.push_back(list);
    }
    rargs.insert(rargs.end(), extra_router_flags.begin(), extra_router_flags.end());
    if (absl::Status s = router_.Start(rargs, dir + "/router.log", env); !s.ok()) return s;
    absl::StatusOr<int> rport = router_.WaitReady(dir + "/router.ready", absl::Seconds(60));
    if (!rport.ok()) return rport.status();
    address_ = absl::StrCat("127.0.0.1:", *rport);
    router_metrics_ = MetricsPort(dir + "/router.ready");
    http_port_ = ReadyPort(dir + "/router.ready", "http_port");
    decode_metrics_ = MetricsPort(dir + "/decode0.ready");
    if (!colocated) prefill_metrics_ = MetricsPort(dir + "/prefill0.ready");
    stub_ = v1::Generation::NewStub(TestChannel(address_, "", tls, {}, certs_dir));
    return absl::OkStatus();
  }

  // `authorization`: sent as that metadata when not empty (API keys).
  Output Generate(const v1::GenerateRequest& req, const std::string& authorization = "") {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
    auto reader = stub_->Generate(&ctx, req);
    Output out;
    v1::GenerateResponse m;
    while (reader->Read(&m)) {
      if (m.has_chunk()) {
        out.tokens.insert(out.tokens.end(), m.chunk().token_ids().begin(), m.chunk().token_ids().end());
        out.text += m.chunk().text();
      } else if (m.has_final()) {
        out.final = m.final();
        out.finish = m.final().finish_reason();
      }
    }
    out.status = reader->Finish();
    return out;
  }

  v1::ClusterStatusResponse Status() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::ClusterStatusResponse out;
    EXPECT_TRUE(stub_->ClusterStatus(&ctx, {}, &out).ok());
    return out;
  }

  std::string Logs() {
    std::string out = absl::StrCat("router:\n", router_.LogTail());
    for (auto& d : decode_) absl::StrAppend(&out, "\ndecode:\n", d->LogTail());
    for (auto& p : prefill_) absl::StrAppend(&out, "\nprefill:\n", p->LogTail());
    return out;
  }
  Subprocess& prefill(int i) { return *prefill_[i]; }
  Subprocess& decode(int i = 0) { return *decode_[i]; }
  // Decode worker i's gRPC address.
  std::string decode_address(int i = 0) const { return absl::StrCat("127.0.0.1:", decode_ports_[i]); }
  // Kills decode worker i and starts it again on the same gRPC port (its
  // KV receiver gets a new one).
  absl::Status RestartDecode(int i) {
    decode_[i]->Kill();
    std::vector<std::string> args = decode_args_[i];
    args.push_back("--listen");
    args.push_back(absl::StrCat("127.0.0.1:", decode_ports_[i]));
    const std::string ready = absl::StrCat(dir_, "/decode", i, ".ready");
    std::filesystem::remove(ready);
    decode_[i] = std::make_unique<Subprocess>();
    if (absl::Status s = decode_[i]->Start(args, absl::StrCat(dir_, "/decode", i, ".restart.log"), decode_env_);
        !s.ok()) {
      return s;
    }
    return decode_[i]->WaitReady(ready, absl::Seconds(60)).status();
  }

  v1::Generation::Stub* stub() { return stub_.get(); }
  const std::string& address() const { return address_; }
  int router_metrics() const { return router_metrics_; }
  // The router's OpenAI HTTP API port.
  int http_port() const { return http_port_; }
  int decode_metrics() const { return decode_metrics_; }
  // Decode worker i's metrics port (as its latest ready file says).
  int decode_metrics(int i) const { return MetricsPort(absl::StrCat(dir_, "/decode", i, ".ready")); }
  int prefill_metrics() const { return prefill_metrics_; }

 private:
  std::string address_;
  std::string dir_;
  std::vector<std::vector<std::string>> decode_args_;
  std::vector<int> decode_ports_;
  std::map<std::string, std::string> decode_env_;
  int router_metrics_ = 0, decode_metrics_ = 0, prefill_metrics_ = 0, http_port_ = 0;
  Subprocess router_;
  std::vector<std::unique_ptr<Subprocess>> decode_;
  std::vector<std::unique_ptr<Subprocess>> prefill_;
  std::unique_ptr<v1::Generation::Stub> stub_;
};

// The fault tests' request: seeded sampling, so every run gives the same tokens.
inline v1::GenerateRequest SeededRequest(int max_tokens) {
  v1::GenerateRequest r;
  r.set_text("In the beginning God created");
  r.set_max_tokens(max_tokens);
  r.mutable_sampling()->set_temperature(0.8f);
  r.mutable_sampling()->set_seed(77);
  return r;
}

// Reads a stream to its end into `got`.
inline void ReadToEnd(grpc::ClientReader<v1::GenerateResponse>& reader, Output& got) {
  v1::GenerateResponse m;
  while (reader.Read(&m)) {
    if (m.has_chunk()) {
      got.tokens.insert(got.tokens.end(), m.chunk().token_ids().begin(), m.chunk().token_ids().end());
      got.text += m.chunk().text();
    } else if (m.has_final()) {
      got.final = m.final();
      got.finish = m.final().finish_reason();
    }
  }
  got.status = reader.Finish();
}

// Reads chunks into `got` until it holds at least `n` tokens (or the stream ends).
inline void ReadAtLeast(grpc::ClientReader<v1::GenerateResponse>& reader, size_t n, Output& got) {
  v1::GenerateResponse m;
  while (got.tokens.size() < n && reader.Read(&m)) {
    if (!m.has_chunk()) continue;
    got.tokens.insert(got.tokens.end(), m.chunk().token_ids().begin(), m.chunk().token_ids().end());
    got.text += m.chunk().text();
  }
}

// The request through an undisturbed cluster of the same shape: what a
// faulty run must reproduce.
inline Output Undisturbed(const std::string& dir, bool colocated, const v1::GenerateRequest& req) {
  Cluster calm;
  const absl::Status s = calm.Start(dir + "/calm", colocated);
  EXPECT_TRUE(s.ok()) << s;
  Output want = calm.Generate(req);
  EXPECT_TRUE(want.status.ok()) << want.status.error_message();
  return want;
}

inline void ExpectUndisturbed(const Output& got, const Output& want, Cluster& c) {
  ASSERT_TRUE(got.status.ok()) << got.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(got.final.finish_reason(), v1::FINISH_REASON_LENGTH) << got.final.error() << "\n" << c.Logs();
  EXPECT_EQ(got.tokens, want.tokens) << "a token repeated, lost or changed";
  EXPECT_EQ(got.text, want.text);
}

// The KV blocks in use on every worker, summed: 0 as soon as it is, else
// the sum when `wait` runs out (the survivors of a fault must hold none).
// The prefill workers' queued prompt tokens once every request has ended
// (each request's tokens are released when its first token is produced, or
// when its call ends): 0 unless the accounting leaks.
inline int64_t QueuedPrefillTokensAfterSettling(Cluster& c, absl::Duration wait = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + wait;
  int64_t queued = -1;
  while (absl::Now() < deadline) {
    queued = 0;
    const v1::ClusterStatusResponse st = c.Status();
    for (const v1::WorkerStatus& w : st.prefill()) queued += w.queued_prefill_tokens();
    if (queued == 0) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return queued;
}

inline int AllKvUsedAfterSettling(Cluster& c, absl::Duration wait = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + wait;
  int used = -1;
  while (absl::Now() < deadline) {
    const v1::ClusterStatusResponse st = c.Status();
    used = 0;
    for (const v1::WorkerStatus& w : st.prefill()) used += w.kv_blocks_used();
    for (const v1::WorkerStatus& w : st.decode()) used += w.kv_blocks_used();
    if (used == 0) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return used;
}

}  // namespace pdserve

#endif  // PDSERVE_TESTS_CLUSTER_CLUSTER_HARNESS_H_
