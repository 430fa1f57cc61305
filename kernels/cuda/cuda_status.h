// A CUDA runtime error as a Status (UNAVAILABLE: the device, its driver or
// its memory), for the CUDA sources. Includes the CUDA runtime header.
#ifndef PDSERVE_KERNELS_CUDA_CUDA_STATUS_H_
#define PDSERVE_KERNELS_CUDA_CUDA_STATUS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve::kernels::cuda {

inline absl::Status CudaError(const char* what, cudaError_t e) {
  return absl::UnavailableError(
      absl::StrCat(what, ": CUDA error ", static_cast<int>(e), " (", cudaGetErrorString(e), ")"));
}

}  // namespace pdserve::kernels::cuda

#endif  // PDSERVE_KERNELS_CUDA_CUDA_STATUS_H_
