// A persistent pool of worker threads for data-parallel loops.
//
// A parallel loop is cut into chunks that the caller and the workers claim
// dynamically, so a worker that the OS has descheduled (two vCPUs shared with
// other processes) delays the loop by at most the chunk it holds, never by a
// fixed share. ParallelStealing instead gives each thread a contiguous share
// to walk in order (one stream through memory) and lets a thread that runs
// out take grains from the back of another's. Idle workers spin for a few
// milliseconds before they block, so the back-to-back operators of one
// forward step do not pay a wake-up each.
//
// Thread safety: one loop at a time (the forward is single-caller). Bodies
// must not throw.
#ifndef PDSERVE_KERNELS_CPU_THREAD_POOL_H_
#define PDSERVE_KERNELS_CPU_THREAD_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace pdserve::kernels::cpu {

class ThreadPool {
 public:
  using Body = std::function<void(int64_t begin, int64_t end)>;

  // REQUIRES: num_threads >= 1 (1 = run everything on the caller).
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Calls body(begin, end) on disjoint chunks covering [0, n), about
  // chunks_per_thread per thread; returns when all are done.
  void ParallelFor(int64_t n, const Body& body, int chunks_per_thread = 4);

  // Chunk c is [bounds[c], bounds[c + 1]). REQUIRES: bounds non-decreasing.
  void ParallelChunks(const std::vector<int64_t>& bounds, const Body& body);

  // Calls body(begin, end) on grains of `grain` items covering [0, n) (the
  // last may be shorter). Each thread owns a contiguous share of the grains
  // and runs it front to back, a grain at a time; one that runs out takes
  // grains from the back of the share with the most left. So each thread
  // walks one stream through memory, and the last to finish waits for at
  // most a grain, not a chunk. REQUIRES: grain >= 1.
  void ParallelStealing(int64_t n, int64_t grain, const Body& body);

 private:
  // Participant `self` (0: the caller) of a job.
  void WorkerLoop(int self);
  // Claims and runs chunks of job `job` until none is left.
  void RunChunks(uint32_t job);
  // ParallelStealing's part of participant `self` in job `job`.
  void RunStealing(uint32_t job, int self);
  // One grain of participant `owner`'s share, from its front (the owner)
  // or its back (a thief); -1 when the share is empty or the job is over.
  int64_t ClaimGrain(uint32_t job, int owner, bool front);

  const int num_threads_;
  std::vector<std::thread> workers_;

  // The current job. `next_` packs (job id << 32 | next chunk index), so a
  // late worker can never claim a chunk of a job other than the one it saw.
  const Body* body_ = nullptr;
  const std::vector<int64_t>* bounds_ = nullptr;
  uint32_t num_chunks_ = 0;
  std::atomic<uint64_t> next_{0};
  std::atomic<uint32_t> done_{0};
  std::atomic<uint32_t> job_{0};
  // ParallelStealing's job (when stealing_): grains of grain_ items up to
  // n_, and each participant's share as (job id low 24 bits << 40 | front
  // grain << 20 | end grain), each on its own cache line.
  std::atomic<bool> stealing_{false};
  int64_t grain_ = 1;
  int64_t n_ = 0;
  struct alignas(64) Share {
    std::atomic<uint64_t> v{0};
  };
  std::vector<Share> shares_;
  std::atomic<bool> stop_{false};
  // ParallelFor's chunk bounds, reused (one loop at a time) so that the
  // dozens of loops of a forward step allocate nothing.
  std::vector<int64_t> for_bounds_;
  absl::Mutex mu_;
  uint32_t sleep_job_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_THREAD_POOL_H_
