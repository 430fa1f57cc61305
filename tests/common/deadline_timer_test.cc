#include "base/deadline_timer.h"

#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

TEST(ManualTimerTest, RunsWhatFallsDueInDeadlineOrderWithTheClockAtEach) {
  ManualTimer t;
  const absl::Time start = t.Now();
  std::vector<std::pair<int, absl::Duration>> ran;
  t.At(start + absl::Seconds(3), [&] { ran.push_back({3, t.Now() - start}); });
  t.At(start + absl::Seconds(1), [&] { ran.push_back({1, t.Now() - start}); });
  const Timer::Id two = t.At(start + absl::Seconds(2), [&] { ran.push_back({2, t.Now() - start}); });
  t.Cancel(two);
  t.Advance(absl::Milliseconds(999));
  EXPECT_TRUE(ran.empty());
  t.Advance(absl::Seconds(5));
  ASSERT_EQ(ran.size(), 2u);
  EXPECT_EQ(ran[0], std::make_pair(1, absl::Seconds(1)));
  EXPECT_EQ(ran[1], std::make_pair(3, absl::Seconds(3)));
  EXPECT_EQ(t.Now() - start, absl::Milliseconds(5999));
  EXPECT_EQ(t.pending(), 0u);
}

TEST(ManualTimerTest, ACallbackMayScheduleAnotherThatFallsDueInTheSameAdvance) {
  ManualTimer t;
  int runs = 0;
  t.At(t.Now() + absl::Seconds(1), [&] {
    ++runs;
    t.At(t.Now() + absl::Seconds(1), [&] { ++runs; });
  });
  t.Advance(absl::Seconds(2));
  EXPECT_EQ(runs, 2);
}

TEST(ThreadTimerTest, AnEarlierDeadlineWakesTheThreadAndCancelledOnesNeverRun) {
  ThreadTimer t;
  absl::Mutex mu;
  std::vector<int> ran;
  absl::Notification early;
  // A far deadline first: the thread sleeps towards it.
  t.At(absl::Now() + absl::Hours(1), [&] {
    absl::MutexLock l(&mu);
    ran.push_back(0);
  });
  const Timer::Id cancelled = t.At(absl::Now() + absl::Milliseconds(5), [&] {
    absl::MutexLock l(&mu);
    ran.push_back(-1);
  });
  t.Cancel(cancelled);
  t.At(absl::Now() + absl::Milliseconds(20), [&] {
    {
      absl::MutexLock l(&mu);
      ran.push_back(1);
    }
    early.Notify();
  });
  ASSERT_TRUE(early.WaitForNotificationWithTimeout(absl::Seconds(30)));
  {
    absl::MutexLock l(&mu);
    EXPECT_EQ(ran, std::vector<int>{1});
  }
  EXPECT_EQ(t.pending(), 1u);
  t.Stop();  // The hour-long one never runs.
  EXPECT_EQ(t.pending(), 0u);
  EXPECT_EQ(t.At(absl::Now(), [] {}), 0u);
  absl::MutexLock l(&mu);
  EXPECT_EQ(ran, std::vector<int>{1});
}

TEST(ThreadTimerTest, ACallbackMayCancelAndSchedule) {
  ThreadTimer t;
  absl::Notification done;
  Timer::Id later = t.At(absl::Now() + absl::Hours(1), [] { ADD_FAILURE() << "cancelled from a callback"; });
  t.At(absl::Now(), [&] {
    t.Cancel(later);
    t.At(absl::Now(), [&] { done.Notify(); });
  });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
}

}  // namespace
}  // namespace pdserve
