#include "decode_worker/batch_engine.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/prefix_cache.h"

namespace pdserve {

BatchEngine::BatchEngine(Model& model, KvManager& kv, BatchEngineOptions options)
    : model_(model),
      kv_(kv),
      options_(options),
      hasher_(model.identity(), kv.spec().dtype, kv.spec().block_size) {}

BatchEngine::~BatchEngine() = default;

void BatchEngine::SubmitPrefill(uint64_t id, std::unique_ptr<Generation> gen, EventSink sink) {
  auto s = std::make_unique<Seq>();
  s->id = id;
  s->kv = kv_.NewSequence();
  s->context = gen->AllTokens();
  s->gen = std::move(gen);
  s->sink = std::move(sink);
  absl::MutexLock lock(&mu_);
  inbox_.prefill.push_back(std::move(s));
}

void BatchEngine::SubmitDecode(uint64_t id, std::unique_ptr<Generation> gen, SequenceKv kv,
                               EventSink sink) {
  auto s = std::make_unique<Seq>();
  s->id = id;
  s->gen = std::move(gen);
  s->sink = std::move(sink);
  s->kv = std::move(kv);
  absl::MutexLock lock(&mu_);
  inbox_.decode.push_back(std::move(s));
}

void BatchEngine::Cancel(uint64_t id) {
  absl::MutexLock lock(&mu_);
  inbox_.cancel.push_back(id);
}

BatchEngineStats BatchEngine::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void BatchEngine::Publish(const Seq& s) {
  if (!options_.prefix_cache || s.gen == nullptr || s.kv.num_positions() == 0) return;
  // Waiting sequences' KV covers context[0, fed); running ones', prompt +
  // generated tokens but the last (not fed yet).
  if (!s.context.empty()) {
    PublishFullBlocks(kv_, hasher_, s.context, s.kv);
  } else {
    PublishFullBlocks(kv_, hasher_, s.gen->AllTokens(), s.kv);
  }
}

void BatchEngine::Finish(Seq& s, absl::Status status) {
  if (status.ok() || absl::IsCancelled(status)) Publish(s);
  s.kv.Release();
  if (!status.ok()) s.sink(EngineEvent{std::move(status), {}});
}

void BatchEngine::DrainInbox() {
  Inbox in;
  {
    absl::MutexLock lock(&mu_);
    std::swap(in, inbox_);
  }
  for (auto& s : in.decode) {
    if (s->gen->finished()) {
      Finish(*s, absl::OkStatus());
      continue;
    }
    running_.push_back(std::move(s));
  }
  for (auto& s : in.prefill) waiting_.push_back(std::move(s));
  for (uint64_t id : in.cancel) {
    const absl::Status cancelled = absl::CancelledError(absl::StrCat("request ", id, " cancelled"));
    for (auto it = running_.begin(); it != running_.end(); ++it) {
      if ((*it)->id == id) {
        Finish(**it, cancelled);
        running_.erase(it);
        break;
      }
    }
    for (auto it = waiting_.begin(); it != waiting_.end(); ++it) {
      if ((*it)->id == id) {
        Finish(**it, cancelled);
        waiting_.erase(it);
        break;
      }
    }
  }
}

void BatchEngine::Preempt(size_t i) {
  std::unique_ptr<Seq> s = std::move(running_[i]);
  running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(i));
  Publish(*s);  // The recompute then starts from these blocks.
  s->kv.Release();
  s->context = s->gen->AllTokens();
  s->fed = 0;
  waiting_.push_front(std::move(s));
  absl::MutexLock lock(&mu_);
  ++stats_.preemptions;
}

absl::Status BatchEngine::ReserveDecodeRows() {
  for (size_t i = 0; i < running_.size();) {
    SequenceKv& kv = running_[i]->kv;
    absl::Status st = kv_.Grow(kv, kv.num_positions() + 1);
    if (st.ok()) {
      ++i;
      continue;
    }
    if (!absl::IsResourceExhausted(st)) return st;
    // Free the newest sequence's blocks (possibly this one) and retry.
    Preempt(running_.size() - 1);
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> BatchEngine::Step() {
  DrainInbox();
  if (running_.empty() && waiting_.empty()) {
    absl::MutexLock lock(&mu_);
    stats_.running = 0;
    stats_.waiting = 0;
    return false;
  }
  if (absl::Status st = ReserveDecodeRows(); !st.ok()) return st;

  // Prefill chunks from the front of the queue, within the token budget.
  const bool over_target =
      options_.itl_target_seconds > 0 && !running_.empty() && step_avg_ > options_.itl_target_seconds;
  int32_t budget = options_.prefill_chunk_tokens;
  std::vector<int32_t> chunk;  // Tokens of waiting_[j] in this step.
  for (size_t j = 0; j < waiting_.size() && budget > 0; ++j) {
    Seq& s = *waiting_[j];
    if (running_.size() + chunk.size() >= static_cast<size_t>(options_.max_batch)) break;
    if (s.fed == 0 && over_target) break;  // Started prefills still finish.
    if (s.fed == 0 && options_.prefix_cache && s.kv.block_table().empty()) {
      s.fed = AttachCachedPrefix(kv_, hasher_, s.context, s.kv);
      s.cached = s.fed;
    }
    const int32_t left = static_cast<int32_t>(s.context.size()) - s.fed;
    const int32_t n = std::min(budget, left);
    if (!kv_.Grow(s.kv, s.fed + n).ok()) break;
    chunk.push_back(n);
    budget -= n;
  }

  std::vector<ForwardSequence> batch;
  batch.reserve(running_.size() + chunk.size());
  for (auto& s : running_) {
    batch.push_back({&s->kv, absl::MakeConstSpan(&s->gen->generated().back(), 1), LogitsMode::kLast});
  }
  for (size_t j = 0; j < chunk.size(); ++j) {
    Seq& s = *waiting_[j];
    const bool ends = s.fed + chunk[j] == static_cast<int32_t>(s.context.size());
    batch.push_back({&s.kv, absl::MakeConstSpan(s.context.data() + s.fed, chunk[j]),
                     ends ? LogitsMode::kLast : LogitsMode::kNone});
  }
  if (batch.empty()) {
    // Nothing runs and the first waiting context does not fit. If later
    // waiting sequences hold blocks (partial prefills), free them (they
    // prefill again later) so the queue's head can go first.
    bool freed = false;
    for (size_t j = 1; j < waiting_.size(); ++j) {
      Seq& w = *waiting_[j];
      if (w.kv.block_table().empty()) continue;
      w.kv.Release();
      w.fed = 0;
      freed = true;
    }
    if (freed) {
      absl::MutexLock lock(&mu_);
      ++stats_.preemptions;
      return true;
    }
    // Alone in the pool and still too big.
    std::unique_ptr<Seq> s = std::move(waiting_.front());
    waiting_.pop_front();
    Finish(*s, absl::ResourceExhaustedError(absl::StrCat(
                   "request ", s->id, " needs ", s->context.size() + 1, " KV positions; the pool holds ",
                   static_cast<int64_t>(kv_.spec().num_blocks) * kv_.spec().block_size)));
    return true;
  }

  const auto t0 = std::chrono::steady_clock::now();
  absl::StatusOr<ForwardResult> res = model_.Forward(kv_.storage(), batch);
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!res.ok()) {
    for (auto& s : running_) Finish(*s, res.status());
    for (auto& s : waiting_) Finish(*s, res.status());
    running_.clear();
    waiting_.clear();
    return res.status();
  }
  if (!running_.empty()) step_avg_ = step_avg_ == 0 ? t : 0.8 * step_avg_ + 0.2 * t;

  // Decode rows.
  const size_t num_decode = running_.size();
  std::vector<std::unique_ptr<Seq>> still;
  still.reserve(num_decode);
  for (size_t i = 0; i < num_decode; ++i) {
    Seq& s = *running_[i];
    absl::StatusOr<TokenEvent> ev = s.gen->Accept(res->Last(i));
    if (!ev.ok()) {
      Finish(s, ev.status());
      continue;
    }
    const bool done = ev->finish != FinishReason::kNone;
    s.sink(EngineEvent{absl::OkStatus(), *std::move(ev)});
    if (done) {
      Finish(s, absl::OkStatus());
    } else {
      still.push_back(std::move(running_[i]));
    }
  }
  running_ = std::move(still);
  // Prefill chunks: the ones that completed their context sample their
  // next token and join the running set.
  for (size_t j = 0; j < chunk.size(); ++j) {
    Seq& s = *waiting_[j];
    s.fed += chunk[j];
    if (s.fed < static_cast<int32_t>(s.context.size())) continue;
    absl::StatusOr<TokenEvent> ev = s.gen->Accept(res->Last(num_decode + j));
    if (!ev.ok()) {
      Finish(s, ev.status());
      s.context.clear();
      continue;
    }
    const bool done = ev->finish != FinishReason::kNone;
    s.sink(EngineEvent{absl::OkStatus(), *std::move(ev), s.first_sent ? 0 : s.cached});
    s.first_sent = true;
    Publish(s);  // The context's blocks, for the next request that shares them.
    s.context.clear();
    s.context.shrink_to_fit();
    if (done) Finish(s, absl::OkStatus());
  }
  // Completed chunks form a prefix of the queue (only the last chunk can
  // stop short of its context).
  while (!waiting_.empty() && waiting_.front()->context.empty()) {
    std::unique_ptr<Seq> s = std::move(waiting_.front());
    waiting_.pop_front();
    if (!s->gen->finished() && s->kv.num_positions() > 0) running_.push_back(std::move(s));
  }
  double history = 0;
  for (const auto& s : running_) history += s->kv.num_positions();
  absl::MutexLock lock(&mu_);
  ++stats_.steps;
  stats_.mean_history = running_.empty() ? 0 : history / static_cast<double>(running_.size());
  stats_.running = static_cast<int32_t>(running_.size());
  stats_.waiting = static_cast<int32_t>(waiting_.size());
  stats_.step_seconds_avg = step_avg_;
  return true;
}

}  // namespace pdserve
