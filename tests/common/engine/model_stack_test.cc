// The compute stack's backend choice: the CPU by default, the CUDA backend
// loaded only on request, and clear errors where it cannot run.
#include "engine/model_stack.h"

#include <cstdlib>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_loader.h"

namespace pdserve {
namespace {

// $PDSERVE_SOURCE_DIR: the checkout on a GPU machine the binary was carried to.
const std::string kModel =
    std::string(std::getenv("PDSERVE_SOURCE_DIR") != nullptr ? std::getenv("PDSERVE_SOURCE_DIR") : PDSERVE_SOURCE_DIR) +
    "/deploy/models/kjv-tiny";

ModelStackOptions Options(const std::string& backend) {
  ModelStackOptions o;
  o.model_dir = kModel;
  o.backend = backend;
  o.kv_positions = 256;
  return o;
}

// First: a library once loaded stays loaded for the process (CTest runs
// each test in a process of its own).
TEST(ModelStackTest, AMissingCudaLibraryIsNamed) {
  setenv("PDSERVE_CUDA_MODULE", "/nonexistent/libpdserve_cuda.so", 1);
  absl::StatusOr<std::unique_ptr<kernels::cuda::CudaBackend>> gpu = kernels::cuda::LoadCudaBackend({});
  unsetenv("PDSERVE_CUDA_MODULE");
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition) << gpu.status();
  EXPECT_NE(gpu.status().message().find("/nonexistent/libpdserve_cuda.so"), std::string::npos) << gpu.status();
}

TEST(ModelStackTest, TheCpuIsTheDefault) {
  absl::StatusOr<ModelStack> s = LoadModelStack(Options("cpu"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_NE(s->backend, nullptr);
  EXPECT_EQ(s->gpu, nullptr);
  EXPECT_EQ(&s->compute(), s->backend.get());
  EXPECT_NE(s->KernelsDescription().find("matrix path"), std::string::npos) << s->KernelsDescription();
  // The attention's form is named: BF16 dot products on the bf16 path
  // over BF16 KV, else F32.
  const bool dot = s->backend->Bf16DotAttention(s->kv->spec().dtype, s->kv->spec().block_size);
  EXPECT_NE(s->KernelsDescription().find(dot ? "; attention BF16 dot)" : "; attention F32)"), std::string::npos)
      << s->KernelsDescription();
}

TEST(ModelStackTest, AnUnknownBackendIsRefused) {
  absl::StatusOr<ModelStack> s = LoadModelStack(Options("tpu"));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("cpu or cuda"), std::string::npos) << s.status();
}

// Without a GPU (or without the library) the CUDA stack says why; with
// one, it loads and generates nothing here (cuda_backend_test covers it).
TEST(ModelStackTest, TheCudaBackendLoadsOnlyOnRequestAndExplainsAFailure) {
  absl::StatusOr<std::unique_ptr<kernels::cuda::CudaBackend>> gpu = kernels::cuda::LoadCudaBackend({});
  absl::StatusOr<ModelStack> s = LoadModelStack(Options("cuda"));
  if (gpu.ok()) {
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->backend, nullptr);
    EXPECT_NE(s->gpu, nullptr);
    EXPECT_NE(s->compute().Name().find("cuda/"), std::string::npos);
    return;
  }
  // No usable GPU (the driver's reason) or no library (the loader's).
  EXPECT_TRUE(gpu.status().code() == absl::StatusCode::kUnavailable ||
              gpu.status().code() == absl::StatusCode::kFailedPrecondition)
      << gpu.status();
  EXPECT_EQ(s.status().code(), gpu.status().code()) << s.status();
  EXPECT_FALSE(s.status().message().empty());
}

// A GPU pool cannot come from a host allocator (the workers pass none on
// a GPU: their handoff copies through the backend).
TEST(ModelStackTest, AGpuPoolFromAHostAllocatorIsRefused) {
  if (!kernels::cuda::LoadCudaBackend({}).ok()) GTEST_SKIP() << "no usable GPU";
  HostKvRegionAllocator host;
  ModelStackOptions o = Options("cuda");
  o.allocator = &host;
  absl::StatusOr<ModelStack> s = LoadModelStack(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
}

}  // namespace
}  // namespace pdserve
