#include "kv_transfer/event_loop.h"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <future>

namespace pdserve::kv {
namespace {
// After the last piece of work the loop keeps polling this long before it
// arms and sleeps: an answer that comes back within it (a commit ack over
// loopback) costs no wake-up. An idle loop pays it once per ticker period.
constexpr absl::Duration kSpinAfterWork = absl::Microseconds(100);
// Outstanding operations keep the loop polling, but once nothing at all has
// happened for this long (a peer that stopped answering, a transport whose
// fd stays busy) it waits on its fds for up to kStalledWait per round
// instead of spinning a core until the operations fail.
constexpr absl::Duration kSpinWhileStalled = absl::Milliseconds(10);
constexpr int kStalledWaitMs = 1;
// That spin pays only while the core is otherwise idle. A loop that shares
// its core with a compute thread (a decode worker pinned to one core) uses
// up its scheduler slice spinning, is preempted, and then waits a whole
// tick (4 ms at 250 Hz) behind the compute for its next turn; asleep
// instead, its wake-up preempts the compute at once. So once the loop finds
// it was preempted (an involuntary context switch since it last looked) it
// does not spin for this long.
constexpr absl::Duration kNoSpinAfterPreempted = absl::Milliseconds(500);

int64_t InvoluntarySwitches() {
  rusage u{};
  if (getrusage(RUSAGE_THREAD, &u) != 0) return 0;
  return u.ru_nivcsw;
}

// The kernel's sched_attr (include/uapi/linux/sched/types.h, first version);
// glibc has no wrapper for sched_setattr.
struct SchedAttr {
  uint32_t size;
  uint32_t sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime;
  uint64_t sched_deadline;
  uint64_t sched_period;
};
// The loop works in short bursts, and a peer waits on each (a reservation,
// a commit's answer): it asks the scheduler for a short slice, which on
// EEVDF kernels (6.12+) lets its wake-ups preempt a compute thread on the
// same core at once instead of after that thread's slice. Unprivileged; a
// kernel without custom slices ignores or refuses it, and nothing changes.
constexpr uint64_t kLoopSliceNs = 100'000;

void RequestShortSlice() {
  SchedAttr attr{};
  attr.size = sizeof(attr);
  attr.sched_policy = SCHED_OTHER;
  errno = 0;
  const int nice = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  attr.sched_nice = errno == 0 ? nice : 0;
  attr.sched_runtime = kLoopSliceNs;
  (void)syscall(SYS_sched_setattr, 0, &attr, 0);
}

// The lowest real-time priority: above every normal-class thread (the
// compute), below any real-time thread the operator runs.
constexpr int kLoopRealtimePriority = 1;

// Empty when the calling thread now runs in SCHED_FIFO; otherwise why not.
std::string RequestRealtime() {
  sched_param param{};
  param.sched_priority = kLoopRealtimePriority;
  const int rc = pthread_setschedparam(pthread_self(), SCHED_FIFO, &param);
  if (rc == 0) return "";
  return rc == EPERM ? "not permitted (needs root, CAP_SYS_NICE or RLIMIT_RTPRIO >= 1)" : std::strerror(rc);
}
}  // namespace

void EventLoop::Start(std::string name, Device device, Options options) {
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  std::promise<void> scheduled;
  std::future<void> scheduled_done = scheduled.get_future();
  thread_ = std::thread([this, device = std::move(device), name = std::move(name), options, &scheduled] {
    pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
    thread_id_.store(std::this_thread::get_id());
    if (options.realtime) {
      realtime_refused_ = RequestRealtime();
      realtime_ = realtime_refused_.empty();
    }
    if (!realtime_) RequestShortSlice();
    scheduled.set_value();
    Run(device);
  });
  scheduled_done.wait();
}

void EventLoop::Stop() {
  if (!thread_.joinable()) return;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  thread_.join();
  close(wake_fd_);
  wake_fd_ = -1;
}

void EventLoop::Post(std::function<void()> task) {
  {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
}

void EventLoop::AddTicker(absl::Duration period, std::function<void()> fn) {
  {
    absl::MutexLock lock(&mu_);
    tickers_.push_back({period, absl::Now() + period, std::move(fn)});
  }
  // A loop asleep with no timeout must learn of the new deadline.
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
}

void EventLoop::PostAt(absl::Time when, std::function<void()> fn) {
  {
    absl::MutexLock lock(&mu_);
    timers_.emplace_back(when, std::move(fn));
  }
  // A loop asleep must learn of the new deadline.
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)!write(wake_fd_, &one, sizeof(one));
}

void EventLoop::Run(Device device) {
  absl::Time last_work = absl::Now();
  std::vector<std::function<void()>> batch;
  int64_t preemptions_seen = InvoluntarySwitches();
  bool looked_since_work = false;
  absl::Time no_spin_until = absl::InfinitePast();
  for (;;) {
    const absl::Time round_start = absl::Now();
    last_beat_ns_.store(absl::ToUnixNanos(round_start), std::memory_order_relaxed);
    bool stop;
    {
      absl::MutexLock lock(&mu_);
      batch.swap(tasks_);
      stop = stop_;
    }
    for (auto& t : batch) t();
    const bool ran = !batch.empty();
    batch.clear();
    if (stop && !ran) return;

    bool worked = ran;
    if (device.progress) worked |= device.progress();

    absl::Time next_tick = absl::InfiniteFuture();
    std::vector<std::function<void()>> due;
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      for (Ticker& t : tickers_) {
        if (t.next <= now) {
          due.push_back(t.fn);
          t.next = now + t.period;
        }
        next_tick = std::min(next_tick, t.next);
      }
      for (auto it = timers_.begin(); it != timers_.end();) {
        if (it->first <= now) {
          due.push_back(std::move(it->second));
          it = timers_.erase(it);
        } else {
          next_tick = std::min(next_tick, it->first);
          ++it;
        }
      }
    }
    for (auto& fn : due) fn();
    const int64_t round_ns = absl::ToInt64Nanoseconds(absl::Now() - round_start);
    int64_t longest = longest_round_ns_.load(std::memory_order_relaxed);
    while (round_ns > longest && !longest_round_ns_.compare_exchange_weak(longest, round_ns)) {
    }

    if (worked) {
      last_work = absl::Now();
      looked_since_work = false;
    }
    if (worked || !due.empty()) continue;  // Tickers alone are not progress.
    pollfd fds[2] = {{wake_fd_, POLLIN, 0}, {device.fd, POLLIN, 0}};
    const int nfds = device.fd >= 0 ? 2 : 1;
    const absl::Time now = absl::Now();
    const absl::Duration quiet = now - last_work;
    const bool stalled = quiet > kSpinWhileStalled;
    bool spin = quiet < kSpinAfterWork;
    if (spin && !looked_since_work) {  // One look per burst of work.
      looked_since_work = true;
      const int64_t preemptions = InvoluntarySwitches();
      if (preemptions != preemptions_seen) no_spin_until = now + kNoSpinAfterPreempted;
      preemptions_seen = preemptions;
    }
    if (spin && now < no_spin_until) spin = false;
    // A real-time loop's wake-ups are prompt, and spinning on outstanding
    // operations (up to kSpinWhileStalled) would hold the core from the
    // compute: it waits on its fds instead (the device signals their
    // progress), with kStalledWaitMs as the longest wait while any are
    // outstanding.
    const bool poll_busy = busy_.load() > 0 && !realtime_;
    if (poll_busy || spin || (device.arm && !device.arm())) {
      if (stalled) {
        poll(fds, nfds, kStalledWaitMs);
        uint64_t drained;
        (void)!read(wake_fd_, &drained, sizeof(drained));
      } else {
        // A spinning loop never sleeps, so the scheduler sees no reason to
        // hand its core to a thread woken there (another process's loop,
        // this process's caller waiting on an answer) until its slice ends
        // at the next tick, 4 ms at 250 Hz: the answer it spins for may be
        // the one that thread is to send. Yielding each round gives such a
        // thread the core at once; alone on the core it costs a syscall.
        sched_yield();
      }
      continue;
    }
    int timeout_ms = -1;
    if (next_tick != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(std::max<int64_t>(
          0, absl::ToInt64Milliseconds(next_tick - absl::Now()) + 1));
    }
    if (busy_.load() > 0 && (timeout_ms < 0 || timeout_ms > kStalledWaitMs)) timeout_ms = kStalledWaitMs;
    poll(fds, nfds, timeout_ms);
    uint64_t drained;
    (void)!read(wake_fd_, &drained, sizeof(drained));
    last_work = absl::Now();
  }
}

}  // namespace pdserve::kv
