// TLS on every hop, against real processes: who is refused (plaintext
// clients, clients of another CA, callers of a worker that are not
// routers), impostor workers getting no traffic, certificates rotated
// under load with no stream failing, the plaintext health-only port, and a
// server that will not start without TLS or --insecure.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "pdserve/v1/worker.grpc.pb.h"
#include "router/api_keys.h"
#include "base/grpc_server.h"
#include "tests/cluster/cluster_harness.h"
#include "tests/support/http_client.h"

namespace pdserve {
namespace {

std::string MakeCerts(const std::string& dir) {
  const std::string cmd = absl::StrCat("'", PDSERVE_SOURCE_DIR, "/deploy/make_certs.sh' '", dir, "' > /dev/null");
  EXPECT_EQ(std::system(cmd.c_str()), 0);
  return dir;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Starts `argv` (plus its ready file) and returns its gRPC port.
absl::StatusOr<int> Launch(Subprocess& p, const std::string& dir, const std::string& name,
                           std::vector<std::string> argv) {
  const std::string ready = absl::StrCat(dir, "/", name, ".ready");
  argv.push_back("--ready_file");
  argv.push_back(ready);
  if (absl::Status s = p.Start(argv, absl::StrCat(dir, "/", name, ".log")); !s.ok()) return s;
  return p.WaitReady(ready, absl::Seconds(60));
}

// The decode worker's Status, called with `as_role`'s certificate from
// `certs` ("" none: no client certificate).
grpc::Status CallDecodeStatus(const std::string& address, const std::string& as_role, const std::string& certs = "") {
  TlsFiles f = TestTls(as_role.empty() ? "router" : as_role, certs);
  if (as_role.empty()) f.cert = f.key = "";
  grpc::ChannelArguments args;
  auto stub = worker::v1::DecodeWorker::NewStub(
      grpc::CreateCustomChannel(address, ChannelTlsCredentials(f, "decode", &args), args));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  worker::v1::WorkerInfo info;
  return stub->Status(&ctx, {}, &info);
}

class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new Cluster();
    const absl::Status s = cluster_->Start(TempDir() + "/tls", /*colocated=*/false);
    ASSERT_TRUE(s.ok()) << s;
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  static Cluster* cluster_;
};
Cluster* TlsTest::cluster_ = nullptr;

TEST_F(TlsTest, PlaintextForeignAndWrongRoleCallersAreRefused) {
  // The cluster serves over TLS.
  const Output ok = cluster_->Generate(SeededRequest(4));
  ASSERT_TRUE(ok.status.ok()) << ok.status.error_message();

  auto generate = [](const std::shared_ptr<grpc::Channel>& channel) {
    auto stub = v1::Generation::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::CompleteResponse out;
    return stub->Complete(&ctx, SeededRequest(2), &out);
  };
  // Plaintext to the TLS port: no connection.
  EXPECT_EQ(generate(TestChannel(cluster_->address(), "", /*tls=*/false)).error_code(), grpc::StatusCode::UNAVAILABLE);
  // A client that trusts another CA does not trust the router.
  const std::string other = MakeCerts(TempDir() + "/other-ca");
  EXPECT_EQ(generate(TestChannel(cluster_->address(), "", true, {}, other)).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  // Plain HTTP to the HTTPS port gets no HTTP answer.
  const testing_support::HttpReply plain = testing_support::HttpExchange(
      cluster_->http_port(), testing_support::HttpRequest("GET", "/health", ""), absl::Seconds(5));
  EXPECT_NE(plain.status, 200);

  // A worker takes calls from routers only.
  const v1::ClusterStatusResponse st = cluster_->Status();
  const std::string decode = st.decode(0).address();
  EXPECT_TRUE(CallDecodeStatus(decode, "router").ok());
  const grpc::Status as_prefill = CallDecodeStatus(decode, "prefill");
  EXPECT_EQ(as_prefill.error_code(), grpc::StatusCode::UNAUTHENTICATED) << as_prefill.error_message();
  EXPECT_TRUE(absl::StrContains(as_prefill.error_message(), "not a router's")) << as_prefill.error_message();
  EXPECT_TRUE(absl::StrContains(as_prefill.error_message(), "prefill.pdserve.internal"))
      << as_prefill.error_message();
  // No client certificate, or one from another CA: no handshake.
  EXPECT_EQ(CallDecodeStatus(decode, "").error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(CallDecodeStatus(decode, "router", other).error_code(), grpc::StatusCode::UNAVAILABLE);
}

TEST(TlsImpostorTest, WorkersWithAnotherRolesOrAnotherCasCertificateGetNoTraffic) {
  const std::string dir = TempDir();
  const std::string other = MakeCerts(dir + "/other-ca");
  const std::string decode_bin = kBin + "/decode_worker/pdserve-decode-worker";
  Subprocess real, wrong_role, wrong_ca, prefill, prefill_as_decode, router;
  // The router and decode workers take the grant key; a prefill worker has
  // no such flag. The prefill binary's launches below use prefill_tls.
  auto tls = [](const TlsFiles& f) {
    return std::vector<std::string>{"--tls_cert", f.cert, "--tls_key", f.key, "--tls_ca", f.ca,
                                    "--kv_grant_key", TestCertsDir() + "/kv_grant.key"};
  };
  auto prefill_tls = [](const TlsFiles& f) {
    return std::vector<std::string>{"--tls_cert", f.cert, "--tls_key", f.key, "--tls_ca", f.ca};
  };
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  absl::StatusOr<int> d = Launch(real, dir, "decode", with({decode_bin, "--model", kModel}, tls(TestTls("decode"))));
  ASSERT_TRUE(d.ok()) << d.status();
  // A decode worker holding the prefill role's certificate (from the right CA).
  TlsFiles prefill_cert = TestTls("prefill");
  absl::StatusOr<int> i1 = Launch(wrong_role, dir, "wrong-role", with({decode_bin, "--model", kModel}, tls(prefill_cert)));
  // TlsFilesFromFlags refuses a certificate that does not name the role.
  EXPECT_FALSE(i1.ok());
  EXPECT_TRUE(absl::StrContains(wrong_role.LogTail(), "does not name the role decode")) << wrong_role.LogTail();
  // So the impostor lies about nothing it can check: it runs --insecure
  // (what an attacker's own server would do) with the decode certificate
  // of another CA in a second one.
  absl::StatusOr<int> i1b =
      Launch(wrong_role, dir, "wrong-role-plain", {decode_bin, "--model", kModel, "--insecure"});
  ASSERT_TRUE(i1b.ok()) << i1b.status();
  absl::StatusOr<int> i2 =
      Launch(wrong_ca, dir, "wrong-ca", with({decode_bin, "--model", kModel}, tls(TestTls("decode", other))));
  ASSERT_TRUE(i2.ok()) << i2.status();
  absl::StatusOr<int> p = Launch(prefill, dir, "prefill",
                                 with({kBin + "/prefill_worker/pdserve-prefill-worker", "--model", kModel},
                                      prefill_tls(TestTls("prefill"))));
  ASSERT_TRUE(p.ok()) << p.status();
  // A server with a valid certificate of another role: a prefill worker
  // listed as a decode worker.
  absl::StatusOr<int> i3 = Launch(prefill_as_decode, dir, "prefill-as-decode",
                                  with({kBin + "/prefill_worker/pdserve-prefill-worker", "--model", kModel},
                                       prefill_tls(TestTls("prefill"))));
  ASSERT_TRUE(i3.ok()) << i3.status();
  const std::string real_address = absl::StrCat("127.0.0.1:", *d);
  absl::StatusOr<int> r = Launch(
      router, dir, "router",
      with({kBin + "/router/pdserve-router", "--model", kModel, "--http_listen", "127.0.0.1:0", "--worker_wait_s", "3",
            "--prefill", absl::StrCat("127.0.0.1:", *p), "--decode",
            absl::StrCat(real_address, ",127.0.0.1:", *i1b, ",127.0.0.1:", *i2, ",127.0.0.1:", *i3)},
           tls(TestTls("router"))));
  ASSERT_TRUE(r.ok()) << r.status() << router.LogTail();
  auto stub = v1::Generation::NewStub(TestChannel(absl::StrCat("127.0.0.1:", *r)));
  for (int i = 0; i < 8; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::CompleteResponse out;
    const grpc::Status s = stub->Complete(&ctx, SeededRequest(4), &out);
    ASSERT_TRUE(s.ok()) << s.error_message() << router.LogTail();
  }
  // The router never admitted the impostors, and they took no handoff.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ClusterStatusResponse st;
  ASSERT_TRUE(stub->ClusterStatus(&ctx, {}, &st).ok());
  ASSERT_EQ(st.decode_size(), 4);
  for (const v1::WorkerStatus& w : st.decode()) {
    EXPECT_EQ(w.healthy(), w.address() == real_address) << w.ShortDebugString();
  }
  // Each refused for what it is: another role's name, another CA, no TLS.
  const std::string log = ReadFile(dir + "/router.log");
  auto refused = [&log](int port, const std::string& why) {
    const size_t at = log.find(absl::StrCat("\"address\":\"127.0.0.1:", port, "\",\"reason\""));
    return at != std::string::npos && log.find(why, at) < log.find('\n', at);
  };
  EXPECT_TRUE(refused(*i3, "Hostname Verification Check failed")) << log;
  EXPECT_TRUE(refused(*i2, "certificate verify failed")) << log;
  EXPECT_TRUE(refused(*i1b, "wrong version number")) << log;
  auto steps = [&dir](const std::string& name) {
    return MetricValue(HttpGet(MetricsPort(absl::StrCat(dir, "/", name, ".ready")), "/metrics"),
                       "pdserve_handoff_transfers_total");
  };
  EXPECT_EQ(steps("decode"), 8);
  EXPECT_EQ(steps("wrong-role-plain"), 0);
  EXPECT_EQ(steps("wrong-ca"), 0);
}

TEST(TlsRotationTest, CertificatesRotateUnderLoadAndNoStreamFails) {
  const std::string dir = TempDir();
  const std::string certs = MakeCerts(dir + "/certs");
  Cluster c;
  c.certs_dir = certs;
  const absl::Status s = c.Start(dir + "/rotate", /*colocated=*/false);
  ASSERT_TRUE(s.ok()) << s;
  const std::string old_router_cert = ReadFile(certs + "/router.pem");

  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, failed{0};
  std::string first_error;
  absl::Mutex mu;
  std::vector<std::thread> clients;
  for (int t = 0; t < 4; ++t) {
    clients.emplace_back([&, t] {
      for (int i = 0; !stop.load(); ++i) {
        v1::GenerateRequest req = SeededRequest(48);
        req.set_ignore_eos(true);
        req.mutable_sampling()->set_seed(100 * t + i);
        const Output out = c.Generate(req);
        if (out.status.ok() && out.tokens.size() == 48) {
          ++ok;
        } else {
          ++failed;
          absl::MutexLock lock(&mu);
          if (first_error.empty()) first_error = out.status.error_message();
        }
      }
    });
  }
  absl::SleepFor(absl::Seconds(1));
  // A rotation: every role gets a new key and certificate from the same CA
  // (the files replaced by rename, as make_certs.sh and a Secret update do).
  for (const char* role : {"router", "prefill", "decode"}) std::filesystem::remove(absl::StrCat(certs, "/", role, ".pem"));
  MakeCerts(certs);
  ASSERT_NE(ReadFile(certs + "/router.pem"), old_router_cert);
  absl::SleepFor(absl::Seconds(3));  // past every reader's refresh (1 s)
  stop.store(true);
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(failed.load(), 0) << first_error << c.Logs();
  EXPECT_GT(ok.load(), 8);

  // New connections now see the new certificate: gRPC...
  auto stub = v1::Generation::NewStub(TestChannel(c.address(), "", true, {}, certs));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::CompleteResponse out;
  ASSERT_TRUE(stub->Complete(&ctx, SeededRequest(2), &out).ok());
  const std::vector<grpc::string_ref> pem = ctx.auth_context()->FindPropertyValues("x509_pem_cert");
  ASSERT_EQ(pem.size(), 1u);
  const std::string new_cert = ReadFile(certs + "/router.pem");
  EXPECT_TRUE(absl::StartsWith(new_cert, std::string(pem[0].data(), pem[0].size())))
      << "the router still presents its old certificate";
  // ...and HTTPS (the router says it loaded it; curl checks it against the CA).
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (!absl::StrContains(c.Logs(), "http_tls_reloaded") && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(absl::StrContains(c.Logs(), "http_tls_reloaded")) << c.Logs();
  const std::string curl = absl::StrCat("curl -sf --cacert ", certs, "/ca.pem https://127.0.0.1:", c.http_port(),
                                        "/health > /dev/null");
  EXPECT_EQ(std::system(curl.c_str()), 0);
}

// A valid key works, over gRPC and HTTPS alike, until its limit: then 429
// (HTTP, with Retry-After) or RESOURCE_EXHAUSTED (gRPC) naming the key id.
TEST(ApiKeyLimitsTest, AValidKeyWorksAndIsRateLimitedOnBothApis) {
  const std::string dir = TempDir();
  const std::string keys = dir + "/keys";
  std::filesystem::create_directories(dir);
  std::ofstream(keys) << "alice:" << router::Sha256Hex("sk-alice") << " rate=0.5 burst=2\n";
  Cluster c;
  c.extra_router_flags = {"--api_keys_file", keys};
  const absl::Status s = c.Start(dir + "/c", /*colocated=*/true);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(c.Generate(SeededRequest(2)).status.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(c.Generate(SeededRequest(2), "Bearer sk-alice").status.ok());
  EXPECT_TRUE(c.Generate(SeededRequest(2), "Bearer sk-alice").status.ok());
  const Output limited = c.Generate(SeededRequest(2), "Bearer sk-alice");
  EXPECT_EQ(limited.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(limited.status.error_message(), "API key 'alice': over its limit of 0.5 requests/s");
  // HTTPS: the same key's bucket is empty too.
  const std::string out = dir + "/curl.out";
  const std::string curl = absl::StrCat(
      "curl -s -D ", out, ".headers -o ", out, " -w '%{http_code}' --cacert ", TestTls("router").ca,
      " -H 'Authorization: Bearer sk-alice' https://127.0.0.1:", c.http_port(),
      "/v1/completions -d '{\"prompt\":\"a\",\"max_tokens\":2}' > ", out, ".code");
  ASSERT_EQ(std::system(curl.c_str()), 0);
  EXPECT_EQ(ReadFile(out + ".code"), "429") << ReadFile(out);
  EXPECT_TRUE(absl::StrContains(ReadFile(out), "over its limit")) << ReadFile(out);
  const std::string headers = ReadFile(out + ".headers");
  EXPECT_TRUE(absl::StrContains(headers, "Retry-After: 2") || absl::StrContains(headers, "Retry-After: 1"))
      << headers;
  // Counted by key id, never by key.
  const std::string metrics = HttpGet(c.router_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(metrics, "pdserve_api_key_requests_total{key=\"alice\",outcome=\"admitted\"}"), 2);
  EXPECT_EQ(MetricValue(metrics, "pdserve_api_key_requests_total{key=\"alice\",outcome=\"limited\"}"), 2);
  EXPECT_FALSE(absl::StrContains(c.Logs(), "sk-alice"));
}

TEST(TlsHealthPortTest, ThePlaintextHealthPortServesHealthAndNothingElse) {
  const std::string dir = TempDir();
  Subprocess d;
  std::vector<std::string> argv = {kBin + "/decode_worker/pdserve-decode-worker", "--model", kModel,
                                   "--health_listen", "127.0.0.1:0"};
  for (std::string& a : TlsArgs("decode")) argv.push_back(std::move(a));
  absl::StatusOr<int> port = Launch(d, dir, "decode", argv);
  ASSERT_TRUE(port.ok()) << port.status();
  const int health_port = ReadyPort(dir + "/decode.ready", "health_port");
  ASSERT_GT(health_port, 0);
  const std::string health = absl::StrCat("127.0.0.1:", health_port);
  EXPECT_EQ(GrpcHealth(health, "none"), 1);  // SERVING, in plaintext
  // The liveness service (what the manifests' livenessProbe asks) serves
  // too; an unknown service is NOT_FOUND.
  absl::StatusOr<HealthStatus> live =
      CheckHealth(TestChannel(health, "", /*tls=*/false), absl::Seconds(2), kLivenessService);
  ASSERT_TRUE(live.ok()) << live.status();
  EXPECT_EQ(*live, HealthStatus::kServing);
  EXPECT_EQ(CheckHealth(TestChannel(health, "", /*tls=*/false), absl::Seconds(2), "no-such-service").status().code(),
            absl::StatusCode::kNotFound);
  auto stub = worker::v1::DecodeWorker::NewStub(TestChannel(health, "", /*tls=*/false));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  worker::v1::WorkerInfo info;
  EXPECT_EQ(stub->Status(&ctx, {}, &info).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  // The main port wants TLS.
  EXPECT_EQ(GrpcHealth(absl::StrCat("127.0.0.1:", *port), "none"), -1);
}

// One streamed completion over TLS that the client abandons with a reset
// (SO_LINGER 0, no close_notify) once `reset_after` bytes of the reply
// have come, or its last event: the router's next writes to it fail. False if it could not
// even send the request.
bool StreamThenReset(int port, const std::string& request, size_t reset_after) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) return close(fd), false;
  SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
  SSL* ssl = SSL_new(ctx);
  SSL_set_fd(ssl, fd);
  bool sent = SSL_connect(ssl) == 1 && SSL_write(ssl, request.data(), static_cast<int>(request.size())) > 0;
  timeval t{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof t);
  std::string got;
  char buf[4096];
  while (sent && got.size() < reset_after && !absl::StrContains(got, "data: [DONE]")) {
    const int n = SSL_read(ssl, buf, sizeof buf);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  linger l{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
  close(fd);
  SSL_free(ssl);
  SSL_CTX_free(ctx);
  return sent;
}

// Clients of the HTTPS API that vanish (reset) mid-stream or just as their
// stream ends must cost the router nothing. Subprocess gives servers
// SIGPIPE's default disposition, as a shell or a container runtime does.
// Servers ignore SIGPIPE, so a write to a reset connection fails instead
// of killing the router. A loopback reset does not reliably raise SIGPIPE,
// so this test pins reset handling in general; the Kubernetes lifecycle
// test (tests/deploy/k8s_lifecycle.py, over veth links) loads the router
// where SIGPIPE does arrive.
TEST(TlsVanishingClientTest, ClientsThatResetMidStreamCostTheRouterNothing) {
  const std::string dir = TempDir();
  Cluster c;
  const absl::Status s = c.Start(dir + "/c", /*colocated=*/true);
  ASSERT_TRUE(s.ok()) << s;
  const std::string body = R"({"prompt":"In the beginning","max_tokens":24,"ignore_eos":true,"stream":true})";
  const std::string request =
      absl::StrCat("POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n",
                   "Content-Length: ", body.size(), "\r\n\r\n", body);
  int sent = 0;
  for (int i = 0; i < 300; ++i) sent += StreamThenReset(c.http_port(), request, 1 + (i * 97) % 6000) ? 1 : 0;
  EXPECT_GT(sent, 250) << c.Logs();
  // The router still serves (a dead one fails this call).
  const Output out = c.Generate(SeededRequest(4));
  EXPECT_TRUE(out.status.ok()) << out.status.error_message() << c.Logs();
}

TEST(TlsFlagsTest, AServerWithoutTlsOrInsecureDoesNotStart) {
  const std::string dir = TempDir();
  Subprocess r;
  ASSERT_TRUE(r.Start({kBin + "/router/pdserve-router", "--model", kModel, "--decode", "127.0.0.1:1", "--colocated"},
                      dir + "/router.log")
                  .ok());
  EXPECT_EQ(r.Wait(absl::Seconds(30)), 2);
  EXPECT_TRUE(absl::StrContains(r.LogTail(), "no TLS: give --tls_cert")) << r.LogTail();
  Subprocess partial;
  ASSERT_TRUE(partial
                  .Start({kBin + "/decode_worker/pdserve-decode-worker", "--model", kModel, "--tls_cert",
                          TestTls("decode").cert},
                         dir + "/decode.log")
                  .ok());
  EXPECT_EQ(partial.Wait(absl::Seconds(30)), 2);
  EXPECT_TRUE(absl::StrContains(partial.LogTail(), "all three files")) << partial.LogTail();
}

}  // namespace
}  // namespace pdserve
