// pdserve-prefill-worker: chunked prefill + first token + KV handoff over UCX,
// behind the PrefillWorker gRPC service.
//
//   pdserve-prefill-worker --model DIR --listen 127.0.0.1:0 --ready_file F
//
// The KV goes to whichever decode worker each request names (its KV
// receiver address, from the router). UCX picks the transport from its own
// environment (UCX_TLS, UCX_NET_DEVICES); see the README.
// Flags may also come from a file: --flagfile=prefill.flags.
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/server_util.h"
#include "common/tokenizer/tokenizer.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "kv_transfer/sender.h"
#include "kv_transfer/ucx_transport.h"
#include "prefill_worker/prefill_service.h"
#include "tools/pdctl/engine_setup.h"

ABSL_FLAG(std::string, model, "", "model directory (Hugging Face layout)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0", "gRPC address (port 0: any free port)");
ABSL_FLAG(std::string, ready_file, "", "write {\"grpc_port\":..} here once serving");
ABSL_FLAG(int, threads, 1, "compute threads");
ABSL_FLAG(std::string, weights, "", "in-memory weight format: f32, bf16 or int8 (default: as stored)");
ABSL_FLAG(std::string, kv, "", "KV cache format (default: the weight format)");
ABSL_FLAG(int, block_size, 16, "KV block size in positions");
ABSL_FLAG(int, kv_positions, 16384, "KV pool size in positions (prefix cache included)");
ABSL_FLAG(int, prefill_chunk, 512, "prompt tokens per forward, across requests");
ABSL_FLAG(int, max_batch, 8, "requests per forward");

namespace {

int Run() {
  using namespace pdserve;
  absl::StatusOr<std::unique_ptr<kv::UcxTransport>> transport = kv::UcxTransport::Create({.name = "prefill"});
  if (!transport.ok()) {
    LogEvent("error", "ucx_failed", {{"error", std::string(transport.status().message())}});
    return 1;
  }
  pdctl::EngineOptions eo;
  eo.model_dir = absl::GetFlag(FLAGS_model);
  if (eo.model_dir.empty()) {
    LogEvent("error", "bad_flags", {{"error", "--model is required"}});
    return 2;
  }
  eo.threads = absl::GetFlag(FLAGS_threads);
  eo.weights = absl::GetFlag(FLAGS_weights);
  eo.kv = absl::GetFlag(FLAGS_kv);
  eo.block_size = absl::GetFlag(FLAGS_block_size);
  eo.kv_positions = absl::GetFlag(FLAGS_kv_positions);
  eo.allocator = &(*transport)->region_allocator();
  absl::StatusOr<pdctl::Engine> engine = pdctl::MakeEngine(eo);
  if (!engine.ok()) {
    LogEvent("error", "load_failed", {{"error", std::string(engine.status().message())}});
    return 1;
  }
  absl::StatusOr<std::unique_ptr<tok::Tokenizer>> tokenizer = tok::Tokenizer::Load(eo.model_dir);
  if (!tokenizer.ok()) {
    LogEvent("error", "load_failed", {{"error", std::string(tokenizer.status().message())}});
    return 1;
  }
  int exit_code = 0;
  {
    kv::KvSender sender(transport->get(), engine->pool.get(), {.model = engine->model->identity()});
    absl::Mutex pool_mu;
    prefill::PrefillServiceOptions so;
    so.chunk_tokens = absl::GetFlag(FLAGS_prefill_chunk);
    so.max_batch = absl::GetFlag(FLAGS_max_batch);
    prefill::PrefillService service(engine->model.get(), engine->pool.get(), &pool_mu, tokenizer->get(), &sender, so);

    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(absl::GetFlag(FLAGS_listen), grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (server == nullptr || port == 0) {
      LogEvent("error", "listen_failed", {{"address", absl::GetFlag(FLAGS_listen)}});
      return 1;
    }
    server->GetHealthCheckService()->SetServingStatus(true);
    LogEvent("info", "serving", {{"role", "prefill"}, {"grpc_port", std::to_string(port)}, {"model", eo.model_dir}});
    if (!absl::GetFlag(FLAGS_ready_file).empty()) {
      absl::Status st = WriteReadyFile(absl::GetFlag(FLAGS_ready_file), absl::StrCat("{\"grpc_port\":", port, "}"));
      if (!st.ok()) LogEvent("error", "ready_file", {{"error", std::string(st.message())}});
    }
    const int sig = WaitForShutdownSignal();
    LogEvent("info", "shutting_down", {{"signal", std::to_string(sig)}});
    server->GetHealthCheckService()->SetServingStatus(false);
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    service.Shutdown();
    (*transport)->Detach(&sender);
  }
  return exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  pdserve::BlockShutdownSignals();
  absl::SetProgramUsageMessage("pdserve prefill worker: pdserve-prefill-worker --model DIR [--listen ADDR]");
  absl::ParseCommandLine(argc, argv);
  return Run();
}
