#include "kernels/cpu/thread_pool.h"

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <chrono>

namespace pdserve::kernels::cpu {
namespace {
// How long an idle worker spins before it blocks: a forward step issues
// dozens of parallel operators a few microseconds apart, and waking a blocked
// thread costs tens of microseconds or more (much more in a VM).
constexpr auto kSpinTime = std::chrono::milliseconds(5);
}  // namespace

ThreadPool::ThreadPool(int num_threads)
    : num_threads_(num_threads < 1 ? 1 : num_threads), shares_(static_cast<size_t>(num_threads_)) {
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_.store(true, std::memory_order_release);
    ++sleep_job_;
  }
  for (auto& t : workers_) t.join();
}

void ThreadPool::RunChunks(uint32_t job) {
  uint64_t v = next_.load(std::memory_order_acquire);
  while (true) {
    if (static_cast<uint32_t>(v >> 32) != job || static_cast<uint32_t>(v) >= num_chunks_) return;
    if (!next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
    // The job cannot retire before this claimed chunk is done, so its body
    // and bounds stay valid here.
    const uint32_t c = static_cast<uint32_t>(v);
    const std::vector<int64_t>& b = *bounds_;
    if (b[c] < b[c + 1]) (*body_)(b[c], b[c + 1]);
    done_.fetch_add(1, std::memory_order_acq_rel);
    v = next_.load(std::memory_order_acquire);
  }
}

namespace {
// A share's packed state: the job's low 24 bits, then the first and the
// end grain not yet claimed (20 bits each).
constexpr int kGrainBits = 20;
constexpr uint64_t kGrainMask = (uint64_t{1} << kGrainBits) - 1;
constexpr uint64_t kJobMask = (uint64_t{1} << 24) - 1;
uint64_t PackShare(uint32_t job, int64_t front, int64_t end) {
  return (static_cast<uint64_t>(job) & kJobMask) << (2 * kGrainBits) | static_cast<uint64_t>(front) << kGrainBits |
         static_cast<uint64_t>(end);
}
}  // namespace

int64_t ThreadPool::ClaimGrain(uint32_t job, int owner, bool front) {
  std::atomic<uint64_t>& v = shares_[owner].v;
  uint64_t s = v.load(std::memory_order_acquire);
  while (true) {
    if ((s >> (2 * kGrainBits)) != (job & kJobMask)) return -1;
    const int64_t f = static_cast<int64_t>((s >> kGrainBits) & kGrainMask);
    const int64_t e = static_cast<int64_t>(s & kGrainMask);
    if (f >= e) return -1;
    const uint64_t next = front ? PackShare(job, f + 1, e) : PackShare(job, f, e - 1);
    if (v.compare_exchange_weak(s, next, std::memory_order_acq_rel)) return front ? f : e - 1;
  }
}

void ThreadPool::RunStealing(uint32_t job, int self) {
  auto run = [&](int64_t g) {
    const int64_t b = g * grain_;
    (*body_)(b, std::min(n_, b + grain_));
    done_.fetch_add(1, std::memory_order_acq_rel);
  };
  for (int64_t g; (g = ClaimGrain(job, self, true)) >= 0;) run(g);
  while (true) {
    // The share with the most grains left, from its back.
    int victim = -1;
    int64_t most = 0;
    for (int t = 0; t < num_threads_; ++t) {
      const uint64_t s = shares_[t].v.load(std::memory_order_acquire);
      if ((s >> (2 * kGrainBits)) != (job & kJobMask)) return;
      const int64_t left = static_cast<int64_t>(s & kGrainMask) - static_cast<int64_t>((s >> kGrainBits) & kGrainMask);
      if (left > most) {
        most = left;
        victim = t;
      }
    }
    if (victim < 0) return;
    if (const int64_t g = ClaimGrain(job, victim, false); g >= 0) run(g);
  }
}

void ThreadPool::WorkerLoop(int self) {
  uint32_t seen = 0;
  while (true) {
    uint32_t j = job_.load(std::memory_order_acquire);
    if (j == seen) {
      const auto deadline = std::chrono::steady_clock::now() + kSpinTime;
      while (j == seen && !stop_.load(std::memory_order_relaxed)) {
        for (int i = 0; i < 64 && j == seen; ++i) {
          _mm_pause();
          j = job_.load(std::memory_order_acquire);
        }
        if (j == seen && std::chrono::steady_clock::now() > deadline) break;
      }
    }
    if (j == seen) {
      absl::MutexLock lock(&mu_);
      auto woken = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_.load(std::memory_order_acquire) ||
               job_.load(std::memory_order_acquire) != seen;
      };
      mu_.Await(absl::Condition(&woken));
      j = job_.load(std::memory_order_acquire);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = j;
    // The job's kind is published before job_ (release; read after the
    // acquire above). A job that has already ended finds nothing to claim.
    if (stealing_.load(std::memory_order_relaxed)) {
      RunStealing(j, self);
    } else {
      RunChunks(j);
    }
  }
}

void ThreadPool::ParallelChunks(const std::vector<int64_t>& bounds, const Body& body) {
  const uint32_t chunks = bounds.size() < 2 ? 0 : static_cast<uint32_t>(bounds.size() - 1);
  if (num_threads_ == 1 || chunks <= 1) {
    for (uint32_t c = 0; c < chunks; ++c) {
      if (bounds[c] < bounds[c + 1]) body(bounds[c], bounds[c + 1]);
    }
    return;
  }
  const uint32_t job = job_.load(std::memory_order_relaxed) + 1;
  stealing_.store(false, std::memory_order_relaxed);
  body_ = &body;
  bounds_ = &bounds;
  num_chunks_ = chunks;
  done_.store(0, std::memory_order_relaxed);
  next_.store(static_cast<uint64_t>(job) << 32, std::memory_order_release);
  {
    // Taking the lock orders the publication against a worker deciding to
    // sleep, and wakes sleepers.
    absl::MutexLock lock(&mu_);
    job_.store(job, std::memory_order_release);
    ++sleep_job_;
  }
  RunChunks(job);
  int spins = 0;
  while (done_.load(std::memory_order_acquire) != chunks) {
    _mm_pause();
    // A worker holding the last chunk may be descheduled: let it run.
    if (++spins % 1024 == 0) sched_yield();
  }
}

void ThreadPool::ParallelStealing(int64_t n, int64_t grain, const Body& body) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  int64_t grains = (n + grain - 1) / grain;
  // The packed shares hold grain indices below 2^20: coarser grains beyond.
  if (grains > static_cast<int64_t>(kGrainMask)) {
    grain = (n + static_cast<int64_t>(kGrainMask) - 1) / static_cast<int64_t>(kGrainMask);
    grains = (n + grain - 1) / grain;
  }
  if (num_threads_ == 1 || grains <= 1) {
    body(0, n);
    return;
  }
  const uint32_t job = job_.load(std::memory_order_relaxed) + 1;
  stealing_.store(true, std::memory_order_relaxed);
  body_ = &body;
  grain_ = grain;
  n_ = n;
  done_.store(0, std::memory_order_relaxed);
  for (int t = 0; t < num_threads_; ++t) {
    shares_[t].v.store(PackShare(job, grains * t / num_threads_, grains * (t + 1) / num_threads_),
                       std::memory_order_release);
  }
  {
    absl::MutexLock lock(&mu_);
    job_.store(job, std::memory_order_release);
    ++sleep_job_;
  }
  RunStealing(job, 0);
  int spins = 0;
  while (done_.load(std::memory_order_acquire) != static_cast<uint32_t>(grains)) {
    _mm_pause();
    if (++spins % 1024 == 0) sched_yield();
  }
}

void ThreadPool::ParallelFor(int64_t n, const Body& body, int chunks_per_thread) {
  if (n <= 0) return;
  const int64_t chunks = std::min<int64_t>(n, static_cast<int64_t>(num_threads_) * chunks_per_thread);
  for_bounds_.resize(chunks + 1);
  for (int64_t c = 0; c <= chunks; ++c) for_bounds_[c] = n * c / chunks;
  ParallelChunks(for_bounds_, body);
}

}  // namespace pdserve::kernels::cpu
