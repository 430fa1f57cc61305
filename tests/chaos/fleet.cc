#include "tests/chaos/fleet.h"

#include <signal.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"

namespace pdserve::chaos {
namespace {

constexpr int kRestartAttempts = 5;

int MetricsPort(const std::string& ready_file) {
  std::ifstream f(ready_file);
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  return j.is_object() && j.contains("metrics_port") ? j["metrics_port"].get<int>() : 0;
}

// A server's TLS flags for `role` (--insecure without certificates).
std::vector<std::string> TlsFlags(const std::string& certs_dir, const std::string& role) {
  if (certs_dir.empty()) return {"--insecure"};
  std::vector<std::string> flags = {"--tls_cert", absl::StrCat(certs_dir, "/", role, ".pem"), "--tls_key",
                                    absl::StrCat(certs_dir, "/", role, ".key"), "--tls_ca", certs_dir + "/ca.pem"};
  // KV grants: the router mints, the workers check (handoffs on decode
  // workers, prefix pulls on prefill workers).
  if (role == "router" || role == "decode" || role == "prefill") {
    flags.push_back("--kv_grant_key");
    flags.push_back(certs_dir + "/kv_grant.key");
  }
  return flags;
}

}  // namespace

Fleet::Fleet(FleetOptions options) : options_(std::move(options)) {
  const std::string grace = absl::StrCat(options_.drain_grace_s);
  for (int i = 0; i < options_.num_prefill + options_.num_decode; ++i) {
    Worker w;
    w.role = i < options_.num_prefill ? Role::kPrefill : Role::kDecode;
    const bool prefill = w.role == Role::kPrefill;
    w.name = absl::StrCat(prefill ? "prefill" : "decode", prefill ? i : i - options_.num_prefill);
    w.argv = {prefill ? options_.bin_dir + "/prefill_worker/pdserve-prefill-worker"
                      : options_.bin_dir + "/decode_worker/pdserve-decode-worker",
              "--model",
              options_.model_dir,
              "--prefill_chunk",
              "32",
              "--drain_grace_s",
              grace};
    for (std::string& f : TlsFlags(options_.certs_dir, prefill ? "prefill" : "decode")) w.argv.push_back(std::move(f));
    w.argv.insert(w.argv.end(), options_.extra_worker_flags.begin(), options_.extra_worker_flags.end());
    if (options_.kv_tier2) {
      w.argv.push_back("--kv_tier2_dir");
      w.argv.push_back(absl::StrCat(options_.dir, "/", w.name, ".tier2"));
    }
    w.ready_file = absl::StrCat(options_.dir, "/", w.name, ".ready");
    workers_.push_back(std::move(w));
  }
}

Fleet::~Fleet() {
  router_.Kill();
  for (Worker& w : workers_) {
    if (w.process != nullptr) w.process->Kill();
  }
}

absl::Status Fleet::Launch(Worker& w, const std::string& listen) {
  std::filesystem::remove(w.ready_file);
  w.logs.push_back(w.logs.empty() ? absl::StrCat(options_.dir, "/", w.name, ".log")
                                  : absl::StrCat(options_.dir, "/", w.name, ".r", w.logs.size(), ".log"));
  std::vector<std::string> argv = w.argv;
  argv.insert(argv.end(), {"--listen", listen, "--ready_file", w.ready_file});
  w.process = std::make_unique<testing_support::Subprocess>();
  return w.process->Start(argv, w.logs.back());
}

absl::Status Fleet::Start() {
  std::filesystem::create_directories(options_.dir);
  // All workers load their model at once; then each ready file is awaited.
  for (Worker& w : workers_) {
    if (absl::Status s = Launch(w, "127.0.0.1:0"); !s.ok()) return s;
  }
  std::vector<std::string> prefill, decode;
  for (Worker& w : workers_) {
    absl::StatusOr<int> port = w.process->WaitReady(w.ready_file, options_.ready_timeout);
    if (!port.ok()) return absl::UnavailableError(absl::StrCat(w.name, ": ", port.status().message()));
    w.grpc_port = *port;
    (w.role == Role::kPrefill ? prefill : decode).push_back(absl::StrCat("127.0.0.1:", *port));
  }
  const std::string ready = options_.dir + "/router.ready";
  router_log_ = options_.dir + "/router.log";
  std::vector<std::string> argv = {options_.bin_dir + "/router/pdserve-router",
                                         "--model",
                                         options_.model_dir,
                                         "--prefill",
                                         absl::StrJoin(prefill, ","),
                                         "--decode",
                                         absl::StrJoin(decode, ","),
                                         "--ready_file",
                                         ready,
                                         "--http_listen",
                                         "127.0.0.1:0"};
  for (std::string& f : TlsFlags(options_.certs_dir, "router")) argv.push_back(std::move(f));
  argv.insert(argv.end(), options_.extra_router_flags.begin(), options_.extra_router_flags.end());
  if (absl::Status s = router_.Start(argv, router_log_); !s.ok()) return s;
  absl::StatusOr<int> port = router_.WaitReady(ready, options_.ready_timeout);
  if (!port.ok()) return absl::UnavailableError(absl::StrCat("router: ", port.status().message()));
  router_address_ = absl::StrCat("127.0.0.1:", *port);
  router_metrics_port_ = MetricsPort(ready);
  return absl::OkStatus();
}

StopResult Fleet::Stop(int i, int sig) {
  Worker& w = workers_[i];
  StopResult r;
  const absl::Time t0 = absl::Now();
  w.process->Signal(sig);
  const absl::Duration patience =
      sig == SIGTERM ? absl::Seconds(options_.drain_grace_s) + absl::Seconds(5) : absl::Seconds(5);
  r.exit_status = w.process->Wait(patience);
  if (r.exit_status == -1) {
    r.escalated = true;
    w.process->Signal(SIGKILL);
    r.exit_status = w.process->Wait(absl::Seconds(10));
  }
  r.took = absl::Now() - t0;
  w.process.reset();
  return r;
}

absl::Status Fleet::Restart(int i) {
  Worker& w = workers_[i];
  const std::string listen = absl::StrCat("127.0.0.1:", w.grpc_port);
  absl::Status last;
  for (int attempt = 0; attempt < kRestartAttempts; ++attempt) {
    if (attempt > 0) absl::SleepFor(absl::Milliseconds(200) * attempt);  // Back off: the port may still be held.
    last = Launch(w, listen);
    if (!last.ok()) continue;
    absl::StatusOr<int> port = w.process->WaitReady(w.ready_file, options_.ready_timeout);
    if (port.ok() && *port == w.grpc_port) return absl::OkStatus();
    last = port.ok() ? absl::InternalError(absl::StrCat(w.name, " came back on port ", *port, ", not ", w.grpc_port))
                     : absl::Status(port.status().code(), absl::StrCat(w.name, ": ", port.status().message()));
    w.process->Kill();
  }
  w.process.reset();
  return last;
}

std::string Fleet::Tail(const std::string& path, size_t bytes) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string s = ss.str();
  return s.size() > bytes ? s.substr(s.size() - bytes) : s;
}

std::string Fleet::Grep(const std::string& needle) const {
  std::vector<std::string> logs = {router_log_};
  for (const Worker& w : workers_) logs.insert(logs.end(), w.logs.begin(), w.logs.end());
  std::string out;
  for (const std::string& log : logs) {
    std::ifstream f(log);
    const std::string name = std::filesystem::path(log).filename();
    for (std::string line; std::getline(f, line);) {
      if (line.find(needle) != std::string::npos) absl::StrAppend(&out, name, ": ", line, "\n");
    }
  }
  return out;
}

}  // namespace pdserve::chaos
