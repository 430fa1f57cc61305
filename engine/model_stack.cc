#include "engine/model_stack.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cpu/device_contract_backend.h"
#include "kernels/cuda/cuda_loader.h"

namespace pdserve {
namespace {

// Activations, logits and GEMM scratch a GPU forward needs beside the
// weights and the pool.
constexpr size_t kGpuWorkspaceReserve = size_t{1} << 30;

absl::StatusOr<DType> KvDType(const ModelStackOptions& o, const Model& model) {
  if (o.kv.empty()) return model.weight_dtype();
  absl::StatusOr<DType> k = ParseDType(o.kv);
  if (!k.ok()) return absl::InvalidArgumentError(absl::StrCat("--kv: ", k.status().message()));
  return *k;
}

// The CPU backend the options ask for: threads, ISA, matrix path (the
// probe's choice unless forced).
absl::StatusOr<kernels::cpu::CpuBackendOptions> CpuOptions(const ModelStackOptions& o) {
  kernels::cpu::CpuBackendOptions bo;
  bo.num_threads = o.threads;
  if (!o.isa.empty()) {
    absl::StatusOr<kernels::cpu::Isa> isa = kernels::cpu::ParseIsa(o.isa);
    if (!isa.ok()) return isa.status();
    bo.isa = *isa;
  }
  bo.choose_matrix_path = true;
  if (!o.matrix_path.empty()) {
    absl::StatusOr<kernels::cpu::MatrixPath> path = kernels::cpu::ParseMatrixPath(o.matrix_path);
    if (!path.ok()) return absl::InvalidArgumentError(absl::StrCat("--matrix_path: ", path.status().message()));
    bo.matrix_path = *path;
  }
  return bo;
}

// "cuda", or "cpu-device" (the CPU kernels behind a GPU's memory
// contract, for tests of the GPU paths).
absl::StatusOr<ModelStack> LoadGpuStack(const ModelStackOptions& o) {
  if (o.tp != 1) {
    return absl::UnimplementedError(
        "--backend=cuda with --tp > 1: the GPU ranks' NCCL group is not wired into the model yet");
  }
  if (o.allocator != nullptr) {
    return absl::InvalidArgumentError(
        "--backend=cuda: the KV pool is GPU memory and cannot come from a host allocator (the workers' KV "
        "handoff copies through the backend instead)");
  }
  if (o.gpu_memory_fraction < 0 || o.gpu_memory_fraction > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--gpu_memory_fraction must be in [0, 1], got ", o.gpu_memory_fraction));
  }
  ModelStack e;
  kernels::cuda::CudaBackend* cuda = nullptr;
  if (o.backend == "cuda") {
    absl::StatusOr<std::unique_ptr<kernels::cuda::CudaBackend>> gpu =
        kernels::cuda::LoadCudaBackend({.device = o.cuda_device});
    if (!gpu.ok()) return gpu.status();
    cuda = gpu->get();
    e.gpu = *std::move(gpu);
  } else {
    absl::StatusOr<kernels::cpu::CpuBackendOptions> bo = CpuOptions(o);
    if (!bo.ok()) return bo.status();
    absl::StatusOr<std::unique_ptr<kernels::cpu::CpuBackend>> cpu = kernels::cpu::CpuBackend::Create(*bo);
    if (!cpu.ok()) return cpu.status();
    e.gpu = std::make_unique<kernels::cpu::DeviceContractBackend>(*std::move(cpu));
  }
  ModelOptions mo;
  if (!o.weights.empty()) {
    absl::StatusOr<DType> w = ParseDType(o.weights);
    if (!w.ok()) return absl::InvalidArgumentError(absl::StrCat("--weights: ", w.status().message()));
    mo.weight_dtype = *w;
  }
  absl::StatusOr<std::unique_ptr<Model>> model = Model::Load(o.model_dir, mo, e.gpu.get());
  if (!model.ok()) return model.status();
  e.model = *std::move(model);
  absl::StatusOr<DType> kv = KvDType(o, *e.model);
  if (!kv.ok()) return kv.status();
  if (o.block_size <= 0) return absl::InvalidArgumentError("--block-size must be positive");
  int64_t blocks = (o.kv_positions + o.block_size - 1) / o.block_size;
  if (cuda != nullptr && o.gpu_memory_fraction > 0) {
    absl::StatusOr<kernels::cuda::GpuMemoryInfo> mem = cuda->MemoryInfo();
    if (!mem.ok()) return mem.status();
    const double used = static_cast<double>(mem->total_bytes - mem->free_bytes);
    const double budget = o.gpu_memory_fraction * static_cast<double>(mem->total_bytes) - used -
                          static_cast<double>(kGpuWorkspaceReserve);
    const int64_t per_block = e.model->MakeKvSpec(*kv, o.block_size, 1).TotalBytes();
    blocks = budget > 0 ? static_cast<int64_t>(budget / static_cast<double>(per_block)) : 0;
    if (blocks < 1) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "--gpu_memory_fraction=%.2f of %.1f GiB leaves no KV pool: %.1f GiB in use (weights %.1f GiB) and a "
          "%.1f GiB workspace reserve",
          o.gpu_memory_fraction, mem->total_bytes / 1073741824.0, used / 1073741824.0,
          e.model->WeightBytes() / 1073741824.0, kGpuWorkspaceReserve / 1073741824.0));
    }
  }
  e.gpu_kv_memory = std::make_unique<BackendKvRegionAllocator>(e.gpu.get());
  absl::StatusOr<std::unique_ptr<KvManager>> manager =
      KvManager::Create(e.model->MakeKvSpec(*kv, o.block_size, static_cast<int32_t>(blocks)), e.gpu_kv_memory.get());
  if (!manager.ok()) return manager.status();
  e.kv = *std::move(manager);
  return e;
}

}  // namespace

std::string ModelStack::KernelsDescription() const {
  if (gpu) return gpu->Name();
  const bool dot = kv != nullptr && backend->Bf16DotAttention(kv->spec().dtype, kv->spec().block_size);
  return absl::StrCat(backend->Name(), " (matrix path ", kernels::cpu::MatrixPathName(backend->matrix_path()), ": ",
                      backend->matrix_path_reason(), "; attention ", dot ? "BF16 dot" : "F32", ")");
}

absl::StatusOr<ModelStack> LoadModelStack(const ModelStackOptions& o) {
  if (o.backend == "cuda" || o.backend == "cpu-device") return LoadGpuStack(o);
  if (o.backend != "cpu") {
    return absl::InvalidArgumentError(absl::StrCat("--backend must be cpu or cuda, got '", o.backend, "'"));
  }
  ModelStack e;
  absl::StatusOr<kernels::cpu::CpuBackendOptions> options = CpuOptions(o);
  if (!options.ok()) return options.status();
  kernels::cpu::CpuBackendOptions bo = *options;
  absl::StatusOr<std::unique_ptr<kernels::cpu::CpuBackend>> backend =
      kernels::cpu::CpuBackend::Create(bo);
  if (!backend.ok()) return backend.status();
  e.backend = *std::move(backend);
  if (o.tp < 1) return absl::InvalidArgumentError(absl::StrCat("--tp must be at least 1, got ", o.tp));
  // Every rank runs rank 0's kernels: a probe per rank could split them.
  bo.isa = e.backend->isa();
  bo.matrix_path = e.backend->matrix_path();
  for (int r = 1; r < o.tp; ++r) {
    absl::StatusOr<std::unique_ptr<kernels::cpu::CpuBackend>> b = kernels::cpu::CpuBackend::Create(bo);
    if (!b.ok()) return b.status();
    e.rank_backends.push_back(*std::move(b));
  }

  ModelOptions mo;
  mo.tp = o.tp;
  for (const auto& b : e.rank_backends) mo.rank_backends.push_back(b.get());
  if (!o.weights.empty()) {
    absl::StatusOr<DType> w = ParseDType(o.weights);
    if (!w.ok()) return absl::InvalidArgumentError(absl::StrCat("--weights: ", w.status().message()));
    mo.weight_dtype = *w;
  }
  absl::StatusOr<std::unique_ptr<Model>> model = Model::Load(o.model_dir, mo, e.backend.get());
  if (!model.ok()) return model.status();
  e.model = *std::move(model);

  absl::StatusOr<DType> kv_dtype = KvDType(o, *e.model);
  if (!kv_dtype.ok()) return kv_dtype.status();
  const DType kv = *kv_dtype;
  if (o.block_size <= 0) return absl::InvalidArgumentError("--block-size must be positive");
  const int64_t blocks = (o.kv_positions + o.block_size - 1) / o.block_size;
  TpKvLayout layout = TpKvLayout::kHeadSharded;
  if (o.tp_kv_layout == "request") {
    layout = TpKvLayout::kRequestSharded;
  } else if (o.tp_kv_layout != "head") {
    return absl::InvalidArgumentError(
        absl::StrCat("--tp_kv_layout must be head or request, got '", o.tp_kv_layout, "'"));
  }
  absl::StatusOr<std::unique_ptr<KvManager>> manager =
      KvManager::Create(e.model->MakeKvSpec(kv, o.block_size, static_cast<int32_t>(blocks), layout), o.allocator);
  if (!manager.ok()) return manager.status();
  e.kv = *std::move(manager);
  return e;
}

}  // namespace pdserve
