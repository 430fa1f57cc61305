#include "kv/kv_events.h"

#include <algorithm>
#include <utility>

namespace pdserve {

KvEventLog::KvEventLog(size_t capacity) : capacity_(std::max<size_t>(capacity, 1)) {
  absl::MutexLock lock(&mu_);
  Append(KvEvent{0, KvEventKind::kCleared, {}, {}});
}

void KvEventLog::Append(KvEvent e) {
  e.id = next_id_++;
  events_.push_back(e);
  while (events_.size() > capacity_) events_.pop_front();
}

void KvEventLog::OnStored(const BlockHash& hash, const BlockHash& parent) {
  absl::MutexLock lock(&mu_);
  cached_[hash] = parent;
  Append(KvEvent{0, KvEventKind::kStored, hash, parent});
}

void KvEventLog::OnRemoved(const BlockHash& hash) {
  absl::MutexLock lock(&mu_);
  cached_.erase(hash);
  Append(KvEvent{0, KvEventKind::kRemoved, hash, {}});
}

KvEventBatch KvEventLog::Read(uint64_t after, size_t max_events) const {
  absl::MutexLock lock(&mu_);
  KvEventBatch out;
  const uint64_t last = next_id_ - 1;
  const uint64_t first_kept = events_.front().id;
  if (after > last || after + 1 < first_kept) {
    // Ids this process never issued (the reader knew an earlier process),
    // or events that were dropped: start over from what is cached.
    out.snapshot = true;
    out.events.reserve(cached_.size() + 1);
    out.events.push_back(KvEvent{last, KvEventKind::kCleared, {}, {}});
    for (const auto& [hash, parent] : cached_) out.events.push_back(KvEvent{last, KvEventKind::kStored, hash, parent});
    out.last_id = last;
    return out;
  }
  const size_t begin = static_cast<size_t>(after + 1 - first_kept);
  const size_t n = std::min(events_.size() - begin, std::max<size_t>(max_events, 1));
  out.events.assign(events_.begin() + static_cast<std::ptrdiff_t>(begin),
                    events_.begin() + static_cast<std::ptrdiff_t>(begin + n));
  out.last_id = after + n;
  out.more = out.last_id < last;
  return out;
}

uint64_t KvEventLog::last_id() const {
  absl::MutexLock lock(&mu_);
  return next_id_ - 1;
}

size_t KvEventLog::num_cached() const {
  absl::MutexLock lock(&mu_);
  return cached_.size();
}

void TieredListener::Stored(uint8_t bit, const BlockHash& hash, const BlockHash& parent) {
  absl::MutexLock lock(&mu_);
  uint8_t& tiers = held_[hash];
  if (tiers == 0) out_->OnStored(hash, parent);
  tiers |= bit;
}

void TieredListener::Removed(uint8_t bit, const BlockHash& hash) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(hash);
  if (it == held_.end() || (it->second & bit) == 0) return;
  it->second &= static_cast<uint8_t>(~bit);
  if (it->second != 0) return;
  held_.erase(it);
  out_->OnRemoved(hash);
}

}  // namespace pdserve
