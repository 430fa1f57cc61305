// The CPU backend's kernels behind a GPU's memory contract: its memory is
// "not host-addressable", so everything a GPU backend makes take another
// path takes it here too — the forward's logits copied out, the KV pool
// outside the transport's registered memory, the handoff's copies through
// the backend on both sides. It computes exactly what the CPU backend
// computes. For tests of the GPU paths on machines without a GPU
// (`--backend=cpu-device`); never for serving.
#ifndef PDSERVE_KERNELS_CPU_DEVICE_CONTRACT_BACKEND_H_
#define PDSERVE_KERNELS_CPU_DEVICE_CONTRACT_BACKEND_H_

#include <memory>
#include <string>
#include <utility>

#include "kernels/cpu/cpu_backend.h"

namespace pdserve::kernels::cpu {

class DeviceContractBackend final : public Backend {
 public:
  explicit DeviceContractBackend(std::unique_ptr<CpuBackend> inner) : inner_(std::move(inner)) {}

  std::string Name() const override { return "cpu-device/" + inner_->Name(); }
  bool HostAddressable() const override { return false; }
  const CpuBackend& inner() const { return *inner_; }

  absl::StatusOr<std::unique_ptr<LinearWeight>> PackLinear(absl::Span<const MatrixPart> parts, int64_t k,
                                                           DType storage) override {
    return inner_->PackLinear(parts, k, storage);
  }
  void Linear(const LinearWeight& w, const float* x, int64_t m, const float* bias, float* y,
              bool accumulate) override {
    inner_->Linear(w, x, m, bias, y, accumulate);
  }
  void RmsNorm(const float* x, const float* weight, int64_t m, int64_t d, float eps, float* y) override {
    inner_->RmsNorm(x, weight, m, d, eps, y);
  }
  void Rope(float* x, int64_t rows, int32_t heads, int32_t head_dim, const int32_t* positions, const float* cos,
            const float* sin) override {
    inner_->Rope(x, rows, heads, head_dim, positions, cos, sin);
  }
  void SiluMul(const float* gate_up, int64_t m, int64_t f, float* out) override {
    inner_->SiluMul(gate_up, m, f, out);
  }
  void WriteKv(const KvLayerView& kv, int32_t num_kv_heads, int32_t head_dim, const float* k, const float* v,
               int64_t rows, const int32_t* blocks, const int32_t* slots) override {
    inner_->WriteKv(kv, num_kv_heads, head_dim, k, v, rows, blocks, slots);
  }
  void Attention(const AttentionBatch& batch) override { inner_->Attention(batch); }

 private:
  std::unique_ptr<CpuBackend> inner_;
};

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_DEVICE_CONTRACT_BACKEND_H_
