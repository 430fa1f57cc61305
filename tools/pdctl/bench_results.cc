#include "tools/pdctl/bench_results.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pdserve::pdctl {
namespace {

Distribution Distribute(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  Distribution d;
  d.p50 = Percentile(v, 0.5);
  d.p90 = Percentile(v, 0.9);
  d.p99 = Percentile(v, 0.99);
  d.sorted = std::move(v);
  return d;
}

nlohmann::ordered_json Percentiles(const Distribution& d) { return {{"p50", d.p50}, {"p90", d.p90}, {"p99", d.p99}}; }

}  // namespace

double Percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t i = static_cast<size_t>(p * static_cast<double>(values.size() - 1) + 0.5);
  return values[std::min(i, values.size() - 1)];
}

bool MeetsTargets(const RequestResult& r, const LatencyTargets& targets) {
  if (r.outcome != RequestOutcome::kCompleted) return false;
  if (targets.ttft > 0 && r.ttft > targets.ttft) return false;
  return targets.itl <= 0 || Percentile(r.itl, 0.99) <= targets.itl;
}

std::string BenchRow::Label() const {
  return rate > 0 ? absl::StrCat(target, " ", rate, " req/s") : absl::StrCat(target, " c=", concurrency);
}

BenchRow Summarize(const std::vector<RequestResult>& results, double wall_seconds, const LatencyTargets& targets) {
  BenchRow row;
  row.requests = static_cast<int>(results.size());
  row.wall_seconds = wall_seconds;
  std::vector<double> ttft, itl, e2e, first_gap, steady_itl, rejected_e2e;
  for (const RequestResult& r : results) {
    if (r.outcome == RequestOutcome::kRejected) rejected_e2e.push_back(r.e2e);
    if (r.outcome != RequestOutcome::kCompleted) {
      ++(r.outcome == RequestOutcome::kRejected ? row.rejected : row.failed);
      if (row.first_error.empty()) row.first_error = r.error;
      continue;
    }
    ++row.completed;
    row.tokens += r.tokens;
    if (MeetsTargets(r, targets)) {
      ++row.good;
      row.good_tokens += r.tokens;
    }
    ttft.push_back(r.ttft);
    e2e.push_back(r.e2e);
    itl.insert(itl.end(), r.itl.begin(), r.itl.end());
    if (!r.itl.empty()) {
      first_gap.push_back(r.itl.front());
      steady_itl.insert(steady_itl.end(), r.itl.begin() + 1, r.itl.end());
    }
    row.prompt_tokens += r.prompt_tokens;
    row.cached_prompt_tokens += r.cached_prompt_tokens;
    row.local_prefills += r.local_prefill ? 1 : 0;
    if (r.relay_p50 >= 0) {
      row.relay_p50.push_back(r.relay_p50);
      row.relay_p99.push_back(r.relay_p99);
    }
  }
  if (wall_seconds > 0) {
    row.requests_per_second = row.completed / wall_seconds;
    row.tokens_per_second = static_cast<double>(row.tokens) / wall_seconds;
    row.good_requests_per_second = row.good / wall_seconds;
    row.good_tokens_per_second = static_cast<double>(row.good_tokens) / wall_seconds;
  }
  row.ttft = Distribute(std::move(ttft));
  row.itl = Distribute(std::move(itl));
  row.e2e = Distribute(std::move(e2e));
  row.rejected_e2e = Distribute(std::move(rejected_e2e));
  row.first_gap = Distribute(std::move(first_gap));
  row.steady_itl = Distribute(std::move(steady_itl));
  return row;
}

nlohmann::ordered_json RowJson(const BenchRow& row) {
  nlohmann::ordered_json j = {{"target", row.target}, {"rate", row.rate}};
  if (row.rate <= 0) j["concurrency"] = row.concurrency;
  j["requests"] = row.requests;
  j["completed"] = row.completed;
  j["rejected"] = row.rejected;
  j["failed"] = row.failed;
  j["wall_seconds"] = row.wall_seconds;
  j["throughput"] = {{"requests_per_second", row.requests_per_second},
                     {"output_tokens_per_second", row.tokens_per_second}};
  j["goodput"] = {{"good_requests", row.good},
                  {"requests_per_second", row.good_requests_per_second},
                  {"output_tokens_per_second", row.good_tokens_per_second}};
  j["ttft_seconds"] = Percentiles(row.ttft);
  j["itl_seconds"] = Percentiles(row.itl);
  j["e2e_seconds"] = Percentiles(row.e2e);
  j["first_gap_seconds"] = Percentiles(row.first_gap);
  j["steady_itl_seconds"] = Percentiles(row.steady_itl);
  if (!row.relay_p50.empty()) {
    // Per request the router reports its relay p50/p99; across requests:
    // the median of the medians and the largest p99.
    j["router_relay_seconds"] = {{"p50", Percentile(row.relay_p50, 0.5)},
                                 {"p99", *std::max_element(row.relay_p99.begin(), row.relay_p99.end())}};
  }
  if (row.prompt_tokens > 0) {
    j["prefix_cache"] = {{"prompt_tokens", row.prompt_tokens},
                         {"cached_tokens", row.cached_prompt_tokens},
                         {"hit_rate", row.prefix_hit_rate()},
                         {"local_prefills", row.local_prefills}};
  }
  if (!row.tiers.empty()) j["prefill_prefix_cache_by_tier"] = row.tiers;
  if (!row.first_error.empty()) j["first_error"] = row.first_error;
  return j;
}

}  // namespace pdserve::pdctl
