// A persistent pool of worker threads for data-parallel loops.
//
// A parallel loop is cut into chunks that the caller and the workers claim
// dynamically, so a worker that the OS has descheduled (two vCPUs shared with
// other processes) delays the loop by at most the chunk it holds, never by a
// fixed share. Idle workers spin for a few milliseconds before they block, so
// the back-to-back operators of one forward step do not pay a wake-up each.
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

 private:
  void WorkerLoop();
  // Claims and runs chunks of job `job` until none is left.
  void RunChunks(uint32_t job);

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
  std::atomic<bool> stop_{false};
  // ParallelFor's chunk bounds, reused (one loop at a time) so that the
  // dozens of loops of a forward step allocate nothing.
  std::vector<int64_t> for_bounds_;
  absl::Mutex mu_;
  uint32_t sleep_job_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_THREAD_POOL_H_
