#include "engine/engine.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/server_util.h"
#include "kv/kv_checksum.h"
#include "kv/prefix_cache.h"

namespace pdserve::engine {
namespace {

// An engine's own transition: illegal means a bug in the engine.
void Move(Request& r, RequestState to, EndReason reason = EndReason::kNone) {
  if (absl::Status s = r.lifecycle.Transition(to, reason); !s.ok()) {
    ABSL_RAW_LOG(FATAL, "request %s: %s", r.id.str().c_str(), std::string(s.message()).c_str());
  }
}

// Steps whose times give the p99 of the life bound; it is recomputed every
// kP99Every steps.
constexpr size_t kStepWindow = 1024;
constexpr int64_t kP99Every = 64;

}  // namespace

Engine::Engine(Model& model, KvManager& kv, EngineOptions options)
    : model_(model),
      kv_(kv),
      options_(options),
      hasher_(model.identity(), kv.spec().dtype, kv.spec().block_size) {
  // A request waiting for KV that another holder gives back (a handoff's
  // reservation, a parked handoff) runs as soon as it is back. The
  // engine's own frees happen inside a step, which looks again anyway.
  free_listener_ = kv_.AddFreeListener([this] {
    if (std::this_thread::get_id() == thread_id_.load(std::memory_order_relaxed)) return;
    absl::MutexLock lock(&mu_);
    work_ = true;
  });
}

Engine::~Engine() {
  Stop();
  kv_.RemoveFreeListener(free_listener_);
}

absl::Duration TimeWithoutProgress(const Request& r, absl::Time now) {
  switch (r.lifecycle.state()) {
    case RequestState::kPrefilling:
    case RequestState::kDecoding:
      return std::max(absl::ZeroDuration(), now - r.last_progress);
    default:
      return absl::ZeroDuration();
  }
}

absl::Duration Engine::LifeBound() const {
  const absl::Duration per_token = std::max(
      options_.life_min_per_token, absl::Seconds(options_.life_step_factor * p99_step_.load(std::memory_order_relaxed)));
  return options_.life_base + per_token;
}

void Engine::RecordStep(double seconds) {
  if (step_times_.size() < kStepWindow) {
    step_times_.push_back(static_cast<float>(seconds));
  } else {
    step_times_[step_next_] = static_cast<float>(seconds);
    step_next_ = (step_next_ + 1) % kStepWindow;
  }
  // At steps 1, 2, 4, ... 64, then every 64th (into a scratch buffer that
  // keeps its capacity: no allocation per step).
  const bool due = steps_ <= kP99Every ? (steps_ & (steps_ - 1)) == 0 : steps_ % kP99Every == 0;
  if (!due) return;
  p99_scratch_.assign(step_times_.begin(), step_times_.end());
  const size_t at = std::min(p99_scratch_.size() - 1, p99_scratch_.size() * 99 / 100);
  std::nth_element(p99_scratch_.begin(), p99_scratch_.begin() + static_cast<std::ptrdiff_t>(at), p99_scratch_.end());
  p99_step_.store(p99_scratch_[at], std::memory_order_relaxed);
}

void Engine::EndExpired() {
  const absl::Time now = options_.clock();
  const absl::Duration bound = LifeBound();  // One look at the p99 per step, not one per request.
  auto expired = [&](const std::shared_ptr<Request>& r) {
    const absl::Duration silent = TimeWithoutProgress(*r, now);
    if (silent <= bound) return false;
    ++expired_;
    const char* state = RequestStateName(r->lifecycle.state());
    LogEvent("warning", "request_expired",
             {{"request_id", r->id.str()},
              {"no_progress_s", absl::StrFormat("%.3f", absl::ToDoubleSeconds(silent))},
              {"bound_s", absl::StrFormat("%.3f", absl::ToDoubleSeconds(bound))},
              {"state", state}});
    End(*r, absl::DeadlineExceededError(absl::StrFormat(
                "request %s made no progress for %.1f s while %s (bound %g s + 1 token x %.0f ms)", r->id.str(),
                absl::ToDoubleSeconds(silent), state, absl::ToDoubleSeconds(options_.life_base),
                absl::ToDoubleMilliseconds(bound - options_.life_base))),
        EndReason::kError);
    return true;
  };
  running_.erase(std::remove_if(running_.begin(), running_.end(), expired), running_.end());
  waiting_.erase(std::remove_if(waiting_.begin(), waiting_.end(), expired), waiting_.end());
}

void Engine::Start() {
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "engine");
    thread_id_.store(std::this_thread::get_id(), std::memory_order_relaxed);
    Run();
  });
}

absl::Duration Engine::UntilNextExpiry() const {
  const absl::Time now = options_.clock();
  const absl::Duration bound = LifeBound();
  absl::Duration next = absl::InfiniteDuration();
  auto consider = [&](const std::shared_ptr<Request>& r) {
    const RequestState s = r->lifecycle.state();
    if (s == RequestState::kPrefilling || s == RequestState::kDecoding) {
      next = std::min(next, bound - (now - r->last_progress));
    }
  };
  for (const auto& r : running_) consider(r);
  for (const auto& r : waiting_) consider(r);
  // Just past the bound: EndExpired ends what has been silent for longer.
  return std::max(absl::ZeroDuration(), next) + absl::Milliseconds(1);
}

void Engine::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  DrainInbox();
  EndAll(absl::UnavailableError("the engine stopped"));
}

void Engine::Submit(std::shared_ptr<Request> request) {
  absl::Status why;
  {
    absl::MutexLock lock(&mu_);
    if (failure_.ok() && !stop_) {
      inbox_.requests.push_back(std::move(request));
      work_ = true;
      return;
    }
    why = !failure_.ok() ? failure_ : absl::UnavailableError("the engine stopped");
  }
  // No engine thread will take it: it ends here, as the running ones did.
  End(*request, why, EndReason::kError);
}

void Engine::Cancel(const std::shared_ptr<Request>& request, absl::Status why) {
  absl::MutexLock lock(&mu_);
  inbox_.cancels.emplace_back(request, std::move(why));
  work_ = true;
}

void Engine::Pause(const std::shared_ptr<Request>& request, std::function<void(bool paused)> done) {
  absl::MutexLock lock(&mu_);
  inbox_.pauses.emplace_back(request, std::move(done));
  work_ = true;
}

void Engine::Resume(std::shared_ptr<Request> request) {
  absl::MutexLock lock(&mu_);
  inbox_.resumes.push_back(std::move(request));
  work_ = true;
}

EngineStats Engine::stats() const {
  absl::MutexLock lock(&mu_);
  EngineStats s = stats_;
  // Aged at read time: an idle engine does not step to refresh it.
  s.oldest_request_seconds =
      oldest_arrived_ == absl::InfiniteFuture() ? 0 : absl::ToDoubleSeconds(absl::Now() - oldest_arrived_);
  return s;
}

bool Engine::failed() const {
  absl::MutexLock lock(&mu_);
  return !failure_.ok();
}

absl::Status Engine::failure() const {
  absl::MutexLock lock(&mu_);
  return failure_;
}

void Engine::Run() {
  while (true) {
    // Idle: it sleeps until there is something to do (a submit, a cancel,
    // KV given back by another holder, a stop) or a computing request's
    // life bound runs out, whichever comes first. Nothing polls.
    const absl::Duration wait = UntilNextExpiry();
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return work_ || stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&ready), wait);
      if (stop_) return;
      work_ = false;
    }
    while (true) {
      const auto step_start = std::chrono::steady_clock::now();
      const absl::StatusOr<bool> stepped = Step();
      if (!stepped.ok()) {
        // Step failed the engine (Fail) and ended its requests; what was
        // submitted before the failure ends with it too, later submissions
        // end in Submit.
        {
          absl::MutexLock lock(&mu_);
          if (failure_.ok()) failure_ = stepped.status();
        }
        DrainInbox();
        EndAll(stepped.status());
        return;
      }
      if (!*stepped) break;
      // The whole step: the forward, sampling and handing the tokens on.
      busy_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
      absl::MutexLock lock(&mu_);
      if (stop_) return;
    }
  }
}

void Engine::Publish(const Request& r) {
  if (!options_.prefix_cache || r.gen == nullptr || r.kv.num_positions() == 0) return;
  // A waiting request's KV covers context[0, fed); a running one's, prompt
  // + generated tokens but the last (not fed yet).
  const CacheSalt& salt = r.gen->request().cache_salt;
  const std::vector<BlockHash> hashes =
      r.context.empty() ? PublishFullBlocks(kv_, hasher_, r.gen->AllTokens(), r.kv, salt)
                        : PublishFullBlocks(kv_, hasher_, r.context, r.kv, salt);
  if (options_.tier2 == nullptr) return;
  // The tier copies each block out on its own thread, holding the block
  // while it reads: a block evicted from the pool before then is not
  // written (the store counts it). A block it holds or has queued already
  // is not queued again.
  for (size_t b = 0; b < hashes.size(); ++b) {
    options_.tier2->Write(hashes[b], b > 0 ? hashes[b - 1] : salt, [kv = &kv_, hash = hashes[b]](char* out) {
      SequenceKv pin = kv->PinCached(hash);
      if (pin.empty()) return false;
      CopyBlockOut(kv->storage(), pin.block_table()[0], out);
      return true;
    });
  }
}

std::vector<BlockHash> Engine::ContextHashes(const Request& r, int32_t blocks) const {
  const size_t n = std::min(r.context.size(), static_cast<size_t>(blocks) * kv_.spec().block_size);
  return hasher_.FullBlockHashes(absl::MakeConstSpan(r.context).first(n), r.gen->request().cache_salt);
}

bool Engine::StartRestore(const std::shared_ptr<Request>& r) {
  if (r->context.empty() || r->restore_tried) return false;
  const int32_t bs = kv_.spec().block_size;
  const int32_t have = static_cast<int32_t>(r->kv.block_table().size());
  // As from the pool: at least one context position is left to compute
  // (its logits are sampled).
  const int32_t most = static_cast<int32_t>((r->context.size() - 1) / static_cast<size_t>(bs));
  if (r->fed != have * bs || have >= most) return false;
  const std::vector<BlockHash> hashes = ContextHashes(*r, most);
  const int32_t n = options_.tier2->CountPrefix(absl::MakeConstSpan(hashes).subspan(static_cast<size_t>(have)));
  if (n == 0) return false;
  // The blocks to read into; with no room now, the prefix is computed.
  if (!kv_.Grow(r->kv, (have + n) * bs).ok()) return false;
  std::vector<int32_t> blocks(r->kv.block_table().begin() + have, r->kv.block_table().end());
  r->restore_tried = true;
  restoring_.push_back(r);
  options_.tier2->Restore(kv_.storage(), std::vector<BlockHash>(hashes.begin() + have, hashes.begin() + have + n),
                          std::move(blocks), [this, r](int32_t verified) {
                            absl::MutexLock lock(&mu_);
                            inbox_.restored.emplace_back(r, verified);
                            work_ = true;
                          });
  return true;
}

void Engine::FinishRestore(const std::shared_ptr<Request>& r, int32_t verified) {
  restoring_.erase(std::find(restoring_.begin(), restoring_.end(), r));
  const int32_t bs = kv_.spec().block_size;
  const int32_t keep = r->fed / bs + verified;
  // Blocks that were not read back (absent by then, or failed their
  // check) hold nothing: they go back, and those positions are computed.
  kv_.Truncate(r->kv, keep);
  r->kv.SetNumPositions(keep * bs);
  kv_.Publish(r->kv, ContextHashes(*r, keep));
  r->restored = verified * bs;
  r->fed = r->cached = keep * bs;
  if (auto c = std::find_if(restore_cancels_.begin(), restore_cancels_.end(),
                            [&r](const auto& p) { return p.first == r; });
      c != restore_cancels_.end()) {
    const absl::Status why = c->second;
    restore_cancels_.erase(c);
    End(*r, why, absl::IsCancelled(why) ? EndReason::kCancelled : EndReason::kError);
    return;
  }
  waiting_.push_front(r);
}

void Engine::End(Request& r, absl::Status status, EndReason reason) {
  if (status.ok() || absl::IsCancelled(status)) Publish(r);
  r.kv.Release();
  r.context.clear();
  Move(r, RequestState::kFinished, reason);
  if (r.callbacks.on_end) r.callbacks.on_end(status);
}

void Engine::Fail(const absl::Status& status) {
  {
    // Recorded before any request hears of it: whoever sees a request end
    // with the error also sees failed().
    absl::MutexLock lock(&mu_);
    if (failure_.ok()) failure_ = status;
  }
  EndAll(status);
}

void Engine::EndAll(const absl::Status& status) {
  if (!restoring_.empty()) {
    // Their blocks are being read into: wait for the reads, then end them.
    options_.tier2->Flush();
    std::vector<std::pair<std::shared_ptr<Request>, int32_t>> restored;
    {
      absl::MutexLock lock(&mu_);
      std::swap(restored, inbox_.restored);
    }
    for (auto& [r, verified] : restored) FinishRestore(r, verified);
  }
  for (auto& r : running_) End(*r, status, EndReason::kError);
  for (auto& r : waiting_) End(*r, status, EndReason::kError);
  running_.clear();
  waiting_.clear();
  PublishStats();
}

void Engine::DrainInbox() {
  Inbox in;
  {
    absl::MutexLock lock(&mu_);
    std::swap(in, inbox_);
  }
  for (auto& r : in.requests) {
    if (r->mode == RequestMode::kDecodeOnly) {
      if (r->gen->finished()) {  // Its replayed first token ended it.
        End(*r, absl::OkStatus(), EndReasonFor(r->gen->finish()));
        continue;
      }
      if (!CheckHandedOffKv(*r)) {
        // Its KV is not what its producer wrote: computed here instead,
        // from its prompt and first token, as a preempted request is.
        kv_recomputed_positions_ += r->kv.num_positions();
        r->kv.Release();
        Move(*r, RequestState::kDecoding);
        r->context = r->gen->AllTokens();
        r->fed = r->cached = 0;
        Move(*r, RequestState::kPreempted);
        waiting_.push_back(std::move(r));
        continue;
      }
      Move(*r, RequestState::kDecoding);
      r->last_progress = options_.clock();
      running_.push_back(std::move(r));
      continue;
    }
    r->context = r->gen->AllTokens();
    r->kv = kv_.NewSequence(kv_.PickRank());
    r->fed = 0;
    waiting_.push_back(std::move(r));
  }
  for (auto& [r, verified] : in.restored) FinishRestore(r, verified);
  for (auto& r : in.resumes) {
    if (r->lifecycle.state() != RequestState::kDecoding) continue;  // Ended while it was out.
    r->last_progress = options_.clock();
    running_.push_back(std::move(r));
  }
  for (auto& [r, done] : in.pauses) {
    // Only a sequence between its steps, whose KV holds all it was fed:
    // a queued or preempted one has nothing to move yet.
    auto it = std::find(running_.begin(), running_.end(), r);
    const bool out = it != running_.end() && r->lifecycle.state() == RequestState::kDecoding &&
                     r->kv.num_positions() == r->gen->next_position() - 1;
    if (out) running_.erase(it);
    done(out);
  }
  for (auto& [r, why] : in.cancels) {
    const EndReason reason = absl::IsCancelled(why) ? EndReason::kCancelled : EndReason::kError;
    if (auto it = std::find(running_.begin(), running_.end(), r); it != running_.end()) {
      End(**it, why, reason);
      running_.erase(it);
    } else if (auto w = std::find(waiting_.begin(), waiting_.end(), r); w != waiting_.end()) {
      End(**w, why, reason);
      waiting_.erase(w);
    } else if (std::find(restoring_.begin(), restoring_.end(), r) != restoring_.end()) {
      restore_cancels_.emplace_back(r, why);
    }
  }
}

bool Engine::CheckHandedOffKv(Request& r) {
  KvCheck& check = r.kv_check;
  if (check.layer_checksums.empty()) return true;
  ++kv_checked_;
  const KvStorage storage = kv_.storage();
  const std::vector<int32_t>& table = r.kv.block_table();
  bool ok = static_cast<int32_t>(check.layer_checksums.size()) == storage.spec.num_layers &&
            check.first_block >= 0 && check.first_block <= check.end_block &&
            check.end_block <= static_cast<int32_t>(table.size());
  int32_t bad_layer = -1;
  for (int32_t l = 0; ok && l < storage.spec.num_layers; ++l) {
    if (LayerChecksum(storage, l, table, check.first_block, check.end_block) != check.layer_checksums[l]) {
      ok = false;
      bad_layer = l;
    }
  }
  if (ok) {
    Publish(r);  // Held back from the prefix cache until now.
  } else {
    ++kv_checksum_failures_;
    LogEvent("warning", "kv_checksum_mismatch",
             {{"request_id", r.id.str()},
              {"producer", check.producer},
              {"layer", absl::StrCat(bad_layer)},
              {"detail", "handed-off KV does not match its producer's checksums; discarded, computed here"}});
  }
  check = {};
  return ok;
}

void Engine::Preempt(std::shared_ptr<Request> r) {
  Publish(*r);  // The recompute then starts from these blocks.
  r->kv.Release();
  r->context = r->gen->AllTokens();
  r->fed = 0;
  r->cached = 0;
  Move(*r, RequestState::kPreempted);
  waiting_.push_front(std::move(r));
  ++preemptions_;
}

SchedulerInput Engine::Describe() const {
  SchedulerInput in;
  const KvCounts counts = kv_.Counts();
  in.allocatable_blocks = counts.free;
  in.total_blocks = counts.total;
  in.block_size = kv_.spec().block_size;
  in.admit_new = !(options_.itl_target_seconds > 0 && !running_.empty() && step_avg_ > options_.itl_target_seconds);
  in.running.reserve(running_.size());
  for (const auto& r : running_) {
    in.running.push_back({r->kv.num_positions(), static_cast<int32_t>(r->kv.block_table().size())});
  }
  in.waiting.reserve(waiting_.size());
  for (const auto& r : waiting_) {
    in.waiting.push_back(
        {static_cast<int32_t>(r->context.size()), r->fed, static_cast<int32_t>(r->kv.block_table().size())});
  }
  return in;
}

bool Engine::AcceptToken(Request& r, absl::Span<const float> logits) {
  absl::StatusOr<TokenEvent> ev = r.gen->Accept(logits);
  if (!ev.ok()) {
    End(r, ev.status(), EndReason::kError);
    return false;
  }
  const bool first = !r.first_sent;
  const int32_t cached = first ? r.cached : 0;
  r.first_sent = true;
  if (r.lifecycle.state() == RequestState::kPrefilling) {
    Publish(r);  // The context's blocks, for the next request that shares them.
    r.context.clear();
    r.context.shrink_to_fit();
  }
  if (first && r.callbacks.on_first_cached) r.callbacks.on_first_cached(cached, r.restored);
  if (r.callbacks.on_token) r.callbacks.on_token(*ev, cached);
  if (ev->finish != FinishReason::kNone) {
    End(r, absl::OkStatus(), EndReasonFor(ev->finish));
    return false;
  }
  if (r.lifecycle.state() != RequestState::kPrefilling) return true;  // Decoding on.
  if (r.mode != RequestMode::kPrefillOnly) {
    Move(r, RequestState::kDecoding);
    return true;
  }
  if (!r.layer_status.ok()) {
    End(r, r.layer_status, EndReason::kError);
    return false;
  }
  Move(r, RequestState::kHandingOff);
  r.callbacks.on_handoff(*ev, std::move(r.kv));
  return false;
}

void Engine::PublishStats() {
  double history = 0;
  for (const auto& r : running_) history += r->kv.num_positions();
  absl::Time oldest = absl::InfiniteFuture();
  for (const auto& r : running_) oldest = std::min(oldest, r->arrived);
  for (const auto& r : waiting_) oldest = std::min(oldest, r->arrived);
  for (const auto& r : restoring_) oldest = std::min(oldest, r->arrived);
  const double p99 = p99_step_.load(std::memory_order_relaxed);
  std::vector<int32_t> rank_rows;
  if (const int32_t ranks = kv_.spec().request_ranks; ranks > 1) {
    rank_rows.assign(ranks, 0);
    for (const auto& r : running_) ++rank_rows[r->kv.rank()];
  }
  absl::MutexLock lock(&mu_);
  stats_.rank_rows = std::move(rank_rows);
  oldest_arrived_ = oldest;
  stats_.p99_step_seconds = p99;
  stats_.expired = expired_;
  stats_.kv_checked = kv_checked_;
  stats_.kv_checksum_failures = kv_checksum_failures_;
  stats_.kv_recomputed_positions = kv_recomputed_positions_;
  stats_.steps = steps_;
  stats_.busy_seconds = busy_seconds_;
  stats_.decode_tokens = decode_tokens_;
  stats_.preemptions = preemptions_;
  stats_.mean_history = running_.empty() ? 0 : history / static_cast<double>(running_.size());
  stats_.running = static_cast<int32_t>(running_.size());
  stats_.waiting = static_cast<int32_t>(waiting_.size() + restoring_.size());
  stats_.step_seconds_avg = step_avg_;
}

absl::StatusOr<bool> Engine::Step() {
  DrainInbox();
  EndExpired();
  if (running_.empty() && waiting_.empty()) {
    PublishStats();
    return false;
  }

  // Plan.
  if (options_.prefix_cache) {
    // Requests that may start this step begin from their cached prefix.
    const size_t room = static_cast<size_t>(std::max<int32_t>(0, options_.max_batch - static_cast<int32_t>(running_.size())));
    for (size_t j = 0; j < waiting_.size() && j < room;) {
      Request& r = *waiting_[j];
      if (r.fed == 0 && r.kv.empty()) {
        r.fed = r.cached = AttachCachedPrefix(kv_, hasher_, r.context, r.kv,
                                              r.gen != nullptr ? r.gen->request().cache_salt : CacheSalt{});
        if (options_.tier2 != nullptr && r.gen != nullptr && StartRestore(waiting_[j])) {
          waiting_.erase(waiting_.begin() + static_cast<ptrdiff_t>(j));
          continue;
        }
      }
      ++j;
    }
  }
  const StepPlan plan = PlanStep(Describe(), {.max_batch = options_.max_batch, .chunk_tokens = options_.chunk_tokens});
  for (int32_t i = 0; i < plan.preempt; ++i) {
    std::shared_ptr<Request> r = std::move(running_.back());
    running_.pop_back();
    Preempt(std::move(r));
  }
  if (!plan.release.empty()) {
    for (int32_t j : plan.release) {
      Request& r = *waiting_[j];
      r.kv.Release();
      r.fed = r.cached = 0;
      if (r.lifecycle.state() == RequestState::kPrefilling) Move(r, RequestState::kPreempted);
    }
    ++preemptions_;
  }
  if (plan.reject_head) {
    std::shared_ptr<Request> r = std::move(waiting_.front());
    waiting_.pop_front();
    End(*r, absl::ResourceExhaustedError(absl::StrCat(
                "request ", r->id.str(), " needs ", r->context.size() + 1, " KV positions; the pool holds ",
                static_cast<int64_t>(kv_.spec().num_blocks) * kv_.spec().block_size)),
        EndReason::kError);
  }
  if (!plan.has_forward()) {
    PublishStats();
    return plan.preempt > 0 || !plan.release.empty() || plan.reject_head;
  }

  // Allocate: every row's and chunk's blocks at once, or none. The plan
  // read the counts a moment ago; a transport thread may have reserved
  // blocks since, and then the next step plans again.
  std::vector<KvManager::GrowRequest> grow;
  grow.reserve(plan.decode_rows + plan.chunks.size());
  for (int32_t i = 0; i < plan.decode_rows; ++i) {
    grow.push_back({&running_[i]->kv, running_[i]->kv.num_positions() + 1});
  }
  for (const StepPlan::Chunk& c : plan.chunks) {
    Request& r = *waiting_[c.waiting];
    grow.push_back({&r.kv, r.fed + c.tokens});
  }
  if (absl::Status s = kv_.GrowAll(grow); !s.ok()) {
    if (!absl::IsResourceExhausted(s)) {
      Fail(s);
      return s;
    }
    PublishStats();
    return true;
  }

  // Forward.
  std::vector<ForwardSequence> batch;
  batch.reserve(grow.size());
  for (int32_t i = 0; i < plan.decode_rows; ++i) {
    Request& r = *running_[i];
    batch.push_back({&r.kv, absl::MakeConstSpan(&r.gen->generated().back(), 1), LogitsMode::kLast});
  }
  std::vector<Request*> handing_off;  // Chunks ending a kPrefillOnly context.
  for (const StepPlan::Chunk& c : plan.chunks) {
    Request& r = *waiting_[c.waiting];
    if (r.lifecycle.state() != RequestState::kPrefilling) Move(r, RequestState::kPrefilling);
    batch.push_back({&r.kv, absl::MakeConstSpan(r.context.data() + r.fed, c.tokens),
                     c.ends_context ? LogitsMode::kLast : LogitsMode::kNone});
    if (c.ends_context && r.mode == RequestMode::kPrefillOnly) handing_off.push_back(&r);
  }
  ForwardOptions fo;
  if (!handing_off.empty()) {
    fo.on_layer_kv_written = [&handing_off](int32_t layer) {
      for (Request* r : handing_off) {
        if (!r->layer_status.ok() || !r->callbacks.on_layer_written) continue;
        r->layer_status = r->callbacks.on_layer_written(layer, r->kv);
      }
    };
  }
  const auto t0 = std::chrono::steady_clock::now();
  // A slow model, for fault tests: timed as part of the step.
  if (options_.fault_stall_forward > absl::ZeroDuration()) absl::SleepFor(options_.fault_stall_forward);
  absl::StatusOr<ForwardResult> res = model_.Forward(kv_.storage(), batch, fo);
  const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!res.ok()) {
    Fail(res.status());
    return res.status();
  }
  ++steps_;
  decode_tokens_ += plan.decode_rows;
  RecordStep(t);
  if (plan.decode_rows > 0) step_avg_ = step_avg_ == 0 ? t : 0.8 * step_avg_ + 0.2 * t;

  // Apply: decode rows, then chunks; requests whose context is done sample
  // their next token and join the running set (or hand off).
  const absl::Time progressed = options_.clock();
  std::vector<std::shared_ptr<Request>> still;
  still.reserve(running_.size());
  for (int32_t i = 0; i < plan.decode_rows; ++i) {
    running_[i]->last_progress = progressed;
    if (AcceptToken(*running_[i], res->Last(i))) still.push_back(std::move(running_[i]));
  }
  std::vector<bool> leaves(waiting_.size(), false);
  for (size_t k = 0; k < plan.chunks.size(); ++k) {
    const StepPlan::Chunk& c = plan.chunks[k];
    std::shared_ptr<Request>& r = waiting_[c.waiting];
    r->fed += c.tokens;
    r->last_progress = progressed;
    if (!c.ends_context) continue;
    leaves[c.waiting] = true;
    if (AcceptToken(*r, res->Last(plan.decode_rows + k))) still.push_back(r);
  }
  running_ = std::move(still);
  std::deque<std::shared_ptr<Request>> waiting;
  for (size_t j = 0; j < waiting_.size(); ++j) {
    if (!leaves[j]) waiting.push_back(std::move(waiting_[j]));
  }
  waiting_ = std::move(waiting);
  PublishStats();
  return true;
}

}  // namespace pdserve::engine
