// KV pool counts for readers that must never wait behind a forward pass
// (Status, health checks, metrics): the workers hold the pool's lock for a
// whole forward, which can take longer than a health probe's deadline. The
// counts are read under the lock when it is free at once, else the last
// counts published or read are returned.
//
// Thread safety: thread-safe.
#ifndef PDSERVE_COMMON_POOL_COUNTERS_H_
#define PDSERVE_COMMON_POOL_COUNTERS_H_

#include <cstdint>

#include "absl/synchronization/mutex.h"
#include "common/kv_cache.h"

namespace pdserve {

class PoolCounters {
 public:
  struct Counts {
    int32_t total = 0;
    int32_t used = 0;
    int32_t free = 0;
    int32_t block_size = 0;
  };

  // Reads once, waiting for the lock. REQUIRES: both outlive this object.
  PoolCounters(const BlockPool* pool, absl::Mutex* pool_mu) : pool_(pool), pool_mu_(pool_mu) {
    absl::MutexLock lock(pool_mu_);
    last_ = ReadLocked();
  }

  // After work done under the pool's lock (a forward, a decode step), so
  // that readers see counts at most one such step old.
  void Publish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(*pool_mu_) {
    const Counts c = ReadLocked();
    absl::MutexLock lock(&mu_);
    last_ = c;
  }

  Counts Read() {
    if (pool_mu_->TryLock()) {
      const Counts c = ReadLocked();
      pool_mu_->Unlock();
      absl::MutexLock lock(&mu_);
      last_ = c;
      return c;
    }
    absl::MutexLock lock(&mu_);
    return last_;
  }

 private:
  Counts ReadLocked() const {
    return {pool_->spec().num_blocks, pool_->num_used(), pool_->num_free(), pool_->spec().block_size};
  }

  const BlockPool* pool_;
  absl::Mutex* pool_mu_;
  absl::Mutex mu_;
  Counts last_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve

#endif  // PDSERVE_COMMON_POOL_COUNTERS_H_
