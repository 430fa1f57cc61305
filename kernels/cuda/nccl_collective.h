// Collectives for GPU ranks over NCCL (kernels/collective.h): one rank per
// device, buffers in device memory, each call enqueued on the rank's stream
// and waited for before it returns (the forward that uses it is written
// against blocking collectives).
//
// NCCL sums in its own algorithm's order (ring or tree), not rank order:
// every rank still receives the same bits, and a rerun on the same
// topology gives the same bits.
//
// Set-up: one process (or thread) makes a unique id with NewUniqueId and
// hands it to every rank; each rank calls Create on its own thread, with
// its device current. Create blocks until all ranks have joined.
//
// Thread safety: one NcclCollective per rank, driven by that rank's thread.
#ifndef PDSERVE_KERNELS_CUDA_NCCL_COLLECTIVE_H_
#define PDSERVE_KERNELS_CUDA_NCCL_COLLECTIVE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/collective.h"
#include "kernels/cuda/cuda_backend.h"  // CudaDeviceCount

namespace pdserve::kernels::cuda {

class NcclCollective final : public Collective {
 public:
  // An id for one communicator (opaque bytes, the same on every rank).
  static absl::StatusOr<std::string> NewUniqueId();
  // Joins communicator `unique_id` as `rank` of `size` on `device`.
  // Errors: INVALID_ARGUMENT for a malformed id or rank, UNAVAILABLE for
  // CUDA or NCCL failures (named).
  static absl::StatusOr<std::unique_ptr<NcclCollective>> Create(const std::string& unique_id, int rank,
                                                                int size, int device);
  ~NcclCollective() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* Name() const override { return "nccl"; }
  absl::Status AllReduceSum(float* data, int64_t n) override;
  absl::Status AllGather(const void* in, size_t bytes, void* out) override;
  absl::Status Broadcast(void* data, size_t bytes, int root) override;
  absl::Status Barrier() override;

 private:
  struct State;
  NcclCollective(std::unique_ptr<State> state, int rank, int size);
  absl::Status Finish(const char* what, int nccl_result);

  std::unique_ptr<State> state_;
  int rank_;
  int size_;
};

}  // namespace pdserve::kernels::cuda

#endif  // PDSERVE_KERNELS_CUDA_NCCL_COLLECTIVE_H_
