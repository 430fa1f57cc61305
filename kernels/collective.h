// Collectives between the ranks of one tensor-parallel worker (DESIGN.md
// fact 12): each rank holds a slice of every layer and meets the others at
// the all-reduces after the row-parallel projections and at the vocabulary
// gather. Two implementations: ThreadCollectiveGroup (kernels/cpu/), for
// ranks that are threads of one process on the CPU, and NCCL
// (kernels/cuda/nccl_collective.h) for GPU ranks.
//
// Every rank of a group calls the same collectives in the same order with
// the same sizes; buffers live in the rank's backend memory (host memory on
// the CPU). A collective that fails fails on every rank (the group is then
// broken: every later call returns the same error), so a worker can report
// NOT_SERVING with the reason instead of hanging.
//
// Thread safety: one Collective is driven by its own rank's thread only.
#ifndef PDSERVE_KERNELS_COLLECTIVE_H_
#define PDSERVE_KERNELS_COLLECTIVE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace pdserve::kernels {

class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "threads", "nccl": for logs and Status.
  virtual const char* Name() const = 0;

  // data[0, n) on every rank becomes the element-wise sum over ranks; every
  // rank holds the same bits and a rerun gives the same bits (the thread
  // implementation adds in rank order 0, 1, ..., size-1; NCCL in its
  // algorithm's order).
  virtual absl::Status AllReduceSum(float* data, int64_t n) = 0;
  // out[r * bytes, (r + 1) * bytes) = rank r's in[0, bytes), on every rank.
  // `out` holds size() * bytes; `in` may alias out's own slot.
  virtual absl::Status AllGather(const void* in, size_t bytes, void* out) = 0;
  // data[0, bytes) on every rank becomes root's.
  virtual absl::Status Broadcast(void* data, size_t bytes, int root) = 0;
  virtual absl::Status Barrier() = 0;
};

}  // namespace pdserve::kernels

#endif  // PDSERVE_KERNELS_COLLECTIVE_H_
