#include "kernels/cuda/nccl_collective.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace pdserve::kernels::cuda {
namespace {

absl::Status NcclError(const char* what, ncclResult_t r) {
  return absl::UnavailableError(absl::StrCat(what, ": NCCL error ", static_cast<int>(r), " (",
                                             ncclGetErrorString(r), ")"));
}

}  // namespace

struct NcclCollective::State {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  float* scratch = nullptr;  // One float on the device, for Barrier.
  int device = 0;
};

absl::StatusOr<std::string> NcclCollective::NewUniqueId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return NcclError("ncclGetUniqueId", r);
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<NcclCollective>> NcclCollective::Create(const std::string& unique_id, int rank,
                                                                       int size, int device) {
  ncclUniqueId id;
  if (unique_id.size() != sizeof(id.internal)) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL unique id of ", unique_id.size(), " bytes (want ",
                                                   sizeof(id.internal), ")"));
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("NCCL rank ", rank, " of ", size));
  }
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  auto state = std::make_unique<State>();
  state->device = device;
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return CudaError("cudaSetDevice", e);
  if (cudaError_t e = cudaStreamCreateWithFlags(&state->stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return CudaError("cudaStreamCreate", e);
  }
  if (cudaError_t e = cudaMalloc(reinterpret_cast<void**>(&state->scratch), sizeof(float)); e != cudaSuccess) {
    cudaStreamDestroy(state->stream);
    return CudaError("cudaMalloc", e);
  }
  if (ncclResult_t r = ncclCommInitRank(&state->comm, size, id, rank); r != ncclSuccess) {
    cudaFree(state->scratch);
    cudaStreamDestroy(state->stream);
    return NcclError("ncclCommInitRank", r);
  }
  return std::unique_ptr<NcclCollective>(new NcclCollective(std::move(state), rank, size));
}

NcclCollective::NcclCollective(std::unique_ptr<State> state, int rank, int size)
    : state_(std::move(state)), rank_(rank), size_(size) {}

NcclCollective::~NcclCollective() {
  cudaSetDevice(state_->device);
  ncclCommDestroy(state_->comm);
  cudaFree(state_->scratch);
  cudaStreamDestroy(state_->stream);
}

absl::Status NcclCollective::Finish(const char* what, int nccl_result) {
  const auto r = static_cast<ncclResult_t>(nccl_result);
  if (r != ncclSuccess) return NcclError(what, r);
  if (cudaError_t e = cudaStreamSynchronize(state_->stream); e != cudaSuccess) return CudaError(what, e);
  return absl::OkStatus();
}

absl::Status NcclCollective::AllReduceSum(float* data, int64_t n) {
  return Finish("ncclAllReduce",
                ncclAllReduce(data, data, static_cast<size_t>(n), ncclFloat, ncclSum, state_->comm, state_->stream));
}

absl::Status NcclCollective::AllGather(const void* in, size_t bytes, void* out) {
  return Finish("ncclAllGather", ncclAllGather(in, out, bytes, ncclChar, state_->comm, state_->stream));
}

absl::Status NcclCollective::Broadcast(void* data, size_t bytes, int root) {
  return Finish("ncclBroadcast", ncclBroadcast(data, data, bytes, ncclChar, root, state_->comm, state_->stream));
}

absl::Status NcclCollective::Barrier() {
  return Finish("ncclAllReduce (barrier)",
                ncclAllReduce(state_->scratch, state_->scratch, 1, ncclFloat, ncclSum, state_->comm, state_->stream));
}

}  // namespace pdserve::kernels::cuda
