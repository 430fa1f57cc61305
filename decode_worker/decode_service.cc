#include "decode_worker/decode_service.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/server_util.h"
#include "proto/convert.h"

namespace pdserve::decode {
namespace {

using worker::v1::DecodeEvent;

grpc::Status ToGrpc(const absl::Status& s) {
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// What the engine tells one Decode call: a token, or the end (status).
struct StreamEvent {
  absl::Status status;
  bool end = false;
  TokenEvent token;
  int32_t cached_tokens = 0;
};

// Events of one Decode call, filled by the engine thread.
struct Stream {
  absl::Mutex mu;
  std::deque<StreamEvent> events ABSL_GUARDED_BY(mu);
};

engine::RequestCallbacks StreamCallbacks(const std::shared_ptr<Stream>& stream) {
  engine::RequestCallbacks c;
  c.on_token = [stream](const TokenEvent& t, int32_t cached) {
    absl::MutexLock lock(&stream->mu);
    stream->events.push_back({absl::OkStatus(), false, t, cached});
  };
  c.on_end = [stream](const absl::Status& s) {
    absl::MutexLock lock(&stream->mu);
    stream->events.push_back({s, true, {}, 0});
  };
  return c;
}

}  // namespace

DecodeService::DecodeService(Model* model, KvManager* kv, const tok::Tokenizer* tokenizer,
                             DecodeServiceOptions options)
    : model_(model),
      kv_(kv),
      tokenizer_(tokenizer),
      options_(std::move(options)),
      engine_(*model, *kv, options_.engine) {
  kv_->set_listener(&kv_events_);
  engine_.Start();
  sweep_thread_ = std::thread([this] { SweepLoop(); });
}

DecodeService::~DecodeService() {
  Shutdown();
  kv_->set_listener(nullptr);
  absl::MutexLock h(&handoff_mu_);
  committed_.clear();  // Their KV goes back to the manager.
}

void DecodeService::Shutdown() {
  {
    absl::MutexLock lock(&sweep_mu_);
    if (stop_sweeping_) return;
    stop_sweeping_ = true;
  }
  if (sweep_thread_.joinable()) sweep_thread_.join();
  engine_.Stop();
  stopped_ = true;
}

void DecodeService::SweepLoop() {
  absl::MutexLock lock(&sweep_mu_);
  while (true) {
    auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(sweep_mu_) { return stop_sweeping_; };
    if (sweep_mu_.AwaitWithTimeout(absl::Condition(&stop), absl::Milliseconds(100))) return;
    sweep_mu_.Unlock();
    SweepHandoffs();
    sweep_mu_.Lock();
  }
}

void DecodeService::OnHandoffCommitted(const std::string& request_id, HandedOff seq) {
  absl::MutexLock lock(&handoff_mu_);
  seq.arrived = absl::Now();
  if (claimed_.contains(request_id) || committed_.contains(request_id)) {
    // A duplicate commit (a retried prefill): keep the first, free this one.
    LogEvent("warning", "duplicate_handoff", {{"request_id", request_id}});
    return;  // Its KV goes back with it.
  }
  committed_.emplace(request_id, std::move(seq));
}

void DecodeService::SweepHandoffs() {
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&handoff_mu_);
  for (auto it = committed_.begin(); it != committed_.end();) {
    if (now - it->second.arrived > absl::Seconds(options_.handoff_wait_seconds)) {
      LogEvent("warning", "unclaimed_handoff_freed", {{"request_id", it->first}});
      committed_.erase(it++);
    } else {
      ++it;
    }
  }
  for (auto it = claimed_.begin(); it != claimed_.end();) {
    if (now - it->second > absl::Minutes(5)) {
      claimed_.erase(it++);
    } else {
      ++it;
    }
  }
}

bool DecodeService::idle() {
  if (active_calls_.load() > 0) return false;
  const engine::EngineStats st = engine_.stats();
  if (st.running > 0 || st.waiting > 0) return false;
  absl::MutexLock lock(&handoff_mu_);
  return committed_.empty();
}

void DecodeService::Drain(absl::Time deadline) {
  draining_ = true;
  while (active_calls_.load() > 0) {
    if (absl::Now() > deadline) evict_ = true;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

grpc::Status DecodeService::Decode(grpc::ServerContext* ctx, const worker::v1::DecodeRequest* req,
                                   grpc::ServerWriter<DecodeEvent>* writer) {
  if (!healthy()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "decode engine is not running");
  if (draining_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "decode worker is draining");
  ++active_calls_;
  struct Leave {
    std::atomic<int32_t>& n;
    ~Leave() { --n; }
  } leave{active_calls_};
  const worker::v1::WorkRequest& w = req->request();
  GenerationRequest gr = rpc::FromWork(w, model_->config().eos_token_ids);
  if (gr.prompt.empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prompt_ids: empty");
  for (int32_t id : gr.prompt) {
    if (id < 0 || id >= model_->config().vocab_size) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("prompt_ids: ", id, " is outside the vocabulary"));
    }
  }
  if (absl::Status s = ValidateSamplingParams(gr.params, model_->config().vocab_size); !s.ok()) return ToGrpc(s);
  if (gr.prompt.size() + gr.params.max_tokens > static_cast<size_t>(model_->config().max_position_embeddings)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("max_tokens: prompt (", gr.prompt.size(), ") + max_tokens (", gr.params.max_tokens,
                                     ") exceeds the context (", model_->config().max_position_embeddings, ")"));
  }
  const bool logprobs = gr.params.logprobs > 0;
  if (options_.stand_in) {
    DecodeEvent ev;
    v1::TokenChunk* chunk = ev.mutable_chunk();
    chunk->add_token_ids(0);
    chunk->set_text("x");
    for (int32_t i = 0; i < gr.params.max_tokens; ++i) {
      chunk->set_token_ids(0, i % static_cast<int32_t>(model_->config().vocab_size));
      if (!writer->Write(ev)) return grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
    }
    DecodeEvent fin;
    fin.mutable_final()->set_finish_reason(v1::FINISH_REASON_LENGTH);
    fin.mutable_final()->set_completion_tokens(gr.params.max_tokens);
    writer->Write(fin);
    return grpc::Status::OK;
  }
  absl::StatusOr<std::unique_ptr<Generation>> made =
      rpc::MakeGeneration(w, model_->config().eos_token_ids, model_->config().vocab_size, tokenizer_);
  if (!made.ok()) return ToGrpc(made.status());
  std::unique_ptr<Generation> gen = *std::move(made);
  if (gen->finished()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "generated_ids: already finished");
  auto stream = std::make_shared<Stream>();
  engine::RequestId id(w.request_id().empty() ? absl::StrCat("local-", next_id_++) : w.request_id());
  const auto start = std::chrono::steady_clock::now();
  int32_t completion_tokens = 0;
  std::shared_ptr<engine::Request> request;
  if (req->prefill_here()) {
    if (!options_.allow_prefill) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "this decode worker does not prefill (--prefill-local)");
    }
    request = std::make_shared<engine::Request>(std::move(id), engine::RequestMode::kLocal, std::move(gen),
                                                StreamCallbacks(stream));
    engine_.Submit(request);
  } else {
    // Wait for the prefill worker's handoff of this request.
    HandedOff seq;
    {
      absl::MutexLock lock(&handoff_mu_);
      const std::string& rid = w.request_id();
      auto arrived = [this, &rid]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(handoff_mu_) { return committed_.contains(rid); };
      const absl::Time deadline = absl::Now() + absl::Seconds(options_.handoff_wait_seconds);
      while (!arrived()) {
        if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled while waiting for the KV handoff");
        if (evict_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "decode worker drained: continue elsewhere");
        if (absl::Now() > deadline) {
          return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                              absl::StrCat("no KV handoff for request ", rid, " within ", options_.handoff_wait_seconds, " s"));
        }
        handoff_mu_.AwaitWithTimeout(absl::Condition(&arrived), absl::Milliseconds(50));
      }
      auto node = committed_.extract(rid);
      seq = std::move(node.mapped());
      claimed_[rid] = absl::Now();
    }
    absl::StatusOr<TokenEvent> first = gen->Replay(seq.first);
    completion_tokens = 1;
    if (!first.ok() || gen->finished()) {
      seq.kv.Release();
      if (!first.ok()) return ToGrpc(first.status());
      DecodeEvent fin;
      fin.mutable_final()->set_finish_reason(rpc::ToProto(gen->finish()));
      fin.mutable_final()->set_completion_tokens(completion_tokens);
      writer->Write(fin);
      return grpc::Status::OK;
    }
    request = std::make_shared<engine::Request>(std::move(id), engine::RequestMode::kDecodeOnly, std::move(gen),
                                                StreamCallbacks(stream));
    request->kv = std::move(seq.kv);
    (void)request->lifecycle.Transition(engine::RequestState::kWaitingForKv);
    engine_.Submit(request);
  }

  double max_itl = 0, sum_itl = 0;
  int32_t gaps = 0;
  auto last = start;
  double prefill_seconds = 0;
  int32_t cached_tokens = 0;
  const bool unparseable = fault_unparseable_.Take();
  int32_t chunks_written = 0;
  while (true) {
    std::deque<StreamEvent> batch;
    {
      absl::MutexLock lock(&stream->mu);
      auto ready = [&stream]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(stream->mu) { return !stream->events.empty(); };
      stream->mu.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(100));
      std::swap(batch, stream->events);
    }
    if (ctx->IsCancelled()) {
      engine_.Cancel(request, absl::CancelledError("cancelled by the caller"));
      return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled by the caller");
    }
    if (evict_) {
      engine_.Cancel(request, absl::UnavailableError("decode worker drained: continue elsewhere"));
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "decode worker drained: continue elsewhere");
    }
    if (batch.empty()) {
      if (!healthy()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "decode engine stopped");
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    DecodeEvent out;
    v1::TokenChunk* chunk = out.mutable_chunk();
    FinishReason finish = FinishReason::kNone;
    absl::Status error;
    for (const StreamEvent& e : batch) {
      if (e.end) {
        error = e.status;  // OK: the finish came with the last token.
        break;
      }
      rpc::AppendToken(e.token, logprobs, chunk);
      ++completion_tokens;
      cached_tokens = std::max(cached_tokens, e.cached_tokens);
      if (e.token.finish != FinishReason::kNone) finish = e.token.finish;
    }
    if (chunk->token_ids_size() > 0) {
      const double gap = std::chrono::duration<double>(now - last).count();
      if (completion_tokens == chunk->token_ids_size() && req->prefill_here()) {
        prefill_seconds = gap;  // Colocated: the first batch carries the first token.
      } else {
        sum_itl += gap;
        max_itl = std::max(max_itl, gap);
        ++gaps;
      }
      last = now;
      if (unparseable && ++chunks_written == 2) chunk->mutable_text()->append("\xff");
      if (!writer->Write(out)) {
        engine_.Cancel(request, absl::CancelledError("the caller went away"));
        return grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
      }
    }
    if (!error.ok() || finish != FinishReason::kNone) {
      DecodeEvent fin;
      worker::v1::DecodeFinal* f = fin.mutable_final();
      f->set_finish_reason(error.ok() ? rpc::ToProto(finish)
                                      : (absl::IsCancelled(error) ? v1::FINISH_REASON_CANCELLED
                                                                   : v1::FINISH_REASON_ERROR));
      if (!error.ok()) f->set_error(std::string(error.message()));
      f->set_completion_tokens(completion_tokens);
      f->set_prefill_seconds(prefill_seconds);
      f->set_cached_tokens(cached_tokens);
      f->set_mean_itl(gaps > 0 ? sum_itl / gaps : 0);
      f->set_max_itl(max_itl);
      writer->Write(fin);
      return grpc::Status::OK;
    }
  }
}

grpc::Status DecodeService::Status(grpc::ServerContext*, const worker::v1::WorkerStatusRequest* req,
                                   worker::v1::WorkerInfo* out) {
  rpc::FillKvEvents(kv_events_, *req, out);
  rpc::FillPrefixHash(model_->identity(), kv_->spec().dtype, kv_->spec().block_size, out);
  const engine::EngineStats st = engine_.stats();
  v1::WorkerStatus* s = out->mutable_status();
  s->set_kv_cached_blocks(static_cast<int64_t>(kv_events_.num_cached()));
  s->set_role("decode");
  out->set_instance_id(ProcessInstanceId());
  s->set_running(st.running);
  s->set_queued(st.waiting);
  s->set_preemptions(st.preemptions);
  s->set_step_seconds(st.step_seconds_avg);
  s->set_mean_history_tokens(st.mean_history);
  s->set_steps(st.steps);
  s->set_max_batch(options_.engine.max_batch);
  s->set_kv_bytes_per_position(kv_->spec().BytesPerPosition());
  {
    const KvCounts k = kv_->Counts();  // Bookkeeping only: never waits behind a forward.
    s->set_kv_blocks_total(k.total);
    s->set_kv_block_size(k.block_size);
    s->set_kv_blocks_used(k.used);
    s->set_kv_blocks_free(k.free);
  }
  {
    absl::MutexLock lock(&handoff_mu_);
    out->set_kv_address(kv_address_);
    std::string why = !healthy() ? "decode engine is not running" : draining_ ? "draining" : unhealthy_reason_;
    s->set_healthy(why.empty());
    out->set_unhealthy_reason(std::move(why));
  }
  out->set_context_length(static_cast<int32_t>(model_->config().max_position_embeddings));
  return grpc::Status::OK;
}

}  // namespace pdserve::decode
