// The serving loop every pdserve binary shares: a gRPC server with health
// checking and reflection on one address, a "serving" log line and the
// ready file once it listens, then SIGINT/SIGTERM to stop (health goes
// NOT_SERVING first, then the service drains within its grace period, then
// the server stops).
#ifndef PDSERVE_BASE_GRPC_SERVER_H_
#define PDSERVE_BASE_GRPC_SERVER_H_

#include <functional>
#include <memory>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace pdserve {

inline constexpr char kLivenessService[] = "liveness";

struct ServeOptions {
  std::string address;     // host:port (port 0: any free port)
  // TLS (base/tls.h); null: plaintext.
  std::shared_ptr<grpc::ServerCredentials> credentials;
  // A second, plaintext port serving only gRPC health, mirroring the main
  // port's status (port 0: any free; "" = none). The ready file gets
  // "health_port". On both, the whole server's status ("") is the
  // readiness verdict (`health` below), and the service kLivenessService
  // is SERVING from start to shutdown: what a liveness probe asks, so that
  // a process that cannot serve for a while (no worker to place on) is
  // taken out of rotation, not restarted.
  std::string health_address;
  // The largest request message a client may send (larger: RESOURCE_EXHAUSTED).
  int max_receive_message_bytes = 8 << 20;
  std::string ready_file;  // "" = none; else {"grpc_port": N} once listening
  std::string role;        // In the log lines.
  // Prometheus /metrics on this host:port (port 0: any free; "" = none).
  const class MetricsRegistry* metrics = nullptr;
  std::string metrics_address = "127.0.0.1:0";
  std::vector<std::pair<std::string, std::string>> log_fields;  // Extra "serving" fields.
  // More listening ports for the ready file and the "serving" line
  // ({"http_port", 8000}).
  std::vector<std::pair<std::string, int>> ports;
  // Runs first after the signal, with health already NOT_SERVING: stop
  // taking new work and finish what is in flight, returning by `deadline`.
  std::function<void(absl::Time deadline)> on_drain;
  absl::Duration drain_grace = absl::Seconds(30);
  // The least time between the signal and shutting down: after on_drain,
  // the server stays up (NOT_SERVING, refusing new work) until then.
  absl::Duration drain_min = absl::ZeroDuration();
  // Judged every health_period while serving: "" = SERVING, else why not
  // (gRPC health goes NOT_SERVING and the change is logged). None: SERVING.
  std::function<std::string()> health;
  absl::Duration health_period = absl::Milliseconds(200);
  // Runs after the drain, before the server shuts down (stop engines).
  std::function<void()> on_shutdown;
};

// Serves `services` (and /metrics) until SIGINT/SIGTERM (which the caller must have
// blocked with BlockShutdownSignals first). Returns the process exit code:
// 0 after a signal, 1 if the address could not be bound.
int ServeUntilSignal(const ServeOptions& options, std::initializer_list<grpc::Service*> services);

// Routes libprotobuf's own messages (e.g. "String field ... contains
// invalid UTF-8", for a client's malformed request) into LogEvent, so they
// are JSON lines like every other (event "protobuf"). Call once, first
// thing in main.
void LogProtobufAsEvents();

}  // namespace pdserve

#endif  // PDSERVE_BASE_GRPC_SERVER_H_
