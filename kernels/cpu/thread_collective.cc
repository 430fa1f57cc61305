#include "kernels/cpu/thread_collective.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/base/internal/raw_logging.h"

namespace pdserve::kernels::cpu {
namespace {

// Spin this many pauses (a few microseconds) before blocking.
constexpr int kSpins = 256;

inline void Pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

// Rank r's share of n elements, cut at 16-element (64-byte) boundaries so
// that no two ranks write one cache line.
std::pair<int64_t, int64_t> Slice(int64_t n, int r, int size) {
  const int64_t lines = (n + 15) / 16;
  const int64_t lo = std::min(n, lines * r / size * 16);
  const int64_t hi = std::min(n, lines * (r + 1) / size * 16);
  return {lo, hi};
}

}  // namespace

class ThreadCollectiveGroup::Rank final : public Collective {
 public:
  Rank(ThreadCollectiveGroup* group, int r) : g_(group), r_(r) {}
  int rank() const override { return r_; }
  int size() const override { return g_->size_; }
  const char* Name() const override { return "threads"; }

  absl::Status AllReduceSum(float* data, int64_t n) override {
    return Timed(n * static_cast<int64_t>(sizeof(float)), [&]() -> absl::Status {
      g_->published_[r_] = data;
      if (absl::Status s = g_->Meet(); !s.ok()) return s;
      const auto [lo, hi] = Slice(n, r_, g_->size_);
      constexpr int64_t kChunk = 512;
      float acc[kChunk];
      for (int64_t c = lo; c < hi; c += kChunk) {
        const int64_t len = std::min(kChunk, hi - c);
        const float* first = static_cast<const float*>(g_->published_[0]) + c;
        std::copy(first, first + len, acc);
        for (int j = 1; j < g_->size_; ++j) {
          const float* src = static_cast<const float*>(g_->published_[j]) + c;
          for (int64_t i = 0; i < len; ++i) acc[i] += src[i];
        }
        for (int j = 0; j < g_->size_; ++j) {
          std::memcpy(static_cast<float*>(g_->published_[j]) + c, acc, len * sizeof(float));
        }
      }
      return g_->Meet();
    });
  }

  absl::Status AllGather(const void* in, size_t bytes, void* out) override {
    return Timed(static_cast<int64_t>(bytes), [&]() -> absl::Status {
      g_->published_[r_] = out;
      if (absl::Status s = g_->Meet(); !s.ok()) return s;
      // This rank's part goes into slot r_ of every output.
      for (int j = 0; j < g_->size_; ++j) {
        char* dst = static_cast<char*>(g_->published_[j]) + r_ * bytes;
        if (dst != in) std::memcpy(dst, in, bytes);
      }
      return g_->Meet();
    });
  }

  absl::Status Broadcast(void* data, size_t bytes, int root) override {
    ABSL_RAW_CHECK(root >= 0 && root < g_->size_, "broadcast root outside the group");
    return Timed(static_cast<int64_t>(bytes), [&]() -> absl::Status {
      if (r_ == root) g_->published_root_ = data;
      if (absl::Status s = g_->Meet(); !s.ok()) return s;
      if (r_ != root) std::memcpy(data, g_->published_root_, bytes);
      return g_->Meet();
    });
  }

  absl::Status Barrier() override {
    return Timed(0, [&] { return g_->Meet(); });
  }

  CollectiveStats stats() const { return stats_; }

 private:
  template <typename Fn>
  absl::Status Timed(int64_t bytes, Fn fn) {
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = g_->CountCall(r_);
    if (s.ok()) s = fn();
    ++stats_.calls;
    stats_.bytes += bytes;
    stats_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return s;
  }

  ThreadCollectiveGroup* const g_;
  const int r_;
  CollectiveStats stats_;
};

ThreadCollectiveGroup::ThreadCollectiveGroup(int size)
    : size_(size), published_(size, nullptr) {
  ABSL_RAW_CHECK(size >= 1, "a group needs a rank");
  for (int r = 0; r < size; ++r) ranks_.push_back(std::make_unique<Rank>(this, r));
}

ThreadCollectiveGroup::~ThreadCollectiveGroup() = default;

Collective& ThreadCollectiveGroup::rank(int r) {
  ABSL_RAW_CHECK(r >= 0 && r < size_, "rank outside the group");
  return *ranks_[r];
}

CollectiveStats ThreadCollectiveGroup::stats(int r) const {
  ABSL_RAW_CHECK(r >= 0 && r < size_, "rank outside the group");
  return ranks_[r]->stats();
}

void ThreadCollectiveGroup::Break(absl::Status why) {
  ABSL_RAW_CHECK(!why.ok(), "breaking a group needs an error");
  absl::MutexLock lock(&mu_);
  if (why_.ok()) why_ = std::move(why);
  is_broken_.store(true, std::memory_order_release);
  met_.SignalAll();
}

absl::Status ThreadCollectiveGroup::broken() const {
  absl::MutexLock lock(&mu_);
  return why_;
}

void ThreadCollectiveGroup::InjectFailure(int64_t nth, absl::Status why) {
  ABSL_RAW_CHECK(!why.ok(), "breaking a group needs an error");
  absl::MutexLock lock(&mu_);
  fail_at_ = calls_ + nth;
  fail_why_ = std::move(why);
}

absl::Status ThreadCollectiveGroup::CountCall(int r) {
  if (is_broken_.load(std::memory_order_acquire)) return broken();
  if (r != 0) return absl::OkStatus();  // Every rank makes the same calls.
  absl::Status fail;
  {
    absl::MutexLock lock(&mu_);
    ++calls_;
    if (fail_at_ == 0 || calls_ != fail_at_) return absl::OkStatus();
    fail = fail_why_;
    fail_at_ = 0;
  }
  Break(fail);
  return fail;
}

absl::Status ThreadCollectiveGroup::Meet() {
  // The generation cannot move before this rank arrives, so reading it
  // first is safe.
  const uint64_t gen = generation_.load(std::memory_order_acquire);
  if (is_broken_.load(std::memory_order_acquire)) return broken();
  if (size_ == 1) return absl::OkStatus();
  if (arrived_.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
    arrived_.store(0, std::memory_order_relaxed);
    absl::MutexLock lock(&mu_);
    generation_.store(gen + 1, std::memory_order_release);
    met_.SignalAll();
    return absl::OkStatus();
  }
  for (int i = 0; i < kSpins; ++i) {
    if (generation_.load(std::memory_order_acquire) != gen) return absl::OkStatus();
    if (is_broken_.load(std::memory_order_acquire)) return broken();
    Pause();
  }
  absl::MutexLock lock(&mu_);
  while (generation_.load(std::memory_order_acquire) == gen && why_.ok()) met_.Wait(&mu_);
  if (generation_.load(std::memory_order_acquire) != gen) return absl::OkStatus();
  return why_;
}

}  // namespace pdserve::kernels::cpu
