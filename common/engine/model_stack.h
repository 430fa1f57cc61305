// The compute stack a worker or a pdctl command runs on: a CPU backend,
// the model on it, and the KV manager whose pool the model's forward
// reads and writes, loaded from options (the workers' and pdctl's flags).
#ifndef PDSERVE_COMMON_ENGINE_MODEL_STACK_H_
#define PDSERVE_COMMON_ENGINE_MODEL_STACK_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/kv_manager.h"
#include "common/model.h"
#include "kernels/cpu/cpu_backend.h"

namespace pdserve {

struct ModelStackOptions {
  std::string model_dir;
  std::string weights;  // "", "f32", "bf16"
  std::string kv;       // "", "f32", "bf16"
  std::string isa;      // "" = PDSERVE_ISA or best
  std::string matrix_path;  // "" = PDSERVE_MATRIX_PATH or the probe's choice; "f32", "fp16"
  int threads = 1;  // Per tensor-parallel rank.
  int tp = 1;       // Tensor-parallel ranks (threads of this process).
  // "head" (each rank its heads' KV) or "request" (each rank whole
  // requests' KV: decode workers only).
  std::string tp_kv_layout = "head";
  int block_size = 16;
  int64_t kv_positions = 0;  // Pool capacity in positions (rounded up to blocks).
  // Where the pool's region comes from (e.g. UCX-registered memory for a
  // KV handoff); null: ordinary host memory.
  KvRegionAllocator* allocator = nullptr;
};

struct ModelStack {
  std::unique_ptr<kernels::cpu::CpuBackend> backend;  // Rank 0's.
  // Ranks 1..tp-1's, on rank 0's ISA and matrix path.
  std::vector<std::unique_ptr<kernels::cpu::CpuBackend>> rank_backends;
  std::unique_ptr<Model> model;
  std::unique_ptr<KvManager> kv;
};

absl::StatusOr<ModelStack> LoadModelStack(const ModelStackOptions& options);

}  // namespace pdserve

#endif  // PDSERVE_COMMON_ENGINE_MODEL_STACK_H_
