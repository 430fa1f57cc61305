// Loads the CUDA backend's shared library (libpdserve_cuda.so) on demand,
// so that processes on the CPU backend never load the CUDA libraries.
//
// The library is looked for at $PDSERVE_CUDA_MODULE when set, else where
// this build put it, else beside the executable, else by the dynamic
// linker's search path.
#ifndef PDSERVE_KERNELS_CUDA_CUDA_LOADER_H_
#define PDSERVE_KERNELS_CUDA_CUDA_LOADER_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/cuda/cuda_backend.h"

namespace pdserve::kernels::cuda {

// FAILED_PRECONDITION when this build has no CUDA backend or its library
// cannot be loaded (the message says which and why); otherwise
// CudaBackend::Create's result.
absl::StatusOr<std::unique_ptr<CudaBackend>> LoadCudaBackend(const CudaBackendOptions& options);

}  // namespace pdserve::kernels::cuda

#endif  // PDSERVE_KERNELS_CUDA_CUDA_LOADER_H_
