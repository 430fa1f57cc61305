// The chaos run's cluster: prefill and decode workers behind one router,
// real processes on loopback, each writing JSON-line logs to a file under
// the run's directory. Any worker can be stopped (SIGKILL, or SIGTERM and a
// drain) and started again on the same gRPC port, since the router's worker
// list is fixed at its start; a decode worker's KV port changes, and the
// router learns the new one by polling.
//
// Thread safety: none; one thread at a time. Ownership: the Fleet owns its
// processes and SIGKILLs any still running when it goes away.
#ifndef PDSERVE_TESTS_CHAOS_FLEET_H_
#define PDSERVE_TESTS_CHAOS_FLEET_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "tests/support/subprocess.h"

namespace pdserve::chaos {

enum class Role { kPrefill, kDecode };

struct FleetOptions {
  std::string bin_dir;    // The build directory holding router/, prefill_worker/, decode_worker/.
  std::string model_dir;  // Served by every process.
  std::string dir;        // Ready files and logs go here.
  int num_prefill = 2;
  int num_decode = 2;
  double drain_grace_s = 2;                     // Workers' --drain_grace_s: SIGTERM drain before in-flight work moves.
  std::vector<std::string> extra_worker_flags;  // Appended to every worker's command line.
  std::vector<std::string> extra_router_flags;  // Appended to the router's.
  // Each worker keeps a prefix cache second tier in a directory of its own
  // under `dir` (--kv_tier2_dir), reopened by its restarts.
  bool kv_tier2 = false;
  // deploy/make_certs.sh's output: each process gets its role's certificate
  // (mutual TLS). "": every process runs --insecure.
  std::string certs_dir;
  absl::Duration ready_timeout = absl::Seconds(60);
};

// How a stopped worker went.
struct StopResult {
  int exit_status = -1;    // As Subprocess::Wait reports it (128 + signal when killed).
  bool escalated = false;  // A SIGTERM drain outlasted grace + 5 s and was SIGKILLed.
  absl::Duration took;
};

class Fleet {
 public:
  explicit Fleet(FleetOptions options);
  ~Fleet();
  Fleet(const Fleet&) = delete;
  Fleet& operator=(const Fleet&) = delete;

  // Starts the workers, waits for their ready files, then starts the router
  // on them and waits for its ready file.
  absl::Status Start();

  // Workers are numbered prefill first, then decode.
  int num_workers() const { return static_cast<int>(workers_.size()); }
  Role role(int i) const { return workers_[i].role; }
  const std::string& name(int i) const { return workers_[i].name; }  // "prefill0", "decode1", ...
  int grpc_port(int i) const { return workers_[i].grpc_port; }

  // Sends `sig` to worker i and waits for it to exit: SIGKILL briefly,
  // SIGTERM up to the drain grace + 5 s before escalating to SIGKILL.
  // REQUIRES: worker i is running.
  StopResult Stop(int i, int sig);
  // Starts worker i again on its gRPC port and waits for its ready file; a
  // start that fails (say the port is not free yet) is tried a few times.
  // REQUIRES: worker i was stopped.
  absl::Status Restart(int i);

  const std::string& router_address() const { return router_address_; }
  int router_metrics_port() const { return router_metrics_port_; }

  const std::string& router_log() const { return router_log_; }
  // The log of worker i's current (or, once stopped, last) incarnation.
  const std::string& current_log(int i) const { return workers_[i].logs.back(); }
  // Every log line, in any process's log, that contains `needle`; each
  // prefixed with its log's file name.
  std::string Grep(const std::string& needle) const;
  // The last `bytes` of the file at `path`.
  static std::string Tail(const std::string& path, size_t bytes);

 private:
  struct Worker {
    Role role;
    std::string name;
    std::vector<std::string> argv;  // Without --listen.
    std::string ready_file;
    int grpc_port = 0;
    std::vector<std::string> logs;  // One per incarnation.
    std::unique_ptr<testing_support::Subprocess> process;
  };

  absl::Status Launch(Worker& w, const std::string& listen);

  FleetOptions options_;
  std::vector<Worker> workers_;
  testing_support::Subprocess router_;
  std::string router_log_;
  std::string router_address_;
  int router_metrics_port_ = 0;
};

}  // namespace pdserve::chaos

#endif  // PDSERVE_TESTS_CHAOS_FLEET_H_
