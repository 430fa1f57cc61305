// The router's picture of its workers: who they are (discovered from the
// targets, again every resolve interval), whether each serves (a Status
// probe every probe period), what each reports (free KV, batch, step time,
// KV address, hashing scheme) and what each caches (its KV events, applied
// to the prefix index).
//
// The probe policy: a worker is ejected for errors or for making no
// progress, never for one slow health reply on a busy machine.
//  - An answer that says it is not serving, or a probe that fails with any
//    code but DEADLINE_EXCEEDED (UNAVAILABLE: refused, the process is gone),
//    ejects it at once: its prefix index entries are dropped and it is
//    probed again with exponential backoff.
//  - A serving worker whose probes time out (DEADLINE_EXCEEDED) keeps
//    serving, its index kept, probed every probe period, as long as it
//    answered a probe or showed progress (Worker::NoteProgress) within
//    probe_stall; past that it is ejected as above.
//  - A worker not serving (never answered, or ejected) serves again only
//    when a probe answers healthy.
// All times come from the options' clock.
//
// Thread safety: thread-safe. Start() runs the probe and discovery loops on
// threads of their own; the destructor stops them.
#ifndef PDSERVE_ROUTER_WORKER_POOL_H_
#define PDSERVE_ROUTER_WORKER_POOL_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kv/block_hash.h"
#include "base/dtype.h"
#include "base/metrics.h"
#include "router/discovery.h"
#include "router/measured.h"
#include "router/prefix_index.h"
#include "router/transport.h"

namespace pdserve::router {

// How a worker hashes its KV blocks (block_hash.h): prompts hashed the
// same way match its index.
struct HashScheme {
  ModelIdentity model;
  DType kv_dtype = DType::kF32;
  int32_t block_size = 0;
  friend bool operator==(const HashScheme& a, const HashScheme& b) {
    return a.model == b.model && a.kv_dtype == b.kv_dtype && a.block_size == b.block_size;
  }
};

// What a worker's last answered Status said.
struct WorkerReport {
  bool healthy = false;
  std::string unhealthy_reason;
  uint64_t instance = 0;        // its process's id; a new one: it restarted
  std::string kv_address;       // decode: where its KV receiver listens
  std::optional<HashScheme> prefix_hash;
  int64_t free_positions = -1;  // -1: not known yet
  int64_t kv_positions_total = 0;  // its pool's size; 0: not known yet
  int32_t kv_block_size = 0;
  int64_t kv_bytes_per_position = 0;
  int32_t max_batch = 0;
  int32_t running = 0;          // decode: sequences running
  double step_seconds = 0;      // decode: its average step time
};

// The report of a Status answer.
WorkerReport ReportFromInfo(const worker::v1::WorkerInfo& info);

class Worker {
 public:
  Worker(std::string address, Role role, std::shared_ptr<WorkerConnection> connection)
      : address_(std::move(address)), role_(role), connection_(std::move(connection)) {}

  const std::string& address() const { return address_; }
  Role role() const { return role_; }
  bool prefill_role() const { return role_ == Role::kPrefill; }
  WorkerConnection* connection() const { return connection_.get(); }

  // Serving in the router's view: its last answered probe said so, no
  // probe has failed but by timing out, it has not stalled (see the probe
  // policy above) and no request has seen it fail since. False until the
  // first probe answers healthy.
  bool healthy() const { return healthy_.load(std::memory_order_relaxed); }
  // A request saw it fail: picked no more until a probe finds it serving.
  void MarkFailed() { healthy_.store(false, std::memory_order_relaxed); }
  uint64_t instance() const { return instance_.load(std::memory_order_relaxed); }
  // No longer named by its target: picked no more; requests on it finish.
  bool removed() const { return removed_.load(std::memory_order_relaxed); }

  // It did work at `now`: sent a message on one of the router's requests
  // (a prefill's first token or done, a decode chunk) or, decode, reported
  // steps a probe had not seen. A worker whose probes time out keeps
  // serving while it does. Thread-safe; an earlier `now` than the last one
  // noted changes nothing.
  void NoteProgress(absl::Time now) {
    const int64_t ns = absl::ToUnixNanos(now);
    int64_t seen = last_progress_ns_.load(std::memory_order_relaxed);
    while (seen < ns && !last_progress_ns_.compare_exchange_weak(seen, ns, std::memory_order_relaxed)) {
    }
  }
  // The latest time NoteProgress noted; InfinitePast() before the first.
  absl::Time last_progress() const {
    const int64_t ns = last_progress_ns_.load(std::memory_order_relaxed);
    return ns == kNoProgress ? absl::InfinitePast() : absl::FromUnixNanos(ns);
  }

  WorkerReport report() const {
    absl::MutexLock lock(&mu_);
    return report_;
  }
  // Why the last probe found it not serving ("" when serving).
  std::string ejection_reason() const {
    absl::MutexLock lock(&mu_);
    return ejection_reason_;
  }

  // The router's own load on it: its requests in flight here, and (prefill)
  // the uncached prompt tokens it has sent and not yet seen answered.
  std::atomic<int32_t> in_flight{0};
  std::atomic<int64_t> queued_tokens{0};

 private:
  friend class WorkerPool;

  const std::string address_;
  const Role role_;
  const std::shared_ptr<WorkerConnection> connection_;
  std::atomic<bool> healthy_{false};
  std::atomic<uint64_t> instance_{0};
  std::atomic<bool> removed_{false};
  static constexpr int64_t kNoProgress = std::numeric_limits<int64_t>::min();
  std::atomic<int64_t> last_progress_ns_{kNoProgress};  // nanoseconds since the Unix epoch
  mutable absl::Mutex mu_;
  WorkerReport report_ ABSL_GUARDED_BY(mu_);
  std::string ejection_reason_ ABSL_GUARDED_BY(mu_);
};
using WorkerPtr = std::shared_ptr<Worker>;

struct WorkerPoolOptions {
  std::vector<WorkerTarget> prefill_targets;
  std::vector<WorkerTarget> decode_targets;
  absl::Duration resolve_interval = absl::Seconds(5);
  absl::Duration resolve_timeout = absl::Seconds(2);
  // Status probes of each worker; one that ejects it is retried with
  // exponential backoff from probe_period up to max_backoff.
  absl::Duration probe_period = absl::Milliseconds(100);
  absl::Duration probe_timeout = absl::Milliseconds(500);
  absl::Duration max_backoff = absl::Seconds(2);
  // How long a serving worker that stops answering probes in time
  // (DEADLINE_EXCEEDED) keeps serving in the router's view while it shows
  // no progress: a busy machine answers health late, a stuck one not at all.
  absl::Duration probe_stall = absl::Seconds(10);
  Clock clock = RealClock();
  // Counted each time a worker stops serving in the router's view
  // (nullable).
  Counter* prefill_ejections = nullptr;
  Counter* decode_ejections = nullptr;
  // Run by the probe thread after each round (the router refreshes its
  // admission load there).
  std::function<void()> after_probe_round;
};

class WorkerPool {
 public:
  // `transport`, `measured` and `index` must outlive the pool.
  WorkerPool(WorkerPoolOptions options, WorkerTransport* transport, MeasuredInputs* measured, PrefixIndex* index);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // The pool's workers now, in the order they were added.
  std::vector<WorkerPtr> Snapshot(Role role) const;

  // Adds `address` (discovery does this; tests call it directly). An
  // address already there is returned as it is.
  WorkerPtr Add(Role role, const std::string& address);
  // Drops `address`: picked no more, its measurements and index forgotten.
  void Remove(Role role, const std::string& address);

  // Resolves every target of both pools; adds new addresses, removes gone
  // ones. A target that fails to resolve keeps its previous addresses.
  void Discover();
  // One round of Status probes (those due, or all), concurrently. Returns
  // when the next one is due (InfiniteFuture: no worker).
  absl::Time ProbeDue(bool force_all);

  // Discovers and probes until every worker answers (decode workers also
  // with their KV address when `need_kv_address`), or, once each pool in
  // `pools` has one that does, for at most two more seconds; then starts
  // the loops. Errors: UNAVAILABLE naming the pool with no live worker and
  // the silent addresses.
  absl::Status WaitForWorkers(absl::Duration timeout, std::vector<Role> pools, bool need_kv_address);
  // Starts the probe and discovery loops (WaitForWorkers does).
  void Start();

  // Bumped each time the set of serving workers may have changed: a worker
  // added, removed, admitted or ejected.
  uint64_t serving_epoch() const;
  // Returns once serving_epoch() differs from `seen`, `*stop` is true (a
  // waker sets it, then calls WakeWaiters), or `timeout` has passed.
  void AwaitServingChange(uint64_t seen, absl::Duration timeout, const std::atomic<bool>* stop) const;
  // Has every AwaitServingChange look at its condition again.
  void WakeWaiters() const;

  // "no healthy decode worker (ADDRESS: why it is not serving; ...)".
  std::string NoHealthyWorker(Role role) const;
  // Serving workers of `role`, and the largest decode batch reported.
  int64_t Serving(Role role) const;
  int64_t MaxDecodeBatch() const;

 private:
  // The prober's own bookkeeping per worker.
  struct ProbeState {
    int failures = 0;
    absl::Time next_probe = absl::InfinitePast();
    std::string last_reason;
    int64_t last_steps = 0;  // decode steps seen at the last probe
    absl::Time last_answered = absl::InfinitePast();
    // Since when its probes time out while it serves (nullopt: they don't).
    std::optional<absl::Time> slow_since;
  };
  void Probe(const absl::Time now, bool force_all) ABSL_EXCLUSIVE_LOCKS_REQUIRED(probe_mu_);
  // The earliest probe due among the workers in the pool.
  absl::Time NextProbe() ABSL_EXCLUSIVE_LOCKS_REQUIRED(probe_mu_);
  void Ingest(Worker& w, ProbeState& ps, const worker::v1::WorkerInfo& info, absl::Time now);
  void ProbeLoop();
  void DiscoverLoop();
  // Waits `d` or until stopping; true when stopping.
  bool WaitOrStop(absl::Duration d);
  // Waits until `due` (on the pool's clock), a worker is added, or
  // stopping; true when stopping.
  bool WaitForProbeOrStop(absl::Time due);

  const WorkerPoolOptions options_;
  WorkerTransport* const transport_;
  MeasuredInputs* const measured_;
  PrefixIndex* const index_;

  mutable absl::Mutex mu_;
  std::vector<WorkerPtr> prefill_ ABSL_GUARDED_BY(mu_);
  std::vector<WorkerPtr> decode_ ABSL_GUARDED_BY(mu_);
  uint64_t serving_epoch_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Mutex probe_mu_;  // one probe round at a time
  // Keyed by the worker itself (held until it leaves the pool), so a new
  // worker never inherits a removed one's backoff.
  absl::flat_hash_map<WorkerPtr, ProbeState> probes_ ABSL_GUARDED_BY(probe_mu_);

  absl::Mutex discover_mu_;  // one discovery at a time
  // Per target, its addresses at the last successful resolve.
  absl::flat_hash_map<std::string, std::vector<std::string>> resolved_ ABSL_GUARDED_BY(discover_mu_);

  absl::Mutex stop_mu_;
  bool stop_ ABSL_GUARDED_BY(stop_mu_) = false;
  bool added_ ABSL_GUARDED_BY(stop_mu_) = false;  // a worker joined: probe it now
  std::thread prober_;
  std::thread discoverer_;  // a slow name server never delays the probes
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_WORKER_POOL_H_
