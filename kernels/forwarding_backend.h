// A backend that hands every call to another one: the base of wrappers
// that change one thing (how memory looks, what happens after a KV write)
// and forward the rest.
#ifndef PDSERVE_KERNELS_FORWARDING_BACKEND_H_
#define PDSERVE_KERNELS_FORWARDING_BACKEND_H_

#include <memory>
#include <string>

#include "kernels/backend.h"

namespace pdserve::kernels {

class ForwardingBackend : public Backend {
 public:
  // `inner` outlives this backend.
  explicit ForwardingBackend(Backend* inner) : inner_(inner) {}

  std::string Name() const override { return inner_->Name(); }
  bool HostAddressable() const override { return inner_->HostAddressable(); }
  absl::StatusOr<void*> Allocate(size_t bytes) override { return inner_->Allocate(bytes); }
  void Free(void* p) override { inner_->Free(p); }
  void CopyToDevice(void* dst, const void* src, size_t bytes) override { inner_->CopyToDevice(dst, src, bytes); }
  void CopyToHost(void* dst, const void* src, size_t bytes) override { inner_->CopyToHost(dst, src, bytes); }
  void Copy2D(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, int64_t rows) override {
    inner_->Copy2D(dst, dst_pitch, src, src_pitch, width, rows);
  }
  void Zero(void* dst, size_t bytes) override { inner_->Zero(dst, bytes); }
  void Add(float* y, const float* x, int64_t n) override { inner_->Add(y, x, n); }
  void Synchronize() override { inner_->Synchronize(); }
  absl::Status status() const override { return inner_->status(); }
  absl::StatusOr<std::unique_ptr<BackendUploader>> NewUploader() override { return inner_->NewUploader(); }
  absl::StatusOr<std::unique_ptr<EmbeddingTable>> PackEmbedding(const MatrixPart& part, int64_t dim,
                                                                DType storage) override {
    return inner_->PackEmbedding(part, dim, storage);
  }
  void Embed(const EmbeddingTable& table, const int32_t* ids, int64_t n, float* out) override {
    inner_->Embed(table, ids, n, out);
  }
  absl::StatusOr<std::unique_ptr<LinearWeight>> RandomLinear(int64_t n, int64_t k, DType storage, float bound,
                                                             uint64_t seed) override {
    return inner_->RandomLinear(n, k, storage, bound, seed);
  }
  absl::StatusOr<std::unique_ptr<EmbeddingTable>> RandomEmbedding(int64_t rows, int64_t dim, DType storage,
                                                                  float bound, uint64_t seed) override {
    return inner_->RandomEmbedding(rows, dim, storage, bound, seed);
  }
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
  void PrefetchKv(const KvLayerView& kv, absl::Span<const AttentionSequence> sequences) override {
    inner_->PrefetchKv(kv, sequences);
  }

 protected:
  Backend* inner() const { return inner_; }

 private:
  Backend* inner_;
};

}  // namespace pdserve::kernels

#endif  // PDSERVE_KERNELS_FORWARDING_BACKEND_H_
