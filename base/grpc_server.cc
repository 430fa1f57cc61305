#include "base/grpc_server.h"

#include <chrono>
#include <cstdlib>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "base/metrics.h"
#include "base/server_util.h"
#include "google/protobuf/stubs/logging.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"

namespace pdserve {

int ServeUntilSignal(const ServeOptions& o, std::initializer_list<grpc::Service*> services) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(o.address, o.credentials != nullptr ? o.credentials : grpc::InsecureServerCredentials(),
                           &port);
  builder.SetMaxReceiveMessageSize(o.max_receive_message_bytes);
  for (grpc::Service* s : services) builder.RegisterService(s);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    LogEvent("error", "listen_failed", {{"role", o.role}, {"address", o.address}});
    return 1;
  }
  // The health-only port: a server with no service of ours, so its default
  // health service is all it answers.
  std::unique_ptr<grpc::Server> health_server;
  int health_port = 0;
  if (!o.health_address.empty()) {
    grpc::ServerBuilder hb;
    hb.AddListeningPort(o.health_address, grpc::InsecureServerCredentials(), &health_port);
    health_server = hb.BuildAndStart();
    if (health_server == nullptr || health_port == 0) {
      LogEvent("error", "listen_failed", {{"role", o.role}, {"address", o.health_address}, {"port", "health"}});
      return 1;
    }
  }
  auto set_serving = [&](bool serving) {
    server->GetHealthCheckService()->SetServingStatus("", serving);
    if (health_server != nullptr) health_server->GetHealthCheckService()->SetServingStatus("", serving);
  };
  server->GetHealthCheckService()->SetServingStatus(kLivenessService, true);
  if (health_server != nullptr) health_server->GetHealthCheckService()->SetServingStatus(kLivenessService, true);
  std::unique_ptr<MetricsHttpServer> metrics_server;
  if (o.metrics != nullptr && !o.metrics_address.empty()) {
    const size_t colon = o.metrics_address.rfind(':');
    const int mport = colon == std::string::npos ? 0 : std::atoi(o.metrics_address.c_str() + colon + 1);
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> m =
        MetricsHttpServer::Start(o.metrics_address.substr(0, colon), mport, o.metrics);
    if (!m.ok()) {
      LogEvent("error", "metrics_listen_failed", {{"role", o.role}, {"error", std::string(m.status().message())}});
      return 1;
    }
    metrics_server = *std::move(m);
  }
  // The first verdict comes before the ready file: a worker that cannot
  // serve (say, its KV transport failed its self-check) never shows SERVING.
  const std::string first_verdict = o.health ? o.health() : "";
  set_serving(first_verdict.empty());
  std::vector<std::pair<std::string, std::string>> fields = {{"role", o.role}, {"grpc_port", std::to_string(port)}};
  if (metrics_server != nullptr) fields.emplace_back("metrics_port", std::to_string(metrics_server->port()));
  for (const auto& [k, v] : o.log_fields) fields.emplace_back(k, v);
  fields.emplace_back("tls", o.credentials != nullptr ? "on" : "OFF (plaintext: --insecure)");
  std::string more_ports;
  if (health_server != nullptr) {
    fields.emplace_back("health_port", std::to_string(health_port));
    absl::StrAppend(&more_ports, ",\"health_port\":", health_port);
  }
  for (const auto& [k, v] : o.ports) {
    fields.emplace_back(k, std::to_string(v));
    absl::StrAppend(&more_ports, ",\"", k, "\":", v);
  }
  LogEvent("info", "serving", fields);
  if (!o.ready_file.empty()) {
    absl::Status st = WriteReadyFile(
        o.ready_file, absl::StrCat("{\"grpc_port\":", port, ",\"metrics_port\":",
                                   metrics_server != nullptr ? metrics_server->port() : 0, more_ports, "}"));
    if (!st.ok()) LogEvent("error", "ready_file", {{"error", std::string(st.message())}});
  }
  absl::Notification stop_health;
  std::thread health_thread;
  if (o.health) {
    health_thread = std::thread([&] {
      std::string last;
      std::string why = first_verdict;
      while (true) {
        if (why != last) {
          set_serving(why.empty());
          LogEvent(why.empty() ? "info" : "warning", "health_changed",
                   {{"role", o.role}, {"serving", why.empty() ? "true" : "false"}, {"reason", why}});
          last = why;
        }
        if (stop_health.WaitForNotificationWithTimeout(o.health_period)) break;
        why = o.health();
      }
    });
  }
  const int sig = WaitForShutdownSignal();
  stop_health.Notify();
  if (health_thread.joinable()) health_thread.join();
  LogEvent("info", "shutting_down", {{"role", o.role}, {"signal", std::to_string(sig)}});
  // Every service NOT_SERVING, liveness too.
  server->GetHealthCheckService()->SetServingStatus(false);
  if (health_server != nullptr) health_server->GetHealthCheckService()->SetServingStatus(false);
  const absl::Time signalled = absl::Now();
  if (o.on_drain) {
    o.on_drain(signalled + o.drain_grace);
    LogEvent("info", "drained",
             {{"role", o.role}, {"seconds", std::to_string(absl::ToDoubleSeconds(absl::Now() - signalled))}});
  }
  if (const absl::Duration rest = signalled + o.drain_min - absl::Now(); rest > absl::ZeroDuration()) {
    LogEvent("info", "draining_until_min", {{"role", o.role}, {"seconds", std::to_string(absl::ToDoubleSeconds(rest))}});
    absl::SleepFor(rest);
  }
  if (o.on_shutdown) o.on_shutdown();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (health_server != nullptr) health_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  return 0;
}

void LogProtobufAsEvents() {
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel level, const char* file, int line,
                                     const std::string& message) {
    const char* lvl = level == google::protobuf::LOGLEVEL_INFO      ? "info"
                      : level == google::protobuf::LOGLEVEL_WARNING ? "warning"
                                                                     : "error";
    LogEvent(lvl, "protobuf", {{"message", message}, {"at", absl::StrCat(file, ":", line)}});
  });
}

}  // namespace pdserve
