// Callbacks at deadlines: what a server uses instead of a periodic sweep,
// so that each entry that can expire carries its own deadline and nothing
// wakes up to look at entries that have not.
//
// Timer is the interface; ThreadTimer runs callbacks on one thread of its
// own, and ManualTimer runs them when a test moves its clock.
//
// A callback runs outside the timer's lock, so it may schedule or cancel
// (itself included); it must not block for long, since the callbacks due
// after it wait for it. Cancel after the callback started is a no-op: a
// callback must still check that what it expires is the thing it was
// scheduled for (a generation number, a pointer it compares).
//
// Thread safety: thread-safe.
#ifndef PDSERVE_BASE_DEADLINE_TIMER_H_
#define PDSERVE_BASE_DEADLINE_TIMER_H_

#include <cstdint>
#include <map>
#include <thread>
#include <utility>

#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve {

class Timer {
 public:
  using Id = uint64_t;  // 0 is never an id: "no timer".
  virtual ~Timer() = default;
  virtual absl::Time Now() = 0;
  // Runs `fn` once, at or after `when` (at once if `when` has passed).
  virtual Id At(absl::Time when, absl::AnyInvocable<void()> fn) = 0;
  // The callback will not run, unless it already started. Unknown ids
  // (ran, cancelled, 0) are ignored.
  virtual void Cancel(Id id) = 0;
};

// Keeps the due callbacks in deadline order (ties in scheduling order).
class TimerQueue {
 public:
  Timer::Id Add(absl::Time when, absl::AnyInvocable<void()> fn);
  bool Remove(Timer::Id id);
  bool empty() const { return by_time_.empty(); }
  absl::Time earliest() const { return by_time_.begin()->first.first; }
  // Takes the earliest callback if it is due at `now`.
  bool PopDue(absl::Time now, absl::AnyInvocable<void()>* fn);
  size_t size() const { return by_time_.size(); }
  void Clear() {
    by_time_.clear();
    by_id_.clear();
  }

 private:
  using Key = std::pair<absl::Time, Timer::Id>;
  Timer::Id next_ = 1;
  std::map<Key, absl::AnyInvocable<void()>> by_time_;
  std::map<Timer::Id, absl::Time> by_id_;
};

class ThreadTimer final : public Timer {
 public:
  explicit ThreadTimer(const char* thread_name = "timer");
  ~ThreadTimer() override;  // Stop().

  absl::Time Now() override { return absl::Now(); }
  Id At(absl::Time when, absl::AnyInvocable<void()> fn) override;
  void Cancel(Id id) override;
  // Joins the thread; callbacks not yet run never run, and At() after it
  // schedules nothing. Must not be called from a callback.
  void Stop();
  size_t pending();

 private:
  void Loop(const char* thread_name);

  absl::Mutex mu_;
  TimerQueue queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Tests: time moves only when the test says.
class ManualTimer final : public Timer {
 public:
  explicit ManualTimer(absl::Time start = absl::UnixEpoch() + absl::Hours(1)) : now_(start) {}

  absl::Time Now() override;
  Id At(absl::Time when, absl::AnyInvocable<void()> fn) override;
  void Cancel(Id id) override;
  // Moves the clock forward by `d`, running each callback that falls due
  // (with the clock at its deadline), in deadline order.
  void Advance(absl::Duration d);
  size_t pending();

 private:
  absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
  TimerQueue queue_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve

#endif  // PDSERVE_BASE_DEADLINE_TIMER_H_
