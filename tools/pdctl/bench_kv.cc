#include "tools/pdctl/bench_kv.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "kv_transfer/grant.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "model/model.h"
#include "model/synthetic_model.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/forwarding_backend.h"
#include "kv/kv_checksum.h"
#include "kv_transfer/layout_copy.h"
#include "kv_transfer/receiver.h"
#include "kv_transfer/sender.h"
#include "kv_transfer/tcp_transport.h"
#include "kv_transfer/ucx_transport.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, prompt_len, 2048, "bench-kv: prompt length in positions");
ABSL_FLAG(int, iters, 20, "bench-kv: timed handoffs (and raw put rounds)");
ABSL_FLAG(int, kv_layers, 12, "bench-kv: layers (without --model)");
ABSL_FLAG(int, kv_heads, 4, "bench-kv: KV heads (without --model); bench-attention: KV heads");
ABSL_FLAG(int, head_dim, 64, "bench-kv: head dim (without --model); bench-attention: head dim");
ABSL_FLAG(int, kv_tp, 1,
          "bench-kv: the sender's tensor-parallel ranks (without --model; the receiver's in the child)");
ABSL_FLAG(int, kv_receiver_tp, 0, "bench-kv: the receiver's tensor-parallel ranks (0: --kv-tp)");
ABSL_FLAG(bool, with_prefill, false, "bench-kv: run a real prefill forward, streaming KV per layer");
ABSL_FLAG(bool, show_lanes, false, "bench-kv: print the UCX lanes of the connection (stderr; --kv_transport=ucx)");
ABSL_FLAG(std::string, kv_transport, "tcp", "bench-kv: the KV transport both processes use, tcp or ucx (as the workers' flag)");
ABSL_FLAG(bool, kv_loop_realtime, true,
          "bench-kv: both processes' transport loops in SCHED_FIFO when permitted (as the workers' flag)");
ABSL_FLAG(bool, kv_direct_writes, true,
          "bench-kv: --kv-transport=tcp: the receiver offers direct writes to its same-host sender (as the workers' "
          "flag); false: every put is a data frame the receiver reads, as from another host");
ABSL_FLAG(std::string, kv_role, "", "bench-kv: internal, 'receive' in the child process");
ABSL_FLAG(std::string, kv_model_identity, "", "bench-kv: internal, the receiver's model identity (hex lo:hi)");
ABSL_FLAG(int, kv_blocks, 0, "bench-kv: internal, the receiver's pool size in blocks");
ABSL_FLAG(bool, kv_grants, true,
          "bench-kv: each handoff carries a grant the receiver checks (kv_transfer/grant.h), as in a TLS cluster; "
          "false: none, to see their cost");
ABSL_FLAG(std::string, kv_grant_key_file, "", "bench-kv: internal, the receiver's grant key");
ABSL_FLAG(bool, reserve_during_prefill, false,
          "bench-kv: the receiving process prefills --prompt-len tokens over and over (--threads) while "
          "reservations of its KV are timed");
ABSL_FLAG(int, receiver_cpu, -1,
          "bench-kv: pin the receiving process to this CPU, and keep the sending one off it (-1: no pinning)");
ABSL_FLAG(int, reservations, 200, "bench-kv: reservations timed by --reserve-during-prefill");
ABSL_FLAG(std::string, kv_compute_model, "", "bench-kv: internal, the model the receiving process prefills with");
ABSL_FLAG(int, kv_compute_tokens, 0, "bench-kv: internal, the receiving process's prefill length");
ABSL_FLAG(int, kv_compute_threads, 1, "bench-kv: internal, the receiving process's compute threads");

namespace pdserve::pdctl {
namespace {

using kv::Connection;
using kv::Handoff;
using kv::KvReceiver;
using kv::KvSender;
using kv::UcxTransport;

// The transport --kv_transport names (`ucx` set when it is UCX's).
absl::StatusOr<std::unique_ptr<kv::Transport>> MakeTransport(const std::string& name, UcxTransport** ucx) {
  const std::string kind = absl::GetFlag(FLAGS_kv_transport);
  if (kind == "tcp") {
    absl::StatusOr<std::unique_ptr<kv::TcpTransport>> t =
        kv::TcpTransport::Create({.name = name,
                                  .realtime_loop = absl::GetFlag(FLAGS_kv_loop_realtime),
                                  .direct_writes = absl::GetFlag(FLAGS_kv_direct_writes)});
    if (!t.ok()) return t.status();
    return std::unique_ptr<kv::Transport>(*std::move(t));
  }
  if (kind == "ucx") {
    absl::StatusOr<std::unique_ptr<UcxTransport>> t = UcxTransport::Create({.name = name, .realtime_loop = absl::GetFlag(FLAGS_kv_loop_realtime)});
    if (!t.ok()) return t.status();
    if (ucx != nullptr) *ucx = t->get();
    return std::unique_ptr<kv::Transport>(*std::move(t));
  }
  return absl::InvalidArgumentError(absl::StrCat("bench-kv: --kv_transport=", kind, ": expected tcp or ucx"));
}

// "fifo" or "normal": the class a transport's loop runs in.
const char* LoopClass(const kv::EventLoop& loop) { return loop.realtime() ? "fifo" : "normal"; }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The receiving process's own compute (--reserve-during-prefill): prefills
// of `tokens` over and over on the KV manager the receiver reserves from,
// as a decode worker's local prefill does.
class ComputeLoad {
 public:
  absl::Status Start(const std::string& model_dir, int threads, int tokens, KvManager* kv) {
    kernels::cpu::CpuBackendOptions bo;
    bo.num_threads = threads;
    auto backend = kernels::cpu::CpuBackend::Create(bo);
    if (!backend.ok()) return backend.status();
    backend_ = *std::move(backend);
    auto m = Model::Load(model_dir, {}, backend_.get());
    if (!m.ok()) return m.status();
    model_ = *std::move(m);
    tokens_.resize(tokens);
    for (int i = 0; i < tokens; ++i) tokens_[i] = 1 + (i * 31) % static_cast<int>(model_->config().vocab_size - 1);
    thread_ = std::thread([this, kv] {
      while (!stop_.HasBeenNotified()) {
        SequenceKv seq = kv->NewSequence();
        ForwardSequence fs{.kv = &seq, .tokens = tokens_, .logits = LogitsMode::kLast};
        ForwardOptions fo;
        fo.on_layer_kv_written = [this](int32_t) {
          if (!started_.HasBeenNotified()) started_.Notify();
        };
        if (absl::StatusOr<ForwardResult> r = ForwardGrowing(*model_, *kv, {&fs, 1}, fo); !r.ok()) {
          std::fprintf(stderr, "bench-kv receiver: prefill failed: %s\n", std::string(r.status().message()).c_str());
          if (!started_.HasBeenNotified()) started_.Notify();
          return;
        }
      }
    });
    started_.WaitForNotification();  // The first prefill is computing.
    return absl::OkStatus();
  }
  ~ComputeLoad() { Stop(); }
  // Ends the prefills (the one running finishes first).
  void Stop() {
    if (!stop_.HasBeenNotified()) stop_.Notify();
    if (thread_.joinable()) thread_.join();
  }

 private:
  std::unique_ptr<kernels::cpu::CpuBackend> backend_;
  std::unique_ptr<Model> model_;
  std::vector<int32_t> tokens_;
  absl::Notification started_, stop_;
  std::thread thread_;
};

// `shape` (num_kv_heads: the model's, or its model_kv_heads) held over
// `tp` ranks: split, or one head each when ranks outnumber heads.
KvCacheSpec TpShape(KvCacheSpec shape, int tp) {
  const int32_t heads = shape.ModelKvHeads();
  shape.model_kv_heads = heads;
  shape.num_ranks = tp;
  shape.num_kv_heads = tp <= heads ? heads / tp : 1;
  return shape;
}

// The receiving process: a pool of --kv-blocks, commits released at once.
// --kv_grants: the key the receiver child checks grants with, and the
// grants the sending side presents (minted as the router would, before each
// reservation and off its clock).
struct BenchGrants {
  std::shared_ptr<const kv::GrantKey> key;
  std::string receiver;  // "127.0.0.1:PORT" of the child.
  uint64_t next = 0;
  std::string last_request;  // The request the last grant is for: its commit must name it.
  // The next request's grant, for handing off `context` (no room to
  // decode beyond it).
  std::string Next(const std::vector<int32_t>& context) {
    last_request = absl::StrCat("bench-", next++);
    if (key == nullptr) return "";
    absl::StatusOr<kv::Grant> g = kv::MintGrant(*key, {.request_id = last_request,
                                                       .attempt = 1,
                                                       .sender = "127.0.0.1",
                                                       .receiver = receiver,
                                                       .expires = absl::Now() + absl::Seconds(60),
                                                       .positions = static_cast<int32_t>(context.size()),
                                                       .tokens_digest = kv::DigestTokens(context)});
    return g.ok() ? kv::EncodeGrant(*g) : "";
  }
  // A context of `n` positions that no earlier one shares a block with
  // (its first id differs), so the receiver's prefix cache never holds part
  // of it and every position is sent.
  std::vector<int32_t> UniqueContext(int32_t n) const {
    std::vector<int32_t> ids(static_cast<size_t>(n), 1);
    if (n > 0) ids[0] = static_cast<int32_t>(2 + next % 30000);
    return ids;
  }
};
BenchGrants g_grants;

// What a grant costs in this process: minting one (the router's side) and
// decoding and checking one (the decode worker's, per reservation), each a
// median of timed single calls, warm (back to back) and cold (each after
// reading 8 MiB, as between two reservations). Microseconds.
nlohmann::json TimeGrants(const kv::GrantKey& key) {
  auto us = [](absl::Time a, absl::Time b) { return absl::ToDoubleMicroseconds(b - a); };
  std::vector<double> mint, warm, cold;
  std::string encoded;
  for (int i = 0; i < 2000; ++i) {
    const absl::Time t0 = absl::Now();
    encoded = kv::EncodeGrant(*kv::MintGrant(key, {.request_id = absl::StrCat("time-", i),
                                                   .attempt = 1,
                                                   .sender = "127.0.0.1",
                                                   .receiver = "127.0.0.1:1",
                                                   .expires = absl::Now() + absl::Seconds(60),
                                                   .positions = 2048,
                                                   .tokens_digest = {}}));
    mint.push_back(us(t0, absl::Now()));
  }
  auto check = [&] {
    const absl::Time t0 = absl::Now();
    kv::GrantRefusal why;
    absl::StatusOr<kv::Grant> g = kv::DecodeGrant(encoded);
    const bool ok = g.ok() && kv::VerifyGrant(key, *g, "127.0.0.1:1", absl::Now(), &why).ok();
    const double t = us(t0, absl::Now());
    return ok ? t : -1.0;
  };
  for (int i = 0; i < 2000; ++i) warm.push_back(check());
  std::vector<char> evict(8 << 20, 1);
  int64_t sink = 0;
  for (int i = 0; i < 50; ++i) {
    for (size_t j = 0; j < evict.size(); j += 64) sink += evict[j];
    cold.push_back(check());
  }
  evict[0] = static_cast<char>(sink);
  return {{"mint_us_median", Median(mint)}, {"check_us_median_warm", Median(warm)},
          {"check_us_median_cold", Median(cold)}};
}

absl::Status RunReceiver(const KvCacheSpec& spec, const ModelIdentity& model) {
  if (const int cpu = absl::GetFlag(FLAGS_receiver_cpu); cpu >= 0) {
    // Before any thread starts: the transport's and the compute's inherit it.
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      return absl::InternalError(absl::StrCat("bench-kv: cannot pin the receiver to CPU ", cpu));
    }
  }
  auto transport = MakeTransport("bench-kv-recv", nullptr);
  if (!transport.ok()) return transport.status();
  auto pool = KvManager::Create(spec, &(*transport)->region_allocator());
  if (!pool.ok()) return pool.status();
  KvManager* p = pool->get();
  // A committed sequence's blocks go back as it goes out of scope.
  // The raw-put probe writes outside any reservation (over TCP a server's
  // receiver drops such writes); the handoffs carry grants when asked.
  kv::ReceiverOptions ro{.model = model};
  ro.writes_outside_reservations = true;
  if (const std::string key = absl::GetFlag(FLAGS_kv_grant_key_file); !key.empty()) {
    absl::StatusOr<kv::GrantKey> k = kv::GrantKey::FromFile(key);
    if (!k.ok()) return k.status();
    ro.grant_key = std::make_shared<const kv::GrantKey>(*std::move(k));
  }
  auto receiver = KvReceiver::Create(transport->get(), p, ro, [](kv::CommittedSequence) {});
  if (!receiver.ok()) return receiver.status();
  auto port = (*receiver)->Listen("127.0.0.1", 0);
  if (!port.ok()) return port.status();
  (*receiver)->SetAddress(absl::StrCat("127.0.0.1:", *port));
  auto region = (*transport)->PackRegion(p->region());
  if (!region.ok()) return region.status();
  ComputeLoad compute;
  if (const std::string dir = absl::GetFlag(FLAGS_kv_compute_model); !dir.empty()) {
    if (absl::Status s = compute.Start(dir, absl::GetFlag(FLAGS_kv_compute_threads),
                                       absl::GetFlag(FLAGS_kv_compute_tokens), p);
        !s.ok()) {
      return s;
    }
  }
  std::printf("%d %s %s\n", *port, absl::BytesToHexString(*region).c_str(), LoopClass((*transport)->loop()));
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
  }
  compute.Stop();
  receiver->reset();
  pool->reset();
  return absl::OkStatus();
}

class ReceiverProcess {
 public:
  ~ReceiverProcess() {
    if (pid_ <= 0) return;
    close(stdin_);
    int st;
    for (int i = 0; i < 200 && waitpid(pid_, &st, WNOHANG) == 0; ++i) usleep(10000);
    if (waitpid(pid_, &st, WNOHANG) == 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &st, 0);
    }
  }
  absl::Status Start(const std::vector<std::string>& args) {
    int in[2], out[2];
    if (pipe2(in, O_CLOEXEC) != 0 || pipe2(out, O_CLOEXEC) != 0) return absl::InternalError("pipe");
    pid_ = fork();
    if (pid_ == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      std::vector<char*> argv;
      std::string self = "/proc/self/exe";
      argv.push_back(self.data());
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    stdin_ = in[1];
    pollfd pfd{out[0], POLLIN, 0};
    std::string got;
    char c;
    std::vector<std::string> parts;
    // UCX may log to stdout before the answer line.
    for (int lines = 0; lines < 100; ++lines) {
      got.clear();
      while (poll(&pfd, 1, 20000) > 0 && read(out[0], &c, 1) == 1 && c != '\n') got.push_back(c);
      parts = absl::StrSplit(got, ' ');
      if (got.empty() || (parts.size() == 3 && absl::SimpleAtoi(parts[0], &port_))) break;
    }
    close(out[0]);
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &port_)) {
      return absl::UnavailableError(absl::StrCat("bench-kv: the receiver process did not start ('", got, "')"));
    }
    region_ = absl::HexStringToBytes(parts[1]);
    loop_class_ = parts[2];
    return absl::OkStatus();
  }
  int port() const { return port_; }
  const std::string& region() const { return region_; }
  // The receiver's transport loop's scheduling class (LoopClass).
  const std::string& loop_class() const { return loop_class_; }

 private:
  pid_t pid_ = -1;
  int stdin_ = -1;
  int port_ = 0;
  std::string region_;
  std::string loop_class_;
};

// Forwards to a backend and streams each layer as soon as its K/V are
// written (the forward writes layer l's KV before layer l's attention).
class StreamingBackend final : public kernels::ForwardingBackend {
 public:
  explicit StreamingBackend(kernels::Backend* inner) : ForwardingBackend(inner) {}
  void Arm(const KvStorage* storage, Handoff* h, const std::vector<int32_t>* table) {
    storage_ = storage;
    handoff_ = h;
    table_ = table;
    layer_written_.assign(storage->spec.num_layers, absl::InfinitePast());
  }
  void Disarm() { handoff_ = nullptr; }
  const std::vector<absl::Time>& layer_written() const { return layer_written_; }
  // The first layer send that failed (not Backend::status(): the forward
  // itself did not fail).
  absl::Status send_status() const { return status_; }

  void WriteKv(const kernels::KvLayerView& kv, int32_t num_kv_heads, int32_t head_dim, const float* k,
               const float* v, int64_t rows, const int32_t* blocks, const int32_t* slots) override {
    ForwardingBackend::WriteKv(kv, num_kv_heads, head_dim, k, v, rows, blocks, slots);
    if (handoff_ == nullptr) return;
    const KvCacheSpec& s = storage_->spec;
    const int64_t layer = (static_cast<char*>(kv.base) - storage_->base) /
                          (static_cast<int64_t>(s.num_blocks) * s.LayerBlockBytes());
    layer_written_[layer] = absl::Now();
    if (absl::Status st = handoff_->SendLayer(static_cast<int32_t>(layer), *table_); !st.ok() && status_.ok()) {
      status_ = st;
    }
  }

 private:
  const KvStorage* storage_ = nullptr;
  Handoff* handoff_ = nullptr;
  const std::vector<int32_t>* table_ = nullptr;
  std::vector<absl::Time> layer_written_;
  absl::Status status_;
};

}  // namespace

static double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

// The CPU the figures come from: the reservation's latency depends on the
// scheduler and the core, and the two CPU classes behave differently.
static std::string CpuModelName() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (!absl::StartsWith(line, "model name")) continue;
    const size_t colon = line.find(':');
    if (colon != std::string::npos) return std::string(absl::StripAsciiWhitespace(line.substr(colon + 1)));
  }
  return "unknown";
}

// A decode worker answers a reservation from its transport thread while its
// engine computes; the prefill worker waits on that answer before it starts.
constexpr double kReserveTargetP99Ms = 1.0;

// --reserve-during-prefill: the receiving process computes prefills of
// `prompt` tokens back to back; each timed reservation (one block, aborted
// at once) goes to it while one runs. The answer comes from its transport
// thread, which takes the KV manager's lock for bookkeeping only.
static absl::Status TimeReservationsDuringPrefill(kv::Transport* transport, KvManager& kv, const ModelIdentity& identity,
                                           const ReceiverProcess& child, int prompt, const BenchKvCommon& common) {
  KvSender sender(transport, kv.storage(), {.model = identity, .timeout = absl::Seconds(30)});
  auto conn = sender.Connect("127.0.0.1", child.port());
  if (!conn.ok()) return conn.status();
  const int n = absl::GetFlag(FLAGS_reservations);
  std::vector<double> ms;
  for (int i = -5; i < n; ++i) {
    const absl::Time t0 = absl::Now();
    std::vector<int32_t> context = g_grants.UniqueContext(1);
    std::string grant = g_grants.Next(context);
    auto h = sender.Reserve(*conn, {.num_positions = 1, .prompt_tokens = std::move(context), .grant = std::move(grant)});
    const absl::Time t1 = absl::Now();
    if (!h.ok()) return h.status();
    if (absl::Status s = (*h)->Abort(absl::CancelledError("bench-kv: timing reservations only")); !s.ok()) return s;
    if (i >= 0) ms.push_back(absl::ToDoubleMilliseconds(t1 - t0));
  }
  nlohmann::json out = {{"receiver_prefill_tokens", prompt},
                        {"receiver_threads", common.threads},
                        {"receiver_cpu", absl::GetFlag(FLAGS_receiver_cpu)},
                        {"reservations", n},
                        {"reserve_ms_p50", Quantile(ms, 0.5)},
                        {"reserve_ms_p99", Quantile(ms, 0.99)},
                        {"reserve_ms_max", Quantile(ms, 1.0)},
                        {"reserve_ms_p99_target", kReserveTargetP99Ms},
                        {"sender_loop", LoopClass(transport->loop())},
                        {"receiver_loop", child.loop_class()},
                        {"cpu", CpuModelName()}};
  if (common.json) {
    std::printf("%s\n", out.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf("bench-kv --reserve-during-prefill  receiver prefilling %d tokens back to back (%d threads%s)\n", prompt,
              common.threads,
              absl::GetFlag(FLAGS_receiver_cpu) >= 0 ? absl::StrCat(", pinned to CPU ", absl::GetFlag(FLAGS_receiver_cpu)).c_str()
                                                    : "");
  std::printf("  reservation answered   p50 %.3f ms   p99 %.3f ms   max %.3f ms   (%d reservations)\n",
              out["reserve_ms_p50"].get<double>(), out["reserve_ms_p99"].get<double>(),
              out["reserve_ms_max"].get<double>(), n);
  std::printf("  p99 target < %.0f ms: %s   (CPU: %s; transport loops: sender %s, receiver %s)\n",
              kReserveTargetP99Ms, out["reserve_ms_p99"].get<double>() < kReserveTargetP99Ms ? "met" : "MISSED",
              out["cpu"].get<std::string>().c_str(), LoopClass(transport->loop()), child.loop_class().c_str());
  return absl::OkStatus();
}

// UCX's own benchmark in the same run: ucx_perftest (ucx-utils) as a
// server and a client on loopback, ucp_am_bw with `message_bytes` messages,
// the same UCX_* environment as this process; with `error_handling`, both
// sides' endpoints have peer error handling (`-e`), as the handoff's
// control endpoint has. Its overall bandwidth in bytes/s; NotFound when
// ucx_perftest is not installed. (ucp_put_bw is not the reference: over
// tcp its target does not progress the emulated puts, and it measured
// 0.05-0.09 GB/s here against 2.4 GB/s for ucp_am_bw.)
absl::StatusOr<double> UcxPerftestBandwidth(int64_t message_bytes, int iterations, bool error_handling) {
  const char* e = error_handling ? "-e" : nullptr;
  const char* kBin = "/usr/bin/ucx_perftest";
  if (access(kBin, X_OK) != 0) return absl::NotFoundError("ucx_perftest is not installed (Debian ucx-utils)");
  // A port that was free a moment ago (perftest binds it itself).
  const int probe = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (bind(probe, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      getsockname(probe, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    close(probe);
    return absl::InternalError("no free port for ucx_perftest");
  }
  const std::string port = std::to_string(ntohs(a.sin_port));
  close(probe);
  const pid_t server = fork();
  if (server < 0) return absl::InternalError("fork failed");
  if (server == 0) {
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    execl(kBin, kBin, "-p", port.c_str(), e, static_cast<char*>(nullptr));
    _exit(127);
  }
  std::string output;
  for (int attempt = 0; attempt < 30 && output.find("Final:") == std::string::npos; ++attempt) {
    absl::SleepFor(absl::Milliseconds(100));  // The server's listen.
    const std::string cmd = absl::StrCat(kBin, " 127.0.0.1 -p ", port, " -t ucp_am_bw -s ", message_bytes, " -n ",
                                         iterations, error_handling ? " -e" : "", " 2>&1");
    FILE* f = popen(cmd.c_str(), "r");
    if (f == nullptr) break;
    output.clear();
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) output.append(buf, n);
    pclose(f);
  }
  kill(server, SIGKILL);
  waitpid(server, nullptr, 0);
  // "Final: ITERS P50 AVG OVERALL BW_AVG BW_OVERALL RATE_AVG RATE_OVERALL",
  // bandwidths in MB/s of 2^20 bytes.
  const size_t at = output.find("Final:");
  if (at == std::string::npos) return absl::InternalError(absl::StrCat("ucx_perftest gave no result: ", output));
  std::vector<std::string> fields =
      absl::StrSplit(output.substr(at + 6, output.find('\n', at) - at - 6), ' ', absl::SkipEmpty());
  double mbps = 0;
  if (fields.size() < 6 || !absl::SimpleAtod(fields[5], &mbps)) {
    return absl::InternalError(absl::StrCat("ucx_perftest's result did not parse: ", output.substr(at)));
  }
  return mbps * 1048576.0;
}

// The shared-memory reference in the same run: one request's bytes copied
// (memcpy) from a buffer of this process into a buffer as large that
// another process (a forked child) maps and has made resident, as UCX's
// shared-memory transports copy into a receiver's mapped pool; both
// buffers as large as the request, not the one reused, cache-resident
// buffer of ucx_perftest. Also what a fresh mapping costs (this process's
// first copy into pages the child made resident: a new request's pages in
// a receiver's pool), and the same after this process readied a second
// such buffer the way the sender's page warmer does.
struct CrossProcessCopy {
  double warm_bytes_per_second = 0;  // Median of `iterations` copies.
  double fresh_seconds = 0;          // The first copy into the fresh mapping.
  double ready_seconds = 0;          // ReadyPagesForWrites over the second one,
  double readied_seconds = 0;        // then the first copy into it.
};

absl::StatusOr<CrossProcessCopy> CrossProcessCopyBandwidth(int64_t bytes, int iterations) {
  std::vector<char> src(static_cast<size_t>(bytes));
  for (int64_t i = 0; i < bytes; i += 4096) src[i] = static_cast<char>(i / 4096);
  const size_t page = kv::PageBytes();
  const size_t mapped = (static_cast<size_t>(bytes) + page - 1) / page * page;
  char* shared[2];
  for (char*& m : shared) {
    void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    m = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  }
  auto unmap = [&] {
    for (char* m : shared) {
      if (m != nullptr) munmap(m, mapped);
    }
  };
  if (shared[0] == nullptr || shared[1] == nullptr) {
    unmap();
    return absl::InternalError(absl::StrCat("mmap: ", strerror(errno)));
  }
  int ready_pipe[2], done_pipe[2];
  if (pipe(ready_pipe) != 0 || pipe(done_pipe) != 0) {
    unmap();
    return absl::InternalError("pipe failed");
  }
  const pid_t child = fork();
  if (child < 0) {
    unmap();
    return absl::InternalError("fork failed");
  }
  if (child == 0) {
    // Only async-signal-safe calls here: the parent has threads.
    close(ready_pipe[0]);
    close(done_pipe[1]);
    for (char* m : shared) {
      for (size_t i = 0; i < mapped; i += 4096) m[i] = 1;  // Resident, as a pool is.
    }
    const char c = 1;
    if (write(ready_pipe[1], &c, 1) != 1) _exit(1);
    char d;
    while (read(done_pipe[0], &d, 1) < 0) {
    }
    _exit(0);
  }
  close(ready_pipe[1]);
  close(done_pipe[0]);
  char c = 0;
  const bool ready = read(ready_pipe[0], &c, 1) == 1;
  close(ready_pipe[0]);
  CrossProcessCopy out;
  std::vector<double> seconds;
  for (int i = -1; ready && i < iterations; ++i) {
    const absl::Time t0 = absl::Now();
    std::memcpy(shared[0], src.data(), static_cast<size_t>(bytes));
    (i >= 0 ? seconds.emplace_back() : out.fresh_seconds) = absl::ToDoubleSeconds(absl::Now() - t0);
  }
  if (ready) {
    const absl::Time t0 = absl::Now();
    kv::ReadyPagesForWrites(shared[1], mapped / page);
    const absl::Time t1 = absl::Now();
    std::memcpy(shared[1], src.data(), static_cast<size_t>(bytes));
    out.ready_seconds = absl::ToDoubleSeconds(t1 - t0);
    out.readied_seconds = absl::ToDoubleSeconds(absl::Now() - t1);
  }
  close(done_pipe[1]);
  waitpid(child, nullptr, 0);
  unmap();
  if (!ready) return absl::UnavailableError("the child did not map the buffers");
  std::sort(seconds.begin(), seconds.end());
  out.warm_bytes_per_second = static_cast<double>(bytes) / seconds[seconds.size() / 2];
  return out;
}

absl::Status RunBenchKv(const BenchKvCommon& common) {
  absl::StatusOr<DType> kv_dtype = ParseDType(common.kv.empty() ? "bf16" : common.kv);
  if (!kv_dtype.ok()) return kv_dtype.status();
  const int prompt = absl::GetFlag(FLAGS_prompt_len);
  const int iters = absl::GetFlag(FLAGS_iters);
  const bool with_prefill = absl::GetFlag(FLAGS_with_prefill);
  const bool reserve_during_prefill = absl::GetFlag(FLAGS_reserve_during_prefill);
  if (prompt < 1 || iters < 1) return absl::InvalidArgumentError("--prompt-len and --iters must be positive");
  const int32_t blocks = (prompt + common.block_size - 1) / common.block_size + 1;

  if (absl::GetFlag(FLAGS_kv_role) == "receive") {
    std::vector<std::string> id = absl::StrSplit(absl::GetFlag(FLAGS_kv_model_identity), ':');
    ModelIdentity model;
    if (id.size() != 2 || !absl::SimpleHexAtoi(id[0], &model.lo) || !absl::SimpleHexAtoi(id[1], &model.hi)) {
      return absl::InvalidArgumentError("--kv-model-identity must be LO:HI in hex");
    }
    const KvCacheSpec spec = TpShape({.num_layers = absl::GetFlag(FLAGS_kv_layers),
                                      .num_kv_heads = absl::GetFlag(FLAGS_kv_heads),
                                      .head_dim = absl::GetFlag(FLAGS_head_dim), .block_size = common.block_size,
                                      .dtype = *kv_dtype, .num_blocks = absl::GetFlag(FLAGS_kv_blocks)},
                                     absl::GetFlag(FLAGS_kv_tp));
    return RunReceiver(spec, model);
  }

  if (const int cpu = absl::GetFlag(FLAGS_receiver_cpu); cpu >= 0) {
    // The sender keeps off the receiver's CPU (where one is left), so that
    // what is timed is the receiver answering beside its own compute, not
    // the sender's threads queued behind that compute.
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_ISSET(cpu, &set) && CPU_COUNT(&set) > 1) {
      CPU_CLR(cpu, &set);
      (void)sched_setaffinity(0, sizeof(set), &set);
    }
  }
  UcxTransport* ucx = nullptr;
  auto transport = MakeTransport("bench-kv-send", &ucx);
  if (!transport.ok()) return transport.status();

  // The model (with --with-prefill or --model) or a bare shape.
  std::unique_ptr<kernels::cpu::CpuBackend> cpu;
  std::unique_ptr<StreamingBackend> streaming;
  std::unique_ptr<Model> model;
  const int send_tp = absl::GetFlag(FLAGS_kv_tp);
  const int receive_tp = absl::GetFlag(FLAGS_kv_receiver_tp) > 0 ? absl::GetFlag(FLAGS_kv_receiver_tp) : send_tp;
  KvCacheSpec spec = TpShape({.num_layers = absl::GetFlag(FLAGS_kv_layers),
                              .num_kv_heads = absl::GetFlag(FLAGS_kv_heads),
                              .head_dim = absl::GetFlag(FLAGS_head_dim), .block_size = common.block_size,
                              .dtype = *kv_dtype, .num_blocks = blocks},
                             send_tp);
  ModelIdentity identity = HashBytes(absl::StrCat("bench-kv shape ", spec.num_layers, "x", spec.num_kv_heads, "x",
                                                  spec.head_dim));
  std::string model_dir = common.model_dir;
  if (with_prefill || reserve_during_prefill || !model_dir.empty()) {
    if (send_tp != 1 || receive_tp != 1) {
      return absl::InvalidArgumentError("bench-kv: --kv-tp and --kv-receiver-tp take the shape flags, not a model");
    }
    if (model_dir.empty()) {
      model_dir = MakeTempDir("bench-kv-model");
      RandomModelSpec rs = Llama125MSpec();
      rs.dtype = DType::kBF16;
      if (absl::Status s = WriteRandomModel(model_dir, rs); !s.ok()) return s;
    }
    kernels::cpu::CpuBackendOptions bo;
    bo.num_threads = common.threads;
    auto backend = kernels::cpu::CpuBackend::Create(bo);
    if (!backend.ok()) return backend.status();
    cpu = *std::move(backend);
    streaming = std::make_unique<StreamingBackend>(cpu.get());
    auto m = Model::Load(model_dir, {}, streaming.get());
    if (!m.ok()) return m.status();
    model = *std::move(m);
    spec = model->MakeKvSpec(*kv_dtype, common.block_size, blocks);
    identity = model->identity();
  }
  if (absl::Status s = spec.Validate(); !s.ok()) return s;
  auto pool = KvManager::Create(spec, &(*transport)->region_allocator());
  if (!pool.ok()) return pool.status();
  KvManager& p = **pool;
  {
    auto* bytes = static_cast<unsigned char*>(p.region().data());
    for (size_t i = 0; i < p.region().size(); i += 4096) bytes[i] = static_cast<unsigned char>(i >> 12);
  }

  ReceiverProcess child;
  std::vector<std::string> child_args = {
      "bench-kv", "--kv_role=receive", absl::StrCat("--kv_layers=", spec.num_layers),
      absl::StrCat("--kv_heads=", spec.ModelKvHeads()), absl::StrCat("--head_dim=", spec.head_dim),
      absl::StrCat("--kv_tp=", receive_tp),
      absl::StrCat("--kv=", DTypeName(spec.dtype)), absl::StrCat("--block_size=", spec.block_size),
      // Room for the handoffs, and for the receiver's own prefill.
      absl::StrCat("--kv_blocks=", (reserve_during_prefill ? 2 * blocks : blocks) + 8),
      absl::StrFormat("--kv_model_identity=%x:%x", identity.lo, identity.hi),
      absl::StrCat("--receiver_cpu=", absl::GetFlag(FLAGS_receiver_cpu)),
      absl::StrCat("--kv_transport=", absl::GetFlag(FLAGS_kv_transport)),
      absl::StrCat("--kv_loop_realtime=", absl::GetFlag(FLAGS_kv_loop_realtime) ? "true" : "false"),
      absl::StrCat("--kv_direct_writes=", absl::GetFlag(FLAGS_kv_direct_writes) ? "true" : "false")};
  std::string grant_key_path;
  if (absl::GetFlag(FLAGS_kv_grants)) {
    // A fresh random key for this run, readable by its owner only.
    std::string key(32, '\0');
    std::FILE* r = std::fopen("/dev/urandom", "rb");
    if (r == nullptr || std::fread(key.data(), 1, key.size(), r) != key.size()) {
      if (r != nullptr) std::fclose(r);
      return absl::InternalError("bench-kv: cannot read /dev/urandom for a grant key");
    }
    std::fclose(r);
    key = absl::BytesToHexString(key);
    char path[] = "/tmp/pdserve-bench-kv-grant-XXXXXX";
    const int fd = mkstemp(path);
    if (fd < 0 || write(fd, key.data(), key.size()) != static_cast<ssize_t>(key.size())) {
      return absl::InternalError("bench-kv: cannot write the grant key file");
    }
    close(fd);
    grant_key_path = path;
    g_grants.key = std::make_shared<const kv::GrantKey>(*kv::GrantKey::FromBytes(key));
    child_args.push_back(absl::StrCat("--kv_grant_key_file=", grant_key_path));
  }
  if (reserve_during_prefill) {
    child_args.push_back(absl::StrCat("--kv_compute_model=", model_dir));
    child_args.push_back(absl::StrCat("--kv_compute_tokens=", prompt));
    child_args.push_back(absl::StrCat("--kv_compute_threads=", common.threads));
  }
  absl::Status started = child.Start(child_args);
  if (!grant_key_path.empty()) unlink(grant_key_path.c_str());  // The child has read it.
  if (!started.ok()) return started;
  g_grants.receiver = absl::StrCat("127.0.0.1:", child.port());
  if (reserve_during_prefill) return TimeReservationsDuringPrefill(transport->get(), p, identity, child, prompt, common);

  nlohmann::json out;
  {
    KvSender sender(transport->get(), p.storage(), {.model = identity, .timeout = absl::Seconds(30)});
    auto conn = sender.Connect("127.0.0.1", child.port());
    if (!conn.ok()) return conn.status();
    SequenceKv seq = p.NewSequence();
    if (absl::Status s = p.Grow(seq, prompt); !s.ok()) return s;
    seq.SetNumPositions(0);
    // What lands: every receiver rank's blocks of every layer, one put per
    // layer and receiver rank (the receiver's layout, packed by the sender
    // when the layouts differ).
    KvCacheSpec rspec = TpShape(spec, receive_tp);
    rspec.num_blocks = (reserve_during_prefill ? 2 * blocks : blocks) + 8;
    const int64_t rank_layer_bytes = static_cast<int64_t>(seq.block_table().size()) * rspec.LayerBlockBytes();
    const int64_t bytes_moved = rank_layer_bytes * rspec.num_ranks * spec.num_layers;
    const int64_t layer_bytes = rank_layer_bytes;

    // The handoff: reserve, every layer, commit.
    // Reserve happens when the prefill starts (off the critical path); the
    // stream (first put issued -> commit acknowledged) is what the user waits
    // for after the last layer, so bandwidth is judged on it.
    std::vector<double> handoff_s, stream_s, reserve_s, commit_s;
    for (int i = -2; i < iters; ++i) {
      std::vector<int32_t> context = g_grants.UniqueContext(prompt);
      std::string grant = g_grants.Next(context);
      const absl::Time t0 = absl::Now();
      auto h = sender.Reserve(*conn, {.num_positions = prompt, .prompt_tokens = context, .grant = std::move(grant)});
      if (!h.ok()) return h.status();
      const absl::Time t1 = absl::Now();
      for (int32_t l = 0; l < spec.num_layers; ++l) {
        if (absl::Status s = (*h)->SendLayer(l, seq.block_table()); !s.ok()) return s;
      }
      kv::Commit c;
      c.request_id = g_grants.last_request;
      c.num_positions = prompt;
      c.tokens = std::move(context);
      c.first_token = 1;
      const absl::Time t2 = absl::Now();
      if (absl::Status s = (*h)->Commit(std::move(c)); !s.ok()) return s;
      const absl::Time t3 = absl::Now();
      if (i >= 0) {
        handoff_s.push_back(absl::ToDoubleSeconds(t3 - t0));
        stream_s.push_back(absl::ToDoubleSeconds(t3 - t1));
        reserve_s.push_back(absl::ToDoubleSeconds(t1 - t0));
        commit_s.push_back(absl::ToDoubleSeconds(t3 - t2));
      }
    }

    if (absl::GetFlag(FLAGS_show_lanes) && ucx != nullptr) {
      std::fprintf(stderr, "%s", ucx->Describe(*conn).c_str());
    }
    // Raw transport puts of the same sizes (one per layer) into the receiver's
    // pool, then a flush: no protocol, same worker and connection.
    std::vector<double> raw_s;
    {
      kv::Transport* t = transport->get();
      Connection* c = *conn;
      // What the receiver hands this connection: the whole descriptor when
      // it lets this same-host sender write directly, else the base alone.
      const std::string region =
          absl::GetFlag(FLAGS_kv_direct_writes) ? child.region() : t->WithoutRemoteKey(child.region());
      auto remote = t->loop().RunSync([&] { return c->ImportRegion(region); });
      if (!remote.ok()) return remote.status();
      const char* base = p.storage().base;
      for (int i = -2; i < iters; ++i) {
        std::promise<absl::Status> done;
        auto fut = done.get_future();
        const absl::Time t0 = absl::Now();
        t->loop().Post([&] {
          auto left = std::make_shared<int>(spec.num_layers * rspec.num_ranks);
          auto err = std::make_shared<absl::Status>();
          for (int32_t l = 0; l < spec.num_layers; ++l) {
            for (int32_t r = 0; r < rspec.num_ranks; ++r) {
              t->loop().AddBusy(1);
              // Any of the sender's bytes: the sizes and places are the point.
              c->Put(base, layer_bytes, **remote, kv::LayerBlockOffset(rspec, l, 0, r),
                     [&, left, err](absl::Status s) {
                       t->loop().AddBusy(-1);
                       if (!s.ok()) *err = s;
                       if (--*left == 0) c->Flush([&, err](absl::Status s) { done.set_value(err->ok() ? s : *err); });
                     });
            }
          }
        });
        if (absl::Status s = fut.get(); !s.ok()) return s;
        if (i >= 0) raw_s.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
      }
      t->loop().RunSync([&] { remote->reset(); });
    }
    seq.Release();

    const double h_med = Median(handoff_s), raw_med = Median(raw_s), stream_med = Median(stream_s);
    const char* tls = std::getenv("UCX_TLS");
    out = {{"transport", absl::GetFlag(FLAGS_kv_transport)},
           {"direct_writes", absl::GetFlag(FLAGS_kv_direct_writes)},
           {"ucx_tls", ucx == nullptr ? "(not used)" : tls ? tls : "(default)"},
           {"layers", spec.num_layers},
           {"kv_heads", spec.ModelKvHeads()},
           {"sender_tp", spec.num_ranks},
           {"receiver_tp", rspec.num_ranks},
           {"head_dim", spec.head_dim},
           {"kv_dtype", std::string(DTypeName(spec.dtype))},
           {"block_size", spec.block_size},
           {"prompt_len", prompt},
           {"bytes_per_request", bytes_moved},
           {"put_bytes_per_layer", layer_bytes},
           {"iters", iters},
           {"handoff_ms_median", h_med * 1e3},
           {"reserve_ms_median", Median(reserve_s) * 1e3},
           {"grants", g_grants.key != nullptr},
           {"grant_costs", g_grants.key != nullptr ? TimeGrants(*g_grants.key) : nlohmann::json()},
           {"stream_commit_ms_median", stream_med * 1e3},
           {"commit_ms_median", Median(commit_s) * 1e3},
           {"handoff_gbps", bytes_moved / stream_med / 1e9},
           {"raw_put_ms_median", raw_med * 1e3},
           {"raw_put_gbps", bytes_moved / raw_med / 1e9},
           {"handoff_vs_raw", raw_med / stream_med}};
    // UCX's own benchmark for the same transport and message size, under
    // `key` (its bandwidth, the handoff's ratio to it, or why it did not run).
    auto perftest_into = [&](bool error_handling, const std::string& key) {
      absl::StatusOr<double> perftest = UcxPerftestBandwidth(layer_bytes, iters * spec.num_layers, error_handling);
      if (!perftest.ok()) {
        out[key + "_error"] = std::string(perftest.status().message());
        return;
      }
      out[key + "_am_gbps"] = *perftest / 1e9;
      out["handoff_vs_" + key] = bytes_moved / stream_med / *perftest;
    };
    if (ucx != nullptr) perftest_into(false, "ucx_perftest");
    // Where the KV goes by active messages on the control endpoint (no
    // shared memory with the peer), that endpoint has peer error handling;
    // ucx_perftest measured slower with it over tcp here (-e 3.6-4.2 GB/s
    // against 4.8-6.6 without): the same benchmark with it, as a second
    // reference.
    if (ucx != nullptr && !(*conn)->PeerMayMapMemory()) perftest_into(true, "ucx_perftest_peer_errors");
    // The shared-memory limit: the same bytes copied once between processes.
    if (absl::StatusOr<CrossProcessCopy> copy = CrossProcessCopyBandwidth(bytes_moved, iters); copy.ok()) {
      out["cross_process_copy_gbps"] = copy->warm_bytes_per_second / 1e9;
      out["handoff_vs_cross_process_copy"] = bytes_moved / stream_med / copy->warm_bytes_per_second;
      out["fresh_mapping_first_copy_ms"] = copy->fresh_seconds * 1e3;
      out["fresh_mapping_ready_ms"] = copy->ready_seconds * 1e3;
      out["fresh_mapping_readied_copy_ms"] = copy->readied_seconds * 1e3;
    } else {
      out["cross_process_copy_error"] = std::string(copy.status().message());
    }
    // A verified handoff (--kv_verify_handoffs) hashes its bytes once on
    // each side (LayerChecksum, one thread): that rate beside one thread's
    // read rate from DRAM, sampled alternately in this run, and the two
    // sides' hashing as a share of the handoff.
    {
      kernels::cpu::CpuBackendOptions bo;
      bo.num_threads = 1;
      absl::StatusOr<std::unique_ptr<kernels::cpu::CpuBackend>> one = kernels::cpu::CpuBackend::Create(bo);
      if (!one.ok()) return one.status();
      kernels::cpu::CpuBackend::ReadProbe probe(one->get(), size_t{256} << 20);
      const KvStorage pool = p.storage();
      SequenceKv request = p.NewSequence();  // A request's blocks, as the handoff's.
      if (absl::Status s = p.Grow(request, prompt); !s.ok()) return s;
      const std::vector<int32_t>& table = request.block_table();
      const int64_t hashed = static_cast<int64_t>(table.size()) * spec.LayerBlockBytes() * spec.num_layers * spec.num_ranks;
      std::vector<double> hash_s, read_bps;
      uint64_t sink = 0;
      for (int i = 0; i < std::max(5, iters / 2); ++i) {
        const absl::Time t0 = absl::Now();
        for (int32_t l = 0; l < spec.num_layers; ++l) {
          sink ^= LayerChecksum(pool, l, table, 0, static_cast<int32_t>(table.size()));
        }
        hash_s.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
        read_bps.push_back(probe.Sample());
      }
      out["checksum_sink"] = sink;  // Kept, so the hashing is not elided.
      out["checksum_bytes"] = hashed;
      out["checksum_ms_median"] = Median(hash_s) * 1e3;
      out["checksum_gbps"] = static_cast<double>(hashed) / Median(hash_s) / 1e9;
      out["read_gbps_one_thread"] = Median(read_bps) / 1e9;
      out["checksum_both_sides_vs_handoff"] = 2 * Median(hash_s) / h_med;
    }

    if (with_prefill) {
      std::vector<int32_t> tokens(prompt);
      for (int i = 0; i < prompt; ++i) tokens[i] = 1 + (i * 31) % static_cast<int>(model->config().vocab_size - 1);
      std::vector<double> unhidden, forward_s, after_forward;
      (void)(*transport)->loop().TakeLongestStall();  // From here on.
      for (int i = -1; i < std::min(iters, 3); ++i) {
        SequenceKv s = p.NewSequence();
        if (absl::Status st = p.Grow(s, prompt); !st.ok()) return st;
        // No prefix held from an earlier round.
        tokens[0] = 1 + static_cast<int32_t>(g_grants.next % static_cast<uint64_t>(model->config().vocab_size - 1));
        std::string grant = g_grants.Next(tokens);
        auto h = sender.Reserve(*conn, {.num_positions = prompt, .prompt_tokens = tokens, .grant = std::move(grant)});
        if (!h.ok()) return h.status();
        streaming->Arm(&p.storage(), h->get(), &s.block_table());
        const absl::Time t0 = absl::Now();
        kv::Commit c;
        c.request_id = g_grants.last_request;
        ForwardSequence fs{.kv = &s, .tokens = tokens, .logits = LogitsMode::kLast};
        auto r = model->Forward(p.storage(), absl::MakeConstSpan(&fs, 1));
        const absl::Time t_forward = absl::Now();
        streaming->Disarm();
        if (!r.ok()) return r.status();
        if (!streaming->send_status().ok()) return streaming->send_status();
        const auto last = r->Last(0);
        c.first_token = static_cast<int32_t>(std::max_element(last.begin(), last.end()) - last.begin());
        c.num_positions = prompt;
        c.tokens = tokens;
        c.generated = 1;
        if (absl::Status st = (*h)->Commit(std::move(c)); !st.ok()) return st;
        const absl::Time t_acked = absl::Now();
        s.Release();
        if (i < 0) continue;
        unhidden.push_back(absl::ToDoubleSeconds(t_acked - streaming->layer_written().back()));
        after_forward.push_back(absl::ToDoubleSeconds(t_acked - t_forward));
        forward_s.push_back(absl::ToDoubleSeconds(t_forward - t0));
      }
      out["prefill_forward_ms"] = Median(forward_s) * 1e3;
      out["unhidden_ms"] = Median(after_forward) * 1e3;
      out["transport_longest_stall_ms"] = absl::ToDoubleMilliseconds((*transport)->loop().TakeLongestStall());
      out["ack_after_last_layer_kv_written_ms"] = Median(unhidden) * 1e3;
      out["one_layer_transfer_ms"] = raw_med / spec.num_layers * 1e3;
    }
  }

  if (common.json) {
    std::printf("%s\n", out.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf("bench-kv  transport %s, UCX_TLS=%s  %d layers x %d KV heads x %d dim, %s KV, block %d, prompt %d, TP %d -> %d, "
              "grants %s\n",
              out["transport"].get<std::string>().c_str(), out["ucx_tls"].get<std::string>().c_str(), spec.num_layers, spec.ModelKvHeads(), spec.head_dim,
              std::string(DTypeName(spec.dtype)).c_str(), spec.block_size, prompt, out["sender_tp"].get<int>(),
              out["receiver_tp"].get<int>(), out["grants"].get<bool>() ? "on" : "off (--kv_grants=false)");
  const int receiver_ranks = out["receiver_tp"].get<int>();
  std::printf("  bytes per request        %10.2f MiB  (%d puts of %.2f MiB, one per layer%s)\n",
              out["bytes_per_request"].get<double>() / 1048576, spec.num_layers * receiver_ranks,
              out["put_bytes_per_layer"].get<double>() / 1048576, receiver_ranks > 1 ? " and receiver rank" : "");
  std::printf("  per request (median of %d) %8.3f ms                (reserve %.3f ms + stream + commit ack)\n", iters,
              out["handoff_ms_median"].get<double>(), out["reserve_ms_median"].get<double>());
  if (const nlohmann::json& g = out["grant_costs"]; g.is_object()) {
    std::printf("  grant (in-process)        mint %.1f us, check %.1f us warm / %.1f us cold (medians)\n",
                g["mint_us_median"].get<double>(), g["check_us_median_warm"].get<double>(),
                g["check_us_median_cold"].get<double>());
  }
  std::printf("  handoff stream + commit  %10.3f ms   %7.2f GB/s  (first put -> flush -> commit acknowledged)\n",
              out["stream_commit_ms_median"].get<double>(), out["handoff_gbps"].get<double>());
  std::printf("    of which commit          %10.3f ms                (after the last SendLayer: puts still in flight, flush, commit ack)\n",
              out["commit_ms_median"].get<double>());
  std::printf("  raw puts + flush         %10.3f ms   %7.2f GB/s  (same sizes, same connection)\n",
              out["raw_put_ms_median"].get<double>(), out["raw_put_gbps"].get<double>());
  std::printf("  handoff / raw bandwidth  %10.1f %%\n", 100 * out["handoff_vs_raw"].get<double>());
  if (out.contains("ucx_perftest_am_gbps")) {
    std::printf("  ucx_perftest ucp_am_bw   %10s      %7.2f GB/s  (same transport and message size; handoff at %.1f %%)\n",
                "", out["ucx_perftest_am_gbps"].get<double>(), 100 * out["handoff_vs_ucx_perftest"].get<double>());
  } else if (out.contains("ucx_perftest_error")) {
    std::printf("  ucx_perftest: %s\n", out["ucx_perftest_error"].get<std::string>().c_str());
  }
  if (out.contains("ucx_perftest_peer_errors_am_gbps")) {
    std::printf("  ucx_perftest ucp_am_bw -e%10s    %7.2f GB/s  (the same with peer error handling, as the handoff's endpoint has; handoff at %.1f %%)\n",
                "", out["ucx_perftest_peer_errors_am_gbps"].get<double>(),
                100 * out["handoff_vs_ucx_perftest_peer_errors"].get<double>());
  } else if (out.contains("ucx_perftest_peer_errors_error")) {
    std::printf("  ucx_perftest -e: %s\n", out["ucx_perftest_peer_errors_error"].get<std::string>().c_str());
  }

  if (out.contains("cross_process_copy_gbps")) {
    std::printf("  cross-process copy       %10s      %7.2f GB/s  (memcpy of the request's bytes into another "
                "process's mapped buffer as large; handoff at %.1f %%)\n",
                "", out["cross_process_copy_gbps"].get<double>(),
                100 * out["handoff_vs_cross_process_copy"].get<double>());
    std::printf("  fresh mapping            first copy %.1f ms; readied (%.1f ms, as the sender's page warmer does) "
                "then first copy %.1f ms\n",
                out["fresh_mapping_first_copy_ms"].get<double>(), out["fresh_mapping_ready_ms"].get<double>(),
                out["fresh_mapping_readied_copy_ms"].get<double>());
  } else {
    std::printf("  cross-process copy: %s\n", out["cross_process_copy_error"].get<std::string>().c_str());
  }
  std::printf("  checksum (XXH3-64)       %10.3f ms     %7.2f GB/s  (one thread over the request's %.1f MiB; one "
              "thread's DRAM read %.2f GB/s; both sides' hashing = %.1f %% of the handoff)\n",
              out["checksum_ms_median"].get<double>(), out["checksum_gbps"].get<double>(),
              out["checksum_bytes"].get<double>() / (1 << 20), out["read_gbps_one_thread"].get<double>(),
              100 * out["checksum_both_sides_vs_handoff"].get<double>());
  if (with_prefill) {
    std::printf("  prefill forward          %10.3f ms\n", out["prefill_forward_ms"].get<double>());
    std::printf("  unhidden: commit ack - last layer computed %8.3f ms  (one layer's raw transfer %.3f ms)\n",
                out["unhidden_ms"].get<double>(), out["one_layer_transfer_ms"].get<double>());
    std::printf("  (commit ack - last layer's K/V written %.3f ms: includes that layer's attention, MLP and the logits)\n",
                out["ack_after_last_layer_kv_written_ms"].get<double>());
    std::printf("  transport thread's longest stall during the prefills %.3f ms\n",
                out["transport_longest_stall_ms"].get<double>());
  }
  return absl::OkStatus();
}

}  // namespace pdserve::pdctl
