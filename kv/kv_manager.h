// The KV manager: the one place KV blocks are allocated and freed.
//
// Every holder of KV blocks holds them through a SequenceKv, an owner that
// gives its blocks back when it is destroyed (or released): a running
// sequence, a reservation for an incoming handoff, a committed handoff on
// its way to the engine. Allocation happens before a forward, never inside
// it (Model::Forward takes ready block tables), and its failure is a
// RESOURCE_EXHAUSTED the caller acts on (preempt, refuse, retry).
//
// Thread safety: thread-safe. The manager's lock covers bookkeeping only
// (the free list, reference counts, the prefix cache's index, the owners of
// each block): never a forward, a transfer or a wait, so a reader of its
// counts or a transport thread reserving blocks never waits behind
// compute. The bytes of a block are read and written without the lock, by
// whoever holds it (storage()); a published (prefix-cached) block is only
// read. The listener is called under the lock and must not call back;
// free listeners are called outside it, on the thread that gave blocks
// back, so whoever waits for room (an engine) wakes instead of polling.
//
// Programmer errors abort (they are bugs, not conditions to handle): a
// block released by an owner that does not hold it (a double release
// included), a manager destroyed while blocks are still held.
#ifndef PDSERVE_KV_KV_MANAGER_H_
#define PDSERVE_KV_KV_MANAGER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"
#include "kv/kv_cache.h"

namespace pdserve {

class KvManager;

// The KV blocks of one owner (a sequence or a reservation): its block table
// and how many positions hold KV. Move-only; its blocks go back to the
// manager when it is destroyed, assigned over or Release()d.
class SequenceKv {
 public:
  SequenceKv() = default;  // Holds nothing and belongs to no manager.
  SequenceKv(SequenceKv&& other) noexcept;
  SequenceKv& operator=(SequenceKv&& other) noexcept;
  SequenceKv(const SequenceKv&) = delete;
  SequenceKv& operator=(const SequenceKv&) = delete;
  ~SequenceKv();

  int32_t num_positions() const { return num_positions_; }
  // The rank whose block range holds it (request-sharded pools; else 0).
  int32_t rank() const { return rank_; }
  const std::vector<int32_t>& block_table() const { return block_table_; }
  int32_t capacity(int32_t block_size) const { return static_cast<int32_t>(block_table_.size()) * block_size; }
  bool empty() const { return block_table_.empty(); }
  // Records that positions [0, n) hold KV. REQUIRES: n <= capacity.
  void SetNumPositions(int32_t n) { num_positions_ = n; }
  // Gives every block back now (nothing when it holds none).
  void Release();

 private:
  friend class KvManager;
  KvManager* manager_ = nullptr;
  uint64_t owner_ = 0;  // Unique per owner, for the manager's checks.
  std::vector<int32_t> block_table_;
  int32_t num_positions_ = 0;
  int32_t rank_ = 0;
};

struct KvCounts {
  int32_t total = 0;
  int32_t used = 0;       // Referenced by some owner.
  int32_t free = 0;       // An allocation could take them now (free + evictable).
  int32_t cached = 0;     // Published to the prefix cache (referenced or not).
  int32_t block_size = 0;
  PrefixCacheStats prefix;
};

class KvManager {
 public:
  // The region comes from `allocator` (host memory when null). Errors:
  // invalid spec, allocation failure.
  static absl::StatusOr<std::unique_ptr<KvManager>> Create(const KvCacheSpec& spec,
                                                           KvRegionAllocator* allocator = nullptr);
  // REQUIRES: no SequenceKv holds blocks any more (aborts otherwise).
  ~KvManager();

  const KvCacheSpec& spec() const { return storage_.spec; }
  // Where the blocks' bytes are: for the forward and the transfers.
  const KvStorage& storage() const { return storage_; }
  KvRegion& region() { return *region_; }

  // A new owner of this manager's blocks, holding none yet; in a
  // request-sharded pool, its blocks come from `rank`'s range.
  // REQUIRES: 0 <= rank < spec().request_ranks.
  SequenceKv NewSequence(int32_t rank = 0);

  // Where a new request goes (0 unless request-sharded): the rank whose
  // range has the most blocks an allocation could take, ties going round
  // robin from the last rank chosen, so back-to-back requests on an idle
  // pool spread too.
  int32_t PickRank();

  // Makes room in `seq` for `positions` in total (blocks allocated; free
  // blocks first, then the least recently used unreferenced cached ones).
  // RESOURCE_EXHAUSTED (naming the counts) leaves `seq` unchanged.
  // REQUIRES: `seq` belongs to this manager.
  absl::Status Grow(SequenceKv& seq, int32_t positions);
  struct GrowRequest {
    SequenceKv* seq = nullptr;
    int32_t positions = 0;  // In total.
  };
  // Grow for several owners at once, all or nothing (a step's batch).
  absl::Status GrowAll(absl::Span<const GrowRequest> requests);

  // Attaches to the empty `seq` the cached blocks of the longest cached
  // prefix of `hashes` (one reference each) and marks their positions as
  // filled. Returns the number of blocks attached. Counts hits and misses.
  // In a request-sharded pool the prefix stops at the first block outside
  // seq's rank range.
  int32_t AttachCachedPrefix(SequenceKv& seq, absl::Span<const BlockHash> hashes);
  // An owner holding the longest cached prefix of `hashes` and fresh blocks
  // up to `positions` in total, all or nothing: a reservation for an
  // incoming handoff. Its num_positions() is the cached prefix's length;
  // the fresh blocks come in ascending id order (a transfer merges
  // consecutive ones).
  absl::StatusOr<SequenceKv> Reserve(absl::Span<const BlockHash> hashes, int32_t positions, int32_t rank = 0);
  // A new owner holding the one block cached under `hash` (a reader of
  // its bytes, such as the prefix cache's second tier copying it out), or
  // holding nothing when it is not cached. Not a prefix lookup: counts no
  // hit or miss.
  SequenceKv PinCached(const BlockHash& hash);
  // Gives back seq's blocks past its first `keep` (nothing when it holds no
  // more), and caps its positions at what the rest hold.
  void Truncate(SequenceKv& seq, int32_t keep);
  // Publishes seq's first hashes.size() blocks, fully written, under
  // `hashes` (a chain: hashes[i-1] is block i's parent). A hash already
  // cached under another block keeps that block.
  // REQUIRES: `seq` holds at least hashes.size() blocks.
  void Publish(const SequenceKv& seq, absl::Span<const BlockHash> hashes);

  KvCounts Counts() const;
  // Logical vs physical bytes of `sequences` (DESIGN.md fact 4).
  KvMemoryReport ReportMemory(absl::Span<const SequenceKv* const> sequences) const;
  // Receives stored/removed events from now on (null: none).
  // REQUIRES: outlives the manager or is reset first.
  void set_listener(BlockPoolListener* listener);
  // `fn` runs each time an owner gives blocks back (released or
  // destroyed), after the manager's lock is dropped. Returns a handle for
  // RemoveFreeListener; `fn` must not add or remove free listeners.
  int AddFreeListener(std::function<void()> fn);
  void RemoveFreeListener(int handle);
  // Tests: the block's reference count and whether it is cached.
  int32_t RefCount(BlockId b) const;
  bool IsCached(BlockId b) const;

 private:
  friend class SequenceKv;
  KvManager(std::unique_ptr<BlockPool> pool);

  void Release(SequenceKv& seq);
  absl::Status GrowLocked(SequenceKv& seq, int32_t positions) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddOwnerLocked(int32_t block, uint64_t owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveOwnerLocked(int32_t block, uint64_t owner) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Undoes a Grow: drops seq's blocks past `keep`.
  void ShrinkLocked(SequenceKv& seq, size_t keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::unique_ptr<BlockPool> pool_ ABSL_PT_GUARDED_BY(mu_);
  KvStorage storage_;  // Immutable after construction.
  KvRegion* const region_;  // The pool's; the pointer is immutable (the bytes are the holders').
  // Who holds each block (an owner appears once per reference it holds).
  std::vector<absl::InlinedVector<uint64_t, 2>> owners_ ABSL_GUARDED_BY(mu_);
  uint64_t next_owner_ ABSL_GUARDED_BY(mu_) = 1;
  int32_t last_rank_ ABSL_GUARDED_BY(mu_) = -1;  // PickRank's last choice.
  // Its own lock: a listener may take locks under which the manager's is
  // taken (an engine's), so they never nest inside mu_.
  absl::Mutex free_mu_;
  std::vector<std::pair<int, std::function<void()>>> free_listeners_ ABSL_GUARDED_BY(free_mu_);
  int next_free_listener_ ABSL_GUARDED_BY(free_mu_) = 1;
};

}  // namespace pdserve

#endif  // PDSERVE_KV_KV_MANAGER_H_
