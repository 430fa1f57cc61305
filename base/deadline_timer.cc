#include "base/deadline_timer.h"

#include <pthread.h>

#include <algorithm>

namespace pdserve {

Timer::Id TimerQueue::Add(absl::Time when, absl::AnyInvocable<void()> fn) {
  const Timer::Id id = next_++;
  by_time_.emplace(Key{when, id}, std::move(fn));
  by_id_.emplace(id, when);
  return id;
}

bool TimerQueue::Remove(Timer::Id id) {
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return false;
  by_time_.erase(Key{it->second, id});
  by_id_.erase(it);
  return true;
}

bool TimerQueue::PopDue(absl::Time now, absl::AnyInvocable<void()>* fn) {
  if (by_time_.empty() || by_time_.begin()->first.first > now) return false;
  auto first = by_time_.begin();
  *fn = std::move(first->second);
  by_id_.erase(first->first.second);
  by_time_.erase(first);
  return true;
}

ThreadTimer::ThreadTimer(const char* thread_name) {
  thread_ = std::thread([this, thread_name] { Loop(thread_name); });
}

ThreadTimer::~ThreadTimer() { Stop(); }

Timer::Id ThreadTimer::At(absl::Time when, absl::AnyInvocable<void()> fn) {
  absl::MutexLock lock(&mu_);
  if (stop_) return 0;
  // The loop's wait re-evaluates on unlock, so an earlier deadline than
  // the one it sleeps towards wakes it.
  return queue_.Add(when, std::move(fn));
}

void ThreadTimer::Cancel(Id id) {
  absl::MutexLock lock(&mu_);
  queue_.Remove(id);
}

size_t ThreadTimer::pending() {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

void ThreadTimer::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  queue_.Clear();
}

void ThreadTimer::Loop(const char* thread_name) {
  pthread_setname_np(pthread_self(), thread_name);
  absl::MutexLock lock(&mu_);
  while (true) {
    // Sleeps until the earliest deadline, a new earlier one, or Stop.
    const absl::Time wake = queue_.empty() ? absl::InfiniteFuture() : queue_.earliest();
    auto changed = [this, wake]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return stop_ || (!queue_.empty() && queue_.earliest() < wake);
    };
    mu_.AwaitWithDeadline(absl::Condition(&changed), wake);
    if (stop_) return;
    absl::AnyInvocable<void()> fn;
    while (!stop_ && queue_.PopDue(absl::Now(), &fn)) {
      mu_.Unlock();
      fn();
      fn = nullptr;  // Whatever it captured goes now, outside the lock.
      mu_.Lock();
    }
  }
}

absl::Time ManualTimer::Now() {
  absl::MutexLock lock(&mu_);
  return now_;
}

Timer::Id ManualTimer::At(absl::Time when, absl::AnyInvocable<void()> fn) {
  absl::MutexLock lock(&mu_);
  return queue_.Add(when, std::move(fn));
}

void ManualTimer::Cancel(Id id) {
  absl::MutexLock lock(&mu_);
  queue_.Remove(id);
}

size_t ManualTimer::pending() {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

void ManualTimer::Advance(absl::Duration d) {
  absl::MutexLock lock(&mu_);
  const absl::Time end = now_ + d;
  absl::AnyInvocable<void()> fn;
  while (!queue_.empty() && queue_.earliest() <= end) {
    now_ = std::max(now_, queue_.earliest());
    queue_.PopDue(now_, &fn);
    mu_.Unlock();
    fn();
    fn = nullptr;
    mu_.Lock();
  }
  now_ = end;
}

}  // namespace pdserve
