// The router's queue in front of the prefill pool. A request goes on to a
// prefill worker only once a decode worker has KV room for it
// (decode_room.h); until then it waits here, holding no worker's memory
// and no computation. Past the queue's bounds the router refuses at once,
// before any prefill work, and says when to come back.
//
// Order: first come, first served within an API key, and the keys take
// turns (one request each in rotation), so one key's burst cannot hold
// another key's requests behind it. The request whose turn it is waits
// for room; nobody overtakes it (a small request slipping past a large one
// forever would starve the large one).
//
// Nothing here polls. The queue tries the request whose turn it is when a
// request arrives, when a lease is returned, when a worker's report is
// read and when a waiting request leaves; a waiting request sleeps until
// it is placed, its wait ends or it is cancelled.
//
// Refusals, each RESOURCE_EXHAUSTED with kRetryAfterPayload (router/api_keys.h):
//   "the router's queue is full: 1,000 requests waiting (--max_queued_requests)"
//   "waited 60.0 s in the router's queue for decode KV room (--max_queue_wait_s)"
// A client deadline that passes while queued ends the wait with
// DEADLINE_EXCEEDED; a cancel ends it with CANCELLED.
//
// Thread safety: thread-safe.
#ifndef PDSERVE_ROUTER_REQUEST_QUEUE_H_
#define PDSERVE_ROUTER_REQUEST_QUEUE_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "router/measured.h"

namespace pdserve::router {

struct RequestQueueOptions {
  // Requests waiting at once; more are refused. The default holds a burst
  // of several thousand requests on one router.
  int64_t max_queued = 8192;  // REQUIRES: >= 0
  // The longest a request waits for room before it is refused.
  absl::Duration max_wait = absl::Seconds(60);
  Clock clock = RealClock();
};

// How a request's time in the queue ended.
enum class QueueEnd {
  kPlaced,
  kFull,           // refused at once: the queue was full
  kWaitedTooLong,  // refused after max_wait
  kDeadline,       // the client's deadline passed while queued
  kCancelled,
};

// What placing the request whose turn it is came to.
enum class PlaceOutcome {
  kPlaced,  // it took its room: it leaves the queue
  kNoRoom,  // no decode worker has room for it now: it and all behind it wait
};

struct RequestQueueStats {
  int64_t waiting = 0;
  int64_t placed = 0;          // left the queue placed (waiting or not)
  int64_t placed_waited = 0;   // of them, after waiting
  double waited_seconds = 0;   // summed over those
  absl::Duration oldest_wait;  // the longest any request waiting now has waited
  int64_t refused_full = 0;
  int64_t refused_wait = 0;
  int64_t deadline = 0;        // the client's deadline passed while queued
  int64_t cancelled = 0;
  // From the router's receipt of each request refused because the queue
  // was full to its refusal (Entry::before_queue + its time here): the sum
  // and the longest.
  double refused_full_seconds = 0;
  double refused_full_max_seconds = 0;
};

class RequestQueue {
 public:
  explicit RequestQueue(RequestQueueOptions options);
  RequestQueue(const RequestQueue&) = delete;
  RequestQueue& operator=(const RequestQueue&) = delete;

  struct Entry {
    std::string key;  // the API key id ("" without keys)
    std::optional<absl::Time> deadline;  // the client's
    // Tried when it is this request's turn, under the queue's lock (so no
    // two requests are placed at once): takes the room when there is some.
    // Must not call back into the queue.
    std::function<PlaceOutcome()> place;
    // Read whenever the queue wakes the request: true ends its wait.
    const std::atomic<bool>* cancelled = nullptr;
    // How long the router had the request before it came here (tokenizing,
    // key checks): counted in the latency of a queue-full refusal.
    absl::Duration before_queue = absl::ZeroDuration();
  };

  // Returns once `entry.place` placed it (OK), or refused/ended as the
  // header says. `waited` and `end` (nullable) get the time spent queued
  // and how the wait ended.
  absl::Status Wait(const Entry& entry, absl::Duration* waited, QueueEnd* end = nullptr);

  // Something changed that may make room (a lease returned, a report
  // read): tries again.
  void Poke();
  // A waiting request's `cancelled` flag was set: wakes it to leave.
  void WakeCancelled();

  RequestQueueStats Stats() const;
  const RequestQueueOptions& options() const { return options_; }

 private:
  // Each waiter sleeps on a condition variable of its own and is signalled
  // only when it is placed or cancelled: with thousands waiting, a wait on
  // a shared mutex condition would have every unlock evaluate every
  // waiter's condition.
  struct Waiter {
    const Entry* entry;
    absl::Time since;
    bool placed = false;
    absl::CondVar cv;
  };
  // Places requests in turn until one finds no room.
  void Dispatch() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Remove(Waiter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Seconds until a place is likely free: what waits, at the rate the
  // queue has placed requests lately (at least 1).
  int64_t RetryAfterSeconds(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Refusal(std::string message, absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RequestQueueOptions options_;
  mutable absl::Mutex mu_;
  // Per key, its waiting requests in arrival order; `turns_` the keys with
  // any, in the order they take turns (the front's turn is now).
  absl::flat_hash_map<std::string, std::deque<Waiter*>> by_key_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> turns_ ABSL_GUARDED_BY(mu_);
  RequestQueueStats stats_ ABSL_GUARDED_BY(mu_);
  // When the last placements from the queue happened (a ring), for the
  // retry-after estimate.
  std::vector<absl::Time> recent_ ABSL_GUARDED_BY(mu_);
  size_t recent_next_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_REQUEST_QUEUE_H_
