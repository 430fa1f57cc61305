// A raw KV handoff peer of a real decode worker, for tests that play a
// prefill worker (or an attacker) over its KV transport (--kv_transport;
// TCP unless a test starts the worker with ucx): a decode worker process with
// TLS and the test grant key, a handler that keeps every answer, and a
// connection that speaks the handoff protocol message by message.
#ifndef PDSERVE_TESTS_CLUSTER_KV_RAW_PEER_H_
#define PDSERVE_TESTS_CLUSTER_KV_RAW_PEER_H_

#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kv_transfer/grant.h"
#include "kv_transfer/tcp_transport.h"
#include "kv_transfer/ucx_transport.h"
#include "kv_transfer/wire.h"
#include "pdserve/v1/worker.grpc.pb.h"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {

using kv::Message;

// Speaks the raw handoff protocol; keeps every answer.
class Raw : public kv::ConnectionHandler {
 public:
  void OnMessage(kv::Connection&, std::string message) override {
    absl::StatusOr<Message> m = kv::Decode(message);
    absl::MutexLock lock(&mu_);
    if (m.ok()) messages_.push_back(*std::move(m));
  }
  void OnDisconnected(kv::Connection&, absl::Status) override {}
  // Whether any answer has come.
  bool Any() {
    absl::MutexLock lock(&mu_);
    return !messages_.empty();
  }
  // Whether an answer of type T for handoff `id` has come (kept for Await).
  template <typename T>
  bool Peek(kv::HandoffId id) {
    absl::MutexLock lock(&mu_);
    for (const Message& m : messages_) {
      if (const T* t = std::get_if<T>(&m); t != nullptr && t->id == id) return true;
    }
    return false;
  }
  template <typename T>
  std::optional<T> Await() {
    absl::MutexLock lock(&mu_);
    auto has = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      for (const Message& m : messages_) {
        if (std::holds_alternative<T>(m)) return true;
      }
      return false;
    };
    mu_.AwaitWithTimeout(absl::Condition(&has), absl::Seconds(10));
    for (auto it = messages_.begin(); it != messages_.end(); ++it) {
      if (std::holds_alternative<T>(*it)) {
        T t = std::get<T>(*it);
        messages_.erase(it);
        return t;
      }
    }
    return std::nullopt;
  }

 private:
  absl::Mutex mu_;
  std::vector<Message> messages_ ABSL_GUARDED_BY(mu_);
};

// A real decode worker (TLS, the test grant key) and where its KV receiver
// listens.
struct DecodeUnderTest {
  Subprocess process;
  int metrics_port = 0;
  std::string kv_address;
  int kv_port = 0;

  absl::Status Start(std::vector<std::string> flags, std::map<std::string, std::string> env = {}) {
    const std::string dir = TempDir();
    std::vector<std::string> argv = {kBin + "/decode_worker/pdserve-decode-worker", "--model", kModel,
                                     "--ready_file", dir + "/decode.ready"};
    for (std::string& a : TlsArgs("decode")) argv.push_back(std::move(a));
    // The raw peer's commits carry no layer checksums: a sampled check
    // would refuse some of them at random. A test's own flags come later
    // and win.
    argv.push_back("--kv_verify_handoffs=off");
    argv.insert(argv.end(), flags.begin(), flags.end());
    if (absl::Status s = process.Start(argv, dir + "/decode.log", env); !s.ok()) return s;
    absl::StatusOr<int> port = process.WaitReady(dir + "/decode.ready", absl::Seconds(60));
    if (!port.ok()) return port.status();
    metrics_port = MetricsPort(dir + "/decode.ready");
    auto stub = worker::v1::DecodeWorker::NewStub(TestChannel(absl::StrCat("127.0.0.1:", *port), "decode"));
    grpc::ClientContext ctx;
    worker::v1::WorkerInfo info;
    if (grpc::Status st = stub->Status(&ctx, {}, &info); !st.ok()) return absl::UnavailableError(st.error_message());
    kv_address = info.kv_address();
    kv_port = std::stoi(kv_address.substr(kv_address.rfind(':') + 1));
    return absl::OkStatus();
  }
  double Refusals(const std::string& reason) const {
    return MetricValue(HttpGet(metrics_port, "/metrics"),
                       absl::StrCat("pdserve_handoff_refusals_total{reason=\"", reason, "\"}"));
  }
};

// The commit of a 4-position request (tokens 1-4, first token 5).
inline kv::Commit FourPositionCommit(kv::HandoffId id, const std::string& request_id) {
  kv::Commit c;
  c.id = id;
  c.request_id = request_id;
  c.num_positions = 4;
  c.tokens = {1, 2, 3, 4};
  c.first_token = 5;
  return c;
}

// The router's grant for a 4-position request (tokens 1-4) with room for
// 60 more.
inline kv::Grant TestGrant(const kv::GrantKey& key, const std::string& request, uint32_t attempt, const std::string& sender,
                    const std::string& receiver, absl::Time expires) {
  return *kv::MintGrant(key, {.request_id = request,
                              .attempt = attempt,
                              .sender = sender,
                              .receiver = receiver,
                              .expires = expires,
                              .positions = 64,
                              .tokens_digest = kv::DigestTokens({1, 2, 3, 4})});
}

// The transport a test peer speaks: the workers' default, or UCX (for a
// worker started with --kv_transport=ucx), over whatever UCX_TLS allows or
// over its tcp transport alone (no shared-memory lanes).
enum class PeerTransport { kTcp, kUcx, kUcxTcpOnly };

inline std::unique_ptr<kv::UcxTransport> TestUcxTransport(const std::string& name, bool tcp_only) {
  if (tcp_only) setenv("UCX_TLS", "tcp", 1);
  absl::StatusOr<std::unique_ptr<kv::UcxTransport>> t = kv::UcxTransport::Create({.name = name});
  if (tcp_only) unsetenv("UCX_TLS");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

inline std::unique_ptr<kv::Transport> TestTransport(const std::string& name, PeerTransport kind) {
  if (kind != PeerTransport::kTcp) return TestUcxTransport(name, kind == PeerTransport::kUcxTcpOnly);
  absl::StatusOr<std::unique_ptr<kv::TcpTransport>> t = kv::TcpTransport::Create({.name = name});
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

// A raw handoff client of a decode worker over a transport of this
// process. Its first reservation carries no grant: refused, but the
// answer tells the receiver's layout, which the later ones present.
struct RawPeer {
  Raw raw;  // Outlives the transport, whose connection calls it.
  std::unique_ptr<kv::Transport> transport;
  kv::Connection* conn = nullptr;
  kv::ReserveRequest req;

  void Start(const DecodeUnderTest& decode, const std::string& name, PeerTransport kind = PeerTransport::kTcp) {
    Start(decode.kv_port, name, kind);
  }
  // Any KV receiver on this host (a prefill worker's pull receiver too).
  void Start(int kv_port, const std::string& name, PeerTransport kind = PeerTransport::kTcp) {
    transport = TestTransport(name, kind);
    ASSERT_NE(transport, nullptr);
    absl::StatusOr<kv::Connection*> c = transport->Connect("127.0.0.1", kv_port, &raw);
    ASSERT_TRUE(c.ok()) << c.status();
    conn = *c;
    req.num_positions = 4;
    req.prompt_tokens = {1, 2, 3, 4};
    std::optional<kv::ReserveReply> first = Reserve(1, "");
    ASSERT_TRUE(first.has_value());
    req.sender = first->receiver;
  }
  void Send(const Message& m) { transport->loop().RunSync([&] { conn->Send(kv::Encode(m)); }); }
  std::optional<kv::ReserveReply> Reserve(uint64_t tag, std::string grant) {
    req.tag = tag;
    req.grant = std::move(grant);
    Send(req);
    return raw.Await<kv::ReserveReply>();
  }
};

}  // namespace pdserve

#endif  // PDSERVE_TESTS_CLUSTER_KV_RAW_PEER_H_
