#include "kernels/cpu/thread_pool.h"

#include <immintrin.h>

namespace pdserve::kernels::cpu {
namespace {
// About 50-100 microseconds of spinning before a worker blocks.
constexpr int kSpinIterations = 20000;
}  // namespace

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_.store(true, std::memory_order_release);
    ++sleep_epoch_;
  }
  for (auto& t : workers_) t.join();
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  while (true) {
    uint64_t e = epoch_.load(std::memory_order_acquire);
    for (int spin = 0; e == seen && spin < kSpinIterations; ++spin) {
      _mm_pause();
      e = epoch_.load(std::memory_order_acquire);
    }
    if (e == seen) {
      absl::MutexLock lock(&mu_);
      auto woken = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_.load(std::memory_order_acquire) ||
               epoch_.load(std::memory_order_acquire) != seen;
      };
      mu_.Await(absl::Condition(&woken));
      if (stop_.load(std::memory_order_acquire)) return;
      e = epoch_.load(std::memory_order_acquire);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = e;
    const std::vector<int64_t>& b = *bounds_;
    if (b[index] < b[index + 1]) (*body_)(b[index], b[index + 1], index);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::ParallelRanges(const std::vector<int64_t>& bounds,
                                const std::function<void(int64_t, int64_t, int)>& body) {
  if (num_threads_ == 1) {
    if (bounds[0] < bounds[1]) body(bounds[0], bounds[1], 0);
    return;
  }
  body_ = &body;
  bounds_ = &bounds;
  pending_.store(num_threads_ - 1, std::memory_order_release);
  {
    // Taking the lock orders the epoch bump against a worker deciding to sleep.
    absl::MutexLock lock(&mu_);
    epoch_.fetch_add(1, std::memory_order_acq_rel);
    ++sleep_epoch_;
  }
  if (bounds[0] < bounds[1]) body(bounds[0], bounds[1], 0);
  while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t, int64_t, int)>& body) {
  std::vector<int64_t> bounds(num_threads_ + 1);
  for (int t = 0; t <= num_threads_; ++t) bounds[t] = n * t / num_threads_;
  ParallelRanges(bounds, body);
}

}  // namespace pdserve::kernels::cpu
