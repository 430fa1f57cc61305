#include "decode_worker/handoff_table.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/server_util.h"

namespace pdserve::decode {

const char* HandoffStateName(HandoffState s) {
  switch (s) {
    case HandoffState::kAwaitingCall:
      return "awaiting-call";
    case HandoffState::kAwaitingKv:
      return "awaiting-KV";
    case HandoffState::kClaimed:
      return "claimed";
    case HandoffState::kReleased:
      return "released";
    case HandoffState::kAbandoned:
      return "abandoned";
  }
  return "?";
}

const char* CommitOutcomeName(HandoffTable::CommitOutcome o) {
  switch (o) {
    case HandoffTable::CommitOutcome::kParked:
      return "parked";
    case HandoffTable::CommitOutcome::kDelivered:
      return "delivered";
    case HandoffTable::CommitOutcome::kDuplicate:
      return "duplicate";
    case HandoffTable::CommitOutcome::kNoTaker:
      return "no-taker";
  }
  return "?";
}

bool IsLegalHandoffTransition(std::optional<HandoffState> from, HandoffState to) {
  using S = HandoffState;
  if (!from.has_value()) return to == S::kAwaitingCall || to == S::kAwaitingKv || to == S::kReleased;
  switch (*from) {
    case S::kAwaitingCall:
      return to == S::kClaimed || to == S::kAbandoned || to == S::kReleased;
    case S::kAwaitingKv:
      // To itself: a newer call displaces the waiting one.
      return to == S::kAwaitingKv || to == S::kClaimed || to == S::kAbandoned || to == S::kReleased;
    case S::kClaimed:
      return to == S::kReleased;
    case S::kAbandoned:
      return to == S::kAwaitingKv || to == S::kReleased;
    case S::kReleased:
      return false;
  }
  return false;
}

HandoffTable::HandoffTable(Timer* timer, HandoffTableOptions options) : timer_(timer), options_(options) {}

HandoffTable::~HandoffTable() {
  absl::flat_hash_map<engine::RequestId, Entry> entries;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, e] : entries_) timer_->Cancel(e.deadline);
    entries.swap(entries_);
  }
  // Parked KV goes back to its manager here, outside the lock.
}

absl::Status HandoffTable::Transition(const engine::RequestId& id, Entry& e, std::optional<HandoffState> from,
                                      HandoffState to) {
  if (!IsLegalHandoffTransition(from, to)) {
    return absl::FailedPreconditionError(absl::StrCat("handoff of request ", id.str(), ": ",
                                                      from.has_value() ? HandoffStateName(*from) : "(none)", " -> ",
                                                      HandoffStateName(to), " is not a legal transition"));
  }
  e.state = to;
  const uint64_t generation = ++e.generation;
  timer_->Cancel(e.deadline);
  const bool waiting = to == HandoffState::kAwaitingCall || to == HandoffState::kAwaitingKv;
  const absl::Time when = timer_->Now() + (waiting ? options_.wait : options_.remember);
  e.deadline = timer_->At(when, [this, id, generation] { Expire(id, generation); });
  return absl::OkStatus();
}

HandoffTable::Entry& HandoffTable::Enter(const engine::RequestId& id, HandoffState to) {
  Entry& e = entries_[id];
  // From nothing to a waiting or released state: always legal.
  (void)Transition(id, e, std::nullopt, to);
  return e;
}

void HandoffTable::Expire(const engine::RequestId& id, uint64_t generation) {
  std::optional<HandedOff> freed;
  std::shared_ptr<HandoffWaiter> waiter;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end() || it->second.generation != generation) return;  // Moved on since.
    Entry& e = it->second;
    switch (e.state) {
      case HandoffState::kAwaitingCall:
        freed = std::move(e.kv);
        e.kv.reset();
        --parked_kv_;
        (void)Transition(id, e, e.state, HandoffState::kAbandoned);
        break;
      case HandoffState::kAwaitingKv:
        waiter = std::move(e.waiter);
        (void)Transition(id, e, e.state, HandoffState::kAbandoned);
        break;
      default:
        entries_.erase(it);  // An end state, remembered long enough.
        return;
    }
  }
  if (freed.has_value()) LogEvent("warning", "unclaimed_handoff_freed", {{"request_id", id.str()}});
  freed.reset();
  if (waiter != nullptr) waiter->OnNoHandoff(NoHandoff::kTimedOut);
}

HandoffTable::CommitOutcome HandoffTable::Commit(const engine::RequestId& id, HandedOff seq) {
  std::shared_ptr<HandoffWaiter> waiter;
  CommitOutcome outcome;
  HandoffState was;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) {
      Entry& e = Enter(id, HandoffState::kAwaitingCall);
      e.kv = std::move(seq);
      ++parked_kv_;
      return CommitOutcome::kParked;
    }
    Entry& e = it->second;
    was = e.state;
    switch (e.state) {
      case HandoffState::kAwaitingKv:
        waiter = std::move(e.waiter);
        e.waiter.reset();
        (void)Transition(id, e, e.state, HandoffState::kClaimed);
        outcome = CommitOutcome::kDelivered;
        break;
      case HandoffState::kAwaitingCall:
      case HandoffState::kClaimed:
        outcome = CommitOutcome::kDuplicate;
        break;
      default:
        outcome = CommitOutcome::kNoTaker;
        break;
    }
  }
  if (waiter != nullptr) {
    waiter->OnHandoff(std::move(seq));
    return outcome;
  }
  // `seq`'s KV goes back to its manager when this returns.
  if (outcome == CommitOutcome::kDuplicate) {
    // A retried prefill whose first attempt had committed: keep the first.
    LogEvent("warning", "duplicate_handoff", {{"request_id", id.str()}});
  } else if (was == HandoffState::kReleased) {
    LogEvent("info", "released_handoff_freed", {{"request_id", id.str()}, {"when", "on arrival"}});
  } else {
    // Its Decode call ended before this commit came: no one will take it.
    LogEvent("warning", "abandoned_handoff_freed", {{"request_id", id.str()}});
  }
  return outcome;
}

HandoffTable::CallOutcome HandoffTable::Call(const engine::RequestId& id, std::shared_ptr<HandoffWaiter> waiter) {
  std::optional<HandedOff> seq;
  std::shared_ptr<HandoffWaiter> displaced;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) {
      Enter(id, HandoffState::kAwaitingKv).waiter = std::move(waiter);
      return CallOutcome::kParked;
    }
    Entry& e = it->second;
    switch (e.state) {
      case HandoffState::kAwaitingCall:
        seq = std::move(e.kv);
        e.kv.reset();
        --parked_kv_;
        (void)Transition(id, e, e.state, HandoffState::kClaimed);
        break;
      case HandoffState::kAwaitingKv:
      case HandoffState::kAbandoned:
        displaced = std::move(e.waiter);
        (void)Transition(id, e, e.state, HandoffState::kAwaitingKv);
        e.waiter = std::move(waiter);
        break;
      case HandoffState::kClaimed:
        return CallOutcome::kTaken;
      case HandoffState::kReleased:
        return CallOutcome::kReleased;
    }
  }
  if (displaced != nullptr) displaced->OnNoHandoff(NoHandoff::kDisplaced);
  if (!seq.has_value()) return CallOutcome::kParked;
  waiter->OnHandoff(*std::move(seq));
  return CallOutcome::kDelivered;
}

void HandoffTable::CallEnded(const engine::RequestId& id, const HandoffWaiter* waiter) {
  std::shared_ptr<HandoffWaiter> gone;  // Let go outside the lock.
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.state != HandoffState::kAwaitingKv || it->second.waiter.get() != waiter) return;
  gone = std::move(it->second.waiter);
  it->second.waiter.reset();
  (void)Transition(id, it->second, HandoffState::kAwaitingKv, HandoffState::kAbandoned);
}

bool HandoffTable::Release(const engine::RequestId& id) {
  std::optional<HandedOff> freed;
  std::shared_ptr<HandoffWaiter> waiter;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(id);
    if (it == entries_.end()) {
      Enter(id, HandoffState::kReleased);
      return false;
    }
    Entry& e = it->second;
    if (e.state == HandoffState::kReleased) return false;
    if (e.state == HandoffState::kAwaitingCall) {
      freed = std::move(e.kv);
      e.kv.reset();
      --parked_kv_;
    }
    waiter = std::move(e.waiter);
    e.waiter.reset();
    (void)Transition(id, e, e.state, HandoffState::kReleased);
  }
  if (freed.has_value()) {
    LogEvent("info", "released_handoff_freed", {{"request_id", id.str()}, {"when", "waiting"}});
  }
  // The router ended this call already; one still waiting here missed that.
  if (waiter != nullptr) waiter->OnNoHandoff(NoHandoff::kReleased);
  return freed.has_value();
}

std::optional<HandoffState> HandoffTable::state(const engine::RequestId& id) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return std::nullopt;
  return it->second.state;
}

int64_t HandoffTable::parked_kv() {
  absl::MutexLock lock(&mu_);
  return parked_kv_;
}

int64_t HandoffTable::size() {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(entries_.size());
}

}  // namespace pdserve::decode
