// Shared setup of pdctl's engine commands: backend, model and KV pool from
// flags.
#ifndef PDSERVE_TOOLS_PDCTL_ENGINE_SETUP_H_
#define PDSERVE_TOOLS_PDCTL_ENGINE_SETUP_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/kv_manager.h"
#include "common/model.h"
#include "kernels/cpu/cpu_backend.h"

namespace pdserve::pdctl {

struct EngineOptions {
  std::string model_dir;
  std::string weights;  // "", "f32", "bf16"
  std::string kv;       // "", "f32", "bf16"
  std::string isa;      // "" = PDSERVE_ISA or best
  int threads = 1;
  int block_size = 16;
  int64_t kv_positions = 0;  // Pool capacity in positions (rounded up to blocks).
  // Where the pool's region comes from (e.g. UCX-registered memory for a
  // KV handoff); null: ordinary host memory.
  KvRegionAllocator* allocator = nullptr;
};

struct Engine {
  std::unique_ptr<kernels::cpu::CpuBackend> backend;
  std::unique_ptr<Model> model;
  std::unique_ptr<KvManager> kv;
};

absl::StatusOr<Engine> MakeEngine(const EngineOptions& options);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_ENGINE_SETUP_H_
