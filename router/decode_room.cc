#include "router/decode_room.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"

namespace pdserve::router {

RoomLease::RoomLease(RoomLease&& other) noexcept
    : room_(std::exchange(other.room_, nullptr)),
      worker_(std::move(other.worker_)),
      positions_(std::exchange(other.positions_, 0)) {}

RoomLease& RoomLease::operator=(RoomLease&& other) noexcept {
  if (this != &other) {
    Release();
    room_ = std::exchange(other.room_, nullptr);
    worker_ = std::move(other.worker_);
    positions_ = std::exchange(other.positions_, 0);
  }
  return *this;
}

void RoomLease::Release() {
  if (room_ == nullptr) return;
  std::exchange(room_, nullptr)->Return(*worker_, positions_);
  worker_.reset();
  positions_ = 0;
}

std::optional<int64_t> DecodeRoom::Free(const Worker& w) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(&w);
  if (it == entries_.end() || it->second.capacity < 0) return std::nullopt;
  const Entry& e = it->second;
  return e.capacity - e.placed - e.excess;
}

int64_t DecodeRoom::Rounded(const Worker& w, int64_t positions) const {
  int64_t block = 0;
  {
    absl::MutexLock lock(&mu_);
    if (auto it = entries_.find(&w); it != entries_.end()) block = it->second.block_size;
  }
  if (block <= 0) block = w.report().kv_block_size;
  if (block <= 0) return positions;
  return (positions + block - 1) / block * block;
}

std::optional<int64_t> DecodeRoom::LargestCapacity(const std::vector<WorkerPtr>& workers) const {
  std::optional<int64_t> largest;
  absl::MutexLock lock(&mu_);
  for (const WorkerPtr& w : workers) {
    auto it = entries_.find(w.get());
    if (it == entries_.end() || it->second.capacity < 0) continue;
    largest = std::max(largest.value_or(0), it->second.capacity);
  }
  return largest;
}

RoomLease DecodeRoom::Take(const WorkerPtr& w, int64_t positions) {
  const int64_t n = Rounded(*w, positions);
  absl::MutexLock lock(&mu_);
  entries_[w.get()].placed += n;
  return RoomLease(this, w, n);
}

void DecodeRoom::Return(const Worker& w, int64_t positions) {
  {
    absl::MutexLock lock(&mu_);
    entries_[&w].placed -= positions;
  }
  if (on_room_) on_room_();
}

int64_t DecodeRoom::Placed(const Worker& w) const {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(&w);
  return it == entries_.end() ? 0 : it->second.placed;
}

void DecodeRoom::Refresh(const std::vector<WorkerPtr>& decode_workers) {
  {
    absl::MutexLock lock(&mu_);
    absl::flat_hash_set<const Worker*> present;
    for (const WorkerPtr& w : decode_workers) {
      present.insert(w.get());
      const WorkerReport r = w->report();
      Entry& e = entries_[w.get()];
      if (r.kv_positions_total <= 0 || r.free_positions < 0) continue;
      e.capacity = r.kv_positions_total;
      e.block_size = r.kv_block_size;
      // What the worker holds that the ledger did not place (or has already
      // seen end): held back until a report shows it gone.
      e.excess = std::max<int64_t>(0, (r.kv_positions_total - r.free_positions) - e.placed);
    }
    absl::erase_if(entries_, [&present](const auto& kv) { return !present.contains(kv.first) && kv.second.placed == 0; });
  }
  if (on_room_) on_room_();
}

}  // namespace pdserve::router
