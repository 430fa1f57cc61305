// EventLoop's deadlines: PostAt runs a task once, on the loop thread, after
// its time and in deadline order, and wakes a loop asleep with nothing else
// to wake it. Its scheduling: a loop started `realtime` runs in SCHED_FIFO
// where the process may, says why not where it may not, and never spins on
// outstanding operations.
#include "kv_transfer/event_loop.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/support/realtime.h"

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

TEST(EventLoopTest, ARealtimeLoopRunsInFifoWherePermittedAndSaysWhyNotElsewhere) {
  EventLoop loop;
  loop.Start("test-rt", EventLoop::Device(), {.realtime = true});
  const int policy = loop.RunSync([] { return sched_getscheduler(0); });
  if (testing_support::RealtimePermitted()) {
    EXPECT_TRUE(loop.realtime());
    EXPECT_TRUE(loop.realtime_refused().empty());
    EXPECT_EQ(policy, SCHED_FIFO);
  } else {
    EXPECT_FALSE(loop.realtime());
    EXPECT_NE(loop.realtime_refused().find("not permitted"), std::string::npos) << loop.realtime_refused();
    EXPECT_EQ(policy, SCHED_OTHER);
  }
}

TEST(EventLoopTest, ALoopStartedNormalStaysInTheNormalClass) {
  EventLoop loop;
  loop.Start("test-normal");
  EXPECT_FALSE(loop.realtime());
  EXPECT_TRUE(loop.realtime_refused().empty());
  EXPECT_EQ(loop.RunSync([] { return sched_getscheduler(0); }), SCHED_OTHER);
}

// A real-time loop that spun on an outstanding operation would hold its
// core from the compute for as long as the operation lasts: it sleeps on
// its fds instead, so it uses a small part of the wall time. (A loop in
// the normal class, which does spin, uses nearly all of it here.)
TEST(EventLoopTest, ARealtimeLoopDoesNotSpinOnOutstandingOperations) {
  if (!testing_support::RealtimePermitted()) GTEST_SKIP() << "SCHED_FIFO is not permitted to this process";
  EventLoop loop;
  loop.Start("test-rt-busy", EventLoop::Device(), {.realtime = true});
  ASSERT_TRUE(loop.realtime());
  const clockid_t clock = loop.RunSync([] {
    clockid_t c;
    pthread_getcpuclockid(pthread_self(), &c);
    return c;
  });
  auto cpu = [clock] {
    timespec ts{};
    clock_gettime(clock, &ts);
    return absl::DurationFromTimespec(ts);
  };
  // An operation outstanding throughout, and a little work every 2 ms (a
  // normal-class loop keeps spinning while work keeps coming).
  loop.AddBusy(1);
  const absl::Duration cpu0 = cpu();
  const absl::Duration wall = absl::Milliseconds(400);
  const absl::Time end = absl::Now() + wall;
  while (absl::Now() < end) {
    loop.Post([] {});
    absl::SleepFor(absl::Milliseconds(2));
  }
  const absl::Duration used = cpu() - cpu0;
  loop.AddBusy(-1);
  // It runs the 100 us spin after each piece of work and a wake-up a
  // millisecond: about a twentieth of the wall time.
  EXPECT_LT(used, wall / 4) << "the loop thread used " << used << " of CPU in " << wall;
}

}  // namespace
}  // namespace pdserve::kv
