// Whether this process may put a thread in SCHED_FIFO (the servers a test
// starts run as the same user with the same limits): tried on a thread of
// its own, which ends with it, so the caller's class never changes.
#ifndef PDSERVE_TESTS_SUPPORT_REALTIME_H_
#define PDSERVE_TESTS_SUPPORT_REALTIME_H_

#include <pthread.h>
#include <sched.h>

#include <thread>

namespace pdserve::testing_support {

inline bool RealtimePermitted() {
  bool permitted = false;
  std::thread([&permitted] {
    sched_param p{};
    p.sched_priority = 1;
    permitted = pthread_setschedparam(pthread_self(), SCHED_FIFO, &p) == 0;
  }).join();
  return permitted;
}

}  // namespace pdserve::testing_support

#endif  // PDSERVE_TESTS_SUPPORT_REALTIME_H_
