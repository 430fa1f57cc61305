#include "router/request_queue.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "router/api_keys.h"

namespace pdserve::router {
namespace {

// Placements remembered for the retry-after estimate.
constexpr size_t kRecent = 256;

}  // namespace

RequestQueue::RequestQueue(RequestQueueOptions options) : options_(std::move(options)) {}

RequestQueueStats RequestQueue::Stats() const {
  const absl::Time now = options_.clock();
  absl::MutexLock lock(&mu_);
  RequestQueueStats s = stats_;
  // Each key's front has waited longest of its key's.
  for (const auto& [key, q] : by_key_) {
    if (!q.empty()) s.oldest_wait = std::max(s.oldest_wait, now - q.front()->since);
  }
  return s;
}

int64_t RequestQueue::RetryAfterSeconds(absl::Time now) const {
  if (recent_.size() < 2) return 1;
  const absl::Time oldest = recent_.size() < kRecent ? recent_.front() : recent_[recent_next_];
  const double span = absl::ToDoubleSeconds(now - oldest);
  if (span <= 0) return 1;
  const double rate = static_cast<double>(recent_.size()) / span;
  const double s = static_cast<double>(stats_.waiting) / rate;
  return std::clamp<int64_t>(static_cast<int64_t>(std::ceil(s)), 1, 600);
}

absl::Status RequestQueue::Refusal(std::string message, absl::Time now) const {
  absl::Status st = absl::ResourceExhaustedError(std::move(message));
  st.SetPayload(kRetryAfterPayload, absl::Cord(absl::StrCat(RetryAfterSeconds(now))));
  return st;
}

void RequestQueue::Remove(Waiter* w) {
  auto it = by_key_.find(w->entry->key);
  if (it == by_key_.end()) return;
  std::deque<Waiter*>& q = it->second;
  q.erase(std::remove(q.begin(), q.end(), w), q.end());
  if (q.empty()) {
    by_key_.erase(it);
    turns_.erase(std::remove(turns_.begin(), turns_.end(), w->entry->key), turns_.end());
  }
  --stats_.waiting;
}

void RequestQueue::Dispatch() {
  while (!turns_.empty()) {
    const std::string key = turns_.front();
    std::deque<Waiter*>& q = by_key_[key];
    Waiter* w = q.front();
    // A cancelled request leaves on its own thread; it is not placed.
    if (w->entry->cancelled != nullptr && w->entry->cancelled->load(std::memory_order_relaxed)) return;
    if (w->entry->place() != PlaceOutcome::kPlaced) return;
    w->placed = true;
    w->cv.Signal();
    q.pop_front();
    --stats_.waiting;
    ++stats_.placed;
    ++stats_.placed_waited;
    const absl::Time now = options_.clock();
    stats_.waited_seconds += absl::ToDoubleSeconds(now - w->since);
    if (recent_.size() < kRecent) {
      recent_.push_back(now);
    } else {
      recent_[recent_next_] = now;
      recent_next_ = (recent_next_ + 1) % kRecent;
    }
    turns_.pop_front();
    if (q.empty()) {
      by_key_.erase(key);
    } else {
      turns_.push_back(key);  // its next request waits for the other keys' turns
    }
  }
}

void RequestQueue::Poke() {
  absl::MutexLock lock(&mu_);
  Dispatch();
}

void RequestQueue::WakeCancelled() {
  absl::MutexLock lock(&mu_);
  for (auto& [key, q] : by_key_) {
    for (Waiter* w : q) {
      if (w->entry->cancelled != nullptr && w->entry->cancelled->load(std::memory_order_relaxed)) w->cv.Signal();
    }
  }
}

absl::Status RequestQueue::Wait(const Entry& entry, absl::Duration* waited, QueueEnd* end) {
  QueueEnd ignored;
  QueueEnd& how = end != nullptr ? *end : ignored;
  absl::MutexLock lock(&mu_);
  const absl::Time since = options_.clock();
  if (waited != nullptr) *waited = absl::ZeroDuration();
  // Nobody waits: place it now if there is room, without queueing.
  if (turns_.empty() && entry.place() == PlaceOutcome::kPlaced) {
    ++stats_.placed;
    how = QueueEnd::kPlaced;
    return absl::OkStatus();
  }
  if (stats_.waiting >= options_.max_queued) {
    ++stats_.refused_full;
    const double took = absl::ToDoubleSeconds(entry.before_queue + (options_.clock() - since));
    stats_.refused_full_seconds += took;
    stats_.refused_full_max_seconds = std::max(stats_.refused_full_max_seconds, took);
    how = QueueEnd::kFull;
    return Refusal(absl::StrFormat("the router's queue is full: %s requests waiting (--max_queued_requests)",
                                   FormatNumber(static_cast<double>(stats_.waiting), 0)),
                   since);
  }
  Waiter w;
  w.entry = &entry;
  w.since = since;
  std::deque<Waiter*>& q = by_key_[entry.key];
  if (q.empty()) turns_.push_back(entry.key);
  q.push_back(&w);
  ++stats_.waiting;
  // Its own turn may be now (another key's request was refused room, but
  // this one's key is first in line only if it is alone).
  Dispatch();
  const absl::Time bound = since + options_.max_wait;
  const absl::Time until = entry.deadline.has_value() ? std::min(*entry.deadline, bound) : bound;
  auto done = [&w, &entry]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return w.placed || (entry.cancelled != nullptr && entry.cancelled->load(std::memory_order_relaxed));
  };
  absl::Time now = since;
  while (!done()) {
    now = options_.clock();
    if (now >= until) break;
    w.cv.WaitWithTimeout(&mu_, until - now);
  }
  now = options_.clock();
  if (waited != nullptr) *waited = now - since;
  if (w.placed) {
    how = QueueEnd::kPlaced;
    return absl::OkStatus();
  }
  Remove(&w);
  // The next in line may fit where this one did not.
  Dispatch();
  if (entry.cancelled != nullptr && entry.cancelled->load(std::memory_order_relaxed)) {
    ++stats_.cancelled;
    how = QueueEnd::kCancelled;
    return absl::CancelledError("cancelled while queued");
  }
  if (entry.deadline.has_value() && *entry.deadline <= bound) {
    ++stats_.deadline;
    how = QueueEnd::kDeadline;
    return absl::DeadlineExceededError(absl::StrFormat(
        "the deadline passed after %.1f s in the router's queue waiting for decode KV room",
        absl::ToDoubleSeconds(now - since)));
  }
  ++stats_.refused_wait;
  how = QueueEnd::kWaitedTooLong;
  return Refusal(absl::StrFormat("waited %.1f s in the router's queue for decode KV room (--max_queue_wait_s)",
                                 absl::ToDoubleSeconds(now - since)),
                 now);
}

}  // namespace pdserve::router
