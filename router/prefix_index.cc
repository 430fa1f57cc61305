#include "router/prefix_index.h"

#include <vector>

namespace pdserve::router {

uint64_t PrefixIndex::NextAfter(const std::string& worker) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : it->second.last_id;
}

void PrefixIndex::Apply(const std::string& worker, uint64_t instance, absl::Span<const KvEvent> events,
                        bool snapshot, uint64_t last_id) {
  absl::MutexLock lock(&mu_);
  Entry& e = workers_[worker];
  if (e.instance != instance) {
    // A new process: what we knew is gone, and a batch that is neither a
    // snapshot nor the start of its log answered the old process's ids.
    e.blocks.clear();
    e.expected.clear();
    e.last_id = 0;
    e.instance = instance;
    if (!snapshot && (events.empty() || events.front().id != 1)) return;
  }
  if (snapshot) {
    e.blocks.clear();
  } else if (!events.empty() && events.front().id != e.last_id + 1) {
    e.blocks.clear();
    e.last_id = 0;  // Out of step: ask for everything again.
    return;
  }
  for (const KvEvent& ev : events) {
    switch (ev.kind) {
      case KvEventKind::kStored:
        e.blocks.insert(ev.hash);
        e.expected.erase(ev.hash);
        break;
      case KvEventKind::kRemoved:
        e.blocks.erase(ev.hash);
        e.expected.erase(ev.hash);
        break;
      case KvEventKind::kCleared:
        e.blocks.clear();
        e.expected.clear();
        break;
    }
  }
  e.last_id = last_id;
}

void PrefixIndex::Drop(const std::string& worker) {
  absl::MutexLock lock(&mu_);
  workers_.erase(worker);
}

int32_t PrefixIndex::MatchBlocks(const std::string& worker, absl::Span<const BlockHash> chain,
                                 absl::Time now) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  if (it == workers_.end()) return 0;
  const Entry& e = it->second;
  int32_t n = 0;
  for (const BlockHash& h : chain) {
    if (!e.blocks.contains(h)) {
      auto x = e.expected.find(h);
      if (x == e.expected.end() || x->second <= now) break;
    }
    ++n;
  }
  return n;
}

void PrefixIndex::Expect(const std::string& worker, absl::Span<const BlockHash> chain, absl::Time now,
                         absl::Duration ttl) {
  absl::MutexLock lock(&mu_);
  Entry& e = workers_[worker];
  for (const BlockHash& h : chain) {
    if (!e.blocks.contains(h)) e.expected[h] = now + ttl;
  }
  // Expired entries are dropped once they could matter for memory.
  if (e.expected.size() > 2 * e.blocks.size() + 4096) {
    std::vector<BlockHash> stale;
    for (const auto& [h, t] : e.expected) {
      if (t <= now) stale.push_back(h);
    }
    for (const BlockHash& h : stale) e.expected.erase(h);
  }
}

int64_t PrefixIndex::NumBlocks(const std::string& worker) const {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : static_cast<int64_t>(it->second.blocks.size());
}

}  // namespace pdserve::router
