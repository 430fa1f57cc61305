#include "kernels/cuda/cuda_loader.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pdserve::kernels::cuda {
namespace {

// The library's entry point (cuda_backend.cu).
using CreateFn = CudaBackend* (*)(int device, absl::Status* status);
constexpr char kModule[] = "libpdserve_cuda.so";
constexpr char kEntry[] = "pdserve_cuda_create_backend";

std::string ExecutableDir() {
  std::string buf(4096, '\0');
  const ssize_t n = readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return "";
  buf.resize(static_cast<size_t>(n));
  return buf.substr(0, buf.rfind('/'));
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaBackend>> LoadCudaBackend(const CudaBackendOptions& options) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("PDSERVE_CUDA_MODULE"); env != nullptr && *env != '\0') {
    candidates.push_back(env);
  } else {
#ifdef PDSERVE_CUDA_MODULE_BUILD_PATH
    candidates.push_back(PDSERVE_CUDA_MODULE_BUILD_PATH);
#endif
    if (std::string dir = ExecutableDir(); !dir.empty()) candidates.push_back(absl::StrCat(dir, "/", kModule));
    candidates.push_back(kModule);
  }
  // The handle is kept for the process's life: backends made from it may
  // live until exit.
  static void* handle = nullptr;
  std::vector<std::string> why;
  for (const std::string& path : candidates) {
    if (handle != nullptr) break;
    if (path.find('/') != std::string::npos && access(path.c_str(), F_OK) != 0) {
      why.push_back(absl::StrCat(path, ": not there"));
      continue;
    }
    handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) why.push_back(dlerror());
  }
  if (handle == nullptr) {
#ifndef PDSERVE_CUDA_MODULE_BUILD_PATH
    why.insert(why.begin(), "this build has no CUDA backend (nvcc was not found when it was configured)");
#endif
    return absl::FailedPreconditionError(
        absl::StrCat("cannot load the CUDA backend: ", absl::StrJoin(why, "; ")));
  }
  auto create = reinterpret_cast<CreateFn>(dlsym(handle, kEntry));
  if (create == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(kModule, " has no ", kEntry, ": ", dlerror()));
  }
  absl::Status status;
  CudaBackend* backend = create(options.device, &status);
  if (backend == nullptr) return status;
  return std::unique_ptr<CudaBackend>(backend);
}

}  // namespace pdserve::kernels::cuda
