// The compute stack a worker or a pdctl command runs on: a CPU backend,
// the model on it, and the KV manager whose pool the model's forward
// reads and writes, loaded from options (the workers' and pdctl's flags).
#ifndef PDSERVE_ENGINE_MODEL_STACK_H_
#define PDSERVE_ENGINE_MODEL_STACK_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kv/kv_manager.h"
#include "model/model.h"
#include "kernels/cpu/cpu_backend.h"

namespace pdserve {

struct ModelStackOptions {
  std::string model_dir;
  // "cpu" or "cuda" (kernels/cuda/cuda_backend.h: weights, activations and
  // the KV pool on GPU cuda_device); "cpu-device", for tests: the CPU
  // kernels behind a GPU's memory contract (kernels/cpu/device_contract_backend.h).
  std::string backend = "cpu";
  int cuda_device = 0;
  // cuda: the KV pool takes this fraction of the GPU's memory, less what
  // is already used (weights, other processes) and a workspace reserve;
  // 0: kv_positions, like the CPU.
  double gpu_memory_fraction = 0;
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
  std::unique_ptr<kernels::cpu::CpuBackend> backend;  // Rank 0's (null on a GPU).
  // Ranks 1..tp-1's, on rank 0's ISA and matrix path.
  std::vector<std::unique_ptr<kernels::cpu::CpuBackend>> rank_backends;
  std::unique_ptr<kernels::Backend> gpu;  // backend "cuda" (or "cpu-device").
  std::unique_ptr<KvRegionAllocator> gpu_kv_memory;  // The pool's, in GPU memory.
  std::unique_ptr<Model> model;
  std::unique_ptr<KvManager> kv;

  // The backend the model runs on.
  kernels::Backend& compute() const { return gpu ? *gpu : *backend; }
  // What the logs say about the kernels: the backend's name, and on the
  // CPU its matrix path and why it was chosen.
  std::string KernelsDescription() const;
};

absl::StatusOr<ModelStack> LoadModelStack(const ModelStackOptions& options);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_MODEL_STACK_H_
