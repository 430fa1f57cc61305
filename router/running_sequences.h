// What the router knows of each sequence decoding now: its decode
// attempt's id, its worker, its context and what it may still generate.
// Relays keep their entry while they read a decode stream; the rebalance
// (router/rebalance.h) reads them all.
//
// Thread safety: thread-safe.
#ifndef PDSERVE_ROUTER_RUNNING_SEQUENCES_H_
#define PDSERVE_ROUTER_RUNNING_SEQUENCES_H_

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "router/rebalance.h"

namespace pdserve::router {

class RunningSequences {
 public:
  // `owner`'s sequence (one per owner: a relay).
  void Set(const void* owner, SequenceLoad s) {
    absl::MutexLock lock(&mu_);
    by_owner_[owner] = std::move(s);
  }
  void Remove(const void* owner) {
    absl::MutexLock lock(&mu_);
    by_owner_.erase(owner);
  }
  std::vector<SequenceLoad> Snapshot() const {
    absl::MutexLock lock(&mu_);
    std::vector<SequenceLoad> out;
    out.reserve(by_owner_.size());
    for (const auto& [owner, s] : by_owner_) out.push_back(s);
    return out;
  }

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<const void*, SequenceLoad> by_owner_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_RUNNING_SEQUENCES_H_
