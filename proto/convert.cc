#include "proto/convert.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace pdserve::rpc {

GenerationRequest FromWork(const worker::v1::WorkRequest& w, const std::vector<int32_t>& eos_ids) {
  GenerationRequest r;
  r.prompt.assign(w.prompt_ids().begin(), w.prompt_ids().end());
  SamplingParams& p = r.params;
  p.temperature = w.temperature();
  p.top_k = w.top_k();
  p.top_p = w.top_p();
  p.min_p = w.min_p();
  p.repetition_penalty = w.repetition_penalty();
  p.presence_penalty = w.presence_penalty();
  p.frequency_penalty = w.frequency_penalty();
  p.seed = w.seed();
  p.max_tokens = w.max_tokens();
  p.stop_token_ids.assign(w.stop_token_ids().begin(), w.stop_token_ids().end());
  p.ignore_eos = w.ignore_eos();
  p.logprobs = w.logprobs();
  r.stop_strings.assign(w.stop().begin(), w.stop().end());
  r.eos_ids = eos_ids;
  r.cache_salt = CacheSalt{w.cache_salt_lo(), w.cache_salt_hi()};
  return r;
}

absl::StatusOr<std::unique_ptr<Generation>> AcceptWork(const worker::v1::WorkRequest& w, const WorkLimits& limits) {
  GenerationRequest r = FromWork(w, limits.eos_ids);
  if (r.prompt.empty()) return absl::InvalidArgumentError("prompt_ids: empty");
  if (w.has_grammar()) {
    if (limits.grammars == nullptr) return absl::InvalidArgumentError("grammar: this worker takes no response format");
    absl::StatusOr<std::shared_ptr<const grammar::Constraint>> c = limits.grammars->FromSpec(
        {static_cast<grammar::ConstraintKind>(w.grammar().kind()), w.grammar().schema(), w.grammar().hash()});
    if (!c.ok()) return c.status();
    r.constraint = *std::move(c);
  }
  for (int32_t id : r.prompt) {
    if (id < 0 || id >= limits.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_ids: ", id, " is outside the vocabulary"));
    }
  }
  if (absl::Status s = ValidateSamplingParams(r.params, limits.vocab_size); !s.ok()) return s;
  if (limits.max_positions > 0 &&
      static_cast<int64_t>(r.prompt.size()) + r.params.max_tokens > limits.max_positions) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: prompt (", r.prompt.size(), ") + max_tokens (",
                                                   r.params.max_tokens, ") exceeds the context (",
                                                   limits.max_positions, ")"));
  }
  for (int32_t id : w.generated_ids()) {
    if (id < 0 || id >= limits.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("generated_ids: ", id, " is outside the vocabulary"));
    }
  }
  auto gen = std::make_unique<Generation>(std::move(r), limits.tokenizer);
  for (int32_t id : w.generated_ids()) {
    TokenEvent e;
    e.token = id;
    absl::StatusOr<TokenEvent> replayed = gen->Replay(e);
    if (!replayed.ok()) return replayed.status();
  }
  if (gen->finished()) return absl::InvalidArgumentError("generated_ids: already finished");
  return gen;
}

void ToWork(const GenerationRequest& r, worker::v1::WorkRequest* w) {
  w->mutable_prompt_ids()->Assign(r.prompt.begin(), r.prompt.end());
  const SamplingParams& p = r.params;
  w->set_temperature(p.temperature);
  w->set_top_k(p.top_k);
  w->set_top_p(p.top_p);
  w->set_min_p(p.min_p);
  w->set_repetition_penalty(p.repetition_penalty);
  w->set_presence_penalty(p.presence_penalty);
  w->set_frequency_penalty(p.frequency_penalty);
  w->set_seed(p.seed.value_or(0));
  w->set_max_tokens(p.max_tokens);
  w->mutable_stop_token_ids()->Assign(p.stop_token_ids.begin(), p.stop_token_ids.end());
  w->set_ignore_eos(p.ignore_eos);
  w->set_logprobs(p.logprobs);
  for (const std::string& s : r.stop_strings) w->add_stop(s);
  w->set_cache_salt_lo(r.cache_salt.lo);
  w->set_cache_salt_hi(r.cache_salt.hi);
  if (r.constraint != nullptr) {
    w->mutable_grammar()->set_kind(static_cast<int32_t>(r.constraint->spec.kind));
    w->mutable_grammar()->set_schema(r.constraint->spec.schema);
    w->mutable_grammar()->set_hash(r.constraint->spec.hash);
  }
}

v1::FinishReason ToProto(FinishReason f) {
  switch (f) {
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kNone:
      break;
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

FinishReason FromProto(v1::FinishReason f) {
  switch (f) {
    case v1::FINISH_REASON_STOP:
      return FinishReason::kStop;
    case v1::FINISH_REASON_LENGTH:
      return FinishReason::kLength;
    default:
      return FinishReason::kNone;
  }
}

void AppendToken(const TokenEvent& e, bool with_logprobs, v1::TokenChunk* chunk) {
  chunk->add_token_ids(e.token);
  chunk->mutable_text()->append(e.text);
  if (with_logprobs) {
    v1::TokenLogprob* lp = chunk->add_logprobs();
    lp->set_token_id(e.token);
    lp->set_logprob(e.logprob);
    for (const auto& [id, l] : e.top_logprobs) {
      v1::TopLogprob* t = lp->add_top();
      t->set_token_id(id);
      t->set_logprob(l);
    }
  }
}

void FillKvEvents(const KvEventLog& log, const worker::v1::WorkerStatusRequest& req, worker::v1::WorkerInfo* out) {
  if (!req.want_kv_events()) return;
  const KvEventBatch batch = log.Read(req.kv_events_after());
  worker::v1::KvEvents* ev = out->mutable_kv_events();
  ev->set_snapshot(batch.snapshot);
  ev->set_last_id(batch.last_id);
  ev->set_more(batch.more);
  ev->mutable_events()->Reserve(static_cast<int>(batch.events.size()));
  for (const KvEvent& e : batch.events) {
    worker::v1::KvEvent* m = ev->add_events();
    m->set_id(e.id);
    m->set_kind(static_cast<worker::v1::KvEvent::Kind>(static_cast<int>(e.kind)));
    m->set_hash_lo(e.hash.lo);
    m->set_hash_hi(e.hash.hi);
    m->set_parent_lo(e.parent.lo);
    m->set_parent_hi(e.parent.hi);
  }
}

void FillPrefixHash(const ModelIdentity& model, DType kv_dtype, int32_t block_size, worker::v1::WorkerInfo* out) {
  worker::v1::PrefixHashConfig* c = out->mutable_prefix_hash();
  c->set_model_lo(model.lo);
  c->set_model_hi(model.hi);
  c->set_kv_dtype(static_cast<int32_t>(kv_dtype));
  c->set_block_size(block_size);
}

BlockHash HashFromProto(uint64_t lo, uint64_t hi) {
  BlockHash h;
  h.lo = lo;
  h.hi = hi;
  return h;
}

}  // namespace pdserve::rpc
