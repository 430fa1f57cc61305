#include "router/router_service.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/grpcpp.h"
#include "common/grpc_status.h"
#include "common/server_util.h"
#include "proto/convert.h"
#include "proto/received.h"

namespace pdserve::router {
namespace {

using SteadyClock = std::chrono::steady_clock;

// Decode attempts per request (the first and its migrations).
constexpr int kMaxDecodeAttempts = 8;

double Seconds(SteadyClock::time_point a, SteadyClock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

grpc::Status Invalid(const absl::Status& s) {
  return ToGrpcStatus(s);
}

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

}  // namespace

RouterService::RouterService(RouterOptions options) : options_(std::move(options)) { RegisterMetrics(); }

void RouterService::RegisterMetrics() {
  for (const char* o : {"stop", "length", "cancelled", "error", "invalid", "unavailable", "rejected"}) {
    outcomes_[o] = metrics_.AddCounter("pdserve_requests_total", "Requests by how they ended.",
                                       absl::StrCat("outcome=\"", o, "\""));
  }
  ttft_ = metrics_.AddHistogram("pdserve_time_to_first_token_seconds", "Router receipt to first token sent.",
                                LatencyBuckets());
  itl_ = metrics_.AddHistogram("pdserve_inter_token_latency_seconds", "Gap between streamed messages.",
                               LatencyBuckets());
  e2e_ = metrics_.AddHistogram("pdserve_request_duration_seconds", "Router receipt to final message.",
                               LatencyBuckets());
  queue_ = metrics_.AddHistogram("pdserve_queue_seconds", "Waiting for a prefill slot.", LatencyBuckets());
  prefill_time_ = metrics_.AddHistogram("pdserve_prefill_seconds", "Prefill compute.", LatencyBuckets());
  handoff_ = metrics_.AddHistogram("pdserve_handoff_seconds", "First token to KV committed on the decode worker.",
                                   LatencyBuckets());
  retries_ = metrics_.AddCounter("pdserve_prefill_retries_total", "Prefills run again after a worker failed.");
  migrations_ = metrics_.AddCounter("pdserve_migrations_total", "Sequences moved off a failed decode worker.");
  const char* placements[] = {"prefill_pool", "decode_local", "colocated"};
  for (int i = 0; i < 3; ++i) {
    placement_[i] = metrics_.AddCounter(
        "pdserve_prefill_placements_total",
        "Prefills by where they ran: a prefill worker (handoff), the decode worker itself (conditional "
        "disaggregation: short uncached part), or colocated mode.",
        absl::StrCat("placement=\"", placements[i], "\""));
  }
  prompt_tokens_ = metrics_.AddCounter("pdserve_prefill_context_tokens_total", "Context positions prefilled (cached or computed).");
  cached_tokens_ = metrics_.AddCounter("pdserve_prefix_cached_tokens_total",
                                       "Of them, positions taken from a worker's prefix cache.");
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
  for (const char* pool : {"prefill", "decode"}) {
    metrics_.AddGauge(
        "pdserve_recommended_workers", "Workers each pool needs for the observed arrival rate (NaN: no data).",
        [this, pool] {
          const MeasuredCapacity c = CurrentCapacity();
          const std::optional<int64_t> n =
              std::string(pool) == "prefill" ? c.prefill_workers_needed : c.decode_workers_needed;
          return n.has_value() ? static_cast<double>(*n) : std::nan("");
        },
        absl::StrCat("pool=\"", pool, "\""));
  }
  metrics_.AddGauge("pdserve_requests_in_flight", "Requests being served.",
                    [this] { return static_cast<double>(in_flight_.load()); });
  for (const bool prefill : {true, false}) {
    for (const bool healthy : {true, false}) {
      metrics_.AddGauge(
          "pdserve_workers", "Workers known to the router, by role and whether they serve now.",
          [this, prefill, healthy] {
            int n = 0;
            for (const WorkerPtr& w : Snapshot(prefill)) n += w->healthy.load() == healthy ? 1 : 0;
            return static_cast<double>(n);
          },
          absl::StrCat("role=\"", prefill ? "prefill" : "decode", "\",state=\"", healthy ? "serving" : "ejected", "\""));
    }
    ejections_[prefill] = metrics_.AddCounter("pdserve_worker_ejections_total",
                                              "Times a worker stopped serving in the router's view.",
                                              absl::StrCat("role=\"", prefill ? "prefill" : "decode", "\""));
  }
}

void RouterService::CountOutcome(const char* outcome) { outcomes_[outcome]->Add(); }

absl::StatusOr<std::unique_ptr<RouterService>> RouterService::Create(RouterOptions options) {
  if (options.decode_workers.empty()) return absl::InvalidArgumentError("--decode: no decode workers given");
  if (!options.colocated && options.prefill_workers.empty()) {
    return absl::InvalidArgumentError("--prefill: no prefill workers given (or pass --colocated)");
  }
  std::unique_ptr<RouterService> r(new RouterService(std::move(options)));
  absl::StatusOr<ModelConfig> config = LoadModelConfig(r->options_.model_dir);
  if (!config.ok()) return config.status();
  r->config_ = *std::move(config);
  absl::StatusOr<std::unique_ptr<tok::Tokenizer>> tokenizer = tok::Tokenizer::Load(r->options_.model_dir);
  if (!tokenizer.ok()) return tokenizer.status();
  r->tokenizer_ = *std::move(tokenizer);
  if (!r->tokenizer_->chat_template().empty()) {
    absl::StatusOr<tok::ChatFormat> f = tok::DetectChatFormat(r->tokenizer_->chat_template());
    if (f.ok()) r->chat_format_ = *f;
  }
  for (const std::string& spec : r->options_.prefill_workers) {
    absl::StatusOr<WorkerTarget> t = ParseWorkerTarget(spec);
    if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat("--prefill: ", t.status().message()));
    r->prefill_targets_.push_back(*std::move(t));
  }
  for (const std::string& spec : r->options_.decode_workers) {
    absl::StatusOr<WorkerTarget> t = ParseWorkerTarget(spec);
    if (!t.ok()) return absl::InvalidArgumentError(absl::StrCat("--decode: ", t.status().message()));
    r->decode_targets_.push_back(*std::move(t));
  }
  absl::StatusOr<std::unique_ptr<Selector>> ps = MakeSelector(r->options_.prefill_policy, Pool::kPrefill);
  if (!ps.ok()) return absl::InvalidArgumentError(absl::StrCat("--prefill_policy: ", ps.status().message()));
  absl::StatusOr<std::unique_ptr<Selector>> ds = MakeSelector(r->options_.decode_policy, Pool::kDecode);
  if (!ds.ok()) return absl::InvalidArgumentError(absl::StrCat("--decode_policy: ", ds.status().message()));
  r->prefill_selector_ = *std::move(ps);
  r->decode_selector_ = *std::move(ds);
  if (r->options_.admission.has_value()) {
    r->admission_ = std::make_unique<AdmissionController>(*r->options_.admission);
  }
  RouterService* raw = r.get();
  r->watcher_ = std::thread([raw] { raw->WatchLoop(); });
  return r;
}

RouterService::~RouterService() {
  {
    absl::MutexLock lock(&watch_mu_);
    stop_ = true;
  }
  if (watcher_.joinable()) watcher_.join();
  if (poller_.joinable()) poller_.join();
  if (discoverer_.joinable()) discoverer_.join();
}

std::vector<RouterService::WorkerPtr> RouterService::Snapshot(bool prefill) {
  absl::MutexLock lock(&workers_mu_);
  return prefill ? prefill_ : decode_;
}

void RouterService::Discover() {
  for (const bool prefill : {true, false}) {
    std::vector<std::string> addresses;
    for (const WorkerTarget& t : prefill ? prefill_targets_ : decode_targets_) {
      absl::StatusOr<std::vector<std::string>> got = ResolveWorkerTarget(t, options_.resolve_timeout);
      if (got.ok()) {
        resolved_[t.spec] = *std::move(got);
      } else {
        LogEvent("warning", "resolve_failed", {{"target", t.spec}, {"error", std::string(got.status().message())}});
      }
      const std::vector<std::string>& now = resolved_[t.spec];
      addresses.insert(addresses.end(), now.begin(), now.end());
    }
    absl::MutexLock lock(&workers_mu_);
    std::vector<WorkerPtr>& pool = prefill ? prefill_ : decode_;
    for (auto it = pool.begin(); it != pool.end();) {
      if (std::find(addresses.begin(), addresses.end(), (*it)->address) == addresses.end()) {
        (*it)->removed = true;
        measured_.ForgetWorker((*it)->address);
        prefix_index_.Drop((*it)->address);
        LogEvent("info", "worker_removed", {{"role", prefill ? "prefill" : "decode"}, {"address", (*it)->address}});
        it = pool.erase(it);
      } else {
        ++it;
      }
    }
    for (const std::string& a : addresses) {
      if (std::any_of(pool.begin(), pool.end(), [&a](const WorkerPtr& w) { return w->address == a; })) continue;
      auto w = std::make_shared<Worker>();
      w->address = a;
      w->prefill_role = prefill;
      w->channel = Channel(a);
      if (prefill) {
        w->prefill = worker::v1::PrefillWorker::NewStub(w->channel);
      } else {
        w->decode = worker::v1::DecodeWorker::NewStub(w->channel);
      }
      LogEvent("info", "worker_added", {{"role", prefill ? "prefill" : "decode"}, {"address", a}});
      pool.push_back(std::move(w));
    }
  }
}

void RouterService::StatusAll(std::vector<std::unique_ptr<StatusCall>>& calls) {
  absl::Mutex mu;
  size_t done = 0;
  for (auto& c : calls) {
    StatusCall* raw = c.get();
    auto on_done = [raw, &mu, &done](grpc::Status st) {
      absl::MutexLock lock(&mu);
      raw->status = std::move(st);
      ++done;
    };
    if (raw->worker->prefill_role) {
      raw->worker->prefill->async()->Status(&raw->ctx, &raw->req, &raw->info, on_done);
    } else {
      raw->worker->decode->async()->Status(&raw->ctx, &raw->req, &raw->info, on_done);
    }
  }
  absl::MutexLock lock(&mu);
  auto all_done = [&done, n = calls.size()] { return done == n; };
  mu.Await(absl::Condition(&all_done));
}

void RouterService::ProbeDue(bool force_all) {
  const absl::Time now = absl::Now();
  std::vector<std::unique_ptr<StatusCall>> probes;
  for (const bool prefill : {true, false}) {
    for (WorkerPtr& w : Snapshot(prefill)) {
      if (!force_all && now < w->next_probe) continue;
      auto p = std::make_unique<StatusCall>();
      p->worker = w;
      p->req.set_want_kv_events(true);
      p->req.set_kv_events_after(prefix_index_.NextAfter(w->address));
      p->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
      probes.push_back(std::move(p));
    }
  }
  StatusAll(probes);
  for (auto& p : probes) {
    Worker& w = *p->worker;
    const char* role = w.prefill_role ? "prefill" : "decode";
    const bool answered = p->status.ok();
    const bool healthy = answered && p->info.status().healthy();
    const std::string reason = answered ? p->info.unhealthy_reason() : p->status.error_message();
    if (answered) {
      const uint64_t before = w.instance.exchange(p->info.instance_id());
      if (before != 0 && before != p->info.instance_id()) {
        LogEvent("info", "worker_restarted", {{"role", role}, {"address", w.address}});
      }
      if (!p->info.kv_address().empty()) w.set_kv_address(p->info.kv_address());
      {
        absl::MutexLock lock(&w.kv_mu);
        if (p->info.has_prefix_hash()) {
          const worker::v1::PrefixHashConfig& c = p->info.prefix_hash();
          w.prefix_hash_ = HashScheme{rpc::HashFromProto(c.model_lo(), c.model_hi()),
                                      static_cast<DType>(c.kv_dtype()), c.block_size()};
        }
      }
      if (p->info.has_kv_events()) {
        const worker::v1::KvEvents& ke = p->info.kv_events();
        std::vector<KvEvent> events;
        events.reserve(static_cast<size_t>(ke.events_size()));
        for (const worker::v1::KvEvent& e : ke.events()) {
          const int kind = static_cast<int>(e.kind());
          if (kind < 1 || kind > 3) continue;
          events.push_back(KvEvent{e.id(), static_cast<KvEventKind>(kind), rpc::HashFromProto(e.hash_lo(), e.hash_hi()),
                                   rpc::HashFromProto(e.parent_lo(), e.parent_hi())});
        }
        prefix_index_.Apply(w.address, p->info.instance_id(), events, ke.snapshot(), ke.last_id());
      }
      const v1::WorkerStatus& ws = p->info.status();
      w.running = ws.running();
      w.step_seconds = ws.step_seconds();
      w.free_positions = static_cast<int64_t>(ws.kv_blocks_free()) * ws.kv_block_size();
      w.kv_bytes_per_position = ws.kv_bytes_per_position();
      w.max_batch = ws.max_batch();
      // One sample per probe that saw new steps: the worker's step time is
      // a running average, so an idle worker would repeat its last one.
      if (!w.prefill_role && ws.running() > 0 && ws.step_seconds() > 0 && ws.steps() != w.last_steps) {
        measured_.RecordDecodeStep(w.address, ws.running(), ws.mean_history_tokens(), ws.step_seconds());
      }
      w.last_steps = ws.steps();
      w.failures = 0;
      // A long event backlog is read again at once rather than a period later.
      w.next_probe = p->info.kv_events().more() ? now : now + options_.probe_period;
    } else {
      // What a worker that does not answer held is no longer to be counted on.
      prefix_index_.Drop(w.address);
      ++w.failures;
      w.next_probe = now + std::min(options_.max_backoff, options_.probe_period * (1 << std::min(w.failures - 1, 10)));
    }
    const bool was = w.healthy.exchange(healthy);
    if (was && !healthy) ejections_[w.prefill_role]->Add();
    if (was != healthy || (!healthy && reason != w.last_reason)) {
      LogEvent(healthy ? "info" : "warning", healthy ? "worker_admitted" : "worker_ejected",
               {{"role", role}, {"address", w.address}, {"reason", reason},
                {"retry_in_ms", std::to_string(absl::ToInt64Milliseconds(w.next_probe - now))}});
    }
    w.last_reason = healthy ? "" : reason;
    absl::MutexLock lock(&w.kv_mu);
    w.ejection_reason_ = w.last_reason;
  }
}

void RouterService::DiscoverLoop() {
  while (true) {
    {
      absl::MutexLock lock(&watch_mu_);
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(watch_mu_) { return stop_; };
      if (watch_mu_.AwaitWithTimeout(absl::Condition(&stopping), options_.resolve_interval)) return;
    }
    Discover();
  }
}

void RouterService::PollLoop() {
  while (true) {
    ProbeDue(/*force_all=*/false);
    if (admission_ != nullptr && absl::Now() >= next_load_update_) {
      admission_->UpdateLoad(LoadFromCapacity(CurrentCapacity()));
      next_load_update_ = absl::Now() + absl::Milliseconds(250);
    }
    absl::MutexLock lock(&watch_mu_);
    auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(watch_mu_) { return stop_; };
    if (watch_mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::Milliseconds(20))) return;
  }
}

void RouterService::WatchLoop() {
  absl::MutexLock lock(&watch_mu_);
  auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(watch_mu_) { return stop_; };
  while (!stop_) {
    watch_mu_.AwaitWithTimeout(absl::Condition(&stopping), absl::Milliseconds(10));
    for (Watch* w : watches_) {
      if (w->server->IsCancelled()) {
        for (grpc::ClientContext* c : w->clients) c->TryCancel();
      }
    }
  }
}

absl::Status RouterService::WaitForWorkers(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::optional<absl::Time> pools_served_since;
  absl::Status result;
  while (true) {
    Discover();
    ProbeDue(/*force_all=*/true);
    std::string silent;
    std::string empty_pool;
    for (const bool prefill : {true, false}) {
      if (prefill && options_.colocated) continue;
      bool any = false;
      for (const WorkerPtr& w : Snapshot(prefill)) {
        const bool ready = w->healthy.load() && (prefill || options_.colocated || !w->kv_address().empty());
        any |= ready;
        if (!ready) absl::StrAppend(&silent, " ", w->address, w->last_reason.empty() ? "" : absl::StrCat(" (", w->last_reason, ")"));
      }
      if (!any) absl::StrAppend(&empty_pool, empty_pool.empty() ? "" : " and ", prefill ? "prefill" : "decode");
    }
    if (empty_pool.empty() && !pools_served_since.has_value()) pools_served_since = absl::Now();
    if (silent.empty()) break;
    if (empty_pool.empty() && absl::Now() - *pools_served_since > absl::Seconds(2)) {
      LogEvent("warning", "workers_not_ready", {{"workers", silent}});
      break;
    }
    if (absl::Now() > deadline) {
      if (!empty_pool.empty()) {
        return absl::UnavailableError(absl::StrCat("no live ", empty_pool, " worker; not answering:", silent));
      }
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  RouterService* raw = this;
  if (!poller_.joinable()) poller_ = std::thread([raw] { raw->PollLoop(); });
  if (!discoverer_.joinable()) discoverer_ = std::thread([raw] { raw->DiscoverLoop(); });
  return absl::OkStatus();
}

absl::StatusOr<GenerationRequest> RouterService::Resolve(const v1::GenerateRequest& req) const {
  if (!req.model().empty() && req.model() != options_.model_name) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: unknown model '", req.model(), "' (this cluster serves '", options_.model_name, "')"));
  }
  const google::protobuf::UnknownFieldSet& unknown = req.GetReflection()->GetUnknownFields(req);
  if (!unknown.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown field number ", unknown.field(0).number(), " (not part of pdserve.v1.GenerateRequest)"));
  }
  GenerationRequest r;
  switch (req.prompt_case()) {
    case v1::GenerateRequest::kText: {
      if (req.text().empty()) return absl::InvalidArgumentError("text: the prompt is empty");
      absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(req.text(), false);
      if (!ids.ok()) return absl::InvalidArgumentError(absl::StrCat("text: ", ids.status().message()));
      r.prompt = *std::move(ids);
      break;
    }
    case v1::GenerateRequest::kChat: {
      if (req.chat().messages().empty()) return absl::InvalidArgumentError("chat.messages: empty");
      if (!chat_format_.has_value()) {
        return absl::InvalidArgumentError("chat: this model has no recognised chat template; send text or token_ids");
      }
      std::vector<tok::ChatMessage> messages;
      for (const v1::ChatMessage& m : req.chat().messages()) messages.push_back({m.role(), m.content()});
      absl::StatusOr<std::string> text = tok::RenderChat(*chat_format_, messages, /*add_generation_prompt=*/true,
                                                         tokenizer_->bos_token(), tokenizer_->eos_token());
      if (!text.ok()) return absl::InvalidArgumentError(absl::StrCat("chat.", text.status().message()));
      absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(*text, false);
      if (!ids.ok()) return absl::InvalidArgumentError(absl::StrCat("chat: ", ids.status().message()));
      r.prompt = *std::move(ids);
      break;
    }
    case v1::GenerateRequest::kTokenIds: {
      if (req.token_ids().ids().empty()) return absl::InvalidArgumentError("token_ids: the prompt is empty");
      for (int i = 0; i < req.token_ids().ids_size(); ++i) {
        const int32_t id = req.token_ids().ids(i);
        if (id < 0 || id >= config_.vocab_size) {
          return absl::InvalidArgumentError(
              absl::StrCat("token_ids.ids[", i, "]: ", id, " is outside the vocabulary (", config_.vocab_size, ")"));
        }
      }
      r.prompt.assign(req.token_ids().ids().begin(), req.token_ids().ids().end());
      break;
    }
    case v1::GenerateRequest::PROMPT_NOT_SET:
      return absl::InvalidArgumentError("prompt: one of text, chat or token_ids is required");
  }
  if (r.prompt.empty()) return absl::InvalidArgumentError("prompt: it tokenizes to nothing");
  if (req.max_tokens() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: must be at least 1, got ", req.max_tokens()));
  }
  const int64_t context = config_.max_position_embeddings;
  if (static_cast<int64_t>(r.prompt.size()) + req.max_tokens() > context) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: the prompt (", r.prompt.size(), " tokens) + max_tokens (",
                                                   req.max_tokens(), ") exceeds the model's context (", context, ")"));
  }
  SamplingParams& p = r.params;
  const v1::SamplingParams& s = req.sampling();
  if (s.has_temperature()) p.temperature = s.temperature();
  if (s.has_top_k()) p.top_k = s.top_k();
  if (s.has_top_p()) p.top_p = s.top_p();
  if (s.has_min_p()) p.min_p = s.min_p();
  if (s.has_repetition_penalty()) p.repetition_penalty = s.repetition_penalty();
  if (s.has_presence_penalty()) p.presence_penalty = s.presence_penalty();
  if (s.has_seed()) p.seed = s.seed();
  p.max_tokens = req.max_tokens();
  p.ignore_eos = req.ignore_eos();
  p.logprobs = req.logprobs();
  for (int i = 0; i < req.stop_token_ids_size(); ++i) {
    const int32_t id = req.stop_token_ids(i);
    if (id < 0 || id >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("stop_token_ids[", i, "]: ", id, " is outside the vocabulary"));
    }
    p.stop_token_ids.push_back(id);
  }
  if (absl::Status st = ValidateSamplingParams(p, config_.vocab_size); !st.ok()) return st;
  p.seed = ResolveSeed(p);
  for (int i = 0; i < req.stop_size(); ++i) {
    if (req.stop(i).empty()) return absl::InvalidArgumentError(absl::StrCat("stop[", i, "]: empty string"));
    r.stop_strings.push_back(req.stop(i));
  }
  r.eos_ids = config_.eos_token_ids;
  return r;
}

bool RouterService::Excluded(const Worker& w, const std::vector<Failed>& exclude) {
  return std::any_of(exclude.begin(), exclude.end(),
                     [&w](const Failed& f) { return f.worker == &w && f.instance == w.instance.load(); });
}

absl::Span<const BlockHash> RouterService::PromptChains::For(const std::optional<HashScheme>& scheme) {
  if (!scheme.has_value() || scheme->block_size <= 0 || context_.size() <= 1) return {};
  for (const auto& [known, chain] : chains_) {
    if (known == *scheme) return chain;
  }
  const BlockHasher hasher(scheme->model, scheme->kv_dtype, scheme->block_size);
  // The last position is always computed (its logits give the next token).
  chains_.emplace_back(*scheme, hasher.FullBlockHashes(context_.first(context_.size() - 1)));
  return chains_.back().second;
}

int64_t RouterService::CachedTokens(const Worker& w, PromptChains& chains) {
  const std::optional<HashScheme> scheme = w.prefix_hash();
  const absl::Span<const BlockHash> chain = chains.For(scheme);
  if (chain.empty()) return 0;
  return static_cast<int64_t>(prefix_index_.MatchBlocks(w.address, chain, absl::Now())) * scheme->block_size;
}

bool RouterService::HasHeadroom(const Worker& w) const {
  const int32_t max_batch = w.max_batch.load();
  if (max_batch > 0 && w.in_flight.load() >= max_batch) return false;
  if (options_.itl_target > absl::ZeroDuration() && w.running.load() > 0 &&
      w.step_seconds.load() >= absl::ToDoubleSeconds(options_.itl_target)) {
    return false;
  }
  return true;
}

RouterService::WorkerPtr RouterService::PickDecode(int64_t positions, const std::vector<Failed>& exclude,
                                                   PromptChains& chains) {
  const std::vector<WorkerPtr> pool = Snapshot(false);
  auto usable = [&exclude](const WorkerPtr& w) {
    return w->healthy.load() && (w->decode != nullptr) && !Excluded(*w, exclude);
  };
  std::vector<WorkerPtr> roomy;
  std::vector<SelectionCandidate> candidates;
  for (const WorkerPtr& w : pool) {
    if (!usable(w)) continue;
    const int64_t free = w->free_positions.load();
    const int64_t cached = CachedTokens(*w, chains);
    // Cached positions are shared, not allocated again.
    if (free >= 0 && free < positions - cached) continue;
    roomy.push_back(w);
    SelectionCandidate c;
    c.address = w->address;
    c.load = w->in_flight.load();
    c.cached_tokens = cached;
    c.uncached_tokens = chains.size() - cached;
    c.headroom = HasHeadroom(*w);
    candidates.push_back(c);
  }
  if (!roomy.empty()) {
    const size_t i = decode_selector_->Select(candidates);
    if (LogLevelEnabled("debug")) {
      std::string terms;
      for (const SelectionCandidate& c : candidates) {
        absl::StrAppendFormat(&terms, "%s%s: in_flight=%d cached=%d headroom=%d", terms.empty() ? "" : "; ",
                              c.address, c.load, c.cached_tokens, c.headroom ? 1 : 0);
      }
      LogEvent("debug", "decode_choice", {{"policy", std::string(decode_selector_->name())},
                                          {"chosen", roomy[i]->address}, {"candidates", terms}});
    }
    return roomy[i];
  }
  // None has room now: the one with the most free KV (it queues or preempts).
  WorkerPtr best;
  for (const WorkerPtr& w : pool) {
    if (!usable(w)) continue;
    if (best == nullptr || w->free_positions.load() > best->free_positions.load()) best = w;
  }
  return best;
}

SelectionCandidate RouterService::PrefillCandidate(const Worker& w, PromptChains& chains) {
  SelectionCandidate c;
  c.address = w.address;
  c.load = w.queued_tokens.load();
  c.cached_tokens = CachedTokens(w, chains);
  c.uncached_tokens = chains.size() - c.cached_tokens;
  c.tokens_per_s = measured_.PrefillTokensPerS(w.address, c.uncached_tokens).value.value_or(0);
  c.queue_tokens_per_s = measured_.PrefillQueueTokensPerS(w.address).value.value_or(0);
  return c;
}

RouterService::WorkerPtr RouterService::PickPrefill(const std::vector<Failed>& exclude, PromptChains& chains) {
  std::vector<WorkerPtr> usable;
  std::vector<SelectionCandidate> candidates;
  for (const WorkerPtr& w : Snapshot(true)) {
    if (!w->healthy.load() || Excluded(*w, exclude)) continue;
    usable.push_back(w);
    candidates.push_back(PrefillCandidate(*w, chains));
  }
  if (usable.empty()) return nullptr;
  const size_t i = prefill_selector_->Select(candidates);
  if (LogLevelEnabled("debug")) {
    const double fallback = FallbackTokensPerS(candidates);
    std::string terms;
    for (const SelectionCandidate& c : candidates) {
      absl::StrAppendFormat(&terms,
                            "%s%s: queued=%d queue_tokens_per_s=%.0f uncached=%d cached=%d tokens_per_s=%.0f "
                            "est_ttft_s=%.4f",
                            terms.empty() ? "" : "; ", c.address, c.load, c.queue_tokens_per_s, c.uncached_tokens,
                            c.cached_tokens, c.tokens_per_s, EstimatedPrefillSeconds(c, fallback));
    }
    LogEvent("debug", "prefill_choice", {{"policy", std::string(prefill_selector_->name())},
                                         {"chosen", usable[i]->address}, {"candidates", terms}});
  }
  return usable[i];
}

std::string RouterService::NoHealthyWorker(bool prefill) {
  std::string reasons;
  for (const WorkerPtr& w : Snapshot(prefill)) {
    if (w->healthy.load()) continue;
    const std::string why = w->ejection_reason();
    absl::StrAppend(&reasons, reasons.empty() ? "" : "; ", w->address, ": ", why.empty() ? "not probed yet" : why);
  }
  return absl::StrCat("no healthy ", prefill ? "prefill" : "decode", " worker",
                      reasons.empty() ? "" : absl::StrCat(" (", reasons, ")"));
}

RouterService::WorkerPtr RouterService::PickWaiting(grpc::ServerContext* ctx, const std::function<WorkerPtr()>& pick) {
  absl::Time until = absl::Now() + options_.pick_wait;
  if (ctx->deadline() != std::chrono::system_clock::time_point::max()) {
    until = std::min(until, absl::FromChrono(ctx->deadline()));
  }
  while (true) {
    if (WorkerPtr w = pick(); w != nullptr) return w;
    if (ctx->IsCancelled() || absl::Now() >= until) return nullptr;
    absl::SleepFor(absl::Milliseconds(20));
  }
}

grpc::Status RouterService::Run(grpc::ServerContext* ctx, const v1::GenerateRequest& req,
                                const std::function<bool(const v1::GenerateResponse&)>& emit) {
  const auto t_start = SteadyClock::now();
  absl::StatusOr<GenerationRequest> resolved = Resolve(req);
  if (!resolved.ok()) {
    CountOutcome("invalid");
    return Invalid(resolved.status());
  }
  const GenerationRequest& gr = *resolved;
  measured_.RecordArrival();
  const std::string client_id = req.request_id();
  const bool colocated = options_.colocated || prefill_targets_.empty();
  const int64_t prompt_tokens = static_cast<int64_t>(gr.prompt.size());
  // The prompt's block hashes, computed once per worker hashing scheme, for
  // admission and the first attempt (a migration re-hashes its context).
  PromptChains prompt_chains(gr.prompt);
  // Admission: held from here to the first token.
  std::optional<AdmissionTicket> ticket;
  if (admission_ != nullptr) {
    AdmissionRequest ar;
    ar.uncached_tokens = prompt_tokens;
    // The estimate is for the prefill worker with the lowest estimated TTFT
    // (the prefix-aware cost, whatever the policy: the selector itself is
    // not consulted, round robin would advance).
    PromptChains& chains = prompt_chains;
    std::vector<WorkerPtr> pool;
    std::vector<SelectionCandidate> candidates;
    for (const WorkerPtr& w : colocated ? std::vector<WorkerPtr>{} : Snapshot(true)) {
      if (!w->healthy.load()) continue;
      pool.push_back(w);
      candidates.push_back(PrefillCandidate(*w, chains));
    }
    if (!pool.empty()) {
      const size_t i = PrefixAwareSelector(Pool::kPrefill).Select(candidates);
      ar.queued_prefill_tokens = candidates[i].load;
      ar.uncached_tokens = candidates[i].uncached_tokens;
      ar.prefill_tokens_per_s =
          measured_.PrefillTokensPerS(pool[i]->address, candidates[i].uncached_tokens, options_.admission->min_samples);
      ar.queue_tokens_per_s = measured_.PrefillQueueTokensPerS(pool[i]->address);
    }
    if (ctx->deadline() != std::chrono::system_clock::time_point::max()) ar.deadline = absl::FromChrono(ctx->deadline());
    absl::StatusOr<AdmissionTicket> t = admission_->Decide(ar);
    if (!t.ok()) {
      CountOutcome("rejected");
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, std::string(t.status().message()));
    }
    ticket.emplace(*std::move(t));
  }

  v1::GenerateResponse msg;
  msg.set_request_id(client_id);
  v1::Timings timings;
  timings.set_colocated(colocated);
  int32_t completion = 0;
  FinishReason finish = FinishReason::kNone;
  std::string error;
  bool cancelled = false;
  bool unavailable = false;  // No worker of a pool could take the request.
  // Messages from workers that did not parse. The first costs a retry (a
  // migration, or the prefill again), never the worker's health: a message
  // that fails deterministically would otherwise eject every worker in turn.
  // The second ends the request with INTERNAL, naming the field.
  int parse_failures = 0;
  bool internal = false;
  auto unparseable = [&](const char* role, const std::string& address, const absl::Status& why,
                         const std::string& request_id) {
    LogEvent("warning", "unparseable_message", {{"request_id", request_id}, {"role", role}, {"worker", address},
                                                 {"error", std::string(why.message())}});
    if (++parse_failures < 2) return false;
    error = absl::StrCat(role, " worker ", address, " sent ", why.message(), " (after one retry)");
    internal = true;
    return true;
  };
  double max_itl = 0, sum_itl = 0;
  int32_t gaps = 0;
  SteadyClock::time_point last_token = t_start;
  bool client_gone = false;
  std::vector<double> relay;  // Read-to-written per relayed message.
  // Every token sent to the client, and the router's own replay of them: a
  // migrated request continues from exactly this state.
  std::vector<int32_t> streamed;
  Generation replay(gr, tokenizer_.get());
  auto send_chunk = [&](const v1::TokenChunk& chunk) {
    const auto now = SteadyClock::now();
    if (completion == 0) {
      timings.set_ttft(Seconds(t_start, now));
      if (ticket.has_value()) ticket->Release();
    } else {
      const double gap = Seconds(last_token, now);
      itl_->Observe(gap);
      sum_itl += gap;
      max_itl = std::max(max_itl, gap);
      ++gaps;
    }
    last_token = now;
    completion += chunk.token_ids_size();
    msg.clear_kind();
    *msg.mutable_chunk() = chunk;
    if (!emit(msg)) client_gone = true;
    relay.push_back(Seconds(now, SteadyClock::now()));
  };

  Watch watch{ctx, {}};
  {
    absl::MutexLock lock(&watch_mu_);
    watches_.push_back(&watch);
  }
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;  // Every downstream call's.
  auto new_context = [&]() {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    grpc::ClientContext* c = contexts.back().get();
    if (ctx->deadline() != std::chrono::system_clock::time_point::max()) c->set_deadline(ctx->deadline());
    absl::MutexLock lock(&watch_mu_);
    watch.clients.push_back(c);
    return c;
  };
  ++in_flight_;

  // Decode attempts: the first, then one migration per decode worker that
  // dies mid-stream. Each attempt (re)prefills prompt + streamed tokens.
  std::vector<Failed> failed_decode;
  std::vector<Failed> avoid_prefill;  // Sent a message that did not parse.
  int attempt = 0;
  while (error.empty() && !cancelled && finish == FinishReason::kNone) {
    const std::string internal_id =
        absl::StrFormat("%s-%d-%d", client_id.empty() ? "req" : client_id, getpid(), next_request_++);
    if (replay.finished()) {
      // Every token was streamed before the worker failed (its final
      // message was lost): the request is complete.
      finish = replay.finish();
      break;
    }
    // What this attempt prefills: the prompt and any tokens already sent.
    std::vector<int32_t> context;
    std::optional<PromptChains> migrated_chains;
    if (!streamed.empty()) {
      context = gr.prompt;
      context.insert(context.end(), streamed.begin(), streamed.end());
      migrated_chains.emplace(context);
    }
    PromptChains& chains = streamed.empty() ? prompt_chains : *migrated_chains;
    const WorkerPtr d = PickWaiting(ctx, [&] {
      WorkerPtr w = PickDecode(prompt_tokens + gr.params.max_tokens, failed_decode, chains);
      // Every serving worker has failed this request once. A handoff can
      // fail for reasons that pass (a worker restarted in between, a stale
      // connection), so they are tried again, up to a bound.
      if (w == nullptr && attempt < kMaxDecodeAttempts) w = PickDecode(prompt_tokens + gr.params.max_tokens, {}, chains);
      return w;
    });
    if (d == nullptr) {
      error = failed_decode.empty() ? NoHealthyWorker(/*prefill=*/false)
                                    : absl::StrCat("no decode worker left to continue on (last: ",
                                                   failed_decode.back().address, ": ", failed_decode.back().error, ")");
      unavailable = true;
      break;
    }
    if (attempt++ > 0) {
      migrations_->Add();
      LogEvent("warning", "migrating", {{"request_id", internal_id}, {"to", d->address},
                                         {"tokens_so_far", std::to_string(streamed.size())}});
    }
    const int64_t context_tokens = chains.size();
    // Conditional disaggregation: little of the context is missing on the
    // decode worker, and it has room in its batch: prefill there.
    bool local = colocated;
    if (!colocated && options_.local_prefill_max_tokens > 0 &&
        context_tokens - CachedTokens(*d, chains) <= options_.local_prefill_max_tokens && HasHeadroom(*d)) {
      local = true;
      prefix_index_.Expect(d->address, chains.For(d->prefix_hash()), absl::Now(), options_.prefix_expect);
    }
    if (attempt == 1) {
      placement_[colocated ? 2 : local ? 1 : 0]->Add();
      timings.set_local_prefill(local && !colocated);
    }
    worker::v1::WorkRequest work;
    rpc::ToWork(gr, &work);
    work.set_request_id(internal_id);
    work.mutable_generated_ids()->Assign(streamed.begin(), streamed.end());
    d->in_flight++;
    grpc::ClientContext* dctx = new_context();
    worker::v1::DecodeRequest dreq;
    *dreq.mutable_request() = work;
    dreq.set_prefill_here(local);
    using DecodeReader = rpc::RawStreamReader<worker::v1::DecodeEvent>;
    DecodeReader dreader(d->channel.get(), "/pdserve.worker.v1.DecodeWorker/Decode", dctx, dreq);

    bool decode_expected = true;
    if (!local) {
      // Prefill attempts: a prefill worker that fails before its handoff is
      // committed is marked down and the prefill runs again on another; the
      // decode worker keeps waiting under the same request id, and the dead
      // sender's reservation is freed on its side. Sampling is keyed by
      // (seed, position), so a retried first token is the one already sent.
      std::vector<Failed> failed_prefill;
      WorkerPtr p = PickWaiting(ctx, [&] {
        WorkerPtr w = PickPrefill(avoid_prefill, chains);
        return w != nullptr ? w : PickPrefill(failed_prefill, chains);
      });
      bool decode_side_failed = false;
      std::string handoff_error;  // The prefill worker's, when the decode side failed.
      bool prefill_unparseable = false;
      bool first_sent = false;
      int32_t first_token = -1;
      bool handed_off = false;
      if (p == nullptr) {
        error = NoHealthyWorker(/*prefill=*/true);
        unavailable = true;
      }
      while (p != nullptr && decode_expected && error.empty() && !cancelled) {
        // Its queue grows by what it will compute; its cache will hold the
        // prompt's blocks (counted until its own events say so).
        const int64_t queued = context_tokens - CachedTokens(*p, chains);
        prefix_index_.Expect(p->address, chains.For(p->prefix_hash()), absl::Now(), options_.prefix_expect);
        p->in_flight++;
        p->queued_tokens += queued;
        grpc::ClientContext* pc = new_context();
        worker::v1::PrefillRequest preq;
        *preq.mutable_request() = work;
        preq.set_decode_kv_address(d->kv_address());
        using PrefillReader = rpc::RawStreamReader<worker::v1::PrefillEvent>;
        PrefillReader preader(p->channel.get(), "/pdserve.worker.v1.PrefillWorker/Prefill", pc, preq);
        worker::v1::PrefillEvent ev;
        bool first_seen = false;
        PrefillReader::Result read;
        while ((read = preader.Read(&ev)) == PrefillReader::Result::kMessage) {
          if (ev.has_first() && !first_seen) {
            first_seen = true;
            p->queued_tokens -= queued;
            const worker::v1::FirstToken& f = ev.first();
            if (first_sent) {
              if (f.token().token_id() != first_token) {
                error = absl::StrCat("prefill retried on ", p->address, " gave token ", f.token().token_id(),
                                     ", not ", first_token);
              }
              continue;
            }
            TokenEvent te;
            te.token = f.token().token_id();
            te.logprob = f.token().logprob();
            for (const v1::TopLogprob& t : f.token().top()) te.top_logprobs.emplace_back(t.token_id(), t.logprob());
            absl::StatusOr<TokenEvent> text = replay.Replay(te);
            if (!text.ok()) {
              error = std::string(text.status().message());
              break;
            }
            first_sent = true;
            first_token = te.token;
            streamed.push_back(te.token);
            if (attempt == 1) {
              timings.set_queue(f.queue_seconds());
              timings.set_prefill(f.prefill_seconds());
              timings.set_cached_prompt_tokens(f.cached_tokens());
            }
            measured_.RecordPrefill(p->address, context_tokens, context_tokens - f.cached_tokens(), f.prefill_seconds());
            prompt_tokens_->Add(static_cast<double>(context_tokens));
            cached_tokens_->Add(f.cached_tokens());
            v1::TokenChunk chunk;
            rpc::AppendToken(*text, gr.params.logprobs > 0, &chunk);
            send_chunk(chunk);
            if (text->finish != FinishReason::kNone) {
              finish = text->finish;
              decode_expected = false;
              dctx->TryCancel();
            }
          } else if (ev.has_done()) {
            handed_off = true;
            // The decode worker publishes the prompt's full blocks on commit.
            prefix_index_.Expect(d->address, chains.For(d->prefix_hash()), absl::Now(), options_.prefix_expect);
            if (attempt == 1) {
              timings.set_handoff(ev.done().handoff_seconds());
              measured_.RecordHandoff(p->address, d->address,
                                      static_cast<double>(context_tokens * d->kv_bytes_per_position.load()),
                                      ev.done().handoff_seconds());
            }
          }
        }
        const grpc::Status ps = preader.Finish();
        if (!first_seen) p->queued_tokens -= queued;
        p->in_flight--;
        if (read == PrefillReader::Result::kUnparseable && error.empty() && !handed_off) {
          if (unparseable("prefill", p->address, preader.parse_error(), internal_id)) break;
          // Whether the KV was committed is not known: the whole attempt
          // runs again (a new request id, on another prefill worker if there
          // is one). No worker is marked down.
          prefill_unparseable = true;
          avoid_prefill.push_back({p.get(), p->instance.load(), p->address});
          break;
        }
        // After `done` the KV is committed on the decode worker, which
        // carries the request on: a prefill worker dying now costs nothing.
        if (ps.ok() || !error.empty() || handed_off) break;
        if (ctx->IsCancelled() || ps.error_code() == grpc::StatusCode::CANCELLED) {
          cancelled = true;
          break;
        }
        if (ps.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
          error = absl::StrCat("prefill worker ", p->address, ": ", ps.error_message());
          break;
        }
        {
          // A prefill worker that still answers failed because of the
          // decode side (its reservation or transfer): move the sequence to
          // another decode worker instead of retrying the same handoff.
          grpc::ClientContext sc;
          sc.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
          worker::v1::WorkerInfo info;
          if (p->prefill->Status(&sc, {}, &info).ok() && info.status().healthy()) {
            decode_side_failed = true;
            handoff_error = absl::StrCat("prefill worker ", p->address, ": ", ps.error_message());
            LogEvent("warning", "handoff_failed", {{"request_id", internal_id}, {"prefill", p->address},
                                                   {"decode", d->address}, {"error", ps.error_message()}});
            break;
          }
        }
        p->healthy = false;
        failed_prefill.push_back({p.get(), p->instance.load(), p->address, ps.error_message()});
        retries_->Add();
        LogEvent("warning", "prefill_retry", {{"request_id", internal_id}, {"worker", p->address},
                                              {"error", ps.error_message()}});
        p = PickWaiting(ctx, [&] { return PickPrefill(failed_prefill, chains); });
        if (p == nullptr) {
          error = absl::StrCat("no prefill worker could serve the request (last: ", failed_prefill.back().address,
                               ": ", ps.error_message(), ")");
          unavailable = true;
        }
      }
      if (!error.empty() || cancelled) {
        decode_expected = false;
        dctx->TryCancel();
      }
      if ((decode_side_failed || prefill_unparseable) && error.empty() && !cancelled) {
        dctx->TryCancel();
        worker::v1::DecodeEvent ignored;
        while (dreader.Read(&ignored) == DecodeReader::Result::kMessage) {
        }
        (void)dreader.Finish();
        d->in_flight--;
        if (decode_side_failed) {
          d->healthy = false;
          failed_decode.push_back({d.get(), d->instance.load(), d->address, handoff_error});
        }
        continue;  // Migrate: prefill again toward another decode worker.
      }
    }

    worker::v1::DecodeEvent dev;
    bool decode_final = false;
    DecodeReader::Result dread;
    while ((dread = dreader.Read(&dev)) == DecodeReader::Result::kMessage) {
      if (!decode_expected) continue;
      if (dev.has_chunk() && dev.chunk().token_ids_size() > 0) {
        for (int32_t t : dev.chunk().token_ids()) {
          TokenEvent te;
          te.token = t;
          (void)replay.Replay(te);  // Keeps the router's state in step for a migration.
          streamed.push_back(t);
        }
        send_chunk(dev.chunk());
        if (client_gone) dctx->TryCancel();
      } else if (dev.has_final()) {
        decode_final = true;
        const worker::v1::DecodeFinal& f = dev.final();
        if (f.finish_reason() == v1::FINISH_REASON_CANCELLED) {
          cancelled = true;
        } else if (f.finish_reason() == v1::FINISH_REASON_ERROR) {
          error = absl::StrCat("decode worker ", d->address, ": ", f.error());
        } else {
          finish = rpc::FromProto(f.finish_reason());
        }
        if (local && attempt == 1) {
          timings.set_prefill(f.prefill_seconds());
          timings.set_cached_prompt_tokens(f.cached_tokens());
        }
        if (local) {
          prompt_tokens_->Add(static_cast<double>(context_tokens));
          cached_tokens_->Add(f.cached_tokens());
        }
      }
    }
    const grpc::Status ds = dreader.Finish();
    d->in_flight--;
    if (dread == DecodeReader::Result::kUnparseable && decode_expected && !decode_final && error.empty() &&
        !cancelled) {
      if (unparseable("decode", d->address, dreader.parse_error(), internal_id)) break;
      // Migrate, to another worker if there is one; this one stays healthy.
      failed_decode.push_back({d.get(), d->instance.load(), d->address, std::string(dreader.parse_error().message())});
      continue;
    }
    if (!decode_expected || decode_final || !error.empty() || cancelled) break;
    if (ctx->IsCancelled() || client_gone || ds.error_code() == grpc::StatusCode::CANCELLED) {
      cancelled = true;
      break;
    }
    if (ds.ok() || ds.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
      if (!ds.ok()) error = absl::StrCat("decode worker ", d->address, ": ", ds.error_message());
      break;
    }
    // The decode worker failed mid-stream: migrate the sequence.
    d->healthy = false;
    failed_decode.push_back({d.get(), d->instance.load(), d->address, ds.error_message()});
    LogEvent("warning", "decode_failed", {{"request_id", internal_id}, {"worker", d->address},
                                          {"error", ds.error_message()}});
  }
  --in_flight_;
  {
    absl::MutexLock lock(&watch_mu_);
    watches_.erase(std::find(watches_.begin(), watches_.end(), &watch));
  }
  if (ctx->IsCancelled()) {
    CountOutcome("cancelled");
    return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the client");
  }
  if (unavailable && completion == 0) {
    CountOutcome("unavailable");
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, error);
  }
  if (completion > 0) ttft_->Observe(timings.ttft());
  if (!colocated && !timings.local_prefill()) {
    queue_->Observe(timings.queue());
    handoff_->Observe(timings.handoff());
  }
  prefill_time_->Observe(timings.prefill());

  if (!relay.empty()) {
    std::sort(relay.begin(), relay.end());
    timings.set_router_relay_p50(relay[relay.size() / 2]);
    timings.set_router_relay_p99(relay[std::min(relay.size() - 1, static_cast<size_t>(0.99 * relay.size()))]);
  }
  timings.set_mean_itl(gaps > 0 ? sum_itl / gaps : 0);
  timings.set_max_itl(max_itl);
  timings.set_total(Seconds(t_start, SteadyClock::now()));
  msg.clear_kind();
  v1::GenerateFinal* fin = msg.mutable_final();
  if (!error.empty()) {
    fin->set_finish_reason(v1::FINISH_REASON_ERROR);
    fin->set_error(error);
  } else if (cancelled || finish == FinishReason::kNone) {
    fin->set_finish_reason(v1::FINISH_REASON_CANCELLED);
  } else {
    fin->set_finish_reason(rpc::ToProto(finish));
  }
  if (error.empty() && !cancelled && finish != FinishReason::kNone) measured_.RecordFinished(completion);
  CountOutcome(!error.empty() ? "error"
               : (cancelled || finish == FinishReason::kNone) ? "cancelled"
               : finish == FinishReason::kStop                ? "stop"
                                                               : "length");
  e2e_->Observe(timings.total());
  if (internal) return grpc::Status(grpc::StatusCode::INTERNAL, error);
  fin->mutable_usage()->set_prompt_tokens(static_cast<int32_t>(prompt_tokens));
  fin->mutable_usage()->set_completion_tokens(completion);
  fin->set_seed(*gr.params.seed);
  *fin->mutable_timings() = timings;
  emit(msg);
  return grpc::Status::OK;
}

grpc::Status RouterService::Generate(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                                     grpc::ServerWriter<v1::GenerateResponse>* writer) {
  return Run(ctx, *req, [writer](const v1::GenerateResponse& m) { return writer->Write(m); });
}

grpc::Status RouterService::Complete(grpc::ServerContext* ctx, const v1::GenerateRequest* req,
                                     v1::CompleteResponse* out) {
  out->set_request_id(req->request_id());
  return Run(ctx, *req, [out](const v1::GenerateResponse& m) {
    if (m.has_chunk()) {
      out->mutable_token_ids()->Add(m.chunk().token_ids().begin(), m.chunk().token_ids().end());
      out->mutable_text()->append(m.chunk().text());
      for (const auto& lp : m.chunk().logprobs()) *out->add_logprobs() = lp;
    } else if (m.has_final()) {
      *out->mutable_final() = m.final();
    }
    return true;
  });
}

grpc::Status RouterService::ListModels(grpc::ServerContext*, const v1::ListModelsRequest*,
                                       v1::ListModelsResponse* out) {
  v1::ModelInfo* m = out->add_models();
  m->set_name(options_.model_name);
  m->set_context_length(static_cast<int32_t>(config_.max_position_embeddings));
  m->set_vocab_size(static_cast<int32_t>(config_.vocab_size));
  return grpc::Status::OK;
}

MeasuredCapacity RouterService::CurrentCapacity() {
  PoolFacts facts;
  for (const WorkerPtr& w : Snapshot(true)) facts.prefill_workers += w->healthy.load() ? 1 : 0;
  for (const WorkerPtr& w : Snapshot(false)) {
    facts.decode_workers += w->healthy.load() ? 1 : 0;
    facts.decode_batch = std::max<int64_t>(facts.decode_batch, w->max_batch.load());
  }
  if (facts.decode_batch < 1) facts.decode_batch = 1;
  return ComputeMeasuredCapacity(measured_.Snapshot(), facts);
}

grpc::Status RouterService::ClusterStatus(grpc::ServerContext*, const v1::ClusterStatusRequest*,
                                          v1::ClusterStatusResponse* out) {
  // Every worker at once: one that does not answer costs its deadline once,
  // not once per worker after it.
  std::vector<std::unique_ptr<StatusCall>> calls;
  for (const bool prefill : {true, false}) {
    for (WorkerPtr& w : Snapshot(prefill)) {
      auto c = std::make_unique<StatusCall>();
      c->worker = w;
      c->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      calls.push_back(std::move(c));
    }
  }
  StatusAll(calls);
  for (const auto& c : calls) {
    const Worker& w = *c->worker;
    const bool ok = c->status.ok();
    v1::WorkerStatus* s = w.prefill_role ? out->add_prefill() : out->add_decode();
    if (ok) *s = c->info.status();
    s->set_address(w.address);
    s->set_role(w.prefill_role ? "prefill" : "decode");
    s->set_healthy(ok && c->info.status().healthy());
    s->set_unhealthy_reason(ok ? c->info.unhealthy_reason() : c->status.error_message());
    s->set_prefix_index_blocks(prefix_index_.NumBlocks(w.address));
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
  return grpc::Status::OK;
}

}  // namespace pdserve::router
