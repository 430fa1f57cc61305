#include "decode_worker/decode_service.h"

#include <pthread.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/grpc_status.h"
#include "base/one_write_stream.h"
#include "base/server_util.h"
#include "decode_worker/sequence_move.h"
#include "kv/tier2_store.h"
#include "proto/convert.h"

namespace pdserve::decode {
namespace {

using worker::v1::DecodeEvent;


}  // namespace

// One Decode stream. It keeps itself alive until gRPC is done with it
// (OnDone); the engine request's callbacks keep it alive after that until
// the engine lets the request go, and then find it finished.
//
// What it writes next (the buffered tokens as one chunk, the final
// message, or the finish) follows OneWriteStream's rule: decided under
// mu_, done outside it.
class DecodeCall final : public OneWriteStream<DecodeEvent>,
                         public HandoffWaiter,
                         public std::enable_shared_from_this<DecodeCall> {
 public:
  struct Options {
    bool colocated = false;
    bool logprobs = false;
    bool unparseable = false;  // Fault tests: the second chunk's text is not UTF-8.
    int32_t max_buffered_tokens = 4096;
    absl::Duration stall_timeout = absl::Seconds(10);
  };

  static std::shared_ptr<DecodeCall> Create(DecodeService* service, grpc::CallbackServerContext* ctx,
                                            Options options) {
    std::shared_ptr<DecodeCall> call(new DecodeCall(service, ctx, options));
    call->self_ = call;
    return call;
  }

  // Ends the call before anything was written, with `status`.
  void Reject(const grpc::Status& status) { Abort(status, /*cancel_rpc=*/false); }

  void set_request(std::shared_ptr<engine::Request> r) {
    absl::MutexLock lock(&mu_);
    request_ = std::move(r);
  }
  std::shared_ptr<engine::Request> request() {
    absl::MutexLock lock(&mu_);
    return request_;
  }
  bool aborted() {
    absl::MutexLock lock(&mu_);
    return abort_.has_value();
  }
  // Positions the sequence holds: its prompt and the tokens sampled so far.
  int64_t ContextTokens() {
    absl::MutexLock lock(&mu_);
    if (request_ == nullptr) return 0;
    return static_cast<int64_t>(request_->gen->request().prompt.size()) + completion_tokens_;
  }
  // The sequence is paused for a move: after every token buffered, the
  // stream says so (MovePoint).
  void MarkPaused(int32_t generated, const std::string& reason) {
    bool kick;
    {
      absl::MutexLock lock(&mu_);
      if (finishing()) return;
      move_point_ = {generated, reason};
      move_point_sent_ = false;
      kick = NeedsKickLocked();
    }
    if (kick) service_->Kick(shared_from_this());
  }
  // It resumes here (a MovePoint not yet written is not written).
  void ClearPaused() {
    absl::MutexLock lock(&mu_);
    move_point_.reset();
  }
  // The target committed its KV: the stream is over here. It ends OK
  // without a final message, which the router reads as the move's end.
  void EndMoved() { Abort(grpc::Status::OK, /*cancel_rpc=*/false); }

  // The disaggregated call counts the prefill worker's first token.
  void CountFirstToken() {
    absl::MutexLock lock(&mu_);
    completion_tokens_ = 1;
  }

  engine::RequestCallbacks Callbacks() {
    engine::RequestCallbacks c;
    std::shared_ptr<DecodeCall> self = shared_from_this();
    c.on_token = [self](const TokenEvent& t, int32_t cached) { self->OnToken(t, cached); };
    c.on_end = [self](const absl::Status& s) { self->OnEnd(s); };
    return c;
  }

  // The request ended without the engine (its replayed first token
  // finished it): the final message, then OK.
  void EndHere(FinishReason finish) {
    Action a;
    {
      absl::MutexLock lock(&mu_);
      final_finish_ = finish;
      end_ = absl::OkStatus();
      a = NextLocked();
    }
    Do(a);
  }

  // The benchmark stand-in: max_tokens one-token chunks, then the final.
  void StandIn(int32_t max_tokens, int64_t vocab) {
    Action a;
    {
      absl::MutexLock lock(&mu_);
      one_token_per_chunk_ = true;
      for (int32_t i = 0; i < max_tokens; ++i) {
        TokenEvent t;
        t.token = static_cast<int32_t>(i % vocab);
        t.text = "x";
        pending_.push_back(std::move(t));
      }
      completion_tokens_ = max_tokens;
      final_finish_ = FinishReason::kLength;
      end_ = absl::OkStatus();
      a = NextLocked();
    }
    Do(a);
  }

  // The handoff table: this call's KV came.
  void OnHandoff(HandedOff seq) override { service_->StartHandedOff(shared_from_this(), std::move(seq)); }

  // The handoff table: this call's KV will not come.
  void OnNoHandoff(NoHandoff why) override {
    switch (why) {
      case NoHandoff::kTimedOut: {
        std::shared_ptr<engine::Request> r = request();
        if (r == nullptr || !r->lifecycle.Transition(engine::RequestState::kFinished, engine::EndReason::kError).ok()) {
          return;  // It ended otherwise meanwhile.
        }
        Abort(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                           absl::StrCat("no KV handoff for request ", r->id.str(), " within ",
                                        absl::FormatDuration(service_->handoff_wait()))),
              false);
        return;
      }
      case NoHandoff::kReleased:
        // The router ended this call already; this one missed that.
        Abort(grpc::Status(grpc::StatusCode::CANCELLED, "released by the router"), /*cancel_rpc=*/true);
        return;
      case NoHandoff::kDisplaced:
        Abort(grpc::Status(grpc::StatusCode::CANCELLED, "a newer Decode call took this request"), false);
        return;
    }
  }

  // Ends the stream with `status` and no final message (UNAVAILABLE: the
  // router continues elsewhere; DEADLINE_EXCEEDED: its KV never came;
  // CANCELLED: its client stopped reading), after the write in flight if
  // any; with cancel_rpc the RPC is cancelled too, so that a write the
  // client will never take completes. Its request leaves the engine.
  void Abort(const grpc::Status& status, bool cancel_rpc) {
    std::shared_ptr<engine::Request> cancel;
    std::shared_ptr<engine::Request> parked;  // Waiting for its KV in the handoff table.
    Action a;
    {
      absl::MutexLock lock(&mu_);
      if (finish_called() || abort_.has_value()) return;
      abort_ = status;
      if (!end_.has_value()) cancel = request_;
      if (request_ != nullptr && request_->lifecycle.state() == engine::RequestState::kWaitingForKv) parked = request_;
      a = NextLocked();
    }
    // A commit that still comes for it is freed on arrival.
    if (parked != nullptr) service_->handoffs_.CallEnded(parked->id, this);
    if (cancel != nullptr) service_->engine_.Cancel(cancel, FromGrpcStatus(status));
    if (cancel_rpc) ctx_->TryCancel();
    Do(a);
  }

  void OnWriteDone(bool ok) override {
    std::shared_ptr<engine::Request> cancel;
    Action a;
    {
      absl::MutexLock lock(&mu_);
      WriteDoneLocked();
      if (!ok && !abort_.has_value()) {
        abort_ = grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
        if (!end_.has_value()) cancel = request_;
      }
      a = NextLocked();
    }
    if (cancel != nullptr) service_->engine_.Cancel(cancel, absl::CancelledError("the caller went away"));
    Do(a);
  }

  // On the writer thread: starts what is due (the engine's thread only
  // buffers, so that its steps never wait for a socket).
  void Pump() {
    Action a;
    {
      absl::MutexLock lock(&mu_);
      kick_queued_ = false;
      a = NextLocked();
    }
    Do(a);
  }

  // A write has been outstanding for stall_timeout: the client is not
  // reading (its flow-control window stays full).
  // The call's one stall entry came due: a write still outstanding since
  // before the deadline is stalled; a later one moves the entry on.
  void OnStallDeadline() {
    {
      absl::MutexLock lock(&mu_);
      stall_timer_ = 0;
      if (!writing() || finishing()) return;  // the next write arms it again
      const absl::Time deadline = write_started_ + options_.stall_timeout;
      if (service_->timer_.Now() < deadline) {
        ArmStallLocked(deadline);
        return;
      }
    }
    service_->stalled_streams_.fetch_add(1);
    LogEvent("warning", "stream_stalled", {{"request_id", RequestIdForLog()}, {"why", "write stalled"}});
    Abort(grpc::Status(grpc::StatusCode::CANCELLED,
                       absl::StrFormat("the client stopped reading (no write completed for %s)",
                                       absl::FormatDuration(options_.stall_timeout))),
          /*cancel_rpc=*/true);
  }

  void OnCancel() override {
    Abort(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the caller"), /*cancel_rpc=*/false);
  }

  void OnDone() override {
    std::shared_ptr<engine::Request> r;
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      r = std::move(request_);  // The engine may still hold it (and us) a little longer.
      service_->timer_.Cancel(stall_timer_);
      stall_timer_ = 0;
    }
    r.reset();
    service_->Forget(this);
    self_.reset();  // May destroy this.
  }

 private:
  DecodeCall(DecodeService* service, grpc::CallbackServerContext* ctx, Options options)
      : service_(service), ctx_(ctx), options_(options), start_(absl::Now()), last_(start_) {}

  bool finishing() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return finish_called() || abort_.has_value(); }

  void OnToken(const TokenEvent& t, int32_t cached) {
    bool overflow = false;
    bool kick = false;
    bool pause = false;
    {
      absl::MutexLock lock(&mu_);
      if (finishing()) return;
      // The engine's thread: the Generation is its own.
      const int32_t fault_at = service_->options_.fault_move_at_token;
      pause = fault_at > 0 && t.finish == FinishReason::kNone && request_ != nullptr &&
              static_cast<int32_t>(request_->gen->generated().size()) == fault_at;
      const absl::Time now = absl::Now();
      const double gap = absl::ToDoubleSeconds(now - last_);
      if (options_.colocated && completion_tokens_ == 0) {
        prefill_seconds_ = gap;  // Colocated: the first token ends the prefill.
      } else {
        sum_itl_ += gap;
        max_itl_ = std::max(max_itl_, gap);
        ++gaps_;
      }
      last_ = now;
      ++completion_tokens_;
      cached_tokens_ = std::max(cached_tokens_, cached);
      if (t.finish != FinishReason::kNone) final_finish_ = t.finish;
      pending_.push_back(t);
      overflow = static_cast<int32_t>(pending_.size()) > options_.max_buffered_tokens;
      kick = !overflow && NeedsKickLocked();
    }
    if (kick) service_->Kick(shared_from_this());
    if (pause) service_->RequestPause(shared_from_this(), "rebalance");
    if (overflow) {
      service_->stalled_streams_.fetch_add(1);
      LogEvent("warning", "stream_stalled", {{"request_id", RequestIdForLog()}, {"why", "buffer full"}});
      Abort(grpc::Status(grpc::StatusCode::CANCELLED,
                         absl::StrCat("the client stopped reading (", options_.max_buffered_tokens,
                                      " tokens buffered)")),
            /*cancel_rpc=*/true);
      return;
    }
  }

  void OnEnd(const absl::Status& s) {
    bool kick;
    {
      absl::MutexLock lock(&mu_);
      end_ = s;
      kick = NeedsKickLocked();
    }
    if (kick) service_->Kick(shared_from_this());
  }

  // Whether the writer thread must look at this call: nothing is being
  // written, and it was not asked to look already.
  bool NeedsKickLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (busy() || done_ || kick_queued_) return false;
    kick_queued_ = true;
    return true;
  }

  std::string RequestIdForLog() {
    absl::MutexLock lock(&mu_);
    return request_ != nullptr ? request_->id.str() : "";
  }

  Action NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (busy() || done_) return {};
    if (abort_.has_value()) return FinishLocked(*abort_);
    if (!pending_.empty()) {
      out_.Clear();
      v1::TokenChunk* chunk = out_.mutable_chunk();
      const size_t n = one_token_per_chunk_ ? 1 : pending_.size();
      for (size_t i = 0; i < n; ++i) rpc::AppendToken(pending_[i], options_.logprobs, chunk);
      pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(n));
      if (options_.unparseable && ++chunks_written_ == 2) chunk->mutable_text()->append("\xff");
      return StartWriteLocked();
    }
    if (move_point_.has_value() && !move_point_sent_) {
      out_.Clear();
      worker::v1::MovePoint* m = out_.mutable_paused();
      m->set_generated(move_point_->first);
      m->set_reason(move_point_->second);
      move_point_sent_ = true;
      return StartWriteLocked();
    }
    if (!end_.has_value()) return {};
    if (final_sent_) return FinishLocked(grpc::Status::OK);
    // Ended by the engine: UNAVAILABLE (stopping) and CANCELLED end the
    // RPC with that status (the router continues elsewhere, or nobody
    // listens); anything else is the request's own end, in a final message.
    if (absl::IsUnavailable(*end_) || absl::IsCancelled(*end_)) return FinishLocked(ToGrpcStatus(*end_));
    out_.Clear();
    worker::v1::DecodeFinal* f = out_.mutable_final();
    f->set_finish_reason(end_->ok() ? rpc::ToProto(final_finish_) : v1::FINISH_REASON_ERROR);
    if (!end_->ok()) f->set_error(std::string(end_->message()));
    f->set_completion_tokens(completion_tokens_);
    f->set_prefill_seconds(prefill_seconds_);
    f->set_cached_tokens(cached_tokens_);
    f->set_mean_itl(gaps_ > 0 ? sum_itl_ / gaps_ : 0);
    f->set_max_itl(max_itl_);
    final_sent_ = true;
    return StartWriteLocked();
  }

  // A write, with its own stall deadline.
  // A write costs a clock read: the call keeps one timer entry, armed at
  // its first write and moved on when it comes due while writes complete,
  // instead of an entry scheduled and cancelled for every message.
  Action StartWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    write_started_ = service_->timer_.Now();
    if (stall_timer_ == 0) ArmStallLocked(write_started_ + options_.stall_timeout);
    return WriteLocked();
  }
  void ArmStallLocked(absl::Time when) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::weak_ptr<DecodeCall> weak = weak_from_this();
    stall_timer_ = service_->timer_.At(when, [weak] {
      if (std::shared_ptr<DecodeCall> c = weak.lock()) c->OnStallDeadline();
    });
  }

  DecodeService* const service_;
  grpc::CallbackServerContext* const ctx_;
  const Options options_;
  const absl::Time start_;
  std::shared_ptr<DecodeCall> self_;

  std::shared_ptr<engine::Request> request_ ABSL_GUARDED_BY(mu_);
  std::vector<TokenEvent> pending_ ABSL_GUARDED_BY(mu_);
  absl::Time write_started_ ABSL_GUARDED_BY(mu_);   // The latest write's start.
  Timer::Id stall_timer_ ABSL_GUARDED_BY(mu_) = 0;  // The call's stall entry (0: none).
  std::optional<absl::Status> end_ ABSL_GUARDED_BY(mu_);     // From the engine (or EndHere).
  std::optional<grpc::Status> abort_ ABSL_GUARDED_BY(mu_);   // Ends the RPC with this.
  bool final_sent_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<std::pair<int32_t, std::string>> move_point_ ABSL_GUARDED_BY(mu_);  // generated, reason
  bool move_point_sent_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool one_token_per_chunk_ ABSL_GUARDED_BY(mu_) = false;
  bool kick_queued_ ABSL_GUARDED_BY(mu_) = false;
  int32_t chunks_written_ ABSL_GUARDED_BY(mu_) = 0;
  // What the final message reports.
  FinishReason final_finish_ ABSL_GUARDED_BY(mu_) = FinishReason::kNone;
  int32_t completion_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t cached_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  double prefill_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double sum_itl_ ABSL_GUARDED_BY(mu_) = 0, max_itl_ ABSL_GUARDED_BY(mu_) = 0;
  int32_t gaps_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_ ABSL_GUARDED_BY(mu_);
};

DecodeService::DecodeService(Model* model, KvManager* kv, const tok::Tokenizer* tokenizer,
                             DecodeServiceOptions options)
    : model_(model),
      kv_(kv),
      tokenizer_(tokenizer),
      grammars_(tokenizer == nullptr ? nullptr
                                     : std::make_unique<grammar::GrammarCache>(options.grammar, [tokenizer] {
                                         return grammar::Vocabulary::FromTokenizer(*tokenizer);
                                       })),
      options_(std::move(options)),
      engine_(*model, *kv, options_.engine),
      handoffs_(&timer_, HandoffTableOptions{.wait = absl::Seconds(options_.handoff_wait_seconds)}) {
  // With a second tier, the router follows both tiers as one.
  if (options_.engine.tier2 != nullptr) {
    tiered_events_ = std::make_unique<TieredListener>(&kv_events_);
    kv_->set_listener(tiered_events_->pool());
    options_.engine.tier2->set_listener(tiered_events_->tier2());
  } else {
    kv_->set_listener(&kv_events_);
  }
  engine_.Start();
  writer_thread_ = std::thread([this] { WriterLoop(); });
  if (options_.mover != nullptr) mover_thread_ = std::thread([this] { MoverLoop(); });
}

void DecodeService::Kick(std::shared_ptr<DecodeCall> call) {
  absl::MutexLock lock(&writer_mu_);
  kicks_.push_back(std::move(call));
}

void DecodeService::WriterLoop() {
  pthread_setname_np(pthread_self(), "stream-writer");
  std::vector<std::shared_ptr<DecodeCall>> batch;
  while (true) {
    {
      absl::MutexLock lock(&writer_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(writer_mu_) { return !kicks_.empty() || stop_writer_; };
      writer_mu_.Await(absl::Condition(&ready));
      if (kicks_.empty()) return;  // Stopping, and nothing left to start.
      batch.swap(kicks_);
    }
    for (auto& c : batch) c->Pump();
    batch.clear();
  }
}

DecodeService::~DecodeService() {
  Shutdown();
  kv_->set_listener(nullptr);
  if (options_.engine.tier2 != nullptr) options_.engine.tier2->set_listener(nullptr);
  // Committed handoffs' KV goes back to the manager with handoffs_.
}

void DecodeService::Shutdown() {
  if (shut_down_.exchange(true)) return;
  timer_.Stop();  // No deadline runs from here on.
  stopped_ = true;
  engine_.Stop();  // Running streams end with UNAVAILABLE.
  {
    absl::MutexLock lock(&writer_mu_);
    stop_writer_ = true;
  }
  if (writer_thread_.joinable()) writer_thread_.join();
  {
    absl::MutexLock lock(&move_mu_);
    stop_mover_ = true;
  }
  if (mover_thread_.joinable()) mover_thread_.join();
  {
    // Paused sequences' KV goes back; their calls end below.
    absl::flat_hash_map<std::string, Paused> paused;
    {
      absl::MutexLock lock(&move_mu_);
      paused.swap(paused_);
    }
  }
  std::vector<std::shared_ptr<DecodeCall>> calls;
  {
    absl::MutexLock lock(&calls_mu_);
    for (const auto& [p, c] : calls_) calls.push_back(c);
  }
  for (auto& c : calls) c->Abort(grpc::Status(grpc::StatusCode::UNAVAILABLE, "decode worker stopped"), false);
}

void DecodeService::Forget(DecodeCall* call) {
  absl::MutexLock lock(&calls_mu_);
  calls_.erase(call);
}

void DecodeService::OnHandoffCommitted(const std::string& request_id, HandedOff seq) {
  seq.arrived = absl::Now();
  (void)handoffs_.Commit(engine::RequestId(request_id), std::move(seq));
}

void DecodeService::StartHandedOff(const std::shared_ptr<DecodeCall>& call, HandedOff seq) {
  std::shared_ptr<engine::Request> r = call->request();
  // The call ended while its KV was on the way (cancelled, timed out): the
  // KV goes back with `seq`.
  if (r == nullptr || r->lifecycle.state() != engine::RequestState::kWaitingForKv || call->aborted()) return;
  absl::StatusOr<TokenEvent> first = r->gen->Replay(seq.first);
  // The response format's state is part of the sampling state: the sender
  // says where its matcher stands, and the replay here must stand there too.
  const GenerationRequest& q = r->gen->request();
  const uint64_t hash = q.constraint != nullptr ? q.constraint->spec.hash : 0;
  if (first.ok() && (seq.grammar_hash != hash || seq.grammar_digest != r->gen->grammar_digest())) {
    first = absl::InternalError(absl::StrCat("response format: the handoff's state (format ", seq.grammar_hash,
                                             ", state ", seq.grammar_digest, ") is not this worker's (format ", hash,
                                             ", state ", r->gen->grammar_digest(), ")"));
  }
  if (!first.ok()) {
    (void)r->lifecycle.Transition(engine::RequestState::kFinished, engine::EndReason::kError);
    call->Abort(ToGrpcStatus(first.status()), false);
    return;
  }
  if (r->gen->finished()) {
    (void)r->lifecycle.Transition(engine::RequestState::kFinished, engine::EndReasonFor(r->gen->finish()));
    call->EndHere(r->gen->finish());
    return;
  }
  r->kv = std::move(seq.kv);
  r->kv_check = std::move(seq.check);
  engine_.Submit(r);
  // A cancel that came while this was starting found the request not yet
  // in the engine: send it again.
  if (call->aborted()) engine_.Cancel(r, absl::CancelledError("cancelled by the caller"));
}

bool DecodeService::idle() {
  {
    absl::MutexLock lock(&calls_mu_);
    if (!calls_.empty()) return false;
  }
  const engine::EngineStats st = engine_.stats();
  if (st.running > 0 || st.waiting > 0) return false;
  return handoffs_.parked_kv() == 0;
}

void DecodeService::Drain(absl::Time deadline) {
  draining_ = true;
  if (options_.mover != nullptr) MoveAllOut(deadline);
  auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) { return calls_.empty(); };
  std::vector<std::shared_ptr<DecodeCall>> calls;
  {
    absl::MutexLock lock(&calls_mu_);
    if (calls_mu_.AwaitWithDeadline(absl::Condition(&none), deadline)) return;
    for (const auto& [p, c] : calls_) calls.push_back(c);
  }
  // Past the grace period: what still runs continues elsewhere.
  {
    absl::MutexLock lock(&move_mu_);
    move_counts_.drain_replayed += static_cast<int64_t>(calls.size());
  }
  for (auto& c : calls) {
    c->Abort(grpc::Status(grpc::StatusCode::UNAVAILABLE, "decode worker drained: continue elsewhere"), false);
  }
  {
    absl::MutexLock lock(&calls_mu_);
    if (calls_mu_.AwaitWithTimeout(absl::Condition(&none), absl::Seconds(5))) return;
    for (const auto& [p, c] : calls_) calls.push_back(c);
  }
  // A write its client never takes: cancel the RPC.
  for (auto& c : calls) c->Abort(grpc::Status(grpc::StatusCode::UNAVAILABLE, "decode worker drained"), true);
}

grpc::ServerWriteReactor<DecodeEvent>* DecodeService::Decode(grpc::CallbackServerContext* ctx,
                                                              const worker::v1::DecodeRequest* req) {
  const worker::v1::WorkRequest& w = req->request();
  DecodeCall::Options co;
  co.colocated = req->prefill_here();
  co.logprobs = w.logprobs() > 0;
  co.max_buffered_tokens = options_.max_buffered_tokens;
  co.stall_timeout = absl::Seconds(options_.stall_timeout_seconds);
  co.unparseable = !options_.stand_in && fault_unparseable_.Take();
  std::shared_ptr<DecodeCall> call = DecodeCall::Create(this, ctx, co);
  auto reject = [&call](grpc::StatusCode code, std::string why) {
    call->Reject(grpc::Status(code, std::move(why)));
    return call.get();
  };
  if (!healthy()) return reject(grpc::StatusCode::UNAVAILABLE, "decode engine is not running");
  if (draining_) return reject(grpc::StatusCode::UNAVAILABLE, "decode worker is draining");
  absl::StatusOr<std::unique_ptr<Generation>> made =
      rpc::AcceptWork(w, {.eos_ids = model_->config().eos_token_ids,
                          .vocab_size = model_->config().vocab_size,
                          .max_positions = model_->config().max_position_embeddings,
                          .tokenizer = tokenizer_, .grammars = grammars_.get()});
  if (!made.ok()) {
    call->Reject(ToGrpcStatus(made.status()));
    return call.get();
  }
  {
    absl::MutexLock lock(&calls_mu_);
    calls_.emplace(call.get(), call);
  }
  if (options_.stand_in) {
    call->StandIn((*made)->request().params.max_tokens, model_->config().vocab_size);
    return call.get();
  }
  engine::RequestId id(w.request_id().empty() ? absl::StrCat("local-", next_id_++) : w.request_id());

  if (req->prefill_here()) {
    if (!options_.allow_prefill) {
      return reject(grpc::StatusCode::FAILED_PRECONDITION, "this decode worker does not prefill (--prefill-local)");
    }
    auto r = std::make_shared<engine::Request>(std::move(id), engine::RequestMode::kLocal, *std::move(made),
                                               call->Callbacks());
    call->set_request(r);
    engine_.Submit(std::move(r));
    return call.get();
  }

  // Disaggregated: meet the prefill worker's handoff of this request.
  if (fault_lose_call_.Take()) {
    // As if the caller had cancelled the call before it ran here.
    return reject(grpc::StatusCode::CANCELLED, "fault: the Decode call was lost before it ran");
  }
  auto r = std::make_shared<engine::Request>(id, engine::RequestMode::kDecodeOnly, *std::move(made), call->Callbacks());
  (void)r->lifecycle.Transition(engine::RequestState::kWaitingForKv);
  call->set_request(r);
  call->CountFirstToken();
  const HandoffTable::CallOutcome met = handoffs_.Call(r->id, call);
  if (met == HandoffTable::CallOutcome::kReleased || met == HandoffTable::CallOutcome::kTaken) {
    (void)r->lifecycle.Transition(engine::RequestState::kFinished, engine::EndReason::kError);
    call->Abort(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                             met == HandoffTable::CallOutcome::kReleased
                                 ? absl::StrCat("request ", r->id.str(), " was released by the router")
                                 : absl::StrCat("request ", r->id.str(), "'s KV was taken by an earlier Decode call")),
                false);
  } else if (met == HandoffTable::CallOutcome::kParked && call->aborted()) {
    // Cancelled before it was in the table: a commit that comes is freed.
    handoffs_.CallEnded(r->id, call.get());
  }
  return call.get();
}

grpc::ServerUnaryReactor* DecodeService::Release(grpc::CallbackServerContext* ctx,
                                                 const worker::v1::ReleaseRequest* req,
                                                 worker::v1::ReleaseResponse* out) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (req->request_id().empty()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "request_id: empty"));
    return reactor;
  }
  out->set_freed(handoffs_.Release(engine::RequestId(req->request_id())));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* DecodeService::Status(grpc::CallbackServerContext* ctx,
                                                const worker::v1::WorkerStatusRequest* req,
                                                worker::v1::WorkerInfo* out) {
  rpc::FillKvEvents(kv_events_, *req, out);
  rpc::FillPrefixHash(model_->identity(), kv_->spec().dtype, kv_->spec().block_size, out);
  const engine::EngineStats st = engine_.stats();
  v1::WorkerStatus* s = out->mutable_status();
  s->set_kv_cached_blocks(static_cast<int64_t>(kv_events_.num_cached()));
  s->set_kv_checksum_failures(st.kv_checksum_failures);
  {
    // The prefix cache by tier.
    s->set_kv_prefix_hit_blocks(kv_->Counts().prefix.hit_blocks);
    if (options_.engine.tier2 != nullptr) {
      const Tier2Stats t2 = options_.engine.tier2->Stats();
      s->set_kv_tier2_restored_blocks(t2.restored_blocks);
      s->set_kv_tier2_bytes(t2.bytes);
      s->set_kv_tier2_capacity_bytes(t2.capacity_bytes);
      s->set_kv_tier2_blocks(t2.blocks);
      s->set_kv_checksum_failures(s->kv_checksum_failures() + t2.checksum_failures);
    }
  }
  s->set_role("decode");
  s->set_kernels(model_->backend().Name());
  out->set_instance_id(ProcessInstanceId());
  s->set_running(st.running);
  s->set_queued(st.waiting);
  s->set_preemptions(st.preemptions);
  s->set_step_seconds(st.step_seconds_avg);
  s->set_mean_history_tokens(st.mean_history);
  s->set_steps(st.steps);
  s->set_busy_seconds(st.busy_seconds);
  s->set_decode_tokens(st.decode_tokens);
  s->set_oldest_request_seconds(st.oldest_request_seconds);
  s->set_requests_expired(st.expired);
  s->set_max_batch(options_.engine.max_batch);
  s->set_kv_bytes_per_position(kv_->spec().BytesPerPosition() * kv_->spec().num_ranks);
  s->set_kv_bytes_per_position_per_rank(kv_->spec().BytesPerPosition());
  s->set_tp(model_->tp());
  for (int32_t rows : st.rank_rows) s->add_rank_rows(rows);
  {
    const KvCounts k = kv_->Counts();  // Bookkeeping only: never waits behind a forward.
    s->set_kv_blocks_total(k.total);
    s->set_kv_block_size(k.block_size);
    s->set_kv_blocks_used(k.used);
    s->set_kv_blocks_free(k.free);
  }
  {
    absl::MutexLock lock(&info_mu_);
    out->set_kv_address(kv_address_);
    std::string why = !healthy() ? (engine_.failed() ? absl::StrCat("decode engine stopped: ", engine_.failure().message())
                                                     : "decode engine is not running")
                      : draining_ ? "draining"
                                  : unhealthy_reason_;
    s->set_healthy(why.empty());
    out->set_unhealthy_reason(std::move(why));
  }
  out->set_context_length(static_cast<int32_t>(model_->config().max_position_embeddings));
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

// --- Moves ------------------------------------------------------------------

bool DecodeService::RequestPause(const std::shared_ptr<DecodeCall>& call, const std::string& reason) {
  if (options_.mover == nullptr || call->aborted()) return false;
  std::shared_ptr<engine::Request> r = call->request();
  if (r == nullptr || r->lifecycle.state() != engine::RequestState::kDecoding) return false;
  const std::string id = r->id.str();
  {
    absl::MutexLock lock(&move_mu_);
    if (paused_.contains(id) || !pausing_.insert(id).second) return false;
    settled_.erase(id);
  }
  engine_.Pause(r, [this, call, r, reason](bool out) { OnPaused(call, r, reason, out); });
  return true;
}

void DecodeService::OnPaused(const std::shared_ptr<DecodeCall>& call, const std::shared_ptr<engine::Request>& r,
                             const std::string& reason, bool out) {
  const std::string id = r->id.str();
  uint64_t serial = 0;
  {
    absl::MutexLock lock(&move_mu_);
    pausing_.erase(id);
    if (!out) {
      Settle(id, false);
      return;
    }
    serial = ++next_pause_;
    paused_[id] = Paused{call, r, reason, serial};
  }
  // The engine's thread: the sequence's Generation is still its own here.
  call->MarkPaused(static_cast<int32_t>(r->gen->generated().size()), reason);
  timer_.At(timer_.Now() + absl::Seconds(options_.move_wait_seconds),
            [this, id, serial] { PauseTimedOut(id, serial); });
}

void DecodeService::Settle(const std::string& id, bool moved) {
  if (draining_) settled_[id] = moved;
}

void DecodeService::PauseTimedOut(const std::string& id, uint64_t serial) {
  Paused p;
  {
    absl::MutexLock lock(&move_mu_);
    auto it = paused_.find(id);
    if (it == paused_.end() || it->second.serial != serial) return;
    p = std::move(it->second);
    paused_.erase(it);
  }
  ResumeOrEnd(std::move(p), absl::StrCat("no move within ", options_.move_wait_seconds, " s"));
}

bool DecodeService::ResumeOrEnd(Paused p, const std::string& why) {
  const std::string id = p.request->id.str();
  LogEvent("warning", "sequence_not_moved", {{"request_id", id}, {"reason", p.reason}, {"why", why}});
  const bool ended = p.call->aborted() || draining_ || stopped_;
  {
    absl::MutexLock lock(&move_mu_);
    ++move_counts_.failed;
    if (draining_) ++move_counts_.drain_replayed;
    Settle(id, false);
  }
  if (ended) {
    (void)p.request->lifecycle.Transition(engine::RequestState::kFinished, engine::EndReason::kError);
    p.request->kv.Release();
    p.call->Abort(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                               absl::StrCat("decode worker drained: continue elsewhere (not moved: ", why, ")")),
                  false);
    return false;
  }
  p.call->ClearPaused();
  std::shared_ptr<engine::Request> r = p.request;
  engine_.Resume(r);
  // A cancel that came while it was out found it nowhere: send it again.
  if (p.call->aborted()) engine_.Cancel(r, absl::CancelledError("cancelled by the caller"));
  return true;
}

grpc::ServerUnaryReactor* DecodeService::PauseSequence(grpc::CallbackServerContext* ctx,
                                                       const worker::v1::PauseSequenceRequest* req,
                                                       worker::v1::PauseSequenceResponse* out) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::shared_ptr<DecodeCall> call;
  {
    absl::MutexLock lock(&calls_mu_);
    for (const auto& [p, c] : calls_) {
      std::shared_ptr<engine::Request> r = c->request();
      if (r != nullptr && r->id.str() == req->request_id()) call = c;
    }
  }
  out->set_pausing(call != nullptr && RequestPause(call, req->reason().empty() ? "rebalance" : req->reason()));
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* DecodeService::MoveSequence(grpc::CallbackServerContext* ctx,
                                                      const worker::v1::MoveSequenceRequest* req,
                                                      worker::v1::MoveSequenceResponse* out) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  if (options_.mover == nullptr) {
    out->set_error("this decode worker does not move sequences");
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  absl::MutexLock lock(&move_mu_);
  if (stop_mover_) {
    reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "decode worker stopped"));
    return reactor;
  }
  move_jobs_.push_back({req, out, reactor});
  return reactor;
}

void DecodeService::MoverLoop() {
  pthread_setname_np(pthread_self(), "seq-mover");
  while (true) {
    MoveJob job;
    {
      absl::MutexLock lock(&move_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(move_mu_) { return stop_mover_ || !move_jobs_.empty(); };
      move_mu_.Await(absl::Condition(&ready));
      if (move_jobs_.empty()) return;
      if (stop_mover_) {
        for (MoveJob& j : move_jobs_) j.reactor->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "decode worker stopped"));
        move_jobs_.clear();
        return;
      }
      job = move_jobs_.front();
      move_jobs_.pop_front();
    }
    RunMove(*job.req, job.out);
    job.reactor->Finish(grpc::Status::OK);
  }
}

void DecodeService::RunMove(const worker::v1::MoveSequenceRequest& req, worker::v1::MoveSequenceResponse* out) {
  std::optional<Paused> found;
  {
    absl::MutexLock lock(&move_mu_);
    if (auto it = paused_.find(req.request_id()); it != paused_.end()) {
      found = std::move(it->second);
      paused_.erase(it);
    }
  }
  if (!found.has_value()) {
    // Its wait ran out (it resumed, or ended), or it never paused here.
    out->set_error(absl::StrCat("request ", req.request_id(), " is not paused here"));
    std::shared_ptr<DecodeCall> call;
    {
      absl::MutexLock lock(&calls_mu_);
      for (const auto& [p, c] : calls_) {
        std::shared_ptr<engine::Request> r = c->request();
        if (r != nullptr && r->id.str() == req.request_id()) call = c;
      }
    }
    out->set_resumed(call != nullptr && !call->aborted());
    return;
  }
  Paused p = *std::move(found);
  if (req.target_kv_address().empty()) {
    out->set_error("no decode worker to move to");
    out->set_resumed(ResumeOrEnd(std::move(p), out->error()));
    return;
  }
  if (p.call->aborted()) {
    out->set_error("the stream ended");
    out->set_resumed(ResumeOrEnd(std::move(p), out->error()));
    return;
  }
  if (options_.fault_stall_move_ms > 0) absl::SleepFor(absl::Milliseconds(options_.fault_stall_move_ms));
  absl::StatusOr<SentSequence> sent = SendSequence(move_connections_, kv_->spec(), *p.request, req);
  if (!sent.ok()) {
    out->set_error(std::string(sent.status().message()));
    out->set_resumed(ResumeOrEnd(std::move(p), out->error()));
    return;
  }
  (void)p.request->lifecycle.Transition(engine::RequestState::kFinished, engine::EndReason::kHandedOff);
  p.request->kv.Release();
  p.call->EndMoved();
  {
    absl::MutexLock lock(&move_mu_);
    ++move_counts_.moved;
    if (draining_) ++move_counts_.drain_moved;
    Settle(req.request_id(), true);
  }
  out->set_moved(true);
  out->set_positions(sent->positions);
  out->set_sent_positions(sent->sent_positions);
  out->set_bytes(sent->bytes);
  out->set_seconds(sent->seconds);
  LogEvent("info", "sequence_moved", {{"request_id", req.request_id()},
                                      {"to", req.target_kv_address()},
                                      {"reason", p.reason},
                                      {"positions", absl::StrCat(sent->positions)},
                                      {"bytes", absl::StrCat(sent->bytes)},
                                      {"seconds", absl::StrFormat("%.4f", sent->seconds)}});
}

void DecodeService::MoveAllOut(absl::Time deadline) {
  absl::flat_hash_set<const DecodeCall*> asked;
  while (absl::Now() < deadline) {
    std::shared_ptr<DecodeCall> next;
    int64_t longest = -1;
    {
      absl::MutexLock lock(&calls_mu_);
      for (const auto& [p, c] : calls_) {
        if (asked.contains(p) || c->aborted()) continue;
        if (const int64_t n = c->ContextTokens(); n > longest) {
          longest = n;
          next = c;
        }
      }
    }
    if (next == nullptr) return;
    asked.insert(next.get());
    std::shared_ptr<engine::Request> r = next->request();
    if (r == nullptr || !RequestPause(next, "drain")) continue;
    const std::string id = r->id.str();
    absl::MutexLock lock(&move_mu_);
    auto settled = [this, &id]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(move_mu_) { return settled_.contains(id); };
    move_mu_.AwaitWithDeadline(absl::Condition(&settled), deadline);
    settled_.erase(id);
  }
}

MoveCounts DecodeService::move_counts() const {
  absl::MutexLock lock(&move_mu_);
  return move_counts_;
}

}  // namespace pdserve::decode
