// The paged KV cache: a pool of fixed-size blocks carved from one contiguous
// region, per-sequence block tables, reference counts and a free list.
//
// Layout of the region (the KV handoff ships it as is):
//   layer l, physical block b starts at  (l * num_blocks + b) * LayerBlockBytes()
//   inside a block:  K: [num_kv_heads] x [head_dim] x [block_size slots]
//   (transposed, so a kernel scores consecutive keys with one vector per
//   dimension), then V: [num_kv_heads] x [block_size slots] x [head_dim],
//   and, for int8 KV, then F32 scales [K | V] x [num_kv_heads] x [block_size]:
//   one per (position, KV head), so a position's bytes never depend on its
//   neighbours or on the order of writes.
// so one layer's blocks are contiguous (streamable layer by layer) and one KV
// head's slots within a block are contiguous (read once per GQA group).
//
// Sizes (DESIGN.md fact 4): c_kv = 2 * L * N_kv * H * p_kv bytes per position
// (+ 2 * L * N_kv * 4 bytes of scales for int8).
// Logical bytes = sum over sequences of positions * c_kv; physical bytes =
// whole blocks held (including the unused tail slots of partial blocks).
//
// Thread safety: BlockPool is not thread-safe: KvManager (kv_manager.h)
// owns it and serialises every use; nothing else allocates or frees
// blocks. KvStorage is an immutable view, usable from any thread.
#ifndef PDSERVE_KV_KV_CACHE_H_
#define PDSERVE_KV_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kv/block_hash.h"
#include "base/dtype.h"
#include "kernels/backend.h"

namespace pdserve {

struct BlockId {
  int32_t value = -1;
  friend bool operator==(BlockId a, BlockId b) { return a.value == b.value; }
};

struct KvCacheSpec {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 16;  // Positions per block.
  DType dtype = DType::kF32;  // kF32, kBF16 or kI8.
  int32_t num_blocks = 0;
  // Tensor parallelism (model/tensor_parallel.h): `num_ranks` pools of
  // this shape side by side in one region, rank r's RankBytes() * r bytes
  // in; a block id addresses the same block in each. Each rank holds
  // num_kv_heads of the model's model_kv_heads (0: num_kv_heads):
  // consecutive ranges, or, when ranks outnumber the model's heads, one
  // head each, every head on num_ranks / model_kv_heads ranks.
  int32_t num_ranks = 1;
  int32_t model_kv_heads = 0;
  // The request-sharded layout (DESIGN.md fact 12): one pool of every KV
  // head, its blocks cut into request_ranks equal ranges of ids, rank r's
  // range holding the whole KV of the requests rank r attends for.
  // REQUIRES (Validate): num_ranks == 1 and num_blocks a multiple of it.
  int32_t request_ranks = 1;

  // c_kv of one rank: bytes of one position across all layers, K and V
  // (scales included), for the heads the rank holds.
  int64_t BytesPerPosition() const;
  // One block of one layer of one rank.
  int64_t LayerBlockBytes() const;
  // One rank's pool.
  int64_t RankBytes() const;
  // The whole region: every rank's pool.
  int64_t TotalBytes() const;
  int32_t ModelKvHeads() const { return model_kv_heads > 0 ? model_kv_heads : num_kv_heads; }
  // The model's KV head that rank r holds as its local head 0.
  int32_t FirstKvHead(int32_t rank) const;
  // The rank whose range holds block b (0 unless request-sharded).
  int32_t RankOfBlock(int32_t b) const { return b / (num_blocks / request_ranks); }
  absl::Status Validate() const;
};

// Where a pool's bytes are: the forward, the transfers and the tests read
// and write blocks through it. A block's bytes belong to whoever holds the
// block (kv_manager.h); the view itself does no bookkeeping.
struct KvStorage {
  KvCacheSpec spec;
  char* base = nullptr;  // The region's start.
  // Rank r's pool alone (a one-rank spec with its heads).
  KvStorage Rank(int32_t rank) const;
  // The KV of `layer` as the backend reads it. REQUIRES: one rank.
  kernels::KvLayerView LayerView(int32_t layer) const;
  // Start of (layer, block) of `rank` in the region.
  void* BlockData(int32_t layer, BlockId block, int32_t rank = 0) const;
};

// Memory the pool lives in. The KV handoff supplies an allocator that
// registers the region with UCX; the default uses aligned host memory.
class KvRegion {
 public:
  virtual ~KvRegion() = default;
  virtual void* data() = 0;
  virtual size_t size() const = 0;
};

class KvRegionAllocator {
 public:
  virtual ~KvRegionAllocator() = default;
  // RESOURCE_EXHAUSTED when the memory cannot be had.
  virtual absl::StatusOr<std::unique_ptr<KvRegion>> Allocate(size_t bytes) = 0;
};

// Zeroed, 2 MiB-aligned host memory.
class HostKvRegionAllocator final : public KvRegionAllocator {
 public:
  absl::StatusOr<std::unique_ptr<KvRegion>> Allocate(size_t bytes) override;
};

// Zeroed memory of a backend (Backend::Allocate: GPU memory for the CUDA
// backend), which must outlive the regions. Its bytes are the backend's:
// only its kernels (and its copies) may touch them.
class BackendKvRegionAllocator final : public KvRegionAllocator {
 public:
  explicit BackendKvRegionAllocator(kernels::Backend* backend) : backend_(backend) {}
  absl::StatusOr<std::unique_ptr<KvRegion>> Allocate(size_t bytes) override;

 private:
  kernels::Backend* backend_;
};

struct PrefixCacheStats {
  int64_t lookups = 0;
  int64_t hit_blocks = 0;   // Blocks reused by lookups.
  int64_t miss_blocks = 0;  // Full blocks looked up and not found.
  int64_t evictions = 0;    // Cached blocks reclaimed for new allocations.
};

struct KvMemoryReport {
  int64_t logical_bytes = 0;   // sum positions * c_kv
  int64_t physical_bytes = 0;  // blocks held * block bytes (all layers)
  int64_t blocks_used = 0;
  int64_t blocks_free = 0;
};

// Told of every change to what a pool's prefix cache holds (the worker's
// KV event log, kv/kv_events.h). Called under whatever lock guards the
// pool; must not call back into it.
class BlockPoolListener {
 public:
  virtual ~BlockPoolListener() = default;
  // A block was published under `hash`; `parent` is its predecessor's hash
  // in the chain (zero for a sequence's first block, or when unknown).
  virtual void OnStored(const BlockHash& hash, const BlockHash& parent) = 0;
  // The block cached under `hash` was evicted.
  virtual void OnRemoved(const BlockHash& hash) = 0;
};

// Blocks are free, held (reference count > 0), or cached-and-unreferenced.
// The prefix cache (DESIGN.md fact 6) maps full-block content hashes to
// blocks; a cached block whose last reference is dropped stays findable
// until the pool needs room, when the least recently released is evicted
// (never a block that is referenced).
class BlockPool {
 public:
  // Allocates the region through `allocator` (a HostKvRegionAllocator when
  // null). Errors: invalid spec, allocation failure.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(const KvCacheSpec& spec,
                                                           KvRegionAllocator* allocator = nullptr);

  const KvCacheSpec& spec() const { return spec_; }
  KvRegion& region() { return *region_; }

  // Takes `n` blocks (reference count 1 each), all or nothing: free blocks
  // first, then evicting cached unreferenced blocks, least recently used
  // first. RESOURCE_EXHAUSTED (naming the counts) when fewer are available.
  // In a request-sharded pool, only from `rank`'s range (a scan of the
  // free list and the evictable blocks: O(blocks)).
  absl::StatusOr<std::vector<BlockId>> Allocate(int32_t n, int32_t rank = 0);
  // REQUIRES: the block is held (count > 0).
  void AddRef(BlockId b);
  // Drops one reference. At zero the block becomes free, or, if cached,
  // evictable (most recently used end).
  // REQUIRES: the block is held (a release of a free block aborts).
  void Release(BlockId b);

  // The blocks of the longest prefix of `hashes` that is cached, each with a
  // reference taken for the caller. Counts hits and misses.
  std::vector<BlockId> AcquireCachedPrefix(absl::Span<const BlockHash> hashes);
  // The block cached under `hash`, with a reference taken for the caller;
  // none when it is not cached. Counts nothing (not a prefix lookup).
  std::optional<BlockId> AcquireCached(const BlockHash& hash);
  // Publishes a held, fully written block under `hash` (`parent`: the
  // hash of the block before it, for the listener). If another block is
  // already cached under it, nothing changes (the first copy stays).
  void MarkCached(BlockId b, const BlockHash& hash, const BlockHash& parent = BlockHash{});
  // Receives stored/removed events from now on (null: none).
  // REQUIRES: outlives the pool or is reset first.
  void set_listener(BlockPoolListener* listener) { listener_ = listener; }
  bool IsCached(BlockId b) const { return hash_of_[b.value].has_value(); }

  int32_t RefCount(BlockId b) const { return ref_counts_[b.value]; }
  // Blocks an Allocate(n, rank) could take now in `rank`'s range
  // (request-sharded pools; O(blocks)).
  int32_t NumFreeInRange(int32_t rank) const;
  // Blocks an Allocate could take now: free + evictable.
  int32_t num_free() const { return static_cast<int32_t>(free_.size()) + num_evictable_; }
  // Blocks referenced by some sequence.
  int32_t num_used() const { return spec_.num_blocks - num_free(); }
  int32_t num_cached() const { return static_cast<int32_t>(cache_.size()); }
  int32_t num_evictable() const { return num_evictable_; }
  const PrefixCacheStats& prefix_stats() const { return stats_; }

  KvStorage storage() const { return KvStorage{spec_, static_cast<char*>(region_->data())}; }

 private:
  BlockPool(const KvCacheSpec& spec, std::unique_ptr<KvRegion> region);

  void LruUnlink(int32_t b);
  void LruPushBack(int32_t b);

  KvCacheSpec spec_;
  std::unique_ptr<KvRegion> region_;
  std::vector<int32_t> ref_counts_;
  std::vector<BlockId> free_;  // LIFO: recently freed blocks are warm in cache.
  // Allocate in a request-sharded pool.
  absl::StatusOr<std::vector<BlockId>> AllocateInRange(int32_t n, int32_t rank);
  // Prefix cache.
  std::vector<std::optional<BlockHash>> hash_of_;
  absl::flat_hash_map<BlockHash, int32_t> cache_;
  // Evictable blocks (cached, unreferenced) in a doubly linked LRU list;
  // index num_blocks is the sentinel.
  std::vector<int32_t> lru_prev_, lru_next_;
  int32_t num_evictable_ = 0;
  PrefixCacheStats stats_;
  BlockPoolListener* listener_ = nullptr;
};

}  // namespace pdserve

#endif  // PDSERVE_KV_KV_CACHE_H_
