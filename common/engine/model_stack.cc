#include "common/engine/model_stack.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve {

absl::StatusOr<ModelStack> LoadModelStack(const ModelStackOptions& o) {
  ModelStack e;
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

  DType kv = e.model->weight_dtype();
  if (!o.kv.empty()) {
    absl::StatusOr<DType> k = ParseDType(o.kv);
    if (!k.ok()) return absl::InvalidArgumentError(absl::StrCat("--kv: ", k.status().message()));
    kv = *k;
  }
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
