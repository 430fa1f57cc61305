// What a worker's prefix cache holds, as a stream of events the router
// follows for prefix-aware routing.
//
// The pool reports every block it publishes under a content hash (stored,
// with the parent block's hash: the chain of kv/block_hash.h) and every
// cached block it evicts (removed). The log numbers them 1, 2, 3, ... per
// process; event 1 is always `cleared` (a new process holds nothing), so a
// reader that sees it after a restart drops what it knew.
//
// Readers pull: Read(after) gives the events with id > after, at most
// max_events of them. The log keeps the last `capacity` events; a reader
// that fell further behind (or asks about ids this process never issued,
// e.g. a restarted worker) gets a snapshot instead: `cleared` followed by a
// `stored` for every block cached now, and continues from its last_id.
//
// Thread safety: thread-safe. The pool calls the listener under its own
// lock; Read never waits for the pool (the log mirrors what is cached).
#ifndef PDSERVE_KV_KV_EVENTS_H_
#define PDSERVE_KV_KV_EVENTS_H_

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "kv/block_hash.h"
#include "kv/kv_cache.h"

namespace pdserve {

enum class KvEventKind : uint8_t { kStored = 1, kRemoved = 2, kCleared = 3 };

struct KvEvent {
  uint64_t id = 0;
  KvEventKind kind = KvEventKind::kStored;
  BlockHash hash;    // Stored, removed.
  BlockHash parent;  // Stored: the previous block's hash (zero for block 0).
};

struct KvEventBatch {
  std::vector<KvEvent> events;
  // The events replace what the reader knew (they start with `cleared`).
  bool snapshot = false;
  // Read again from this id (the last event given, or the log's last id
  // for a snapshot).
  uint64_t last_id = 0;
  bool more = false;  // More events follow last_id now.
};

class KvEventLog final : public BlockPoolListener {
 public:
  explicit KvEventLog(size_t capacity = 1 << 16);

  void OnStored(const BlockHash& hash, const BlockHash& parent) override;
  void OnRemoved(const BlockHash& hash) override;

  // Events after `after` (0: from the start), at most max_events (a
  // snapshot is never cut short).
  KvEventBatch Read(uint64_t after, size_t max_events = 4096) const;

  uint64_t last_id() const;
  size_t num_cached() const;

 private:
  void Append(KvEvent e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<KvEvent> events_ ABSL_GUARDED_BY(mu_);  // Ids consecutive, ending at next_id_ - 1.
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  // What is cached now: hash -> parent.
  absl::flat_hash_map<BlockHash, BlockHash> cached_ ABSL_GUARDED_BY(mu_);
};

// The prefix cache's tiers as one stream: a block counts as held while the
// pool or the second tier (kv/tier2_store.h) holds it. Give pool() to the
// KV manager and tier2() to the store; `out` hears a block stored when the
// first tier takes it, and removed when the last one lets it go. So the
// router's index counts a prefix evicted from the pool but kept on disk as
// held there (reading it back costs a restore, not a prefill).
//
// Thread safety: thread-safe. Each side is called under its tier's lock and
// calls `out` under its own: the order is always tier, this, `out`.
class TieredListener {
 public:
  // REQUIRES: `out` outlives this.
  explicit TieredListener(BlockPoolListener* out) : out_(out) {}
  BlockPoolListener* pool() { return &pool_; }
  BlockPoolListener* tier2() { return &tier2_; }

 private:
  class Side final : public BlockPoolListener {
   public:
    Side(TieredListener* owner, uint8_t bit) : owner_(owner), bit_(bit) {}
    void OnStored(const BlockHash& hash, const BlockHash& parent) override { owner_->Stored(bit_, hash, parent); }
    void OnRemoved(const BlockHash& hash) override { owner_->Removed(bit_, hash); }

   private:
    TieredListener* owner_;
    uint8_t bit_;
  };
  void Stored(uint8_t bit, const BlockHash& hash, const BlockHash& parent);
  void Removed(uint8_t bit, const BlockHash& hash);

  BlockPoolListener* const out_;
  absl::Mutex mu_;
  absl::flat_hash_map<BlockHash, uint8_t> held_ ABSL_GUARDED_BY(mu_);  // Which tiers hold each block.
  Side pool_{this, 1};
  Side tier2_{this, 2};
};

}  // namespace pdserve

#endif  // PDSERVE_KV_KV_EVENTS_H_
