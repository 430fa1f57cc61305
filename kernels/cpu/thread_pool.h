// A persistent pool of worker threads for data-parallel loops.
//
// ParallelFor hands each of the pool's threads (the caller included) one
// contiguous slice of [0, n). Workers spin briefly after a job before they
// block, so the back-to-back operators of one forward step do not pay a
// sleep/wake-up each.
//
// Thread safety: one ParallelFor at a time (callers serialise; the model
// forward is single-caller). The body must not throw.
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
  // REQUIRES: num_threads >= 1 (1 = run everything on the caller).
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Calls body(begin, end, thread_index) on disjoint slices covering [0, n),
  // at most one per thread; returns when all are done.
  void ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& body);

  // Like ParallelFor but with slice boundaries given: slice t is
  // [bounds[t], bounds[t+1]). REQUIRES: bounds.size() == num_threads() + 1.
  void ParallelRanges(const std::vector<int64_t>& bounds,
                      const std::function<void(int64_t, int64_t, int)>& body);

 private:
  void WorkerLoop(int index);

  const int num_threads_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t, int64_t, int)>* body_ = nullptr;
  const std::vector<int64_t>* bounds_ = nullptr;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  absl::Mutex mu_;
  uint64_t sleep_epoch_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_THREAD_POOL_H_
