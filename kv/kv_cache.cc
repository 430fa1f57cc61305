#include "kv/kv_cache.h"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "absl/base/internal/raw_logging.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace pdserve {
namespace {

class HostRegion final : public KvRegion {
 public:
  HostRegion(void* data, size_t size) : data_(data), size_(size) {}
  ~HostRegion() override { std::free(data_); }
  void* data() override { return data_; }
  size_t size() const override { return size_; }

 private:
  void* data_;
  size_t size_;
};

constexpr size_t kHugePage = 2u << 20;

}  // namespace

int64_t KvCacheSpec::BytesPerPosition() const {
  return 2LL * num_layers * num_kv_heads * (head_dim * static_cast<int64_t>(DTypeSize(dtype)) +
                                             (dtype == DType::kI8 ? 4 : 0));
}

int64_t KvCacheSpec::LayerBlockBytes() const {
  return BytesPerPosition() / num_layers * block_size;
}

int64_t KvCacheSpec::RankBytes() const { return LayerBlockBytes() * num_blocks * num_layers; }

int64_t KvCacheSpec::TotalBytes() const { return RankBytes() * num_ranks; }

int32_t KvCacheSpec::FirstKvHead(int32_t rank) const {
  const int32_t model = ModelKvHeads();
  if (num_ranks * num_kv_heads == model) return rank * num_kv_heads;
  return rank / (num_ranks / model);  // Replicated: one head per rank.
}

absl::Status KvCacheSpec::Validate() const {
  if (num_layers <= 0 || num_kv_heads <= 0 || head_dim <= 0) {
    return absl::InvalidArgumentError("KV cache: layers, KV heads and head_dim must be positive");
  }
  if (block_size <= 0 || block_size > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache: block size must be in [1, 256], got ", block_size));
  }
  if (num_blocks <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV cache: number of blocks must be positive, got ", num_blocks));
  }
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kI8) {
    return absl::InvalidArgumentError(absl::StrCat("KV cache: dtype ", DTypeName(dtype),
                                                   " is not supported (f32, bf16, int8)"));
  }
  if (request_ranks < 1 || (request_ranks > 1 && (num_ranks != 1 || num_blocks % request_ranks != 0))) {
    return absl::InvalidArgumentError(absl::StrCat("KV cache: ", request_ranks, " request-sharded ranks over ",
                                                   num_blocks, " blocks and ", num_ranks,
                                                   " head-sharded ranks (want one, and whole ranges)"));
  }
  const int32_t model = ModelKvHeads();
  const bool split = num_ranks >= 1 && num_ranks * num_kv_heads == model;
  const bool replicated = num_ranks >= 1 && num_kv_heads == 1 && num_ranks % model == 0;
  if (!split && !replicated) {
    return absl::InvalidArgumentError(absl::StrCat("KV cache: ", num_ranks, " ranks of ", num_kv_heads,
                                                   " KV heads each do not hold the model's ", model,
                                                   " heads (split evenly, or one head per rank)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<KvRegion>> HostKvRegionAllocator::Allocate(size_t bytes) {
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = std::aligned_alloc(kHugePage, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV cache: cannot allocate ", rounded, " bytes of host memory"));
  }
  madvise(p, rounded, MADV_HUGEPAGE);
  std::memset(p, 0, rounded);
  return std::unique_ptr<KvRegion>(new HostRegion(p, rounded));
}

namespace {

class BackendRegion final : public KvRegion {
 public:
  BackendRegion(kernels::Backend* backend, void* p, size_t size) : backend_(backend), p_(p), size_(size) {}
  ~BackendRegion() override { backend_->Free(p_); }
  void* data() override { return p_; }
  size_t size() const override { return size_; }

 private:
  kernels::Backend* backend_;
  void* p_;
  size_t size_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KvRegion>> BackendKvRegionAllocator::Allocate(size_t bytes) {
  absl::StatusOr<void*> p = backend_->Allocate(bytes);
  if (!p.ok()) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache: ", p.status().message()));
  }
  backend_->Zero(*p, bytes);
  backend_->Synchronize();
  return std::unique_ptr<KvRegion>(new BackendRegion(backend_, *p, bytes));
}

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(const KvCacheSpec& spec,
                                                             KvRegionAllocator* allocator) {
  if (absl::Status s = spec.Validate(); !s.ok()) return s;
  HostKvRegionAllocator host;
  if (allocator == nullptr) allocator = &host;
  absl::StatusOr<std::unique_ptr<KvRegion>> region =
      allocator->Allocate(static_cast<size_t>(spec.TotalBytes()));
  if (!region.ok()) return region.status();
  if ((*region)->size() < static_cast<size_t>(spec.TotalBytes())) {
    return absl::InternalError("KV cache: allocator returned a region smaller than asked");
  }
  return std::unique_ptr<BlockPool>(new BlockPool(spec, *std::move(region)));
}

BlockPool::BlockPool(const KvCacheSpec& spec, std::unique_ptr<KvRegion> region)
    : spec_(spec),
      region_(std::move(region)),
      ref_counts_(spec.num_blocks, 0),
      hash_of_(spec.num_blocks),
      lru_prev_(spec.num_blocks + 1, spec.num_blocks),
      lru_next_(spec.num_blocks + 1, spec.num_blocks) {
  free_.reserve(spec.num_blocks);
  for (int32_t b = spec.num_blocks - 1; b >= 0; --b) free_.push_back(BlockId{b});
}

void BlockPool::LruUnlink(int32_t b) {
  lru_next_[lru_prev_[b]] = lru_next_[b];
  lru_prev_[lru_next_[b]] = lru_prev_[b];
  --num_evictable_;
}

void BlockPool::LruPushBack(int32_t b) {
  const int32_t sentinel = spec_.num_blocks;
  lru_prev_[b] = lru_prev_[sentinel];
  lru_next_[b] = sentinel;
  lru_next_[lru_prev_[sentinel]] = b;
  lru_prev_[sentinel] = b;
  ++num_evictable_;
}

absl::StatusOr<std::vector<BlockId>> BlockPool::Allocate(int32_t n, int32_t rank) {
  if (n < 0) return absl::InvalidArgumentError("KV cache: negative block count");
  if (spec_.request_ranks > 1) return AllocateInRange(n, rank);
  if (n > num_free()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("KV block pool exhausted: ", n, " blocks requested, ", num_free(),
                     " free of ", spec_.num_blocks));
  }
  std::vector<BlockId> out;
  out.reserve(n);
  for (int32_t i = 0; i < n; ++i) {
    BlockId b;
    if (!free_.empty()) {
      b = free_.back();
      free_.pop_back();
    } else {
      // Evict the least recently released cached block.
      b = BlockId{lru_next_[spec_.num_blocks]};
      LruUnlink(b.value);
      cache_.erase(*hash_of_[b.value]);
      if (listener_ != nullptr) listener_->OnRemoved(*hash_of_[b.value]);
      hash_of_[b.value].reset();
      ++stats_.evictions;
    }
    ref_counts_[b.value] = 1;
    out.push_back(b);
  }
  return out;
}

int32_t BlockPool::NumFreeInRange(int32_t rank) const {
  const int32_t per = spec_.num_blocks / spec_.request_ranks;
  auto mine = [&](int32_t b) { return b / per == rank; };
  int32_t n = 0;
  for (BlockId b : free_) n += mine(b.value) ? 1 : 0;
  for (int32_t b = lru_next_[spec_.num_blocks]; b != spec_.num_blocks; b = lru_next_[b]) n += mine(b) ? 1 : 0;
  return n;
}

absl::StatusOr<std::vector<BlockId>> BlockPool::AllocateInRange(int32_t n, int32_t rank) {
  const int32_t per = spec_.num_blocks / spec_.request_ranks;
  const int32_t lo = rank * per, hi = lo + per;
  auto mine = [&](int32_t b) { return b >= lo && b < hi; };
  std::vector<int32_t> evictable;  // Least recently released first.
  int32_t free_here = 0;
  for (BlockId b : free_) free_here += mine(b.value) ? 1 : 0;
  for (int32_t b = lru_next_[spec_.num_blocks]; b != spec_.num_blocks && free_here + static_cast<int32_t>(evictable.size()) < n;
       b = lru_next_[b]) {
    if (mine(b)) evictable.push_back(b);
  }
  if (free_here + static_cast<int32_t>(evictable.size()) < n) {
    return absl::ResourceExhaustedError(absl::StrCat("KV block pool exhausted on rank ", rank, ": ", n,
                                                     " blocks requested, ", free_here + evictable.size(),
                                                     " free of its ", per));
  }
  std::vector<BlockId> out;
  out.reserve(n);
  // Free blocks of the range, most recently freed first.
  for (size_t i = free_.size(); i-- > 0 && static_cast<int32_t>(out.size()) < n;) {
    if (!mine(free_[i].value)) continue;
    out.push_back(free_[i]);
    free_.erase(free_.begin() + static_cast<ptrdiff_t>(i));
  }
  for (size_t e = 0; static_cast<int32_t>(out.size()) < n; ++e) {
    const int32_t b = evictable[e];
    LruUnlink(b);
    cache_.erase(*hash_of_[b]);
    if (listener_ != nullptr) listener_->OnRemoved(*hash_of_[b]);
    hash_of_[b].reset();
    ++stats_.evictions;
    out.push_back(BlockId{b});
  }
  for (BlockId b : out) ref_counts_[b.value] = 1;
  return out;
}

void BlockPool::AddRef(BlockId b) {
  if (ref_counts_[b.value]++ == 0) LruUnlink(b.value);  // Was cached and evictable.
}

void BlockPool::Release(BlockId b) {
  if (ref_counts_[b.value] <= 0) {
    ABSL_RAW_LOG(FATAL, "KV block %d released while not held (a double release)", b.value);
  }
  if (--ref_counts_[b.value] != 0) return;
  if (hash_of_[b.value].has_value()) {
    LruPushBack(b.value);
  } else {
    free_.push_back(b);
  }
}

std::vector<BlockId> BlockPool::AcquireCachedPrefix(absl::Span<const BlockHash> hashes) {
  ++stats_.lookups;
  std::vector<BlockId> out;
  for (const BlockHash& h : hashes) {
    auto it = cache_.find(h);
    if (it == cache_.end()) break;
    AddRef(BlockId{it->second});
    out.push_back(BlockId{it->second});
  }
  stats_.hit_blocks += static_cast<int64_t>(out.size());
  stats_.miss_blocks += static_cast<int64_t>(hashes.size() - out.size());
  return out;
}

std::optional<BlockId> BlockPool::AcquireCached(const BlockHash& hash) {
  auto it = cache_.find(hash);
  if (it == cache_.end()) return std::nullopt;
  AddRef(BlockId{it->second});
  return BlockId{it->second};
}

void BlockPool::MarkCached(BlockId b, const BlockHash& hash, const BlockHash& parent) {
  if (hash_of_[b.value].has_value() || cache_.contains(hash)) return;
  hash_of_[b.value] = hash;
  cache_.emplace(hash, b.value);
  if (listener_ != nullptr) listener_->OnStored(hash, parent);
}

KvStorage KvStorage::Rank(int32_t rank) const {
  KvStorage r{spec, base + static_cast<int64_t>(rank) * spec.RankBytes()};
  r.spec.num_ranks = 1;
  r.spec.model_kv_heads = 0;
  return r;
}

kernels::KvLayerView KvStorage::LayerView(int32_t layer) const {
  if (spec.num_ranks != 1) ABSL_RAW_LOG(FATAL, "KvStorage::LayerView of a %d-rank pool (take a Rank first)", spec.num_ranks);
  const int64_t elem = static_cast<int64_t>(DTypeSize(spec.dtype));
  const int64_t half_elems = static_cast<int64_t>(spec.num_kv_heads) * spec.block_size * spec.head_dim;
  return kernels::KvLayerView{
      .base = base + static_cast<int64_t>(layer) * spec.num_blocks * spec.LayerBlockBytes(),
      .dtype = spec.dtype,
      .block_stride = spec.LayerBlockBytes() / elem,
      .head_stride = static_cast<int64_t>(spec.block_size) * spec.head_dim,
      .v_offset = half_elems,
      .block_size = spec.block_size,
      .scale_offset = spec.dtype == DType::kI8 ? 2 * half_elems : 0,
  };
}

void* KvStorage::BlockData(int32_t layer, BlockId block, int32_t rank) const {
  return base + rank * spec.RankBytes() +
         (static_cast<int64_t>(layer) * spec.num_blocks + block.value) * spec.LayerBlockBytes();
}

}  // namespace pdserve
