#include "router/worker_pool.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "base/server_util.h"
#include "proto/convert.h"

namespace pdserve::router {

WorkerReport ReportFromInfo(const worker::v1::WorkerInfo& info) {
  WorkerReport r;
  const v1::WorkerStatus& ws = info.status();
  r.healthy = ws.healthy();
  r.unhealthy_reason = info.unhealthy_reason();
  r.instance = info.instance_id();
  r.kv_address = info.kv_address();
  if (info.has_prefix_hash()) {
    const worker::v1::PrefixHashConfig& c = info.prefix_hash();
    r.prefix_hash = HashScheme{rpc::HashFromProto(c.model_lo(), c.model_hi()), static_cast<DType>(c.kv_dtype()),
                               c.block_size()};
  }
  r.free_positions = static_cast<int64_t>(ws.kv_blocks_free()) * ws.kv_block_size();
  r.kv_positions_total = static_cast<int64_t>(ws.kv_blocks_total()) * ws.kv_block_size();
  r.kv_block_size = ws.kv_block_size();
  r.kv_bytes_per_position = ws.kv_bytes_per_position();
  r.max_batch = ws.max_batch();
  r.running = ws.running();
  r.step_seconds = ws.step_seconds();
  return r;
}

WorkerPool::WorkerPool(WorkerPoolOptions options, WorkerTransport* transport, MeasuredInputs* measured,
                       PrefixIndex* index)
    : options_(std::move(options)), transport_(transport), measured_(measured), index_(index) {}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock lock(&stop_mu_);
    stop_ = true;
  }
  if (prober_.joinable()) prober_.join();
  if (discoverer_.joinable()) discoverer_.join();
}

std::vector<WorkerPtr> WorkerPool::Snapshot(Role role) const {
  absl::MutexLock lock(&mu_);
  return role == Role::kPrefill ? prefill_ : decode_;
}

WorkerPtr WorkerPool::Add(Role role, const std::string& address) {
  {
    absl::MutexLock lock(&mu_);
    for (const WorkerPtr& w : role == Role::kPrefill ? prefill_ : decode_) {
      if (w->address() == address) return w;
    }
  }
  // Connecting (a channel) is done outside the lock.
  auto w = std::make_shared<Worker>(address, role, transport_->Connect(address, role));
  absl::MutexLock lock(&mu_);
  std::vector<WorkerPtr>& pool = role == Role::kPrefill ? prefill_ : decode_;
  for (const WorkerPtr& other : pool) {
    if (other->address() == address) return other;
  }
  LogEvent("info", "worker_added", {{"role", RoleName(role)}, {"address", address}});
  pool.push_back(w);
  ++serving_epoch_;
  absl::MutexLock wake(&stop_mu_);
  added_ = true;
  return w;
}

void WorkerPool::Remove(Role role, const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerPtr>& pool = role == Role::kPrefill ? prefill_ : decode_;
  for (auto it = pool.begin(); it != pool.end(); ++it) {
    if ((*it)->address() != address) continue;
    (*it)->removed_ = true;
    measured_->ForgetWorker(address);
    index_->Drop(address);
    LogEvent("info", "worker_removed", {{"role", RoleName(role)}, {"address", address}});
    pool.erase(it);
    ++serving_epoch_;
    return;
  }
}

uint64_t WorkerPool::serving_epoch() const {
  absl::MutexLock lock(&mu_);
  return serving_epoch_;
}

void WorkerPool::AwaitServingChange(uint64_t seen, absl::Duration timeout, const std::atomic<bool>* stop) const {
  absl::MutexLock lock(&mu_);
  auto changed = [this, seen, stop]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return serving_epoch_ != seen || (stop != nullptr && stop->load(std::memory_order_relaxed));
  };
  mu_.AwaitWithTimeout(absl::Condition(&changed), timeout);
}

void WorkerPool::WakeWaiters() const {
  // Releasing the lock has every waiter's condition evaluated again.
  absl::MutexLock lock(&mu_);
}

void WorkerPool::Discover() {
  absl::MutexLock discovering(&discover_mu_);
  for (const Role role : {Role::kPrefill, Role::kDecode}) {
    std::vector<std::string> addresses;
    for (const WorkerTarget& t : role == Role::kPrefill ? options_.prefill_targets : options_.decode_targets) {
      absl::StatusOr<std::vector<std::string>> got = ResolveWorkerTarget(t, options_.resolve_timeout);
      if (got.ok()) {
        resolved_[t.spec] = *std::move(got);
      } else {
        LogEvent("warning", "resolve_failed", {{"target", t.spec}, {"error", std::string(got.status().message())}});
      }
      const std::vector<std::string>& now = resolved_[t.spec];
      addresses.insert(addresses.end(), now.begin(), now.end());
    }
    for (const WorkerPtr& w : Snapshot(role)) {
      if (std::find(addresses.begin(), addresses.end(), w->address()) == addresses.end()) Remove(role, w->address());
    }
    for (const std::string& a : addresses) Add(role, a);
  }
}

absl::Time WorkerPool::ProbeDue(bool force_all) {
  absl::MutexLock lock(&probe_mu_);
  Probe(options_.clock(), force_all);
  return NextProbe();
}

absl::Time WorkerPool::NextProbe() {
  absl::Time next = absl::InfiniteFuture();
  for (const Role role : {Role::kPrefill, Role::kDecode}) {
    for (const WorkerPtr& w : Snapshot(role)) {
      auto it = probes_.find(w);
      // One not yet probed is due now.
      next = std::min(next, it == probes_.end() ? absl::InfinitePast() : it->second.next_probe);
    }
  }
  return next;
}

void WorkerPool::Probe(const absl::Time now, bool force_all) {
  std::vector<WorkerPtr> workers;
  std::vector<StatusQuery> queries;
  absl::flat_hash_set<WorkerPtr> present;
  for (const Role role : {Role::kPrefill, Role::kDecode}) {
    for (WorkerPtr& w : Snapshot(role)) {
      present.insert(w);
      ProbeState& ps = probes_[w];
      if (!force_all && now < ps.next_probe) continue;
      StatusQuery q;
      q.worker = w.get();
      q.request.set_want_kv_events(true);
      q.request.set_kv_events_after(index_->NextAfter(w->address()));
      queries.push_back(std::move(q));
      workers.push_back(std::move(w));
    }
  }
  absl::erase_if(probes_, [&present](const auto& kv) { return !present.contains(kv.first); });
  if (queries.empty()) return;
  const std::vector<absl::StatusOr<worker::v1::WorkerInfo>> answers =
      transport_->Status(queries, options_.probe_timeout);
  for (size_t i = 0; i < workers.size(); ++i) {
    Worker& w = *workers[i];
    ProbeState& ps = probes_[workers[i]];
    const absl::StatusOr<worker::v1::WorkerInfo>& a = answers[i];
    const bool healthy = a.ok() && a->status().healthy();
    std::string reason = a.ok() ? a->unhealthy_reason() : std::string(a.status().message());
    if (a.ok()) {
      Ingest(w, ps, *a, now);
      if (ps.slow_since.has_value()) {
        LogEvent("info", "worker_answering",
                 {{"role", RoleName(w.role())}, {"address", w.address()},
                  {"slow_for_ms", std::to_string(absl::ToInt64Milliseconds(now - *ps.slow_since))}});
      }
    } else if (a.status().code() == absl::StatusCode::kDeadlineExceeded && w.healthy()) {
      // A late answer is what a busy machine gives; only a worker that also
      // stops making progress is taken out.
      if (!ps.slow_since.has_value()) {
        ps.slow_since = now;
        LogEvent("warning", "worker_slow",
                 {{"role", RoleName(w.role())}, {"address", w.address()},
                  {"probe_timeout_ms", std::to_string(absl::ToInt64Milliseconds(options_.probe_timeout))},
                  {"probe_stall_ms", std::to_string(absl::ToInt64Milliseconds(options_.probe_stall))}});
      }
      const absl::Duration quiet = now - std::max(ps.last_answered, w.last_progress());
      if (quiet < options_.probe_stall) {
        ps.next_probe = now + options_.probe_period;
        continue;
      }
      reason = absl::StrCat("no probe answered within ", absl::FormatDuration(options_.probe_timeout), " for ",
                            absl::FormatDuration(quiet), " and no progress since");
    }
    ps.slow_since.reset();
    if (!a.ok()) {
      // What a worker that does not answer held is no longer to be counted on.
      index_->Drop(w.address());
      ++ps.failures;
      ps.next_probe = now + std::min(options_.max_backoff, options_.probe_period * (1 << std::min(ps.failures - 1, 10)));
    }
    const bool was = w.healthy_.exchange(healthy);
    if (was != healthy) {
      absl::MutexLock pool_lock(&mu_);
      ++serving_epoch_;  // Whoever waits for a usable worker looks again.
    }
    Counter* ejections = w.prefill_role() ? options_.prefill_ejections : options_.decode_ejections;
    if (was && !healthy && ejections != nullptr) ejections->Add();
    if (was != healthy || (!healthy && reason != ps.last_reason)) {
      LogEvent(healthy ? "info" : "warning", healthy ? "worker_admitted" : "worker_ejected",
               {{"role", RoleName(w.role())}, {"address", w.address()}, {"reason", reason},
                {"retry_in_ms", std::to_string(absl::ToInt64Milliseconds(ps.next_probe - now))}});
    }
    ps.last_reason = healthy ? "" : reason;
    absl::MutexLock wl(&w.mu_);
    w.ejection_reason_ = ps.last_reason;
  }
}

void WorkerPool::Ingest(Worker& w, ProbeState& ps, const worker::v1::WorkerInfo& info, absl::Time now) {
  const uint64_t before = w.instance_.exchange(info.instance_id());
  if (before != 0 && before != info.instance_id()) {
    LogEvent("info", "worker_restarted", {{"role", RoleName(w.role())}, {"address", w.address()}});
  }
  WorkerReport r = ReportFromInfo(info);
  {
    absl::MutexLock lock(&w.mu_);
    // An answer without them keeps what an earlier one said.
    if (r.kv_address.empty()) r.kv_address = w.report_.kv_address;
    if (!r.prefix_hash.has_value()) r.prefix_hash = w.report_.prefix_hash;
    w.report_ = r;
  }
  if (info.has_kv_events()) {
    const worker::v1::KvEvents& ke = info.kv_events();
    std::vector<KvEvent> events;
    events.reserve(static_cast<size_t>(ke.events_size()));
    for (const worker::v1::KvEvent& e : ke.events()) {
      const int kind = static_cast<int>(e.kind());
      if (kind < 1 || kind > 3) continue;
      events.push_back(KvEvent{e.id(), static_cast<KvEventKind>(kind), rpc::HashFromProto(e.hash_lo(), e.hash_hi()),
                               rpc::HashFromProto(e.parent_lo(), e.parent_hi())});
    }
    index_->Apply(w.address(), info.instance_id(), events, ke.snapshot(), ke.last_id());
  }
  const v1::WorkerStatus& ws = info.status();
  // One sample per probe that saw new steps: the worker's step time is a
  // running average, so an idle worker would repeat its last one.
  if (!w.prefill_role() && ws.running() > 0 && ws.step_seconds() > 0 && ws.steps() != ps.last_steps) {
    measured_->RecordDecodeStep(w.address(), ws.running(), ws.mean_history_tokens(), ws.step_seconds());
  }
  ps.last_steps = ws.steps();
  ps.last_answered = now;
  ps.failures = 0;
  // A long event backlog is read again at once rather than a period later.
  ps.next_probe = info.kv_events().more() ? now : now + options_.probe_period;
}

bool WorkerPool::WaitOrStop(absl::Duration d) {
  absl::MutexLock lock(&stop_mu_);
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stop_mu_) { return stop_; };
  return stop_mu_.AwaitWithTimeout(absl::Condition(&stopping), d);
}

bool WorkerPool::WaitForProbeOrStop(absl::Time due) {
  absl::MutexLock lock(&stop_mu_);
  auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stop_mu_) { return stop_ || added_; };
  stop_mu_.AwaitWithTimeout(absl::Condition(&woken), due - options_.clock());
  added_ = false;
  return stop_;
}

// Each round sleeps until the next worker's probe is due (its period, or
// its backoff) or a worker joins.
void WorkerPool::ProbeLoop() {
  while (true) {
    const absl::Time next = ProbeDue(/*force_all=*/false);
    if (options_.after_probe_round) options_.after_probe_round();
    if (WaitForProbeOrStop(next)) return;
  }
}

void WorkerPool::DiscoverLoop() {
  while (!WaitOrStop(options_.resolve_interval)) Discover();
}

void WorkerPool::Start() {
  if (!prober_.joinable()) prober_ = std::thread([this] { ProbeLoop(); });
  if (!discoverer_.joinable()) discoverer_ = std::thread([this] { DiscoverLoop(); });
}

absl::Status WorkerPool::WaitForWorkers(absl::Duration timeout, std::vector<Role> pools, bool need_kv_address) {
  const absl::Time deadline = options_.clock() + timeout;
  std::optional<absl::Time> pools_served_since;
  while (true) {
    Discover();
    ProbeDue(/*force_all=*/true);
    std::string silent;
    std::string empty_pool;
    for (const Role role : pools) {
      bool any = false;
      for (const WorkerPtr& w : Snapshot(role)) {
        const bool ready =
            w->healthy() && (role == Role::kPrefill || !need_kv_address || !w->report().kv_address.empty());
        any |= ready;
        if (!ready) {
          const std::string why = w->ejection_reason();
          absl::StrAppend(&silent, " ", w->address(), why.empty() ? "" : absl::StrCat(" (", why, ")"));
        }
      }
      if (!any) absl::StrAppend(&empty_pool, empty_pool.empty() ? "" : " and ", RoleName(role));
    }
    if (empty_pool.empty() && !pools_served_since.has_value()) pools_served_since = options_.clock();
    // A pool whose targets resolve to no address yet (a headless Service
    // before its first pod is ready) is empty, not silent: wait for it.
    if (silent.empty() && empty_pool.empty()) break;
    if (empty_pool.empty() && options_.clock() - *pools_served_since > absl::Seconds(2)) {
      LogEvent("warning", "workers_not_ready", {{"workers", silent}});
      break;
    }
    if (options_.clock() > deadline) {
      if (!empty_pool.empty()) {
        return absl::UnavailableError(absl::StrCat("no live ", empty_pool, " worker; not answering:", silent));
      }
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  Start();
  return absl::OkStatus();
}

std::string WorkerPool::NoHealthyWorker(Role role) const {
  std::string reasons;
  for (const WorkerPtr& w : Snapshot(role)) {
    if (w->healthy()) continue;
    const std::string why = w->ejection_reason();
    absl::StrAppend(&reasons, reasons.empty() ? "" : "; ", w->address(), ": ", why.empty() ? "not probed yet" : why);
  }
  return absl::StrCat("no healthy ", RoleName(role), " worker", reasons.empty() ? "" : absl::StrCat(" (", reasons, ")"));
}

int64_t WorkerPool::Serving(Role role) const {
  int64_t n = 0;
  for (const WorkerPtr& w : Snapshot(role)) n += w->healthy() ? 1 : 0;
  return n;
}

int64_t WorkerPool::MaxDecodeBatch() const {
  int64_t b = 0;
  for (const WorkerPtr& w : Snapshot(Role::kDecode)) b = std::max<int64_t>(b, w->report().max_batch);
  return b;
}

}  // namespace pdserve::router
