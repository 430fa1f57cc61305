#include "router/rebalance.h"

#include <vector>

namespace pdserve::router {

std::optional<MoveChoice> RebalancePolicy::Decide(
    absl::Time now, absl::Span<const DecodeLoad> workers, absl::Span<const SequenceLoad> sequences,
    const std::function<double(const std::string&, const std::string&)>& link_bytes_per_s) {
  // Forget what the window no longer covers.
  for (auto* m : {&received_, &moved_}) {
    absl::erase_if(*m, [&](const auto& e) { return now - e.second >= options_.window; });
  }
  std::vector<const DecodeLoad*> serving;
  for (const DecodeLoad& w : workers) {
    if (w.serving && w.step_seconds > 0) serving.push_back(&w);
  }
  if (serving.size() < 2) {
    hot_since_.clear();
    return std::nullopt;
  }
  // The coolest peer: the shortest step, then the least KV in use.
  const DecodeLoad* cool = serving[0];
  for (const DecodeLoad* w : serving) {
    if (w->step_seconds < cool->step_seconds ||
        (w->step_seconds == cool->step_seconds && w->kv_used_fraction < cool->kv_used_fraction)) {
      cool = w;
    }
  }
  std::optional<MoveChoice> best;
  for (const DecodeLoad* hot : serving) {
    const bool is_hot = hot != cool && (hot->step_seconds > cool->step_seconds * (1 + options_.step_margin) ||
                                        hot->kv_used_fraction > cool->kv_used_fraction + options_.kv_margin);
    if (!is_hot) {
      hot_since_.erase(hot->address);
      continue;
    }
    auto [since, fresh] = hot_since_.try_emplace(hot->address, now);
    if (fresh || now - since->second < options_.sustain || received_.contains(hot->address)) continue;
    const double step_gain = std::max(0.0, hot->step_seconds - cool->step_seconds);
    double bw = link_bytes_per_s(hot->address, cool->address);
    if (!(bw > 0)) bw = options_.default_bytes_per_s;
    for (const SequenceLoad& s : sequences) {
      if (s.worker != hot->address || moved_.contains(s.id)) continue;
      const double saves = static_cast<double>(s.remaining) * step_gain;
      const double costs = static_cast<double>(s.context * hot->kv_bytes_per_position) / bw +
                           options_.switch_steps * hot->step_seconds;
      if (saves <= costs) continue;
      if (!best.has_value() || saves - costs > best->saves_s - best->costs_s) {
        best = MoveChoice{s.id, hot->address, cool->address, saves, costs};
      }
    }
  }
  if (best.has_value()) {
    moved_[best->id] = now;
    received_[best->to] = now;
    hot_since_[best->from] = now;  // The next move waits for reports taken after this one.
  }
  return best;
}

}  // namespace pdserve::router
