// The one thread that owns a transport (and its UCX worker): runs posted
// tasks, progresses the device, fires tickers, and sleeps on an event fd
// when idle.
//
// Idle: 100 us after its last work, while no operation is outstanding,
// the loop arms the device (ucp_worker_arm) and blocks in poll() on the
// device's fd and its own eventfd (posts wake it), with a timeout at the
// next ticker; an idle loop costs a wake-up per ticker period. A loop that
// finds it was preempted (it shares its core with compute) skips that spin
// for a while: it sleeps at once, so its next wake-up preempts the compute
// instead of waiting a scheduler tick behind it.
//
// Scheduling: a peer waits on the loop's every answer, so a loop started
// with `realtime` runs in SCHED_FIFO at the lowest real-time priority when
// the process may (root, CAP_SYS_NICE or RLIMIT_RTPRIO >= 1): each wake-up
// then preempts the compute on its core at once, on any CPU and kernel. Such
// a loop keeps the 100 us spin after work (it holds the core from the
// compute that long at most) but never spins on outstanding operations: it
// sleeps on its fds, which the device signals, waking at least every
// millisecond while operations are outstanding. Without
// that permission, or without `realtime`, it stays in the normal class and
// asks for a short EEVDF slice, which lets most wake-ups preempt but leaves
// some a scheduler tick behind the compute.
//
// Thread safety: Post, PostAt, RunSync, AddTicker, AddBusy and Stop may be called
// from any thread; tasks, tickers and device hooks run on the loop thread.
#ifndef PDSERVE_KV_TRANSFER_EVENT_LOOP_H_
#define PDSERVE_KV_TRANSFER_EVENT_LOOP_H_

#include <atomic>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pdserve::kv {

class EventLoop {
 public:
  struct Device {
    std::function<bool()> progress;  // True when it did something.
    std::function<bool()> arm;       // True when armed: safe to sleep on fd.
    int fd = -1;
  };

  EventLoop() = default;
  ~EventLoop() { Stop(); }
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  struct Options {
    // SCHED_FIFO when permitted (see "Scheduling" above).
    bool realtime = false;
  };
  // Starts the thread. REQUIRES: called once.
  void Start(std::string name, Device device, Options options);
  void Start(std::string name, Device device) { Start(std::move(name), std::move(device), Options()); }
  void Start(std::string name) { Start(std::move(name), Device()); }
  // Whether the loop thread runs in SCHED_FIFO (known once Start returns),
  // and when it asked for it and was refused, why.
  bool realtime() const { return realtime_; }
  const std::string& realtime_refused() const { return realtime_refused_; }
  // Runs the tasks already posted, then joins. Idempotent.
  void Stop();

  void Post(std::function<void()> task);
  // Runs `f` on the loop thread and returns its result (directly when
  // called from the loop thread).
  template <typename F>
  std::invoke_result_t<F&> RunSync(F f) {
    using R = std::invoke_result_t<F&>;
    if (InLoop()) return f();
    std::packaged_task<R()> task(std::move(f));
    std::future<R> result = task.get_future();
    Post([&task] { task(); });
    return result.get();
  }
  bool InLoop() const { return std::this_thread::get_id() == thread_id_.load(); }

  void AddTicker(absl::Duration period, std::function<void()> fn);
  // Runs `fn` once on the loop thread when `when` has passed (a deadline:
  // the loop sleeps until the earliest of these and its tickers).
  void PostAt(absl::Time when, std::function<void()> fn);
  // When the loop last went round (it goes round at least once per ticker
  // period): a loop stuck in a task or in the device shows an old time.
  absl::Time last_beat() const { return absl::FromUnixNanos(last_beat_ns_.load(std::memory_order_relaxed)); }
  // Outstanding operations: while positive the loop keeps polling.
  void AddBusy(int delta) { busy_.fetch_add(delta); }
  // The longest the loop has gone round without getting back to its device
  // and posts (tasks, progress and tickers of one round; sleeping excluded)
  // since the last call: how long the transport could not answer.
  absl::Duration TakeLongestStall() { return absl::Nanoseconds(longest_round_ns_.exchange(0)); }

 private:
  struct Ticker {
    absl::Duration period;
    absl::Time next;
    std::function<void()> fn;
  };
  void Run(Device device);

  absl::Mutex mu_;
  std::vector<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  std::vector<Ticker> tickers_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<absl::Time, std::function<void()>>> timers_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int wake_fd_ = -1;
  std::atomic<int> busy_{0};
  // Written by the loop thread before Start returns; read-only after.
  bool realtime_ = false;
  std::string realtime_refused_;
  std::atomic<int64_t> last_beat_ns_{absl::ToUnixNanos(absl::Now())};
  std::atomic<int64_t> longest_round_ns_{0};
  std::atomic<std::thread::id> thread_id_{};
  std::thread thread_;
};

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_EVENT_LOOP_H_
