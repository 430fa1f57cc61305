#include "prefill_worker/prefill_service.h"

#include "prefill_worker/prefix_pull.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "engine/generation.h"
#include "kv/prefix_cache.h"
#include "kv/tier2_store.h"
#include "base/grpc_status.h"
#include "base/one_write_stream.h"
#include "base/server_util.h"
#include "proto/convert.h"
#include "proto/received.h"

namespace pdserve::prefill {
namespace {

using Clock = std::chrono::steady_clock;
using worker::v1::PrefillEvent;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The decode worker had no room for the reservation (its pool, or the host
// blocks handoffs into GPU memory land in): a refusal that passes as its
// sequences end. The code alone does not say so, since this side's
// transport gives RESOURCE_EXHAUSTED for a staging buffer it cannot
// allocate: the receiver's refusals for room are the ones that begin so.
bool IsNoRoom(const absl::Status& s) {
  return absl::IsResourceExhausted(s) && absl::StartsWith(s.message(), "KV handoff: reservation of ");
}


}  // namespace

struct PrefillService::Job {
  std::string request_id;
  std::string decode_address;
  std::string kv_grant;  // The router's, for the decode worker (kv_transfer/grant.h).
  std::unique_ptr<Generation> gen;  // Until the engine has the request.
  // Set (under mu) when handed to the engine.
  std::shared_ptr<engine::Request> request;
  std::vector<int32_t> context;  // Prompt + generated_ids: what is prefilled.
  // Of the context, what the engine computed (set with the first token).
  int64_t computed_tokens = 0;
  int32_t tier2_tokens = 0;  // Of the cached positions, read back from the second tier (engine thread).
  Clock::time_point room_wait_since;  // While waiting for room on its decode worker.
  SequenceKv kv;  // From the engine, after the first token: what is committed.
  std::unique_ptr<kv::Handoff> handoff;
  Clock::time_point queued_at, started_at, first_at;
  TokenEvent first;
  std::atomic<bool> cancelled{false};
  absl::Mutex mu;
  // Its Prefill call: what the threads tell the caller goes there.
  std::shared_ptr<PrefillCall> call;

  void Push(PrefillEvent e);
};

// One Prefill stream (callback API): the first token, then HandoffDone,
// then the job's status. At most one write is outstanding; what to do next
// is decided under mu_ and done outside it. It keeps itself alive until
// gRPC is done with it (OnDone), and its job keeps it alive after that.
class PrefillCall final : public OneWriteStream<PrefillEvent> {
 public:
  static std::shared_ptr<PrefillCall> Create(PrefillService* service, int64_t tokens) {
    std::shared_ptr<PrefillCall> call(new PrefillCall(service, tokens));
    call->self_ = call;
    return call;
  }
  void set_job(std::shared_ptr<PrefillService::Job> job) {
    absl::MutexLock lock(&mu_);
    job_ = std::move(job);
  }
  void MakeFirstTokenUnparseable() {
    absl::MutexLock lock(&mu_);
    unparseable_ = true;
  }
  // Counted in the service's in_flight_ and queued tokens until OnDone.
  // Marked before the job is queued (the compute thread may push its first
  // token at once, and that push releases the queued tokens only of an
  // admitted call); withdrawn if the queue then refuses it.
  void Admitted() {
    absl::MutexLock lock(&mu_);
    admitted_ = true;
  }
  void Withdrawn() {
    absl::MutexLock lock(&mu_);
    admitted_ = false;
  }
  void Push(PrefillEvent e) {
    Action a;
    {
      absl::MutexLock lock(&mu_);
      if (e.has_first() && !first_seen_) {
        first_seen_ = true;
        ReleaseQueuedTokens();
      }
      if (unparseable_ && e.has_first()) {
        rpc::MakeUnparseable(&e);
        unparseable_ = false;
      }
      pending_.push_back(std::move(e));
      a = NextLocked();
    }
    Do(a);
  }
  // The job's end (once): after what is pending, the RPC finishes with it.
  void End(const absl::Status& status) {
    Action a;
    {
      absl::MutexLock lock(&mu_);
      if (end_.has_value()) return;
      end_ = ToGrpcStatus(status);
      a = NextLocked();
    }
    Do(a);
  }
  void OnWriteDone(bool ok) override {
    std::shared_ptr<PrefillService::Job> cancel;
    Action a;
    {
      absl::MutexLock lock(&mu_);
      WriteDoneLocked();
      if (!ok) {
        pending_.clear();  // The caller went away.
        cancel = job_;
      }
      a = NextLocked();
    }
    if (cancel != nullptr) service_->Cancel(*cancel);
    Do(a);
  }
  void OnCancel() override {
    std::shared_ptr<PrefillService::Job> job;
    {
      absl::MutexLock lock(&mu_);
      job = job_;
    }
    if (job != nullptr) service_->Cancel(*job);  // The job ends; End finishes the RPC.
  }
  void OnDone() override {
    std::shared_ptr<PrefillService::Job> job;
    {
      absl::MutexLock lock(&mu_);
      job = std::move(job_);
      if (admitted_) {
        if (!first_seen_) ReleaseQueuedTokens();
        absl::MutexLock s(&service_->mu_);
        --service_->in_flight_;
      }
    }
    job.reset();
    self_.reset();  // May destroy this.
  }

 private:
  PrefillCall(PrefillService* service, int64_t tokens) : service_(service), tokens_(tokens) {}

  void ReleaseQueuedTokens() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!admitted_) return;
    absl::MutexLock s(&service_->mu_);
    service_->queued_tokens_ -= tokens_;
  }
  Action NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (busy()) return {};
    if (!pending_.empty()) {
      out_ = std::move(pending_.front());
      pending_.pop_front();
      return WriteLocked();
    }
    if (!end_.has_value()) return {};
    return FinishLocked(*end_);
  }

  PrefillService* const service_;
  const int64_t tokens_;
  std::shared_ptr<PrefillCall> self_;
  std::shared_ptr<PrefillService::Job> job_ ABSL_GUARDED_BY(mu_);
  bool unparseable_ ABSL_GUARDED_BY(mu_) = false;
  bool admitted_ ABSL_GUARDED_BY(mu_) = false;
  bool first_seen_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<PrefillEvent> pending_ ABSL_GUARDED_BY(mu_);
  std::optional<grpc::Status> end_ ABSL_GUARDED_BY(mu_);
};

void PrefillService::Job::Push(PrefillEvent e) { call->Push(std::move(e)); }

// The jobs a decode worker refused for lack of room, oldest first: only
// the front one asks again, so a later (perhaps smaller) one never takes
// the room it waits for.
struct PrefillService::RoomWait {
  std::deque<std::shared_ptr<Job>> jobs;
  // The decode worker told of freed room (RoomFreed, or its connection
  // failed) since the last refusal: the front job asks again.
  bool room = false;
  std::string refusal;  // The receiver's last word, for the error at the bound.
};

PrefillService::PrefillService(Model* model, KvManager* kv, const tok::Tokenizer* tokenizer, kv::KvSender* sender,
                               PrefillServiceOptions options)
    : model_(model),
      kv_(kv),
      tokenizer_(tokenizer),
      grammars_(tokenizer == nullptr ? nullptr
                                     : std::make_unique<grammar::GrammarCache>(options.grammar, [tokenizer] {
                                         return grammar::Vocabulary::FromTokenizer(*tokenizer);
                                       })),
      sender_(sender),
      options_(options),
      fault_unparseable_(options.fault_unparseable_streams),
      engine_(*model, *kv,
              engine::EngineOptions{.max_batch = options.max_batch,
                                    .chunk_tokens = options.chunk_tokens,
                                    .prefix_cache = true,
                                    .life_base = options.life_base,
                                    .life_step_factor = options.life_step_factor,
                                    .life_min_per_token = options.life_min_per_token,
                                    .tier2 = options.tier2,
                                    .fault_stall_forward = absl::Milliseconds(options.fault_stall_prefill_ms)}) {
  // With a second tier, the router follows both tiers as one.
  if (options_.tier2 != nullptr) {
    tiered_events_ = std::make_unique<TieredListener>(&kv_events_);
    kv_->set_listener(tiered_events_->pool());
    options_.tier2->set_listener(tiered_events_->tier2());
  } else {
    kv_->set_listener(&kv_events_);
  }
  sender_->SetRoomListener([this](kv::Connection& c) {
    absl::MutexLock lock(&mu_);
    room_freed_.insert(&c);
  });
  engine_.Start();
  push_thread_ = std::thread([this] { PushLoop(); });
  reserve_thread_ = std::thread([this] { ReserveLoop(); });
  commit_thread_ = std::thread([this] { CommitLoop(); });
}

PrefillService::~PrefillService() {
  sender_->SetRoomListener(nullptr);
  Shutdown();
  kv_->set_listener(nullptr);
  if (options_.tier2 != nullptr) options_.tier2->set_listener(nullptr);
}

void PrefillService::Shutdown() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
  }
  if (reserve_thread_.joinable()) reserve_thread_.join();
  if (push_thread_.joinable()) push_thread_.join();  // Each push is bounded by the KV timeout.
  engine_.Stop();  // What it holds ends with UNAVAILABLE.
  {
    absl::MutexLock lock(&mu_);
    commits_closed_ = true;
  }
  if (commit_thread_.joinable()) commit_thread_.join();
  absl::MutexLock lock(&mu_);
  for (auto& j : queue_) FinishJob(j, absl::UnavailableError("prefill worker shutting down"));
  queue_.clear();
}

void PrefillService::FinishJob(const std::shared_ptr<Job>& job, absl::Status status) {
  if (job->handoff != nullptr && !status.ok()) {
    (void)job->handoff->Abort(status);
  }
  // A forward whose KV no decode worker took: the router prefills the
  // request again elsewhere, so this work is lost.
  const int64_t computed = std::exchange(job->computed_tokens, 0);
  if (computed > 0 && !status.ok() && !job->cancelled) {
    discarded_tokens_.fetch_add(computed, std::memory_order_relaxed);
    LogEvent("warning", "prefill_discarded",
             {{"request_id", job->request_id},
              {"decode", job->decode_address},
              {"tokens", std::to_string(computed)},
              {"error", std::string(status.message())}});
  }
  job->handoff.reset();
  job->kv.Release();
  job->call->End(status);
}

absl::Status PrefillService::StartHandoff(Job& job) {
  const GenerationRequest& r = job.gen->request();
  kv::ReserveArgs args;
  args.num_positions = static_cast<int32_t>(job.context.size());
  args.margin_positions = r.params.max_tokens - static_cast<int32_t>(job.gen->generated().size());
  args.prompt_tokens = job.context;
  args.grant = job.kv_grant;
  args.cache_salt = r.cache_salt;
  absl::StatusOr<std::unique_ptr<kv::Handoff>> h = connections_.Reserve(job.decode_address, args);
  if (!h.ok()) return h.status();
  job.handoff = *std::move(h);
  return absl::OkStatus();
}

void PrefillService::ReserveLoop() {
  int64_t cancels_seen = 0;
  while (true) {
    std::shared_ptr<Job> job;
    bool cancels = false;
    {
      absl::MutexLock lock(&mu_);
      // A bounded lookahead: a reservation is a lease on the decode side's
      // blocks, so only about two forwards' worth wait reserved.
      // Room freed on a decode worker that some job waits for is a
      // reason to run as well, once the lookahead has space.
      auto ready = [this, cancels_seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ || cancels_ != cancels_seen ||
               ((!queue_.empty() || !room_freed_.empty() || room_pending_) && in_engine_ < 2 * options_.max_batch);
      };
      if (const std::optional<Clock::time_point> next = NextRoomEvent(); next.has_value()) {
        mu_.AwaitWithTimeout(absl::Condition(&ready), absl::FromChrono(*next - Clock::now()));
      } else {
        mu_.Await(absl::Condition(&ready));
      }
      if (stop_) break;
      cancels = cancels_ != cancels_seen;
      cancels_seen = cancels_;
      if (!queue_.empty() && in_engine_ < 2 * options_.max_batch) {
        job = queue_.front();
        queue_.pop_front();
      }
    }
    ServeRoomWaits(cancels);
    if (job != nullptr) Reserve(job);
  }
  for (auto& [address, wait] : room_waits_) {
    for (const std::shared_ptr<Job>& job : wait.jobs) {
      EndRoomWait(*job);
      FinishJob(job, absl::UnavailableError("prefill worker shutting down"));
    }
  }
  room_waits_.clear();
}

void PrefillService::Reserve(const std::shared_ptr<Job>& job) {
  if (job->cancelled) {
    FinishJob(job, absl::CancelledError("cancelled"));
    return;
  }
  if (auto it = room_waits_.find(job->decode_address); it != room_waits_.end()) {
    BeginRoomWait(it->second, job);  // Behind those already waiting there.
    return;
  }
  job->started_at = Clock::now();
  absl::Status st = StartHandoff(*job);
  if (st.ok()) {
    Submit(job);
    return;
  }
  if (!IsNoRoom(st) || options_.handoff_room_wait <= absl::ZeroDuration()) {
    FinishJob(job, st);
    return;
  }
  RoomWait& wait = room_waits_[job->decode_address];
  wait.refusal = std::string(st.message());
  BeginRoomWait(wait, job);
}

void PrefillService::BeginRoomWait(RoomWait& wait, const std::shared_ptr<Job>& job) {
  job->room_wait_since = Clock::now();
  wait.jobs.push_back(job);
  room_waits_total_.fetch_add(1, std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  ++waiting_for_room_;
}

void PrefillService::EndRoomWait(Job& job) {
  const double waited = Seconds(job.room_wait_since, Clock::now());
  room_wait_seconds_.fetch_add(waited, std::memory_order_relaxed);
  absl::MutexLock lock(&mu_);
  --waiting_for_room_;
}

std::optional<PrefillService::Clock::time_point> PrefillService::NextRoomEvent() const {
  const Clock::duration bound = absl::ToChronoNanoseconds(options_.handoff_room_wait);
  std::optional<Clock::time_point> next;
  for (const auto& [address, wait] : room_waits_) {
    // Jobs join in arrival order, so the front one reaches the bound first.
    const Clock::time_point t = wait.jobs.front()->room_wait_since + bound;
    if (!next.has_value() || t < *next) next = t;
  }
  return next;
}

void PrefillService::ServeRoomWaits(bool cancels) {
  const Clock::duration bound = absl::ToChronoNanoseconds(options_.handoff_room_wait);
  absl::flat_hash_set<const kv::Connection*> freed;
  {
    absl::MutexLock lock(&mu_);
    freed.swap(room_freed_);
  }
  bool pending = false;
  for (auto it = room_waits_.begin(); it != room_waits_.end();) {
    const std::string& address = it->first;
    RoomWait& wait = it->second;
    if (const kv::Connection* c = connections_.Find(address); c != nullptr && freed.contains(c)) wait.room = true;
    if (cancels) {
      for (auto j = wait.jobs.begin(); j != wait.jobs.end();) {
        if (!(*j)->cancelled) {
          ++j;
          continue;
        }
        EndRoomWait(**j);
        FinishJob(*j, absl::CancelledError("cancelled"));
        j = wait.jobs.erase(j);
      }
    }
    while (!wait.jobs.empty() && Clock::now() - wait.jobs.front()->room_wait_since >= bound) {
      std::shared_ptr<Job> job = std::move(wait.jobs.front());
      wait.jobs.pop_front();
      EndRoomWait(*job);
      FinishJob(job, absl::ResourceExhaustedError(
                         absl::StrFormat("no KV room on decode worker %s for %.1f s: %s", address,
                                         absl::ToDoubleSeconds(options_.handoff_room_wait), wait.refusal)));
    }
    while (!wait.jobs.empty() && wait.room) {
      bool lookahead_full = false;
      {
        absl::MutexLock lock(&mu_);
        lookahead_full = in_engine_ >= 2 * options_.max_batch;
      }
      if (lookahead_full) break;  // asked again once the engine takes one
      std::shared_ptr<Job> job = wait.jobs.front();
      job->started_at = Clock::now();
      room_retries_.fetch_add(1, std::memory_order_relaxed);
      absl::Status st = StartHandoff(*job);
      if (IsNoRoom(st)) {
        // The receiver tells this connection when KV frees next.
        wait.refusal = std::string(st.message());
        wait.room = false;
        break;
      }
      wait.jobs.pop_front();
      EndRoomWait(*job);
      if (st.ok()) {
        Submit(job);
      } else {
        FinishJob(job, st);
      }
      // The next one asks at once: the room that took this one may hold it too.
    }
    pending |= !wait.jobs.empty() && wait.room;
    if (wait.jobs.empty()) {
      room_waits_.erase(it++);
    } else {
      ++it;
    }
  }
  absl::MutexLock lock(&mu_);
  room_pending_ = pending;
}

void PrefillService::Submit(const std::shared_ptr<Job>& job) {
  engine::RequestCallbacks c;
  Job* j = job.get();  // The engine's callbacks end before the job does (FinishJob).
  if (options_.stream_layers) {
    c.on_layer_written = [j](int32_t layer, const SequenceKv& kv) {
      return j->handoff->SendLayer(layer, kv.block_table());
    };
  }
  // The engine's thread, just before on_token.
  c.on_first_cached = [j](int32_t, int32_t tier2) { j->tier2_tokens = tier2; };
  c.on_token = [j](const TokenEvent& first, int32_t cached) {
    const auto now = Clock::now();
    j->first = first;
    j->first_at = now;
    j->computed_tokens = static_cast<int64_t>(j->context.size()) - cached;
    PrefillEvent ev;
    worker::v1::FirstToken* f = ev.mutable_first();
    f->mutable_token()->set_token_id(first.token);
    f->mutable_token()->set_logprob(first.logprob);
    for (const auto& [id, lp] : first.top_logprobs) {
      v1::TopLogprob* t = f->mutable_token()->add_top();
      t->set_token_id(id);
      t->set_logprob(lp);
    }
    f->set_finish_reason(rpc::ToProto(first.finish));
    f->set_cached_tokens(cached);
    f->set_tier2_tokens(j->tier2_tokens);
    f->set_queue_seconds(Seconds(j->queued_at, j->started_at));
    f->set_prefill_seconds(Seconds(j->started_at, now));
    j->Push(std::move(ev));
  };
  c.on_handoff = [this, job](const TokenEvent&, SequenceKv kv) {
    job->kv = std::move(kv);
    absl::MutexLock lock(&mu_);
    --in_engine_;
    commits_.push_back(job);
  };
  // Ended inside the engine: the first token ended the request (OK: the
  // handoff is aborted, nothing to decode), or cancelled, or an error.
  c.on_end = [this, job](const absl::Status& status) {
    {
      absl::MutexLock lock(&mu_);
      --in_engine_;
    }
    if (!status.ok() && !absl::IsCancelled(status) && !absl::IsUnavailable(status)) {
      LogEvent("error", "prefill_failed", {{"request_id", job->request_id}, {"error", std::string(status.message())}});
    }
    FinishJob(job, status);
  };
  auto request = std::make_shared<engine::Request>(engine::RequestId(job->request_id),
                                                  engine::RequestMode::kPrefillOnly, std::move(job->gen), std::move(c));
  {
    absl::MutexLock lock(&job->mu);
    job->request = request;
  }
  {
    absl::MutexLock lock(&mu_);
    ++in_engine_;
  }
  engine_.Submit(request);
  // A cancel that came while the job was reserving (Cancel saw no request).
  if (job->cancelled) engine_.Cancel(request, absl::CancelledError("cancelled"));
}

void PrefillService::Cancel(Job& job) {
  if (job.cancelled.exchange(true)) return;
  std::shared_ptr<engine::Request> request;
  {
    absl::MutexLock lock(&job.mu);
    request = job.request;
  }
  if (request != nullptr) {
    engine_.Cancel(request, absl::CancelledError("cancelled"));
    return;
  }
  // Not in the engine yet: the reserve thread sees the flag, woken now in
  // case the job waits for room.
  absl::MutexLock lock(&mu_);
  ++cancels_;
}

void PrefillService::CommitLoop() {
  while (true) {
    std::shared_ptr<Job> job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return commits_closed_ || !commits_.empty(); };
      mu_.Await(absl::Condition(&ready));
      // Stopping: the compute thread has ended, and what it sent is still committed.
      if (commits_.empty()) return;
      job = commits_.front();
      commits_.pop_front();
    }
    if (options_.fault_stall_before_commit_ms > 0) {
      absl::SleepFor(absl::Milliseconds(options_.fault_stall_before_commit_ms));
    }
    const Generation& gen = *job->request->gen;
    const GenerationRequest& r = gen.request();
    kv::Commit c;
    c.request_id = job->request_id;
    c.num_positions = static_cast<int32_t>(job->context.size());
    c.tokens = job->context;
    c.first_token = job->first.token;
    c.first_logprob = job->first.logprob;
    c.top_logprobs = job->first.top_logprobs;
    c.sampling = r.params;
    c.seed = gen.seed();
    c.generated = static_cast<int32_t>(gen.generated().size());
    c.finish_reason = static_cast<uint8_t>(job->first.finish);
    c.cache_salt = r.cache_salt;
    c.grammar_hash = r.constraint != nullptr ? r.constraint->spec.hash : 0;
    c.grammar_digest = gen.grammar_digest();
    absl::Status st = absl::OkStatus();
    // Not streamed: every layer now, after the forward.
    for (int32_t l = 0; !options_.stream_layers && st.ok() && l < model_->config().num_layers; ++l) {
      st = job->handoff->SendLayer(l, job->kv.block_table());
    }
    if (st.ok()) st = job->handoff->Commit(std::move(c));
    if (st.ok()) {
      PrefillEvent ev;
      ev.mutable_done()->set_handoff_seconds(Seconds(job->first_at, Clock::now()));
      job->Push(std::move(ev));
    }
    (void)job->request->lifecycle.Transition(engine::RequestState::kFinished,
                                             st.ok() ? engine::EndReason::kHandedOff : engine::EndReason::kError);
    FinishJob(job, st);
  }
}

PrefillService::Stats PrefillService::stats() {
  absl::MutexLock lock(&mu_);
  return {static_cast<int32_t>(queue_.size()) + waiting_for_room_ + engine_.stats().waiting, queued_tokens_,
          in_flight_};
}

PrefillService::Counters PrefillService::counters() const {
  Counters c;
  c.room_waits = room_waits_total_.load(std::memory_order_relaxed);
  c.room_wait_seconds = room_wait_seconds_.load(std::memory_order_relaxed);
  c.room_retries = room_retries_.load(std::memory_order_relaxed);
  c.discarded_tokens = discarded_tokens_.load(std::memory_order_relaxed);
  return c;
}

bool PrefillService::draining() {
  absl::MutexLock lock(&mu_);
  return draining_;
}

bool PrefillService::idle() {
  absl::MutexLock lock(&mu_);
  return in_flight_ == 0 && queue_.empty() && waiting_for_room_ == 0 && in_engine_ == 0 && commits_.empty();
}

void PrefillService::Drain(absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    draining_ = true;
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
    mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
    if (in_flight_ == 0) return;
  }
  Shutdown();  // What is left ends with UNAVAILABLE.
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
  mu_.AwaitWithTimeout(absl::Condition(&idle), absl::Seconds(5));
}

grpc::ServerWriteReactor<PrefillEvent>* PrefillService::Prefill(grpc::CallbackServerContext* ctx,
                                                                const worker::v1::PrefillRequest* req) {
  const worker::v1::WorkRequest& w = req->request();
  const int64_t tokens = static_cast<int64_t>(w.prompt_ids_size()) + w.generated_ids_size();
  std::shared_ptr<PrefillCall> call = PrefillCall::Create(this, tokens);
  auto reject = [&call](const absl::Status& s) {
    call->End(s);
    return call.get();
  };
  absl::StatusOr<std::unique_ptr<Generation>> made = rpc::AcceptWork(
      w, {.eos_ids = model_->config().eos_token_ids, .vocab_size = model_->config().vocab_size, .tokenizer = tokenizer_, .grammars = grammars_.get()});
  if (!made.ok()) return reject(made.status());
  if (req->decode_kv_address().empty()) return reject(absl::InvalidArgumentError("decode_kv_address: empty"));
  auto job = std::make_shared<Job>();
  job->request_id = w.request_id();
  job->decode_address = req->decode_kv_address();
  job->kv_grant = req->kv_grant();
  job->gen = *std::move(made);
  job->context = job->gen->AllTokens();
  job->queued_at = Clock::now();
  job->call = call;
  // The call is ready before the compute thread can see its job.
  call->set_job(job);
  call->Admitted();
  if (fault_unparseable_.Take()) call->MakeFirstTokenUnparseable();
  bool queued = false;
  {
    absl::MutexLock lock(&mu_);
    if (!stop_ && !draining_) {
      queue_.push_back(job);
      queued_tokens_ += static_cast<int64_t>(job->context.size());
      ++in_flight_;
      queued = true;
    }
  }
  if (!queued) {
    call->Withdrawn();
    return reject(absl::UnavailableError("prefill worker draining"));
  }
  return call.get();
}

grpc::ServerUnaryReactor* PrefillService::Status(grpc::CallbackServerContext* ctx,
                                                 const worker::v1::WorkerStatusRequest* req,
                                                 worker::v1::WorkerInfo* out) {
  rpc::FillKvEvents(kv_events_, *req, out);
  rpc::FillPrefixHash(model_->identity(), kv_->spec().dtype, kv_->spec().block_size, out);
  v1::WorkerStatus* s = out->mutable_status();
  s->set_role("prefill");
  s->set_kernels(model_->backend().Name());
  {
    absl::MutexLock lock(&mu_);
    std::string why = stop_ ? "stopped" : draining_ ? "draining" : unhealthy_reason_;
    s->set_healthy(why.empty());
    out->set_unhealthy_reason(std::move(why));
    out->set_instance_id(ProcessInstanceId());
    s->set_running(in_flight_);
    s->set_queued(static_cast<int32_t>(queue_.size()) + waiting_for_room_ + engine_.stats().waiting);
    s->set_queued_prefill_tokens(queued_tokens_);
    const engine::EngineStats es = engine_.stats();
    s->set_oldest_request_seconds(es.oldest_request_seconds);
    s->set_requests_expired(es.expired);
  }
  {
    const KvCounts k = kv_->Counts();  // Bookkeeping only: never waits behind a forward.
    s->set_kv_blocks_total(k.total);
    s->set_kv_block_size(k.block_size);
    s->set_kv_bytes_per_position(kv_->spec().BytesPerPosition() * kv_->spec().num_ranks);
    s->set_kv_bytes_per_position_per_rank(kv_->spec().BytesPerPosition());
    s->set_tp(model_->tp());
    s->set_kv_blocks_used(k.used);
    s->set_kv_blocks_free(k.free);
    s->set_prefill_discarded_tokens(discarded_tokens_.load(std::memory_order_relaxed));
  }
  s->set_kv_cached_blocks(static_cast<int64_t>(kv_events_.num_cached()));
  {
    // The prefix cache by tier.
    s->set_kv_prefix_hit_blocks(kv_->Counts().prefix.hit_blocks);
    if (options_.tier2 != nullptr) {
      const Tier2Stats t2 = options_.tier2->Stats();
      s->set_kv_tier2_restored_blocks(t2.restored_blocks);
      s->set_kv_tier2_bytes(t2.bytes);
      s->set_kv_tier2_capacity_bytes(t2.capacity_bytes);
      s->set_kv_tier2_blocks(t2.blocks);
      s->set_kv_checksum_failures(s->kv_checksum_failures() + t2.checksum_failures);
    }
  }
  if (options_.pulls != nullptr) {
    out->set_kv_address(options_.pull_address);
    s->set_kv_checksum_failures(s->kv_checksum_failures() + options_.pulls->checksum_failures.load());
    s->set_kv_pulled_blocks(options_.pulls->positions.load() / kv_->spec().block_size);
  }
  out->set_context_length(static_cast<int32_t>(model_->config().max_position_embeddings));
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* PrefillService::PushPrefix(grpc::CallbackServerContext* ctx,
                                                     const worker::v1::PushPrefixRequest* req,
                                                     worker::v1::PushPrefixResponse* out) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (options_.pusher == nullptr) {
    reactor->Finish(ToGrpcStatus(absl::FailedPreconditionError("this prefill worker sends no prefixes")));
    return reactor;
  }
  absl::MutexLock lock(&mu_);
  if (stop_ || draining_) {
    reactor->Finish(ToGrpcStatus(absl::UnavailableError("prefill worker draining")));
    return reactor;
  }
  // req and out live until Finish.
  pushes_.push_back([this, reactor, req, out] {
    absl::StatusOr<worker::v1::PushPrefixResponse> r = options_.pusher->Push(*req);
    if (r.ok()) *out = *std::move(r);
    reactor->Finish(r.ok() ? grpc::Status::OK : ToGrpcStatus(r.status()));
  });
  return reactor;
}

void PrefillService::PushLoop() {
  for (;;) {
    std::function<void()> push;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](PrefillService* s) ABSL_NO_THREAD_SAFETY_ANALYSIS { return s->stop_ || !s->pushes_.empty(); }, this));
      if (pushes_.empty()) return;
      push = std::move(pushes_.front());
      pushes_.pop_front();
    }
    push();
  }
}

}  // namespace pdserve::prefill
