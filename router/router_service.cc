#include "router/router_service.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <fstream>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/grpcpp.h"
#include "base/grpc_status.h"
#include "base/server_util.h"
#include "router/grpc_transport.h"
#include "router/tool_calls.h"

namespace pdserve::router {
namespace {

// A "VmRSS:"-style line of /proc/self/status, in bytes (0: unreadable).
int64_t ProcStatusBytes(absl::string_view field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    absl::string_view l = line;
    if (!absl::ConsumePrefix(&l, field)) continue;
    int64_t kib = 0;
    l = absl::StripAsciiWhitespace(l);
    absl::ConsumeSuffix(&l, " kB");
    return absl::SimpleAtoi(l, &kib) ? kib * 1024 : 0;
  }
  return 0;
}

std::optional<absl::Time> DeadlineOf(const grpc::ServerContextBase& ctx) {
  if (ctx.deadline() == std::chrono::system_clock::time_point::max()) return std::nullopt;
  return absl::FromChrono(ctx.deadline());
}

// A generation's own thread. The reactor that owns it is deleted in its
// OnDone, which gRPC runs after the thread's last act (Finish); OnDone
// waits for the thread to return, or lets it go when it runs on it.
class CallThread {
 public:
  ~CallThread() {
    if (!thread_.joinable()) return;
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();
    } else {
      thread_.join();
    }
  }
  // False when no thread could be started (logged). The body waits until
  // thread_ holds its thread: a body that ends the call at once may have
  // its reactor deleted, and this joined, before Start returns.
  bool Start(std::function<void()> body) {
    try {
      thread_ = std::thread([this, body = std::move(body)] {
        started_.WaitForNotification();
        body();
      });
    } catch (const std::system_error& e) {
      LogEvent("warning", "generation_thread_start_failed", {{"error", e.what()}});
      return false;
    }
    started_.Notify();
    return true;
  }

 private:
  absl::Notification started_;
  std::thread thread_;
};

const grpc::Status kNoThread(grpc::StatusCode::RESOURCE_EXHAUSTED, "no thread could be started for the generation");

}  // namespace

// Generate: the relay's messages are queued and written one after
// another, each write started by the previous one's completion, so the
// relay's thread does not wait a write's round trip through gRPC's
// callback threads for every message. The queue is bounded: a client that
// reads slower than the relay emits holds the relay back once
// kMaxQueuedWrites wait, as a synchronous writer would.
class RouterService::StreamedCall final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  StreamedCall(RouterService* service, grpc::CallbackServerContext* ctx, const v1::GenerateRequest* req)
      : service_(service), ctx_(ctx), req_(req) {
    if (!thread_.Start([this] { Body(); })) Finish(kNoThread);
  }
  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    queue_.pop_front();
    if (!ok) {  // the client is gone: nothing more is written
      write_ok_ = false;
      queue_.clear();
    }
    if (queue_.empty()) {
      writing_ = false;
    } else {
      WriteFront();
    }
  }
  void OnCancel() override { cancel_.Cancel(); }
  void OnDone() override { delete this; }

 private:
  static constexpr size_t kMaxQueuedWrites = 64;

  void Body() {
    const grpc::Status st =
        service_->Run(ctx_, *req_, Reply::kStreamed, [this](const v1::GenerateResponse& m) { return Write(m); },
                      &cancel_);
    {
      // The status goes after the last message.
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &StreamedCall::Idle));
    }
    Finish(st);
  }
  bool Write(const v1::GenerateResponse& m) {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &StreamedCall::Room));
    if (!write_ok_) return false;
    queue_.push_back(m);  // a deque: the message being written stays where it is
    if (!writing_) {
      writing_ = true;
      WriteFront();
    }
    return true;
  }
  // With more behind it, a message may wait in gRPC's buffer for the next
  // (fewer, fuller frames); the last one queued is sent at once.
  void WriteFront() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    grpc::WriteOptions options;
    if (queue_.size() > 1) options.set_buffer_hint();
    StartWrite(&queue_.front(), options);
  }
  bool Idle() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !writing_; }
  bool Room() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !write_ok_ || queue_.size() < kMaxQueuedWrites; }

  RouterService* const service_;
  grpc::CallbackServerContext* const ctx_;
  const v1::GenerateRequest* const req_;
  ClientCancel cancel_;
  absl::Mutex mu_;
  std::deque<v1::GenerateResponse> queue_ ABSL_GUARDED_BY(mu_);  // the front one is being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool write_ok_ ABSL_GUARDED_BY(mu_) = true;
  CallThread thread_;  // last: joined (in OnDone's delete) before the rest goes
};

// Complete: the reply is gathered whole and sent at the end.
class RouterService::WholeCall final : public grpc::ServerUnaryReactor {
 public:
  WholeCall(RouterService* service, grpc::CallbackServerContext* ctx, const v1::GenerateRequest* req,
            v1::CompleteResponse* out)
      : service_(service), ctx_(ctx), req_(req), out_(out) {
    if (!thread_.Start([this] { Body(); })) Finish(kNoThread);
  }
  void OnCancel() override { cancel_.Cancel(); }
  void OnDone() override { delete this; }

 private:
  void Body() {
    out_->set_request_id(req_->request_id());
    Finish(service_->Run(ctx_, *req_, Reply::kWhole, [this](const v1::GenerateResponse& m) { return Add(m); },
                         &cancel_));
  }
  bool Add(const v1::GenerateResponse& m) {
    if (m.has_chunk()) {
      out_->mutable_token_ids()->Add(m.chunk().token_ids().begin(), m.chunk().token_ids().end());
      out_->mutable_text()->append(m.chunk().text());
      for (const auto& lp : m.chunk().logprobs()) *out_->add_logprobs() = lp;
    } else if (m.has_final()) {
      *out_->mutable_final() = m.final();
    }
    return true;
  }

  RouterService* const service_;
  grpc::CallbackServerContext* const ctx_;
  const v1::GenerateRequest* const req_;
  v1::CompleteResponse* const out_;
  ClientCancel cancel_;
  CallThread thread_;  // last: joined (in OnDone's delete) before the rest goes
};

RouterService::RouterService(RouterOptions options) : options_(std::move(options)) {}

void RouterService::RegisterMetrics() {
  relay_metrics_ = std::make_unique<RelayMetrics>(metrics_);
  resolver_->grammars().RegisterMetrics(metrics_);
  // The measured capacity model, computed at each scrape (NaN: no data yet).
  for (const capacity::Stage stage : {capacity::Stage::kPrefill, capacity::Stage::kHandoff, capacity::Stage::kDecode}) {
    const std::string label = absl::StrCat("stage=\"", capacity::StageName(stage), "\"");
    metrics_.AddGauge(
        "pdserve_stage_capacity_requests_per_second", "Each stage's measured capacity, whole pool.",
        [this, stage] { return CapacityOf(CurrentCapacity(), stage).requests_per_s.value_or(std::nan("")); }, label);
    metrics_.AddGauge(
        "pdserve_bottleneck", "1 for the stage with the lowest measured capacity.",
        [this, stage] {
          const MeasuredCapacity c = CurrentCapacity();
          return c.bottleneck.has_value() && *c.bottleneck == stage ? 1.0 : 0.0;
        },
        label);
  }
  metrics_.AddGauge("pdserve_arrival_rate_requests_per_second", "Arrivals over the last 10 s.",
                    [this] { return CurrentCapacity().arrival_rate.value.value_or(0); });
  // Absent (not NaN) until the stage and the arrival rate each rest on
  // --autoscale_min_samples samples: what the autoscalers read.
  for (const capacity::Stage pool : {capacity::Stage::kPrefill, capacity::Stage::kDecode}) {
    metrics_.AddOptionalGauge(
        "pdserve_recommended_workers", "Workers each pool needs for the observed arrival rate (absent: too few samples).",
        [this, pool]() -> std::optional<double> {
          const std::optional<int64_t> n =
              RecommendedWorkers(CurrentCapacity(), pool, options_.autoscale_min_samples);
          if (!n.has_value()) return std::nullopt;
          return static_cast<double>(*n);
        },
        absl::StrCat("pool=\"", capacity::StageName(pool), "\""));
  }
  metrics_.AddGauge("pdserve_router_resident_bytes", "The router process's resident memory (VmRSS).",
                    [] { return static_cast<double>(ProcStatusBytes("VmRSS:")); });
  metrics_.AddGauge("pdserve_router_peak_resident_bytes", "The router process's peak resident memory (VmHWM).",
                    [] { return static_cast<double>(ProcStatusBytes("VmHWM:")); });
  if (queue_ != nullptr) {
    metrics_.AddGauge("pdserve_queued_requests", "Requests waiting in the router's queue for decode KV room.",
                      [this] { return static_cast<double>(queue_->Stats().waiting); });
  }
  metrics_.AddCounterFunc(
      "pdserve_prefill_tokens_cached_elsewhere_total",
      "Prompt tokens a prefill worker computed although another prefill worker held them in its prefix cache "
      "(recomputation that prefix pulls did not avoid: off, failed or predicted slower).",
      [this] { return placement_ != nullptr ? static_cast<double>(placement_->tokens_cached_elsewhere()) : 0.0; });
  {
    auto stat = [this](std::atomic<int64_t> Placement::PullStats::* field) {
      return [this, field] {
        return placement_ != nullptr ? static_cast<double>((placement_->pull_stats().*field).load()) : 0.0;
      };
    };
    using S = Placement::PullStats;
    for (const auto& [outcome, field] : {std::pair{"pulled", &S::pulled}, std::pair{"not_cached", &S::empty},
                                         std::pair{"failed", &S::failed}, std::pair{"slower", &S::slower},
                                         std::pair{"unmeasured", &S::unmeasured}}) {
      metrics_.AddCounterFunc(
          "pdserve_prefix_pulls_total",
          "Prefixes a prefill worker was about to compute while another held them, by what the router did: pulled, "
          "not_cached (the holder had let them go), failed (computed instead), slower (computing predicted faster), "
          "unmeasured (no link or prefill speed measured yet).",
          stat(field), absl::StrCat("outcome=\"", outcome, "\""));
    }
    metrics_.AddCounterFunc("pdserve_prefix_pulled_tokens_total",
                            "Prompt positions cached on a prefill worker by pulls (held ones included).",
                            stat(&S::pulled_positions));
    metrics_.AddCounterFunc("pdserve_prefix_pull_bytes_total", "KV bytes moved by prefix pulls.", stat(&S::bytes));
    metrics_.AddCounterFunc("pdserve_prefix_pull_seconds_total", "Seconds prefix pulls took, request to commit.",
                            [this] { return placement_ != nullptr ? placement_->pull_stats().seconds.load() : 0.0; });
  }
  metrics_.AddGauge("pdserve_requests_in_flight", "Requests being served.",
                    [this] { return static_cast<double>(in_flight_.load()); });
  for (const Role role : {Role::kPrefill, Role::kDecode}) {
    for (const bool healthy : {true, false}) {
      metrics_.AddGauge(
          "pdserve_workers", "Workers known to the router, by role and whether they serve now.",
          [this, role, healthy] {
            int n = 0;
            for (const WorkerPtr& w : pool_->Snapshot(role)) n += w->healthy() == healthy ? 1 : 0;
            return static_cast<double>(n);
          },
          absl::StrCat("role=\"", RoleName(role), "\",state=\"", healthy ? "serving" : "ejected", "\""));
    }
  }
}

absl::StatusOr<std::unique_ptr<RouterService>> RouterService::Create(RouterOptions options) {
  if (options.decode_workers.empty()) return absl::InvalidArgumentError("--decode: no decode workers given");
  if (!options.colocated && options.prefill_workers.empty()) {
    return absl::InvalidArgumentError("--prefill: no prefill workers given (or pass --colocated)");
  }
  std::unique_ptr<RouterService> r(new RouterService(std::move(options)));
  const RouterOptions& o = r->options_;
  absl::StatusOr<std::unique_ptr<RequestResolver>> resolver = RequestResolver::Create(o.model_dir, o.model_name, o.grammar);
  if (!resolver.ok()) return resolver.status();
  r->resolver_ = *std::move(resolver);
  if (!o.api_keys_file.empty()) {
    absl::StatusOr<std::unique_ptr<ApiKeys>> keys = ApiKeys::Load(o.api_keys_file);
    if (!keys.ok()) return absl::InvalidArgumentError(absl::StrCat("--api_keys_file: ", keys.status().message()));
    r->api_keys_ = *std::move(keys);
  }

  WorkerPoolOptions po;
  for (const auto& [flag, specs, targets] :
       {std::tuple{"--prefill", &o.prefill_workers, &po.prefill_targets},
        std::tuple{"--decode", &o.decode_workers, &po.decode_targets}}) {
    for (const std::string& spec : *specs) {
      absl::StatusOr<WorkerTarget> t = ParseWorkerTarget(spec);
      if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat(flag, ": ", t.status().message()));
      targets->push_back(*std::move(t));
    }
  }
  absl::StatusOr<std::unique_ptr<Selector>> ps = MakeSelector(o.prefill_policy, Pool::kPrefill);
  if (!ps.ok()) return absl::InvalidArgumentError(absl::StrCat("--prefill_policy: ", ps.status().message()));
  absl::StatusOr<std::unique_ptr<Selector>> ds = MakeSelector(o.decode_policy, Pool::kDecode);
  if (!ds.ok()) return absl::InvalidArgumentError(absl::StrCat("--decode_policy: ", ds.status().message()));
  if (o.admission.has_value()) r->admission_ = std::make_unique<AdmissionController>(*o.admission);
  // Colocated, there is no handoff to hold back: each decode worker's engine
  // queues and preempts what its pool cannot take.
  if (o.queue.has_value() && !o.colocated) {
    r->queue_ = std::make_unique<RequestQueue>(*o.queue);
    RequestQueue* queue = r->queue_.get();
    r->room_.set_on_room([queue] { queue->Poke(); });
  }

  r->RegisterMetrics();
  po.resolve_interval = o.resolve_interval;
  po.resolve_timeout = o.resolve_timeout;
  po.probe_period = o.probe_period;
  po.max_backoff = o.max_backoff;
  po.probe_stall = o.probe_stall;
  for (const Role role : {Role::kPrefill, Role::kDecode}) {
    Counter* c = r->metrics_.AddCounter("pdserve_worker_ejections_total",
                                        "Times a worker stopped serving in the router's view.",
                                        absl::StrCat("role=\"", RoleName(role), "\""));
    (role == Role::kPrefill ? po.prefill_ejections : po.decode_ejections) = c;
    r->ejections_[role == Role::kPrefill ? 0 : 1] = c;
  }
  RouterService* raw = r.get();
  po.after_probe_round = [raw] {
    // The workers' reports correct the ledger (and may show room).
    if (raw->queue_ != nullptr) raw->room_.Refresh(raw->pool_->Snapshot(Role::kDecode));
    if (raw->admission_ == nullptr || absl::Now() < raw->next_load_update_) return;
    raw->admission_->UpdateLoad(LoadFromCapacity(raw->CurrentCapacity()));
    raw->next_load_update_ = absl::Now() + absl::Milliseconds(250);
  };
  r->transport_ = std::make_unique<GrpcTransport>(o.tls);
  r->pool_ = std::make_unique<WorkerPool>(std::move(po), r->transport_.get(), &r->measured_, &r->prefix_index_);

  PlacementOptions pl;
  pl.colocated = o.colocated;
  pl.itl_target = o.itl_target;
  pl.local_prefill_max_tokens = o.local_prefill_max_tokens;
  pl.pull_min_tokens = o.pull_min_tokens;
  pl.pull_overhead = o.pull_overhead;
  pl.pull_always = o.pull_always;
  pl.prefix_expect = o.prefix_expect;
  if (r->queue_ != nullptr) pl.room = &r->room_;
  r->placement_ = std::make_unique<Placement>(pl, r->pool_.get(), &r->prefix_index_, &r->measured_, *std::move(ps),
                                              *std::move(ds));

  RelayContext& rc = r->relay_context_;
  rc.options.colocated = o.colocated;
  rc.options.pick_wait = o.pick_wait;
  rc.options.moves = o.decode_moves;
  rc.options.move_timeout = o.move_timeout;
  rc.options.max_request_duration = o.max_request_duration;
  rc.pool = r->pool_.get();
  rc.placement = r->placement_.get();
  rc.transport = r->transport_.get();
  rc.measured = &r->measured_;
  rc.admission = r->admission_.get();
  rc.queue = r->queue_.get();
  if (r->queue_ != nullptr) rc.room = &r->room_;
  if (o.admission.has_value()) rc.admission_min_samples = o.admission->min_samples;
  rc.tokenizer = &r->resolver_->tokenizer();
  rc.metrics = r->relay_metrics_.get();
  rc.in_flight = &r->in_flight_;
  rc.next_id = &r->next_request_;
  rc.grant_key = o.grant_key;
  rc.grant_ttl = o.grant_ttl;
  rc.running = &r->running_;
  if (o.rebalance.has_value() && o.decode_moves && !o.colocated) {
    r->rebalance_thread_ = std::thread([raw] { raw->RebalanceLoop(); });
  }
  return r;
}

void RouterService::RebalanceLoop() {
  RebalancePolicy policy(*options_.rebalance);
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(rebalance_mu_) { return stop_rebalance_; };
  while (true) {
    {
      absl::MutexLock lock(&rebalance_mu_);
      if (rebalance_mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.rebalance_period)) return;
    }
    const std::vector<WorkerPtr> decode = pool_->Snapshot(Role::kDecode);
    std::vector<DecodeLoad> loads;
    loads.reserve(decode.size());
    for (const WorkerPtr& w : decode) {
      const WorkerReport r = w->report();
      DecodeLoad l;
      l.address = w->address();
      l.step_seconds = r.step_seconds;
      if (r.kv_positions_total > 0 && r.free_positions >= 0) {
        l.kv_used_fraction = 1.0 - static_cast<double>(r.free_positions) / static_cast<double>(r.kv_positions_total);
      }
      l.kv_bytes_per_position = r.kv_bytes_per_position;
      l.serving = w->healthy() && !w->removed();
      loads.push_back(std::move(l));
    }
    const std::optional<MoveChoice> choice =
        policy.Decide(absl::Now(), loads, running_.Snapshot(), [this](const std::string& from, const std::string& to) {
          const MeasuredValue v = measured_.LinkBytesPerS(from, to);
          return v.has_data() ? *v.value : 0.0;
        });
    if (!choice.has_value()) continue;
    for (const WorkerPtr& w : decode) {
      if (w->address() != choice->from) continue;
      worker::v1::PauseSequenceRequest req;
      req.set_request_id(choice->id);
      req.set_reason("rebalance");
      const absl::StatusOr<worker::v1::PauseSequenceResponse> r =
          transport_->PauseSequence(*w, req, absl::Seconds(2));
      LogEvent("info", "rebalance", {{"request_id", choice->id}, {"from", choice->from}, {"toward", choice->to},
                                     {"saves_s", absl::StrFormat("%.3f", choice->saves_s)},
                                     {"costs_s", absl::StrFormat("%.3f", choice->costs_s)},
                                     {"pausing", r.ok() && r->pausing() ? "true" : "false"}});
    }
  }
}

// The server ends every call (and so every generation's thread) before
// the service goes.
RouterService::~RouterService() {
  {
    absl::MutexLock lock(&rebalance_mu_);
    stop_rebalance_ = true;
  }
  if (rebalance_thread_.joinable()) rebalance_thread_.join();
}

absl::Status RouterService::WaitForWorkers(absl::Duration timeout) {
  std::vector<Role> pools = {Role::kDecode};
  if (!options_.colocated) pools.insert(pools.begin(), Role::kPrefill);
  return pool_->WaitForWorkers(timeout, pools, /*need_kv_address=*/!options_.colocated);
}

absl::StatusOr<std::string> RouterService::CheckKey(absl::string_view authorization, absl::string_view peer) {
  if (api_keys_ == nullptr) return std::string();
  absl::StatusOr<std::string> id = api_keys_->Check(authorization);
  if (!id.ok()) {
    relay_metrics_->CountOutcome("unauthenticated");
    LogEvent("warning", "unauthenticated", {{"peer", std::string(peer)}, {"error", std::string(id.status().message())}});
    return id.status();
  }
  if (LogLevelEnabled("debug")) LogEvent("debug", "authenticated", {{"key_id", *id}});
  return id;
}

void RouterService::CountKey(const std::string& id, const char* outcome) {
  const std::string k = absl::StrCat(id, "/", outcome);
  Counter* c;
  {
    absl::MutexLock lock(&key_metrics_mu_);
    Counter*& slot = key_metrics_[k];
    if (slot == nullptr) {
      slot = metrics_.AddCounter("pdserve_api_key_requests_total", "Generations by API key id and outcome.",
                                 absl::StrCat("key=\"", id, "\",outcome=\"", outcome, "\""));
    }
    c = slot;
  }
  c->Add();
}

absl::StatusOr<KeyLease> RouterService::AdmitKey(absl::string_view authorization, absl::string_view peer) {
  if (api_keys_ == nullptr) return KeyLease();
  absl::StatusOr<KeyLease> lease = api_keys_->Admit(authorization);
  if (lease.ok()) {
    CountKey(lease->id(), "admitted");
    if (LogLevelEnabled("debug")) LogEvent("debug", "authenticated", {{"key_id", lease->id()}});
    return lease;
  }
  if (absl::IsResourceExhausted(lease.status())) {
    const auto id = lease.status().GetPayload(kKeyIdPayload);
    CountKey(id.has_value() ? std::string(*id) : "?", "limited");
    relay_metrics_->CountOutcome("key_limited");
    LogEvent("warning", "key_limited",
             {{"peer", std::string(peer)}, {"error", std::string(lease.status().message())}});
    return lease.status();
  }
  relay_metrics_->CountOutcome("unauthenticated");
  LogEvent("warning", "unauthenticated",
           {{"peer", std::string(peer)}, {"error", std::string(lease.status().message())}});
  return lease.status();
}

grpc::Status RouterService::Authenticate(grpc::ServerContextBase* ctx) {
  if (api_keys_ == nullptr) return grpc::Status::OK;
  std::string authorization;
  const auto& md = ctx->client_metadata();
  if (auto it = md.find("authorization"); it != md.end()) authorization.assign(it->second.data(), it->second.size());
  return ToGrpcStatus(CheckKey(authorization, ctx->peer()).status());
}

absl::Status RouterService::Ready() {
  if (pool_->Serving(Role::kDecode) == 0) return absl::UnavailableError("no decode worker is serving");
  if (!options_.colocated && pool_->Serving(Role::kPrefill) == 0) {
    return absl::UnavailableError("no prefill worker is serving");
  }
  return absl::OkStatus();
}

openai::HttpBackend RouterService::HttpBackend() {
  openai::HttpBackend b;
  b.resolver = resolver_.get();
  b.relay = &relay_context_;
  if (api_keys_ != nullptr) {
    b.authenticate = [this](absl::string_view authorization, absl::string_view peer) {
      return CheckKey(authorization, peer);
    };
    b.admit = [this](absl::string_view authorization, absl::string_view peer) { return AdmitKey(authorization, peer); };
  }
  b.ready = [this] { return Ready(); };
  if (options_.prefix_cache_scope == PrefixCacheScope::kPerKey) {
    b.cache_salt = [](const std::string& key_id) { return CacheSaltForKey(key_id); };
  }
  b.metrics = &metrics_;
  return b;
}

grpc::Status RouterService::Run(grpc::ServerContextBase* ctx, const v1::GenerateRequest& req, Reply reply,
                                const std::function<bool(const v1::GenerateResponse&)>& emit, ClientCancel* cancel) {
  const absl::Time received = relay_context_.options.clock();  // TTFT counts tokenizing too
  // Refused before any tokenization or placement; the lease is held to the end.
  std::string authorization;
  const auto& md = ctx->client_metadata();
  if (auto it = md.find("authorization"); it != md.end()) authorization.assign(it->second.data(), it->second.size());
  absl::StatusOr<KeyLease> lease = AdmitKey(authorization, ctx->peer());
  if (!lease.ok()) {
    if (auto retry = lease.status().GetPayload(kRetryAfterPayload); retry.has_value()) {
      ctx->AddTrailingMetadata("retry-after", std::string(*retry));
    }
    return ToGrpcStatus(lease.status());
  }
  // max_tokens is required here (Resolve refuses 0), so it is the worst case.
  if (reply == Reply::kWhole && req.logprobs() > 0) {
    const int64_t entries = openai::WholeReplyEntries(req.max_tokens(), req.logprobs());
    if (entries > options_.max_reply_entries) {
      relay_metrics_->CountOutcome("invalid");
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("max_tokens: a reply of ", req.max_tokens(), " tokens with ", req.logprobs(),
                                       " logprob alternatives each holds up to ", entries,
                                       " logprob entries, over this router's limit of ", options_.max_reply_entries,
                                       " for Complete: lower max_tokens or logprobs, or call Generate (streamed)"));
    }
  }
  absl::StatusOr<GenerationRequest> resolved = resolver_->Resolve(req);
  if (!resolved.ok()) {
    relay_metrics_->CountOutcome("invalid");
    return ToGrpcStatus(resolved.status());
  }
  if (options_.prefix_cache_scope == PrefixCacheScope::kPerKey) resolved->cache_salt = CacheSaltForKey(lease->id());
  Relay relay(relay_context_, *std::move(resolved), req.request_id(), DeadlineOf(*ctx), received);
  relay.set_queue_key(lease->id());
  cancel->Attach(&relay);
  absl::Status st;
  if (ParsesToolCalls(req)) {
    // The chunks' text is the model's, calls included; the final carries
    // the calls read from it (router/tool_calls.h).
    ToolCallParser calls(absl::StrCat("call_", absl::Hex(absl::ToUnixNanos(received))), resolver_->tool_syntax());
    st = relay.Run([&](const v1::GenerateResponse& m) {
      if (m.has_chunk()) {
        calls.Feed(m.chunk().text());
        return emit(m);
      }
      if (!m.has_final()) return emit(m);
      v1::GenerateResponse out = m;
      calls.Finish();
      v1::GenerateFinal* f = out.mutable_final();
      for (const v1::ToolCall& c : calls.calls()) *f->add_tool_calls() = c;
      if (!calls.calls().empty() && f->finish_reason() == v1::FINISH_REASON_STOP) {
        f->set_finish_reason(v1::FINISH_REASON_TOOL_CALLS);
      }
      return emit(out);
    });
  } else {
    st = relay.Run(emit);
  }
  cancel->Detach();
  if (auto retry = st.GetPayload(kRetryAfterPayload); retry.has_value()) {
    ctx->AddTrailingMetadata("retry-after", std::string(*retry));
  }
  return ToGrpcStatus(st);
}

grpc::ServerWriteReactor<v1::GenerateResponse>* RouterService::Generate(grpc::CallbackServerContext* ctx,
                                                                        const v1::GenerateRequest* req) {
  return new StreamedCall(this, ctx, req);
}

grpc::ServerUnaryReactor* RouterService::Complete(grpc::CallbackServerContext* ctx, const v1::GenerateRequest* req,
                                                  v1::CompleteResponse* out) {
  return new WholeCall(this, ctx, req, out);
}

grpc::Status RouterService::ListModels(grpc::ServerContext* ctx, const v1::ListModelsRequest*,
                                       v1::ListModelsResponse* out) {
  if (grpc::Status auth = Authenticate(ctx); !auth.ok()) return auth;
  v1::ModelInfo* m = out->add_models();
  m->set_name(options_.model_name);
  m->set_context_length(static_cast<int32_t>(resolver_->config().max_position_embeddings));
  m->set_vocab_size(static_cast<int32_t>(resolver_->config().vocab_size));
  return grpc::Status::OK;
}

MeasuredCapacity RouterService::CurrentCapacity() {
  PoolFacts facts;
  facts.prefill_workers = pool_->Serving(Role::kPrefill);
  facts.decode_workers = pool_->Serving(Role::kDecode);
  facts.decode_batch = std::max<int64_t>(1, pool_->MaxDecodeBatch());
  return ComputeMeasuredCapacity(measured_.Snapshot(), facts);
}

grpc::Status RouterService::ClusterStatus(grpc::ServerContext* ctx, const v1::ClusterStatusRequest*,
                                          v1::ClusterStatusResponse* out) {
  // Worker addresses, their failures and a call to every worker: for key
  // holders only, checked before any of it.
  if (grpc::Status auth = Authenticate(ctx); !auth.ok()) return auth;
  // Every worker at once: one that does not answer costs its deadline once,
  // not once per worker after it.
  std::vector<WorkerPtr> workers;
  std::vector<StatusQuery> queries;
  for (const Role role : {Role::kPrefill, Role::kDecode}) {
    for (WorkerPtr& w : pool_->Snapshot(role)) {
      queries.push_back({w.get(), {}});
      workers.push_back(std::move(w));
    }
  }
  const std::vector<absl::StatusOr<worker::v1::WorkerInfo>> answers = transport_->Status(queries, absl::Seconds(1));
  for (size_t i = 0; i < workers.size(); ++i) {
    const Worker& w = *workers[i];
    const absl::StatusOr<worker::v1::WorkerInfo>& a = answers[i];
    v1::WorkerStatus* s = w.prefill_role() ? out->add_prefill() : out->add_decode();
    if (a.ok()) *s = a->status();
    s->set_address(w.address());
    s->set_role(RoleName(w.role()));
    s->set_healthy(a.ok() && a->status().healthy());
    s->set_unhealthy_reason(a.ok() ? a->unhealthy_reason() : std::string(a.status().message()));
    s->set_prefix_index_blocks(prefix_index_.NumBlocks(w.address()));
    if (!w.prefill_role() && queue_ != nullptr) {
      s->set_router_placed_positions(room_.Placed(w));
      s->set_router_free_positions(placement_->FreeFor(w));
    }
  }
  v1::QueueStatus* q = out->mutable_queue();
  q->set_enabled(queue_ != nullptr);
  if (queue_ != nullptr) {
    const RequestQueueStats qs = queue_->Stats();
    q->set_waiting(qs.waiting);
    q->set_oldest_wait_seconds(absl::ToDoubleSeconds(qs.oldest_wait));
    q->set_max_queued(queue_->options().max_queued);
    q->set_max_wait_seconds(absl::ToDoubleSeconds(queue_->options().max_wait));
    q->set_placed(qs.placed);
    q->set_placed_waited(qs.placed_waited);
    q->set_waited_seconds(qs.waited_seconds);
    q->set_refused_full(qs.refused_full);
    q->set_refused_wait(qs.refused_wait);
    q->set_refused_full_seconds(qs.refused_full_seconds);
    q->set_refused_full_max_seconds(qs.refused_full_max_seconds);
  }
  const MeasuredSnapshot snapshot = measured_.Snapshot();
  const MeasuredCapacity cap = CurrentCapacity();
  for (const capacity::Stage stage : {capacity::Stage::kPrefill, capacity::Stage::kHandoff, capacity::Stage::kDecode}) {
    const StageCapacity& sc = CapacityOf(cap, stage);
    v1::StageCapacity* s = out->add_stages();
    s->set_stage(std::string(capacity::StageName(stage)));
    s->set_known(sc.requests_per_s.has_value());
    s->set_requests_per_s(sc.requests_per_s.value_or(0));
    s->set_basis(sc.basis);
  }
  out->set_arrival_rate(cap.arrival_rate.value.value_or(0));
  if (cap.bottleneck.has_value()) out->set_bottleneck(std::string(capacity::StageName(*cap.bottleneck)));
  out->set_measured_report(absl::StrCat(FormatSnapshot(snapshot), FormatMeasuredCapacity(cap)));
  out->set_requests_in_flight(in_flight_.load());
  out->set_router_resident_bytes(ProcStatusBytes("VmRSS:"));
  out->set_router_peak_resident_bytes(ProcStatusBytes("VmHWM:"));
  out->set_prefill_ejections(static_cast<int64_t>(ejections_[0]->value()));
  {
    const RelayMetrics& m = *relay_metrics_;
    double moved = 0, replayed = 0;
    for (const auto& [key, counter] : m.moves) {
      if (absl::EndsWith(key, "/moved")) moved += counter->value();
      if (absl::EndsWith(key, "/replayed")) replayed += counter->value();
    }
    out->set_decode_moves(static_cast<int64_t>(moved));
    out->set_decode_moves_replayed(static_cast<int64_t>(replayed));
    out->set_migrations(static_cast<int64_t>(m.migrations->value()));
    out->set_prefill_context_tokens(static_cast<int64_t>(m.prompt_tokens->value()));
    out->set_prefix_cached_tokens(static_cast<int64_t>(m.cached_tokens->value()));
    out->set_decode_move_bytes(static_cast<int64_t>(m.move_bytes->value()));
    out->set_decode_move_seconds(m.move_seconds->value());
  }
  out->set_decode_ejections(static_cast<int64_t>(ejections_[1]->value()));
  return grpc::Status::OK;
}

}  // namespace pdserve::router
