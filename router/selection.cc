#include "router/selection.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"

namespace pdserve::router {

size_t LeastLoadedSelector::Select(absl::Span<const SelectionCandidate> candidates) {
  size_t best = 0;
  for (size_t i = 1; i < candidates.size(); ++i) {
    if (candidates[i].load < candidates[best].load) best = i;
  }
  return best;
}

size_t RoundRobinSelector::Select(absl::Span<const SelectionCandidate> candidates) {
  return static_cast<size_t>(next_.fetch_add(1, std::memory_order_relaxed) % candidates.size());
}

double FallbackTokensPerS(absl::Span<const SelectionCandidate> candidates) {
  double sum = 0;
  int n = 0;
  for (const SelectionCandidate& c : candidates) {
    if (c.tokens_per_s > 0) {
      sum += c.tokens_per_s;
      ++n;
    }
  }
  return n > 0 ? sum / n : 1.0;
}

double EstimatedPrefillSeconds(const SelectionCandidate& c, double fallback_tokens_per_s) {
  const double speed = c.tokens_per_s > 0 ? c.tokens_per_s : fallback_tokens_per_s;
  const double queue_speed = c.queue_tokens_per_s > 0 ? c.queue_tokens_per_s : speed;
  return static_cast<double>(c.load) / queue_speed + static_cast<double>(c.uncached_tokens) / speed;
}

size_t PrefixAwareSelector::Select(absl::Span<const SelectionCandidate> candidates) {
  size_t best = 0;
  if (pool_ == Pool::kPrefill) {
    const double fallback = FallbackTokensPerS(candidates);
    double best_cost = EstimatedPrefillSeconds(candidates[0], fallback);
    for (size_t i = 1; i < candidates.size(); ++i) {
      const double cost = EstimatedPrefillSeconds(candidates[i], fallback);
      if (cost < best_cost || (cost == best_cost && candidates[i].cached_tokens > candidates[best].cached_tokens)) {
        best = i;
        best_cost = cost;
      }
    }
    return best;
  }
  bool any_headroom = false;
  for (const SelectionCandidate& c : candidates) any_headroom = any_headroom || c.headroom;
  int64_t min_load = std::numeric_limits<int64_t>::max();
  for (const SelectionCandidate& c : candidates) {
    if (c.headroom == any_headroom) min_load = std::min(min_load, c.load);
  }
  auto near = [&](const SelectionCandidate& c) {
    return c.headroom == any_headroom && c.load <= min_load + kDecodeAffinitySlack;
  };
  auto better = [&](const SelectionCandidate& a, const SelectionCandidate& b) {
    if (near(a) != near(b)) return near(a);
    if (near(a) && a.cached_tokens != b.cached_tokens) return a.cached_tokens > b.cached_tokens;
    return a.load < b.load;
  };
  for (size_t i = 1; i < candidates.size(); ++i) {
    if (better(candidates[i], candidates[best])) best = i;
  }
  return best;
}

absl::StatusOr<std::unique_ptr<Selector>> MakeSelector(absl::string_view policy, Pool pool) {
  if (policy == "prefix_aware") return std::make_unique<PrefixAwareSelector>(pool);
  if (policy == "least_loaded") return std::make_unique<LeastLoadedSelector>();
  if (policy == "round_robin") return std::make_unique<RoundRobinSelector>();
  return absl::InvalidArgumentError(
      absl::StrCat("unknown selection policy '", policy, "' (prefix_aware, least_loaded or round_robin)"));
}

}  // namespace pdserve::router
