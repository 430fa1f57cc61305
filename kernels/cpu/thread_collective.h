// Collectives for tensor-parallel ranks that are threads of one process
// (kernels/collective.h). The ranks share memory, so a collective is a
// meeting: each rank publishes its buffer, every rank then works on its own
// slice of the result across all ranks' buffers, and a second meeting lets
// them go. An all-reduce moves nothing but the reduction itself (rank r
// sums slice r over every rank's buffer, in rank order, and writes the sum
// into every buffer); a gather copies each rank's part once into every
// output.
//
// Waiting spins for a few microseconds and then blocks on a condition
// variable, so eight ranks on two cores still make progress.
//
// Failure: Break() (or an injected failure) fails the pending and every
// later collective on every rank with its status.
//
// Thread safety: rank(r) is driven by rank r's thread only; Break and
// InjectFailure may be called from any thread.
#ifndef PDSERVE_KERNELS_CPU_THREAD_COLLECTIVE_H_
#define PDSERVE_KERNELS_CPU_THREAD_COLLECTIVE_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "kernels/collective.h"

namespace pdserve::kernels::cpu {

// What one rank spent in collectives since the group was made.
struct CollectiveStats {
  int64_t calls = 0;
  int64_t bytes = 0;        // Payload of its calls (its own buffer's bytes).
  double seconds = 0;       // Wall time inside them, waits included.
};

class ThreadCollectiveGroup {
 public:
  // REQUIRES: size >= 1.
  explicit ThreadCollectiveGroup(int size);
  ~ThreadCollectiveGroup();
  ThreadCollectiveGroup(const ThreadCollectiveGroup&) = delete;
  ThreadCollectiveGroup& operator=(const ThreadCollectiveGroup&) = delete;

  int size() const { return size_; }
  // REQUIRES: 0 <= r < size(). Lives as long as the group.
  Collective& rank(int r);
  CollectiveStats stats(int r) const;

  // Every pending and later collective returns `why` on every rank.
  // REQUIRES: !why.ok().
  void Break(absl::Status why);
  // The group's error, OK while it works.
  absl::Status broken() const;
  // The `nth` collective (1-based, counted from now, any kind) fails with
  // `why` on every rank: a fault for tests.
  void InjectFailure(int64_t nth, absl::Status why);

 private:
  class Rank;
  friend class Rank;

  // Waits until every rank has arrived (each exactly once per meeting).
  absl::Status Meet();
  // Counts a collective on rank 0 and fires an injected failure.
  absl::Status CountCall(int r);

  const int size_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  // What each rank published for the current collective.
  std::vector<void*> published_;
  const void* published_root_ = nullptr;  // A broadcast's source.

  std::atomic<int> arrived_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> is_broken_{false};
  mutable absl::Mutex mu_;
  absl::CondVar met_;
  absl::Status why_ ABSL_GUARDED_BY(mu_);
  int64_t fail_at_ ABSL_GUARDED_BY(mu_) = 0;  // 0: no injected failure
  absl::Status fail_why_ ABSL_GUARDED_BY(mu_);
  int64_t calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_THREAD_COLLECTIVE_H_
