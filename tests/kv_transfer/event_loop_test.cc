// EventLoop's deadlines: PostAt runs a task once, on the loop thread, after
// its time and in deadline order, and wakes a loop asleep with nothing else
// to wake it.
#include "kv_transfer/event_loop.h"

#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace pdserve::kv {
namespace {

TEST(EventLoopTest, PostAtRunsEachTaskOnceAfterItsTimeInDeadlineOrder) {
  EventLoop loop;
  loop.Start("test");
  absl::Mutex mu;
  std::vector<int> ran;
  std::vector<absl::Duration> late;  // how long after its time each ran
  bool on_loop = true;
  const absl::Time t0 = absl::Now();
  // Posted out of order, asleep in between: each post must wake the loop
  // to shorten its sleep.
  for (const int ms : {60, 20, 40}) {
    const absl::Time when = t0 + absl::Milliseconds(ms);
    loop.PostAt(when, [&, ms, when, &l = loop] {
      absl::MutexLock lock(&mu);
      ran.push_back(ms);
      late.push_back(absl::Now() - when);
      on_loop &= l.InLoop();
    });
  }
  {
    absl::MutexLock lock(&mu);
    mu.AwaitWithTimeout(absl::Condition(
                            +[](std::vector<int>* r) { return r->size() == 3; }, &ran),
                        absl::Seconds(10));
    EXPECT_EQ(ran, (std::vector<int>{20, 40, 60}));
    for (const absl::Duration d : late) EXPECT_GE(d, absl::ZeroDuration());
    EXPECT_TRUE(on_loop);
  }
  absl::SleepFor(absl::Milliseconds(50));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(ran.size(), 3u) << "a task ran twice";
}

TEST(EventLoopTest, APastDeadlineRunsAtOnce) {
  EventLoop loop;
  loop.Start("test");
  absl::Notification done;
  loop.PostAt(absl::InfinitePast(), [&] { done.Notify(); });
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

}  // namespace
}  // namespace pdserve::kv
