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

  // A weight [n, k] of uniform random values in [-bound, bound] made on
  // the device (benchmarks of large shapes: nothing is read from disk),
  // stored as `storage` (kF32, kBF16 or kI8).
  virtual absl::StatusOr<std::unique_ptr<LinearWeight>> RandomLinear(int64_t n, int64_t k, DType storage,
                                                                     float bound, uint64_t seed) = 0;
};

}  // namespace pdserve::kernels::cuda

#endif  // PDSERVE_KERNELS_CUDA_CUDA_BACKEND_H_
