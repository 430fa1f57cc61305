#include "router/relay.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/server_util.h"
#include "kv_transfer/grant.h"
#include "proto/convert.h"

namespace pdserve::router {
namespace {

double Between(absl::Time a, absl::Time b) { return absl::ToDoubleSeconds(b - a); }

}  // namespace

Clock MonotonicClock() {
  // The wall time at the first call, advanced by the steady clock: never
  // steps back, and close enough to the wall clock for clients' deadlines.
  static const absl::Time base = absl::Now();
  static const std::chrono::steady_clock::time_point steady_base = std::chrono::steady_clock::now();
  return [] { return base + absl::FromChrono(std::chrono::steady_clock::now() - steady_base); };
}


const char* RelayStateName(RelayState s) {
  switch (s) {
    case RelayState::kPlace: return "place";
    case RelayState::kPrefill: return "prefill";
    case RelayState::kRetryPrefill: return "retry_prefill";
    case RelayState::kDecode: return "decode";
    case RelayState::kMove: return "move";
    case RelayState::kMigrate: return "migrate";
    case RelayState::kFinish: return "finish";
  }
  return "?";
}

Relay::Relay(const RelayContext& context, GenerationRequest request, std::string client_id,
             std::optional<absl::Time> deadline, std::optional<absl::Time> received)
    : context_(context),
      default_observer_(context.metrics, context.measured),
      observer_(context.observer != nullptr ? context.observer : &default_observer_),
      request_(std::move(request)),
      client_id_(std::move(client_id)),
      client_deadline_(deadline),
      received_(received),
      prompt_chains_(request_.prompt, request_.cache_salt),
      replay_(request_, context.tokenizer) {}

std::optional<absl::Time> Relay::LifeDeadline(absl::Time from) const {
  const absl::Duration most = context_.options.max_request_duration;
  if (most == absl::InfiniteDuration()) return client_deadline_;
  const absl::Time bound = from + most;
  return client_deadline_.has_value() ? std::min(*client_deadline_, bound) : bound;
}

void Relay::Cancel() {
  // Once is enough: streams opened later cancel themselves (OpenDecode,
  // OpenPrefill).
  if (client_cancelled_.exchange(true, std::memory_order_relaxed)) return;
  if (context_.queue != nullptr) context_.queue->WakeCancelled();  // ends its wait if it is queued
  if (context_.pool != nullptr) context_.pool->WakeWaiters();       // and its wait for a worker
  absl::MutexLock lock(&streams_mu_);
  if (prefill_stream_ != nullptr) prefill_stream_->Cancel();
  if (decode_stream_ != nullptr) decode_stream_->Cancel();
  if (move_stream_ != nullptr) move_stream_->Cancel();
}

// Reachable by Cancel before it starts: a start that blocks can be ended.
void Relay::OpenDecode(std::unique_ptr<DecodeStream> s) {
  decode_reader_ = s.get();
  {
    absl::MutexLock lock(&streams_mu_);
    decode_stream_ = std::move(s);
    if (client_cancelled()) decode_stream_->Cancel();
  }
  decode_reader_->Start();
}

void Relay::OpenPrefill(std::unique_ptr<PrefillStream> s) {
  prefill_reader_ = s.get();
  {
    absl::MutexLock lock(&streams_mu_);
    prefill_stream_ = std::move(s);
    if (client_cancelled()) prefill_stream_->Cancel();
  }
  prefill_reader_->Start();
}

void Relay::ClosePrefill() {
  prefill_reader_ = nullptr;
  absl::MutexLock lock(&streams_mu_);
  prefill_stream_.reset();
}

void Relay::CloseDecode() {
  decode_reader_ = nullptr;
  absl::MutexLock lock(&streams_mu_);
  decode_stream_.reset();
}

void Relay::StopDecode() {
  decode_expected_ = false;
  if (decode_reader_ != nullptr) decode_reader_->Cancel();
}

void Relay::ReleaseHandoff(const Worker& d) {
  if (local_) return;  // Prefilled there: no handoff.
  worker::v1::ReleaseRequest req;
  req.set_request_id(internal_id_);
  context_.transport->Release(d, req);
}

bool Relay::StillServing(const Worker& w) {
  StatusQuery q;
  q.worker = &w;
  const std::vector<absl::StatusOr<worker::v1::WorkerInfo>> still =
      context_.transport->Status({&q, 1}, context_.options.handoff_check_timeout);
  return still[0].ok() && still[0]->status().healthy();
}

WorkerPtr Relay::PickWaiting(const std::function<WorkerPtr()>& pick) {
  absl::Time until = Now() + context_.options.pick_wait;
  if (deadline_.has_value()) until = std::min(until, *deadline_);
  while (true) {
    const uint64_t seen = context_.pool->serving_epoch();
    if (WorkerPtr w = pick(); w != nullptr) return w;
    if (client_cancelled() || Now() >= until) return nullptr;
    // A worker admitted, added or removed, or the client's cancel, ends
    // the wait at once: nothing polls.
    if (context_.options.await_serving) {
      context_.options.await_serving(seen, until - Now());
    } else {
      context_.pool->AwaitServingChange(seen, until - Now(), &client_cancelled_);
    }
  }
}

void Relay::SendChunk(const v1::TokenChunk& chunk) {
  const absl::Time now = Now();
  if (completion_ == 0) {
    timings_.set_ttft(Between(start_, now));
    if (ticket_.has_value()) ticket_->Release();
  } else {
    const double gap = Between(last_token_, now);
    if (gaps_ == 0) timings_.set_first_gap(gap);
    observer_->TokenGap(gap);
    sum_itl_ += gap;
    max_itl_ = std::max(max_itl_, gap);
    ++gaps_;
  }
  last_token_ = now;
  completion_ += chunk.token_ids_size();
  msg_.clear_kind();
  *msg_.mutable_chunk() = chunk;
  if (!(*emit_)(msg_)) client_gone_ = true;
  relay_costs_.push_back(Between(now, Now()));
}

bool Relay::Unparseable(const char* role, const std::string& address, const absl::Status& why) {
  LogEvent("warning", "unparseable_message", {{"request_id", internal_id_}, {"role", role}, {"worker", address},
                                               {"error", std::string(why.message())}});
  if (++parse_failures_ < 2) return false;
  error_ = absl::StrCat(role, " worker ", address, " sent ", why.message(), " (after one retry)");
  internal_ = true;
  return true;
}

int64_t Relay::Positions() const {
  return static_cast<int64_t>(request_.prompt.size()) + request_.params.max_tokens;
}

absl::Status Relay::Enqueue(QueueEnd* end) {
  *end = QueueEnd::kPlaced;
  Placement& placement = *context_.placement;
  const int64_t positions = Positions();
  std::vector<WorkerPtr> serving;
  for (WorkerPtr& w : context_.pool->Snapshot(Role::kDecode)) {
    if (w->healthy()) serving.push_back(std::move(w));
  }
  if (serving.empty()) {
    // No decode worker serves: placement waits its pick_wait and says so,
    // rather than the queue holding the request for a pool that is down.
    first_ = placement.Place(positions, prompt_chains_);
    return absl::OkStatus();
  }
  if (std::optional<int64_t> largest = context_.room->LargestCapacity(serving);
      largest.has_value() && context_.room->Rounded(*serving.front(), positions) > *largest) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "max_tokens: the request needs %d positions of KV (a prompt of %d tokens + max_tokens %d), more than the "
        "largest decode worker's pool holds (%d): lower max_tokens",
        positions, request_.prompt.size(), request_.params.max_tokens, *largest));
  }
  RequestQueue::Entry entry;
  entry.key = queue_key_;
  entry.deadline = client_deadline_;
  entry.cancelled = &client_cancelled_;
  entry.before_queue = Now() - start_;
  entry.place = [&]() {
    WorkerPtr d = placement.PickDecode(positions, {}, prompt_chains_, /*need_room=*/true);
    if (d == nullptr) return PlaceOutcome::kNoRoom;
    lease_ = context_.room->Take(d, positions);
    first_ = Placed{};
    first_.local = placement.PrefillOnDecode(*d, prompt_chains_);
    if (!first_.local) first_.prefill = placement.PickPrefill({}, prompt_chains_);
    first_.decode = std::move(d);
    return PlaceOutcome::kPlaced;
  };
  absl::Duration waited;
  const absl::Status st = context_.queue->Wait(entry, &waited, end);
  timings_.set_router_queue(absl::ToDoubleSeconds(waited));
  observer_->Queued(waited);
  return st;
}

bool Relay::Admit() {
  if (context_.admission == nullptr) return true;
  AdmissionRequest ar = context_.placement->AdmissionInputs(first_, prompt_chains_, context_.admission_min_samples);
  ar.deadline = deadline_;
  absl::StatusOr<AdmissionTicket> t = context_.admission->Decide(ar);
  if (!t.ok()) {
    error_ = std::string(t.status().message());
    return false;
  }
  ticket_.emplace(*std::move(t));
  return true;
}

absl::Status Relay::Run(const std::function<bool(const v1::GenerateResponse&)>& emit) {
  emit_ = &emit;
  start_ = received_.value_or(Now());
  deadline_ = LifeDeadline(start_);
  last_token_ = start_;
  observer_->Arrived();
  msg_.set_request_id(client_id_);
  timings_.set_colocated(context_.options.colocated);
  // The placement admission weighs is the one the first attempt runs with.
  if (context_.queue != nullptr) {
    QueueEnd end;
    if (absl::Status q = Enqueue(&end); !q.ok()) {
      const char* outcome = client_cancelled()             ? "cancelled"
                            : end == QueueEnd::kFull          ? "queue_full"
                            : end == QueueEnd::kWaitedTooLong ? "queue_wait"
                            : end == QueueEnd::kPlaced        ? "invalid"  // refused before waiting
                                                              : "cancelled";
      observer_->EndedEarly(outcome);
      if (client_cancelled()) return absl::CancelledError("cancelled by the client");
      return q;
    }
    // The bound on a request's life starts once it leaves the queue.
    deadline_ = LifeDeadline(Now());
  } else {
    first_ = context_.placement->Place(Positions(), prompt_chains_);
  }
  if (!Admit()) {
    observer_->EndedEarly("rejected");
    return absl::ResourceExhaustedError(error_);
  }
  ++*context_.in_flight;
  RelayState state = RelayState::kPlace;
  while (state != RelayState::kFinish) {
    trace_.push_back(state);
    switch (state) {
      case RelayState::kPlace: state = Place(); break;
      case RelayState::kPrefill: state = Prefill(); break;
      case RelayState::kRetryPrefill: state = RetryPrefill(); break;
      case RelayState::kDecode: state = Decode(); break;
      case RelayState::kMove: state = Move(); break;
      case RelayState::kMigrate: state = Migrate(); break;
      case RelayState::kFinish: break;
    }
  }
  trace_.push_back(RelayState::kFinish);
  lease_.Release();
  --*context_.in_flight;
  return Finish();
}

RelayState Relay::Place() {
  if (!error_.empty() || cancelled_ || finish_ != FinishReason::kNone) return RelayState::kFinish;
  internal_id_ = absl::StrFormat("%s-%d-%d", client_id_.empty() ? "req" : client_id_, getpid(),
                                 context_.next_id->fetch_add(1));
  if (replay_.finished()) {
    // Every token was streamed before the worker failed (its final message
    // was lost): the request is complete.
    finish_ = replay_.finish();
    return RelayState::kFinish;
  }
  // What this attempt prefills: the prompt and any tokens already sent.
  requests_ = Attempt(request_, internal_id_, streamed_);
  if (streamed_.empty()) {
    chains_ = &prompt_chains_;
  } else {
    migrated_chains_.emplace(requests_.context(), request_.cache_salt);
    chains_ = &*migrated_chains_;
  }
  PromptChains& chains = *chains_;
  Placement& placement = *context_.placement;
  const int64_t positions = static_cast<int64_t>(request_.prompt.size()) + request_.params.max_tokens;
  const bool first = attempt_ == 0;
  WorkerPtr d = first && first_.decode != nullptr && first_.decode->healthy() && !first_.decode->removed() ? first_.decode : nullptr;
  if (d == nullptr) {
    d = PickWaiting([&] {
      WorkerPtr w = placement.PickDecode(positions, failed_decode_, chains);
      // Every serving worker has failed this request once. A handoff can
      // fail for reasons that pass (a worker restarted in between, a stale
      // connection), so they are tried again, up to a bound.
      if (w == nullptr && attempt_ < context_.options.max_decode_attempts) w = placement.PickDecode(positions, {}, chains);
      return w;
    });
  }
  if (d == nullptr) {
    error_ = failed_decode_.empty() ? context_.pool->NoHealthyWorker(Role::kDecode)
                                    : absl::StrCat("no decode worker left to continue on (last: ",
                                                   failed_decode_.last_address(), ": ", failed_decode_.last_error(), ")");
    unavailable_ = true;
    return RelayState::kFinish;
  }
  if (attempt_++ > 0) {
    observer_->Migrated();
    LogEvent("warning", "migrating", {{"request_id", internal_id_}, {"to", d->address()},
                                       {"tokens_so_far", std::to_string(streamed_.size())}});
  }
  decode_ = d;
  // The room this attempt takes: the queue's lease on the first, a new one
  // for a migration (which does not queue again: it has a stream to finish).
  if (context_.room != nullptr && (!lease_.held() || lease_.worker() != d)) {
    lease_.Release();
    lease_ = context_.room->Take(d, positions);
  }
  const bool colocated = context_.options.colocated;
  local_ = first && d == first_.decode ? first_.local : placement.PrefillOnDecode(*d, chains);
  // Conditional disaggregation: the decode worker will hold the context.
  if (local_ && !colocated) placement.Expect(*d, chains);
  if (attempt_ == 1) {
    observer_->Placed(colocated ? PrefillPlacement::kColocated
                      : local_  ? PrefillPlacement::kDecodeLocal
                                : PrefillPlacement::kPrefillPool);
    timings_.set_local_prefill(local_ && !colocated);
  }
  decode_load_ = Placement::AssignDecode(d);
  OpenDecode(context_.transport->Decode(*d, requests_.DecodeRequest(local_), deadline_));
  decode_expected_ = true;
  if (local_) return RelayState::kDecode;

  // Prefill attempts: a prefill worker that fails before its handoff is
  // committed is marked down and the prefill runs again on another; the
  // decode worker keeps waiting under the same request id, and the dead
  // sender's reservation is freed on its side. Sampling is keyed by
  // (seed, position), so a retried first token is the one already sent.
  failed_prefill_ = Exclusions();
  first_sent_ = false;
  first_token_ = -1;
  WorkerPtr p = first && first_.prefill != nullptr && first_.prefill->healthy() && !first_.prefill->removed() ? first_.prefill
                                                                                                   : nullptr;
  if (p == nullptr) {
    p = PickWaiting([&] {
      WorkerPtr w = placement.PickPrefill(avoid_prefill_, chains);
      return w != nullptr ? w : placement.PickPrefill(failed_prefill_, chains);
    });
  }
  if (p == nullptr) return NoPrefillWorker(context_.pool->NoHealthyWorker(Role::kPrefill));
  prefill_ = std::move(p);
  return RelayState::kPrefill;
}

RelayState Relay::NoPrefillWorker(std::string error) {
  error_ = std::move(error);
  unavailable_ = true;
  StopDecode();  // kDecode drains the cancelled call
  return RelayState::kDecode;
}

RelayState Relay::Prefill() {
  Worker& p = *prefill_;
  Worker& d = *decode_;
  PromptChains& chains = *chains_;
  const int64_t context_tokens = chains.size();
  PullPrefix(p);
  // Its queue grows by what it will compute; its cache will hold the
  // context's blocks (counted until its own events say so).
  Assignment prefill_load = context_.placement->AssignPrefill(prefill_, chains);
  // This attempt's grant: only p may reserve on d for it, once, until it
  // expires. A retry or a migration is a new attempt.
  const worker::v1::PrefillRequest preq =
      requests_.PrefillRequest(p, d, context_.grant_key.get(), absl::Now(), context_.grant_ttl);
  OpenPrefill(context_.transport->Prefill(p, preq, deadline_));
  worker::v1::PrefillEvent ev;
  bool first_seen = false;
  bool handed_off = false;
  PrefillStream::ReadResult read;
  while ((read = prefill_reader_->Read(&ev)) == PrefillStream::ReadResult::kMessage) {
    p.NoteProgress(Now());
    if (ev.has_first() && !first_seen) {
      first_seen = true;
      prefill_load.DequeueTokens();
      const worker::v1::FirstToken& f = ev.first();
      if (first_sent_) {
        if (f.token().token_id() != first_token_) {
          error_ = absl::StrCat("prefill retried on ", p.address(), " gave token ", f.token().token_id(), ", not ",
                                first_token_);
        }
        continue;
      }
      TokenEvent te;
      te.token = f.token().token_id();
      te.logprob = f.token().logprob();
      for (const v1::TopLogprob& t : f.token().top()) te.top_logprobs.emplace_back(t.token_id(), t.logprob());
      absl::StatusOr<TokenEvent> text = replay_.Replay(te);
      if (!text.ok()) {
        error_ = std::string(text.status().message());
        break;
      }
      first_sent_ = true;
      first_token_ = te.token;
      streamed_.push_back(te.token);
      if (attempt_ == 1) {
        timings_.set_queue(f.queue_seconds());
        timings_.set_prefill(f.prefill_seconds());
        timings_.set_cached_prompt_tokens(f.cached_tokens());
      }
      observer_->Prefilled(p.address(), context_tokens, f.cached_tokens(), f.prefill_seconds());
      observer_->PrefixTiers(f.cached_tokens() - f.tier2_tokens(), f.tier2_tokens());
      v1::TokenChunk chunk;
      rpc::AppendToken(*text, request_.params.logprobs > 0, &chunk);
      SendChunk(chunk);
      if (text->finish != FinishReason::kNone) {
        finish_ = text->finish;
        StopDecode();
      }
    } else if (ev.has_done()) {
      handed_off = true;
      // The decode worker publishes the context's full blocks on commit.
      context_.placement->Expect(d, chains);
      if (attempt_ == 1) {
        timings_.set_handoff(ev.done().handoff_seconds());
        observer_->HandedOff(p.address(), d.address(),
                                         static_cast<double>(context_tokens * d.report().kv_bytes_per_position),
                                         ev.done().handoff_seconds());
      }
    }
  }
  const absl::Status ps = prefill_reader_->Finish();
  const absl::Status parse_error = prefill_reader_->parse_error();
  ClosePrefill();
  prefill_load.Release();
  if (read == PrefillStream::ReadResult::kUnparseable && error_.empty() && !handed_off) {
    if (Unparseable("prefill", p.address(), parse_error)) {
      StopDecode();
      return RelayState::kDecode;
    }
    // Whether the KV was committed is not known: the whole attempt runs
    // again (a new request id, on another prefill worker if there is one).
    // No worker is marked down.
    avoid_prefill_.Add(p);
    migration_ = Migration{};
    return RelayState::kMigrate;
  }
  // After `done` the KV is committed on the decode worker, which carries
  // the request on: a prefill worker dying now costs nothing.
  if (ps.ok() || !error_.empty() || handed_off || !decode_expected_) {
    if (!error_.empty()) StopDecode();
    return RelayState::kDecode;
  }
  // Only this side's cancel is the client's: the router cancels a prefill
  // call for nothing else, and a CANCELLED the worker ends the call with
  // (its graceful shutdown) is a worker failure, retried below.
  if (client_cancelled()) {
    cancelled_ = true;
    StopDecode();
    return RelayState::kDecode;
  }
  if (absl::IsInvalidArgument(ps)) {
    error_ = absl::StrCat("prefill worker ", p.address(), ": ", ps.message());
    StopDecode();
    return RelayState::kDecode;
  }
  // A prefill worker that still answers failed because of the decode side
  // (its reservation or transfer): move the sequence to another decode
  // worker instead of retrying the same handoff.
  if (StillServing(p)) {
    LogEvent("warning", "handoff_failed", {{"request_id", internal_id_}, {"prefill", p.address()},
                                           {"decode", d.address()}, {"error", std::string(ps.message())}});
    migration_ = Migration{true, true, absl::StrCat("prefill worker ", p.address(), ": ", ps.message())};
    return RelayState::kMigrate;
  }
  prefill_status_ = ps;
  return RelayState::kRetryPrefill;
}

void Relay::PullPrefix(Worker& p) {
  PromptChains& chains = *chains_;
  std::optional<PullPlan> plan = context_.placement->PlanPull(p, chains);
  if (!plan.has_value()) return;
  const worker::v1::PushPrefixRequest req = requests_.PullRequest(*plan->from, p, plan->positions,
                                                                  context_.grant_key.get(), absl::Now(),
                                                                  context_.grant_ttl);
  // Waiting longer than computing would take loses what the pull is for.
  absl::Duration timeout = absl::Seconds(std::max(0.25, 2 * plan->compute_s));
  if (deadline_.has_value()) timeout = std::min(timeout, std::max(absl::ZeroDuration(), *deadline_ - absl::Now()));
  const absl::StatusOr<worker::v1::PushPrefixResponse> r =
      context_.transport->PushPrefix(*plan->from, req, timeout);
  context_.placement->PullDone(p, chains, *plan, r, internal_id_);
}

RelayState Relay::RetryPrefill() {
  Worker& p = *prefill_;
  const std::string why(prefill_status_.message());
  p.MarkFailed();
  failed_prefill_.Add(p, why);
  observer_->PrefillRetried();
  LogEvent("warning", "prefill_retry", {{"request_id", internal_id_}, {"worker", p.address()}, {"error", why}});
  PromptChains& chains = *chains_;
  WorkerPtr next = PickWaiting([&] { return context_.placement->PickPrefill(failed_prefill_, chains); });
  if (next == nullptr) {
    return NoPrefillWorker(
        absl::StrCat("no prefill worker could serve the request (last: ", p.address(), ": ", why, ")"));
  }
  prefill_ = std::move(next);
  return RelayState::kPrefill;
}

void Relay::ListRunning() {
  if (context_.running == nullptr) return;
  const int64_t streamed = static_cast<int64_t>(streamed_.size());
  context_.running->Set(this, {.id = internal_id_,
                               .worker = decode_->address(),
                               .context = static_cast<int64_t>(request_.prompt.size()) + streamed,
                               .remaining = std::max<int64_t>(0, request_.params.max_tokens - streamed)});
}

RelayState Relay::Decode() {
  const RelayState next = ReadDecode();
  if (context_.running != nullptr) context_.running->Remove(this);
  return next;
}

RelayState Relay::ReadDecode() {
  Worker& d = *decode_;
  ListRunning();
  worker::v1::DecodeEvent dev;
  bool decode_final = false;
  DecodeStream::ReadResult read;
  while ((read = decode_reader_->Read(&dev)) == DecodeStream::ReadResult::kMessage) {
    d.NoteProgress(Now());
    if (!decode_expected_) continue;
    if (dev.has_chunk() && dev.chunk().token_ids_size() > 0) {
      for (int32_t t : dev.chunk().token_ids()) {
        TokenEvent te;
        te.token = t;
        (void)replay_.Replay(te);  // Keeps the router's state in step for a migration.
        streamed_.push_back(t);
      }
      SendChunk(dev.chunk());
      if (client_gone_) decode_reader_->Cancel();
      // The rebalance weighs what is left: kept roughly current.
      if (streamed_.size() % 16 < static_cast<size_t>(dev.chunk().token_ids_size())) ListRunning();
    } else if (dev.has_paused()) {
      // Every token the worker sampled is relayed: the stream stays open
      // while kMove settles where the sequence goes on.
      pause_ = dev.paused();
      return RelayState::kMove;
    } else if (dev.has_final()) {
      decode_final = true;
      const worker::v1::DecodeFinal& f = dev.final();
      if (f.finish_reason() == v1::FINISH_REASON_CANCELLED) {
        cancelled_ = true;
      } else if (f.finish_reason() == v1::FINISH_REASON_ERROR) {
        error_ = absl::StrCat("decode worker ", d.address(), ": ", f.error());
      } else {
        finish_ = rpc::FromProto(f.finish_reason());
      }
      if (local_ && attempt_ == 1) {
        timings_.set_prefill(f.prefill_seconds());
        timings_.set_cached_prompt_tokens(f.cached_tokens());
      }
      if (local_) {
        observer_->Prefilled("", static_cast<int64_t>(chains_->size()), f.cached_tokens(), f.prefill_seconds());
      }
    }
  }
  const absl::Status ds = decode_reader_->Finish();
  const absl::Status parse_error = decode_reader_->parse_error();
  CloseDecode();
  decode_load_.Release();
  lease_.Release();  // the worker has freed the sequence's KV (or will at the release below)
  if (!decode_final) ReleaseHandoff(d);
  if (read == DecodeStream::ReadResult::kUnparseable && decode_expected_ && !decode_final && error_.empty() &&
      !cancelled_) {
    if (Unparseable("decode", d.address(), parse_error)) return RelayState::kFinish;
    // Migrate, to another worker if there is one; this one stays serving.
    migration_ = Migration{true, false, std::string(parse_error.message())};
    return RelayState::kMigrate;
  }
  if (!decode_expected_ || decode_final || !error_.empty() || cancelled_) return RelayState::kFinish;
  if (client_cancelled() || client_gone_) {
    cancelled_ = true;
    return RelayState::kFinish;
  }
  // A decode worker ends a stream CANCELLED on purpose when its reader (this
  // relay, behind a client that stopped reading) stalls: the request ends
  // as cancelled, and migrating it would only stall the next worker. Its
  // server shutting down with the call still open also ends it CANCELLED:
  // a worker failure, and the sequence migrates. The worker's own answer
  // tells them apart.
  if (absl::IsCancelled(ds) && StillServing(d)) {
    cancelled_ = true;
    return RelayState::kFinish;
  }
  if (ds.ok() || absl::IsInvalidArgument(ds)) {
    if (!ds.ok()) error_ = absl::StrCat("decode worker ", d.address(), ": ", ds.message());
    return RelayState::kFinish;
  }
  // The decode worker failed mid-stream: migrate the sequence.
  LogEvent("warning", "decode_failed", {{"request_id", internal_id_}, {"worker", d.address()},
                                        {"error", std::string(ds.message())}});
  migration_ = Migration{true, true, std::string(ds.message())};
  return RelayState::kMigrate;
}

void Relay::DrainDecode() {
  decode_reader_->Cancel();
  worker::v1::DecodeEvent ignored;
  while (decode_reader_->Read(&ignored) == DecodeStream::ReadResult::kMessage) {
  }
  (void)decode_reader_->Finish();
  CloseDecode();
  decode_load_.Release();
}

RelayState Relay::Move() {
  WorkerPtr source = decode_;
  const std::string reason = pause_.reason().empty() ? "rebalance" : pause_.reason();
  const int32_t generated = pause_.generated();
  const int64_t positions = Positions();
  // The target's context: the prompt and every token relayed but the
  // last, which travels as the handoff's first token.
  const std::vector<int32_t> context_tokens(streamed_.begin(), streamed_.empty() ? streamed_.end() : streamed_.end() - 1);
  std::string target_id;
  Attempt move;
  WorkerPtr target;
  RoomLease target_lease;
  std::optional<PromptChains> target_chains;
  worker::v1::MoveSequenceRequest req;
  req.set_request_id(internal_id_);
  req.set_generated(generated);
  if (context_.options.moves && generated == static_cast<int32_t>(streamed_.size()) && !streamed_.empty() &&
      !replay_.finished() && !client_cancelled()) {
    target_id = absl::StrFormat("%s-%d-%d", client_id_.empty() ? "req" : client_id_, getpid(),
                                context_.next_id->fetch_add(1));
    move = Attempt(request_, target_id, context_tokens);
    target_chains.emplace(move.context(), request_.cache_salt);
    Exclusions away = failed_decode_;
    away.Add(*source, "moving away");
    target = context_.placement->PickDecode(positions, away, *target_chains, /*need_room=*/true);
  }
  absl::Time moved_at = Now();
  if (target != nullptr) {
    if (context_.room != nullptr) target_lease = context_.room->Take(target, positions);
    req = move.MoveRequest(*source, internal_id_, generated, *target, context_.grant_key.get(), absl::Now(),
                           context_.grant_ttl);
    // The target's call waits for the KV under the new id, as it waits
    // for a prefill worker's.
    std::unique_ptr<DecodeStream> s = context_.transport->Decode(*target, move.DecodeRequest(false), deadline_);
    DecodeStream* started = s.get();
    {
      absl::MutexLock lock(&streams_mu_);
      move_stream_ = std::move(s);
      if (client_cancelled()) move_stream_->Cancel();
    }
    started->Start();
  }
  absl::Duration timeout = context_.options.move_timeout;
  if (deadline_.has_value()) timeout = std::min(timeout, std::max(absl::ZeroDuration(), *deadline_ - Now()));
  const absl::StatusOr<worker::v1::MoveSequenceResponse> r = context_.transport->MoveSequence(*source, req, timeout);
  std::unique_ptr<DecodeStream> target_stream;
  {
    absl::MutexLock lock(&streams_mu_);
    target_stream = std::move(move_stream_);
  }
  if (r.ok() && r->moved() && target != nullptr) {
    // The source's stream is over (it ends OK, without a final message).
    DrainDecode();
    lease_.Release();
    lease_ = std::move(target_lease);
    observer_->Moved(reason, "moved", source->address(), target->address(), static_cast<double>(r->bytes()),
                     r->seconds());
    LogEvent("info", "sequence_moved", {{"request_id", internal_id_}, {"to_request_id", target_id},
                                        {"from", source->address()}, {"to", target->address()},
                                        {"reason", reason}, {"tokens_so_far", std::to_string(streamed_.size())},
                                        {"bytes", std::to_string(r->bytes())},
                                        {"seconds", absl::StrFormat("%.4f", absl::ToDoubleSeconds(Now() - moved_at))}});
    // The target publishes the context's full blocks on commit.
    context_.placement->Expect(*target, *target_chains);
    internal_id_ = target_id;
    requests_ = std::move(move);
    migrated_chains_ = std::move(target_chains);
    chains_ = &*migrated_chains_;
    decode_ = target;
    local_ = false;
    decode_load_ = Placement::AssignDecode(target);
    decode_reader_ = target_stream.get();
    {
      absl::MutexLock lock(&streams_mu_);
      decode_stream_ = std::move(target_stream);
      if (client_cancelled()) decode_stream_->Cancel();
    }
    return RelayState::kDecode;
  }
  // Not moved: the target's call ends, and its id there is released.
  if (target_stream != nullptr) {
    target_stream->Cancel();
    worker::v1::DecodeEvent ignored;
    while (target_stream->Read(&ignored) == DecodeStream::ReadResult::kMessage) {
    }
    (void)target_stream->Finish();
    worker::v1::ReleaseRequest rel;
    rel.set_request_id(target_id);
    context_.transport->Release(*target, rel);
  }
  target_lease.Release();
  const std::string why = !r.ok() ? std::string(r.status().message())
                          : target == nullptr ? std::string("no decode worker with room to move to")
                                              : r->error();
  const bool resumed = r.ok() && r->resumed();
  observer_->Moved(reason, resumed ? "resumed" : "replayed", source->address(), target != nullptr ? target->address() : "",
                   0, 0);
  LogEvent("warning", "sequence_not_moved", {{"request_id", internal_id_}, {"from", source->address()},
                                             {"reason", reason}, {"resumed", resumed ? "true" : "false"},
                                             {"error", why}});
  if (resumed) return RelayState::kDecode;
  // The source ended the sequence (it drains) or is gone: replay it.
  migration_ = Migration{true, !r.ok(), absl::StrCat("not moved: ", why)};
  return RelayState::kMigrate;
}

RelayState Relay::Migrate() {
  Worker& d = *decode_;
  if (decode_reader_ != nullptr) {
    // The attempt's decode stream is still open: end it.
    DrainDecode();
    ReleaseHandoff(d);
  }
  lease_.Release();
  if (migration_.mark_failed) d.MarkFailed();
  if (migration_.exclude_decode) failed_decode_.Add(d, migration_.why);
  return RelayState::kPlace;
}

absl::Status Relay::Finish() {
  if (client_cancelled()) {
    observer_->EndedEarly("cancelled");
    return absl::CancelledError("cancelled by the client");
  }
  if (unavailable_ && completion_ == 0) {
    observer_->EndedEarly("unavailable");
    return absl::UnavailableError(error_);
  }
  // A request cut short at the client's deadline ends DEADLINE_EXCEEDED,
  // as gRPC would end it: the workers' calls carry the same deadline, so
  // the relay can see them end and finish before the call itself expires.
  if (client_deadline_.has_value() && Now() >= *client_deadline_ && (cancelled_ || finish_ == FinishReason::kNone)) {
    observer_->EndedEarly("cancelled");
    return absl::DeadlineExceededError("the client's deadline passed");
  }
  if (!relay_costs_.empty()) {
    std::sort(relay_costs_.begin(), relay_costs_.end());
    timings_.set_router_relay_p50(relay_costs_[relay_costs_.size() / 2]);
    timings_.set_router_relay_p99(
        relay_costs_[std::min(relay_costs_.size() - 1, static_cast<size_t>(0.99 * relay_costs_.size()))]);
  }
  timings_.set_mean_itl(gaps_ > 0 ? sum_itl_ / gaps_ : 0);
  timings_.set_max_itl(max_itl_);
  timings_.set_total(Between(start_, Now()));
  msg_.clear_kind();
  v1::GenerateFinal* fin = msg_.mutable_final();
  const bool ended_early = cancelled_ || finish_ == FinishReason::kNone;
  if (!error_.empty()) {
    fin->set_finish_reason(v1::FINISH_REASON_ERROR);
    fin->set_error(error_);
  } else if (ended_early) {
    fin->set_finish_reason(v1::FINISH_REASON_CANCELLED);
  } else {
    fin->set_finish_reason(rpc::ToProto(finish_));
  }
  observer_->Finished(!error_.empty()                  ? "error"
                      : ended_early                    ? "cancelled"
                      : finish_ == FinishReason::kStop ? "stop"
                                                       : "length",
                      timings_, completion_, !context_.options.colocated && !timings_.local_prefill());
  if (internal_) return absl::InternalError(error_);
  fin->mutable_usage()->set_prompt_tokens(static_cast<int32_t>(request_.prompt.size()));
  fin->mutable_usage()->set_completion_tokens(completion_);
  fin->set_seed(*request_.params.seed);
  *fin->mutable_timings() = timings_;
  (*emit_)(msg_);
  return absl::OkStatus();
}

}  // namespace pdserve::router
