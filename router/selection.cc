#include "router/selection.h"

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

absl::StatusOr<std::unique_ptr<Selector>> MakeSelector(absl::string_view policy) {
  if (policy == "least_loaded") return std::make_unique<LeastLoadedSelector>();
  if (policy == "round_robin") return std::make_unique<RoundRobinSelector>();
  return absl::InvalidArgumentError(
      absl::StrCat("unknown selection policy '", policy, "' (least_loaded or round_robin)"));
}

}  // namespace pdserve::router
