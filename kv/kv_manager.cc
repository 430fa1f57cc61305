#include "kv/kv_manager.h"

#include <algorithm>
#include <utility>

#include "absl/base/internal/raw_logging.h"

namespace pdserve {

SequenceKv::SequenceKv(SequenceKv&& other) noexcept
    : manager_(std::exchange(other.manager_, nullptr)),
      owner_(std::exchange(other.owner_, 0)),
      block_table_(std::move(other.block_table_)),
      num_positions_(std::exchange(other.num_positions_, 0)),
      rank_(std::exchange(other.rank_, 0)) {
  other.block_table_.clear();
}

SequenceKv& SequenceKv::operator=(SequenceKv&& other) noexcept {
  if (this == &other) return *this;
  Release();
  manager_ = std::exchange(other.manager_, nullptr);
  owner_ = std::exchange(other.owner_, 0);
  block_table_ = std::move(other.block_table_);
  other.block_table_.clear();
  num_positions_ = std::exchange(other.num_positions_, 0);
  rank_ = std::exchange(other.rank_, 0);
  return *this;
}

SequenceKv::~SequenceKv() { Release(); }

void SequenceKv::Release() {
  if (manager_ != nullptr && !block_table_.empty()) manager_->Release(*this);
  block_table_.clear();
  num_positions_ = 0;
}

absl::StatusOr<std::unique_ptr<KvManager>> KvManager::Create(const KvCacheSpec& spec,
                                                             KvRegionAllocator* allocator) {
  absl::StatusOr<std::unique_ptr<BlockPool>> pool = BlockPool::Create(spec, allocator);
  if (!pool.ok()) return pool.status();
  return std::unique_ptr<KvManager>(new KvManager(*std::move(pool)));
}

KvManager::KvManager(std::unique_ptr<BlockPool> pool)
    : pool_(std::move(pool)),
      storage_(pool_->storage()),
      region_(&pool_->region()),
      owners_(pool_->spec().num_blocks) {}

KvManager::~KvManager() {
  absl::MutexLock lock(&mu_);
  if (pool_->num_used() != 0) {
    ABSL_RAW_LOG(FATAL, "KV manager destroyed while %d blocks are still held", pool_->num_used());
  }
}

int32_t KvManager::PickRank() {
  const int32_t ranks = storage_.spec.request_ranks;
  if (ranks <= 1) return 0;
  absl::MutexLock lock(&mu_);
  int32_t best = 0, most = -1;
  for (int32_t i = 1; i <= ranks; ++i) {
    const int32_t r = (last_rank_ + i) % ranks;
    if (const int32_t n = pool_->NumFreeInRange(r); n > most) {
      most = n;
      best = r;
    }
  }
  last_rank_ = best;
  return best;
}

SequenceKv KvManager::NewSequence(int32_t rank) {
  if (rank < 0 || rank >= storage_.spec.request_ranks) {
    ABSL_RAW_LOG(FATAL, "a SequenceKv of rank %d in a pool of %d request-sharded ranks", rank,
                 storage_.spec.request_ranks);
  }
  SequenceKv seq;
  seq.manager_ = this;
  seq.rank_ = rank;
  absl::MutexLock lock(&mu_);
  seq.owner_ = next_owner_++;
  return seq;
}

void KvManager::AddOwnerLocked(int32_t block, uint64_t owner) { owners_[block].push_back(owner); }

void KvManager::RemoveOwnerLocked(int32_t block, uint64_t owner) {
  auto& list = owners_[block];
  auto it = std::find(list.begin(), list.end(), owner);
  if (it == list.end()) {
    ABSL_RAW_LOG(FATAL, "KV block %d released by owner %llu, which does not hold it", block,
                 static_cast<unsigned long long>(owner));
  }
  list.erase(it);
  pool_->Release(BlockId{block});
}

absl::Status KvManager::GrowLocked(SequenceKv& seq, int32_t positions) {
  if (seq.manager_ != this) {
    ABSL_RAW_LOG(FATAL, "a SequenceKv grown by a KV manager it does not belong to");
  }
  const int32_t bs = storage_.spec.block_size;
  const int32_t need = (positions + bs - 1) / bs - static_cast<int32_t>(seq.block_table_.size());
  if (need <= 0) return absl::OkStatus();
  absl::StatusOr<std::vector<BlockId>> blocks = pool_->Allocate(need, seq.rank_);
  if (!blocks.ok()) return blocks.status();
  for (BlockId b : *blocks) {
    seq.block_table_.push_back(b.value);
    AddOwnerLocked(b.value, seq.owner_);
  }
  return absl::OkStatus();
}

void KvManager::ShrinkLocked(SequenceKv& seq, size_t keep) {
  while (seq.block_table_.size() > keep) {
    RemoveOwnerLocked(seq.block_table_.back(), seq.owner_);
    seq.block_table_.pop_back();
  }
}

absl::Status KvManager::Grow(SequenceKv& seq, int32_t positions) {
  absl::MutexLock lock(&mu_);
  return GrowLocked(seq, positions);
}

absl::Status KvManager::GrowAll(absl::Span<const GrowRequest> requests) {
  absl::MutexLock lock(&mu_);
  std::vector<size_t> before(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    before[i] = requests[i].seq->block_table_.size();
    if (absl::Status s = GrowLocked(*requests[i].seq, requests[i].positions); !s.ok()) {
      for (size_t r = 0; r <= i; ++r) ShrinkLocked(*requests[r].seq, before[r]);
      return s;
    }
  }
  return absl::OkStatus();
}

int32_t KvManager::AttachCachedPrefix(SequenceKv& seq, absl::Span<const BlockHash> hashes) {
  absl::MutexLock lock(&mu_);
  if (seq.manager_ != this || !seq.block_table_.empty()) {
    ABSL_RAW_LOG(FATAL, "AttachCachedPrefix needs an empty SequenceKv of this manager");
  }
  const std::vector<BlockId> blocks = pool_->AcquireCachedPrefix(hashes);
  bool on_rank = true;
  for (BlockId b : blocks) {
    on_rank = on_rank && storage_.spec.RankOfBlock(b.value) == seq.rank_;
    if (!on_rank) {
      pool_->Release(b);  // Another rank's: its KV is not where seq attends.
      continue;
    }
    seq.block_table_.push_back(b.value);
    AddOwnerLocked(b.value, seq.owner_);
  }
  seq.num_positions_ = static_cast<int32_t>(seq.block_table_.size()) * storage_.spec.block_size;
  return static_cast<int32_t>(seq.block_table_.size());
}

absl::StatusOr<SequenceKv> KvManager::Reserve(absl::Span<const BlockHash> hashes, int32_t positions,
                                              int32_t rank) {
  SequenceKv seq = NewSequence(rank);
  AttachCachedPrefix(seq, hashes);
  absl::MutexLock lock(&mu_);
  const size_t attached = seq.block_table_.size();
  if (absl::Status s = GrowLocked(seq, positions); !s.ok()) {
    ShrinkLocked(seq, 0);
    seq.num_positions_ = 0;
    return s;
  }
  // The free list is LIFO (a released table comes back reversed);
  // ascending ids let a transfer merge consecutive blocks into one put.
  std::sort(seq.block_table_.begin() + static_cast<ptrdiff_t>(attached), seq.block_table_.end());
  return seq;
}

SequenceKv KvManager::PinCached(const BlockHash& hash) {
  SequenceKv seq = NewSequence();
  absl::MutexLock lock(&mu_);
  if (std::optional<BlockId> b = pool_->AcquireCached(hash); b.has_value()) {
    seq.block_table_.push_back(b->value);
    AddOwnerLocked(b->value, seq.owner_);
  }
  return seq;
}

void KvManager::Truncate(SequenceKv& seq, int32_t keep) {
  if (seq.manager_ != this) ABSL_RAW_LOG(FATAL, "a SequenceKv truncated by a KV manager it does not belong to");
  const size_t k = static_cast<size_t>(std::max<int32_t>(0, keep));
  if (seq.block_table_.size() <= k) return;
  {
    absl::MutexLock lock(&mu_);
    ShrinkLocked(seq, k);
  }
  seq.num_positions_ = std::min(seq.num_positions_, static_cast<int32_t>(k) * storage_.spec.block_size);
  absl::ReaderMutexLock lock(&free_mu_);
  for (auto& [handle, fn] : free_listeners_) fn();
}

void KvManager::Publish(const SequenceKv& seq, absl::Span<const BlockHash> hashes) {
  absl::MutexLock lock(&mu_);
  if (hashes.size() > seq.block_table_.size()) {
    ABSL_RAW_LOG(FATAL, "Publish of %zu blocks from a sequence holding %zu", hashes.size(),
                 seq.block_table_.size());
  }
  for (size_t b = 0; b < hashes.size(); ++b) {
    pool_->MarkCached(BlockId{seq.block_table_[b]}, hashes[b], b > 0 ? hashes[b - 1] : BlockHash{});
  }
}

void KvManager::Release(SequenceKv& seq) {
  {
    absl::MutexLock lock(&mu_);
    ShrinkLocked(seq, 0);
  }
  absl::ReaderMutexLock lock(&free_mu_);
  for (auto& [handle, fn] : free_listeners_) fn();
}

int KvManager::AddFreeListener(std::function<void()> fn) {
  absl::MutexLock lock(&free_mu_);
  const int handle = next_free_listener_++;
  free_listeners_.emplace_back(handle, std::move(fn));
  return handle;
}

void KvManager::RemoveFreeListener(int handle) {
  absl::MutexLock lock(&free_mu_);
  std::erase_if(free_listeners_, [handle](const auto& l) { return l.first == handle; });
}

KvCounts KvManager::Counts() const {
  absl::MutexLock lock(&mu_);
  KvCounts c;
  c.total = pool_->spec().num_blocks;
  c.used = pool_->num_used();
  c.free = pool_->num_free();
  c.cached = pool_->num_cached();
  c.block_size = pool_->spec().block_size;
  c.prefix = pool_->prefix_stats();
  return c;
}

KvMemoryReport KvManager::ReportMemory(absl::Span<const SequenceKv* const> sequences) const {
  const KvCacheSpec& spec = storage_.spec;
  KvMemoryReport r;
  for (const SequenceKv* s : sequences) r.logical_bytes += s->num_positions() * spec.BytesPerPosition();
  const KvCounts c = Counts();
  r.blocks_used = c.used;
  r.blocks_free = c.free;
  r.physical_bytes = r.blocks_used * spec.LayerBlockBytes() * spec.num_layers;
  return r;
}

void KvManager::set_listener(BlockPoolListener* listener) {
  absl::MutexLock lock(&mu_);
  pool_->set_listener(listener);
}

int32_t KvManager::RefCount(BlockId b) const {
  absl::MutexLock lock(&mu_);
  return pool_->RefCount(b);
}

bool KvManager::IsCached(BlockId b) const {
  absl::MutexLock lock(&mu_);
  return pool_->IsCached(b);
}

}  // namespace pdserve
