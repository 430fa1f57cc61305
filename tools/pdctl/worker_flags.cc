#include "tools/pdctl/worker_flags.h"

#include <string>

#include "absl/flags/flag.h"
#include "common/server_util.h"

ABSL_FLAG(std::string, model, "", "model directory (Hugging Face layout)");
ABSL_FLAG(int, threads, 1, "compute threads");
ABSL_FLAG(std::string, weights, "", "in-memory weight format: f32, bf16 or int8 (default: as stored)");
ABSL_FLAG(std::string, kv, "", "KV cache format (default: the weight format)");
ABSL_FLAG(int, block_size, 16, "KV block size in positions");
ABSL_FLAG(int, kv_positions, 16384, "KV pool size in positions");

namespace pdserve::pdctl {

namespace {

absl::StatusOr<WorkerEngine> LoadWorkerEngine(KvRegionAllocator* allocator) {
  EngineOptions eo;
  eo.model_dir = absl::GetFlag(FLAGS_model);
  if (eo.model_dir.empty()) return absl::InvalidArgumentError("--model is required");
  eo.threads = absl::GetFlag(FLAGS_threads);
  eo.weights = absl::GetFlag(FLAGS_weights);
  eo.kv = absl::GetFlag(FLAGS_kv);
  eo.block_size = absl::GetFlag(FLAGS_block_size);
  eo.kv_positions = absl::GetFlag(FLAGS_kv_positions);
  eo.allocator = allocator;
  WorkerEngine w;
  absl::StatusOr<Engine> engine = MakeEngine(eo);
  if (!engine.ok()) return engine.status();
  w.engine = *std::move(engine);
  absl::StatusOr<std::unique_ptr<tok::Tokenizer>> tokenizer = tok::Tokenizer::Load(eo.model_dir);
  if (!tokenizer.ok()) return tokenizer.status();
  w.tokenizer = *std::move(tokenizer);
  return w;
}

}  // namespace

absl::StatusOr<WorkerRuntime> StartWorkerRuntime(const std::string& name, int* exit_code) {
  WorkerRuntime rt;
  absl::StatusOr<std::unique_ptr<kv::UcxTransport>> transport = kv::UcxTransport::Create({.name = name});
  if (!transport.ok()) {
    LogEvent("error", "ucx_failed", {{"error", std::string(transport.status().message())}});
    *exit_code = 1;
    return transport.status();
  }
  rt.transport = *std::move(transport);
  absl::StatusOr<WorkerEngine> w = LoadWorkerEngine(&rt.transport->region_allocator());
  if (!w.ok()) {
    LogEvent("error", "load_failed", {{"error", std::string(w.status().message())}});
    *exit_code = absl::IsInvalidArgument(w.status()) ? 2 : 1;
    return w.status();
  }
  rt.engine = *std::move(w);
  return rt;
}

void AddKvPoolMetrics(MetricsRegistry& metrics, const BlockPool* pool, absl::Mutex* pool_mu) {
  auto read = [pool, pool_mu](int32_t (BlockPool::*count)() const) {
    return [pool, pool_mu, count] {
      absl::MutexLock lock(pool_mu);
      return static_cast<double>((pool->*count)());
    };
  };
  metrics.AddGauge("pdserve_kv_blocks", "KV blocks by state.", read(&BlockPool::num_used), "state=\"used\"");
  metrics.AddGauge("pdserve_kv_blocks", "KV blocks by state.", read(&BlockPool::num_free), "state=\"free\"");
}

}  // namespace pdserve::pdctl
