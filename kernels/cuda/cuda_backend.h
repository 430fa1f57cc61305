// The CUDA backend (kernels/backend.h) for NVIDIA GPUs, Hopper first
// (sm_90): weights, activations and the paged KV pool in GPU memory; GEMMs
// through cuBLAS (BF16 or F32 operands, F32 accumulation), int8
// weight-only matrices through a fused dequantising GEMV for decode rows
// and dequantise-then-GEMM for prefill; RMSNorm, RoPE, SwiGLU, embedding,
// the paged KV write (the CPU backend's layout and encodings: F32, BF16,
// int8 with per-(position, KV head) scales) and paged attention for
// (S0, m) batches (online softmax over 32-position tiles, long histories
// split across thread blocks and merged) as custom kernels.
//
// Every call is enqueued on the backend's one stream; CopyToHost and
// Synchronize wait for it. A CUDA or cuBLAS error is sticky: status()
// reports the first, and the model's forward returns it.
//
// This header includes no CUDA header, so host code compiled by the C++
// compiler can create the backend.
//
// Thread safety: driven by one thread at a time (Backend's rule); the
// backend makes its device current on that thread in each call.
#ifndef PDSERVE_KERNELS_CUDA_CUDA_BACKEND_H_
#define PDSERVE_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"

namespace pdserve::kernels::cuda {

// The number of CUDA devices, or an error naming why none can be used
// (no driver, no device): GPU tests skip with its message.
absl::StatusOr<int> CudaDeviceCount();

struct CudaBackendOptions {
  int device = 0;
};

struct GpuMemoryInfo {
  size_t free_bytes = 0;
  size_t total_bytes = 0;
};

class CudaBackend : public Backend {
 public:
  // Errors: UNAVAILABLE without a usable device (the message says why).
  static absl::StatusOr<std::unique_ptr<CudaBackend>> Create(const CudaBackendOptions& options);

  // The device's free and total memory now.
  virtual absl::StatusOr<GpuMemoryInfo> MemoryInfo() = 0;
  // Streaming multiprocessors of the device.
  virtual int num_sms() const = 0;

  // Read bandwidth of a read-only kernel over `bytes` of device memory, in
  // bytes/s (the median of a few passes): the memory roofline's divisor.
  virtual absl::StatusOr<double> ReadBandwidth(size_t bytes) = 0;
  // cuBLAS's BF16 GEMM rate (F32 accumulation) at m x n x k, in FLOP/s
  // (the median of a few runs): the compute roofline's divisor.
  virtual absl::StatusOr<double> Bf16GemmRate(int64_t m, int64_t n, int64_t k) = 0;
};

// One row's sampling (engine/sampling.h's pipeline and order, which this
// mirrors on the GPU): the request's parameters, the token counts its
// penalties use, and its draw u = PhiloxUniform(seed, position) (made by
// the caller, so the draw is the CPU's exactly).
struct SampleRowParams {
  float temperature = 1.0f;  // 0 = greedy.
  int32_t top_k = 0;
  float top_p = 1.0f;
  float min_p = 0.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  float uniform = 0.0f;
  absl::Span<const int32_t> seen_ids;             // Prompt + output tokens, once each.
  absl::Span<const int32_t> generated_ids;        // Output tokens, once each...
  absl::Span<const int32_t> generated_counts;     // ...and how often.
};

// Samples on the GPU: penalties, temperature, the (logit desc, id asc)
// candidate order (a stable radix sort), top-k, top-p, min-p and the draw,
// with the CPU's F32 operations in the CPU's order (sums taken
// sequentially in candidate order). It picks the CPU sampler's token for
// the same logits, except where the draw lands within the last bits of a
// candidate boundary (the GPU's expf may differ from the CPU's in the
// last place).
class CudaSampler {
 public:
  virtual ~CudaSampler() = default;
  // On `backend`'s device, which must outlive the sampler.
  static absl::StatusOr<std::unique_ptr<CudaSampler>> Create(CudaBackend* backend);
  // tokens[r] (host) for row r of logits [rows.size(), vocab] in GPU memory,
  // once every call already enqueued on the backend finished.
  virtual absl::Status Sample(const float* logits, int64_t vocab, absl::Span<const SampleRowParams> rows,
                              int32_t* tokens) = 0;
};

}  // namespace pdserve::kernels::cuda

#endif  // PDSERVE_KERNELS_CUDA_CUDA_BACKEND_H_
