#include "router/placement.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/server_util.h"

namespace pdserve::router {

absl::Span<const BlockHash> PromptChains::For(const std::optional<HashScheme>& scheme) {
  if (!scheme.has_value() || scheme->block_size <= 0 || context_.size() <= 1) return {};
  for (const auto& [known, chain] : chains_) {
    if (known == *scheme) return chain;
  }
  const BlockHasher hasher(scheme->model, scheme->kv_dtype, scheme->block_size);
  chains_.emplace_back(*scheme, hasher.FullBlockHashes(context_.first(context_.size() - 1), salt_));
  return chains_.back().second;
}

bool Exclusions::Excludes(const Worker& w) const {
  return std::any_of(failed_.begin(), failed_.end(),
                     [&w](const Failed& f) { return f.worker == &w && f.instance == w.instance(); });
}

Placement::Placement(PlacementOptions options, WorkerPool* pool, PrefixIndex* index, MeasuredInputs* measured,
                     std::unique_ptr<Selector> prefill_selector, std::unique_ptr<Selector> decode_selector)
    : options_(std::move(options)),
      pool_(pool),
      index_(index),
      measured_(measured),
      prefill_selector_(std::move(prefill_selector)),
      decode_selector_(std::move(decode_selector)) {}

int64_t Placement::CachedTokens(const Worker& w, PromptChains& chains) {
  const std::optional<HashScheme> scheme = w.report().prefix_hash;
  const absl::Span<const BlockHash> chain = chains.For(scheme);
  if (chain.empty()) return 0;
  return static_cast<int64_t>(index_->MatchBlocks(w.address(), chain, options_.clock())) * scheme->block_size;
}

Assignment Placement::AssignPrefill(WorkerPtr p, PromptChains& chains) {
  const int64_t cached = CachedTokens(*p, chains);
  const int64_t queued = chains.size() - cached;
  int64_t elsewhere = 0;
  for (const WorkerPtr& w : pool_->Snapshot(Role::kPrefill)) {
    if (w.get() != p.get() && w->healthy()) elsewhere = std::max(elsewhere, CachedTokens(*w, chains));
  }
  if (elsewhere > cached) tokens_cached_elsewhere_.fetch_add(elsewhere - cached, std::memory_order_relaxed);
  Expect(*p, chains);
  return Assignment(std::move(p), queued);
}

std::optional<PullPlan> Placement::PlanPull(const Worker& p, PromptChains& chains) {
  if (options_.pull_min_tokens <= 0) return std::nullopt;
  const WorkerReport pr = p.report();
  if (pr.kv_address.empty() || !pr.prefix_hash.has_value() || pr.kv_bytes_per_position <= 0) return std::nullopt;
  const int64_t cached = CachedTokens(p, chains);
  PullPlan plan;
  for (const WorkerPtr& w : pool_->Snapshot(Role::kPrefill)) {
    if (w.get() == &p || !w->healthy() || w->removed()) continue;
    const WorkerReport wr = w->report();
    if (wr.kv_address.empty() || wr.prefix_hash != pr.prefix_hash) continue;
    const int64_t held = CachedTokens(*w, chains);
    if (held - cached > plan.gain) {
      plan.from = w;
      plan.positions = held;
      plan.gain = held - cached;
    }
  }
  if (plan.from == nullptr || plan.gain < options_.pull_min_tokens) return std::nullopt;
  if (options_.pull_always) return plan;
  const MeasuredValue bw = measured_->LinkBytesPerS(plan.from->address(), p.address());
  const MeasuredValue speed = measured_->PrefillTokensPerS(p.address(), plan.gain);
  if (!bw.has_data() || !speed.has_data() || *bw.value <= 0 || *speed.value <= 0) {
    ++pull_stats_.unmeasured;
    return std::nullopt;
  }
  plan.transfer_s = static_cast<double>(plan.gain * pr.kv_bytes_per_position) / *bw.value +
                    absl::ToDoubleSeconds(options_.pull_overhead);
  plan.compute_s = static_cast<double>(plan.gain) / *speed.value;
  if (plan.transfer_s >= plan.compute_s) {
    ++pull_stats_.slower;
    return std::nullopt;
  }
  return plan;
}

void Placement::PullDone(const Worker& p, PromptChains& chains, const PullPlan& plan,
                         const absl::StatusOr<worker::v1::PushPrefixResponse>& result, const std::string& request_id) {
  if (!result.ok()) {
    ++pull_stats_.failed;
    LogEvent("warning", "prefix_pull_failed",
             {{"request_id", request_id}, {"from", plan.from->address()}, {"to", p.address()},
              {"error", std::string(result.status().message())}});
    return;
  }
  if (result->positions() <= 0) {
    ++pull_stats_.empty;
    return;
  }
  ++pull_stats_.pulled;
  pull_stats_.pulled_positions += result->positions();
  pull_stats_.bytes += result->bytes();
  pull_stats_.seconds.fetch_add(result->seconds(), std::memory_order_relaxed);
  measured_->RecordLink(plan.from->address(), p.address(), static_cast<double>(result->bytes()), result->seconds());
  const std::optional<HashScheme> scheme = p.report().prefix_hash;
  const absl::Span<const BlockHash> chain = chains.For(scheme);
  if (chain.empty()) return;
  const int64_t blocks = std::min<int64_t>(static_cast<int64_t>(chain.size()), result->positions() / scheme->block_size);
  index_->Expect(p.address(), chain.first(blocks), options_.clock(), options_.prefix_expect);
  if (LogLevelEnabled("debug")) {
    LogEvent("debug", "prefix_pulled",
             {{"request_id", request_id}, {"from", plan.from->address()}, {"to", p.address()},
              {"positions", absl::StrCat(result->positions())}, {"sent", absl::StrCat(result->sent_positions())},
              {"seconds", absl::StrFormat("%.4f", result->seconds())},
              {"predicted_s", absl::StrFormat("%.4f", plan.transfer_s)},
              {"compute_s", absl::StrFormat("%.4f", plan.compute_s)}});
  }
}

void Placement::Expect(const Worker& w, PromptChains& chains) {
  index_->Expect(w.address(), chains.For(w.report().prefix_hash), options_.clock(), options_.prefix_expect);
}

bool Placement::HasHeadroom(const Worker& w) const {
  const WorkerReport r = w.report();
  if (r.max_batch > 0 && w.in_flight.load() >= r.max_batch) return false;
  if (options_.itl_target > absl::ZeroDuration() && r.running > 0 &&
      r.step_seconds >= absl::ToDoubleSeconds(options_.itl_target)) {
    return false;
  }
  return true;
}

int64_t Placement::FreeFor(const Worker& w) const {
  if (options_.room != nullptr) {
    if (std::optional<int64_t> free = options_.room->Free(w); free.has_value()) return std::max<int64_t>(0, *free);
  }
  return w.report().free_positions;
}

WorkerPtr Placement::PickDecode(int64_t positions, const Exclusions& exclude, PromptChains& chains, bool need_room) {
  std::vector<WorkerPtr> usable;
  for (WorkerPtr& w : pool_->Snapshot(Role::kDecode)) {
    if (w->healthy() && !exclude.Excludes(*w)) usable.push_back(std::move(w));
  }
  std::vector<WorkerPtr> roomy;
  std::vector<SelectionCandidate> candidates;
  for (const WorkerPtr& w : usable) {
    const int64_t free = FreeFor(*w);
    const int64_t cached = CachedTokens(*w, chains);
    // Cached positions are shared, not allocated again; the ledger counts
    // every request whole, as it leases.
    const int64_t need = options_.room != nullptr ? options_.room->Rounded(*w, positions) : positions - cached;
    if (free >= 0 && free < need) continue;
    roomy.push_back(w);
    SelectionCandidate c;
    c.address = w->address();
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
                                          {"chosen", roomy[i]->address()}, {"candidates", terms}});
    }
    return roomy[i];
  }
  if (need_room) return nullptr;
  // None has room now: the one with the most free KV (it queues or preempts).
  WorkerPtr best;
  int64_t best_free = 0;
  for (const WorkerPtr& w : usable) {
    const int64_t free = FreeFor(*w);
    if (best == nullptr || free > best_free) {
      best = w;
      best_free = free;
    }
  }
  return best;
}

SelectionCandidate Placement::PrefillCandidate(const Worker& w, PromptChains& chains) {
  SelectionCandidate c;
  c.address = w.address();
  c.load = w.queued_tokens.load();
  c.cached_tokens = CachedTokens(w, chains);
  c.uncached_tokens = chains.size() - c.cached_tokens;
  c.tokens_per_s = measured_->PrefillTokensPerS(w.address(), c.uncached_tokens).value.value_or(0);
  c.queue_tokens_per_s = measured_->PrefillQueueTokensPerS(w.address()).value.value_or(0);
  return c;
}

WorkerPtr Placement::PickPrefill(const Exclusions& exclude, PromptChains& chains) {
  std::vector<WorkerPtr> usable;
  std::vector<SelectionCandidate> candidates;
  for (WorkerPtr& w : pool_->Snapshot(Role::kPrefill)) {
    if (!w->healthy() || exclude.Excludes(*w)) continue;
    candidates.push_back(PrefillCandidate(*w, chains));
    usable.push_back(std::move(w));
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
                                         {"chosen", usable[i]->address()}, {"candidates", terms}});
  }
  return usable[i];
}

bool Placement::PrefillOnDecode(const Worker& d, PromptChains& chains) {
  if (options_.colocated) return true;
  return options_.local_prefill_max_tokens > 0 &&
         chains.size() - CachedTokens(d, chains) <= options_.local_prefill_max_tokens && HasHeadroom(d);
}

Placed Placement::Place(int64_t positions, PromptChains& chains, const Exclusions& exclude_decode,
                        const Exclusions& exclude_prefill) {
  Placed p;
  p.decode = PickDecode(positions, exclude_decode, chains);
  p.local = options_.colocated || (p.decode != nullptr && PrefillOnDecode(*p.decode, chains));
  if (!p.local) p.prefill = PickPrefill(exclude_prefill, chains);
  return p;
}

AdmissionRequest Placement::AdmissionInputs(const Placed& placed, PromptChains& chains, int64_t min_samples) {
  AdmissionRequest ar;
  ar.uncached_tokens = chains.size();
  if (placed.prefill != nullptr) {
    const SelectionCandidate c = PrefillCandidate(*placed.prefill, chains);
    ar.queued_prefill_tokens = c.load;
    ar.uncached_tokens = c.uncached_tokens;
    ar.prefill_tokens_per_s = measured_->PrefillTokensPerS(placed.prefill->address(), c.uncached_tokens, min_samples);
    ar.queue_tokens_per_s = measured_->PrefillQueueTokensPerS(placed.prefill->address());
  } else if (placed.local && placed.decode != nullptr && !options_.colocated) {
    ar.uncached_tokens = chains.size() - CachedTokens(*placed.decode, chains);
  }
  return ar;
}

}  // namespace pdserve::router
