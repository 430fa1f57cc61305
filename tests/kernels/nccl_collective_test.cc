// NCCL collectives on the GPUs this machine has. One device runs only a
// 1-rank communicator, so these tests use one rank: multi-rank NCCL is
// compiled but not exercised here. Without a GPU every test skips.
#include "kernels/cuda/nccl_collective.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "gtest/gtest.h"

namespace pdserve::kernels::cuda {
namespace {

class NcclCollectiveTest : public testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<int> devices = CudaDeviceCount();
    if (!devices.ok()) GTEST_SKIP() << "no usable GPU, NCCL collectives not run: " << devices.status();
  }
};

TEST_F(NcclCollectiveTest, OneRankCommunicatorRunsEveryCollective) {
  absl::StatusOr<std::string> id = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<std::unique_ptr<NcclCollective>> comm = NcclCollective::Create(*id, 0, 1, 0);
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->rank(), 0);
  EXPECT_EQ((*comm)->size(), 1);

  const std::vector<float> host = {1.5f, -2.25f, 3.0f, 1e-7f};
  float* dev = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), 2 * host.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_TRUE((*comm)->AllReduceSum(dev, static_cast<int64_t>(host.size())).ok());
  ASSERT_TRUE((*comm)->AllGather(dev, host.size() * sizeof(float), dev + host.size()).ok());
  ASSERT_TRUE((*comm)->Broadcast(dev, host.size() * sizeof(float), 0).ok());
  ASSERT_TRUE((*comm)->Barrier().ok());
  std::vector<float> back(2 * host.size());
  ASSERT_EQ(cudaMemcpy(back.data(), dev, back.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  cudaFree(dev);
  for (size_t i = 0; i < host.size(); ++i) {
    EXPECT_EQ(back[i], host[i]) << i;                // A sum over one rank is the value.
    EXPECT_EQ(back[host.size() + i], host[i]) << i;  // The gather's only slot.
  }
}

TEST_F(NcclCollectiveTest, BadArgumentsAreRefusedBeforeNccl) {
  EXPECT_EQ(NcclCollective::Create("short", 0, 1, 0).status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::string> id = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(NcclCollective::Create(*id, 2, 2, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve::kernels::cuda
