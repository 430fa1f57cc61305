// What `pdctl bench` measured: each request's result on the client's clock,
// whether it met the latency targets (goodput), and one row's summary per
// (target, rate). Pure functions; thread-safe.
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_RESULTS_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_RESULTS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace pdserve::pdctl {

enum class RequestOutcome {
  kCompleted,  // Every requested token arrived.
  kRejected,   // Ended with RESOURCE_EXHAUSTED: the server turned it away.
  kFailed,     // Any other error, or fewer tokens than asked for.
};

struct RequestResult {
  RequestOutcome outcome = RequestOutcome::kFailed;
  std::string error;
  double ttft = 0, e2e = 0;  // Seconds.
  std::vector<double> itl;   // Seconds, one per token after the first.
  int32_t tokens = 0;
  double relay_p50 = -1, relay_p99 = -1;  // Router-reported, when known.
  // Router-reported (cluster only): prompt positions, those that came from
  // a prefix cache, and whether the decode worker prefilled it itself.
  int32_t prompt_tokens = 0, cached_prompt_tokens = 0;
  bool local_prefill = false;
};

// Latency targets (seconds; 0 = no target on that measure).
struct LatencyTargets {
  double ttft = 0;
  double itl = 0;
  bool any() const { return ttft > 0 || itl > 0; }
};

// The nearest-rank percentile (index round(p * (n - 1)) of the sorted
// values); 0 for no values. p in [0, 1].
double Percentile(std::vector<double> values, double p);

// A request is good when it completed, its TTFT <= targets.ttft and the
// 99th percentile of its own inter-token gaps (Percentile above, so the
// largest gap for requests of up to 51 tokens) <= targets.itl. A request of
// one token has no gaps and passes the ITL target.
bool MeetsTargets(const RequestResult& r, const LatencyTargets& targets);

struct Distribution {
  std::vector<double> sorted;  // Seconds, ascending.
  double p50 = 0, p90 = 0, p99 = 0;
};

// One (target, rate) run of the workload.
struct BenchRow {
  std::string target;   // "cluster" or "in-process".
  double rate = 0;      // Offered Poisson rate (req/s); 0 = closed loop.
  int concurrency = 0;  // Closed loop only.
  int requests = 0, completed = 0, rejected = 0, failed = 0;
  int good = 0;  // Completed and within the targets.
  double wall_seconds = 0;
  int64_t tokens = 0, good_tokens = 0;                              // Output tokens of completed / good requests.
  double requests_per_second = 0, tokens_per_second = 0;            // Throughput.
  double good_requests_per_second = 0, good_tokens_per_second = 0;  // Goodput.
  Distribution ttft, itl, e2e;                                      // Over completed requests (ITL: every gap).
  // The gap from the first token to the second (where a KV handoff shows to
  // a user: DESIGN.md fact 14), one per completed request of 2+ tokens, and
  // the steady gaps after the second token.
  Distribution first_gap, steady_itl;
  // How long each refused (RESOURCE_EXHAUSTED) request took to be refused.
  Distribution rejected_e2e;
  std::vector<double> relay_p50, relay_p99;                         // Router-reported, per request.
  // Over completed requests: prompt tokens, those a prefix cache supplied
  // (hit rate = cached / prompt), and prefills the decode worker ran itself.
  int64_t prompt_tokens = 0, cached_prompt_tokens = 0;
  int local_prefills = 0;
  double prefix_hit_rate() const {
    return prompt_tokens > 0 ? static_cast<double>(cached_prompt_tokens) / static_cast<double>(prompt_tokens) : 0;
  }
  std::string first_error;
  // What the router saw during the row (a burst, with --router): the change
  // in its counters over the row, its peak memory. Empty: not asked for.
  nlohmann::ordered_json router_side;
  // The prefill pool's prefix cache by tier over the row (a cluster row of
  // a shared-prefix or multi-turn workload): blocks hit in the pools (of
  // them, pulled from another worker first), read back from second tiers,
  // and prompt blocks sent. Empty: not asked for.
  nlohmann::ordered_json tiers;
  // A drain mid-run (--drain-at): what the streams and the router went
  // through. Empty: none.
  nlohmann::ordered_json drain;
  std::string Label() const;  // "cluster 4 req/s", "in-process c=8".
};

// Summarises `results` of one run that took `wall_seconds`.
BenchRow Summarize(const std::vector<RequestResult>& results, double wall_seconds, const LatencyTargets& targets);

// A row of `pdctl bench --json` for sweeps (latencies in seconds):
// {target, rate, concurrency?, requests, completed, rejected, failed,
//  wall_seconds, throughput {requests_per_second, output_tokens_per_second},
//  goodput {good_requests, requests_per_second, output_tokens_per_second},
//  ttft_seconds / itl_seconds / e2e_seconds / first_gap_seconds /
//  steady_itl_seconds {p50, p90, p99},
//  router_relay_seconds?, prefix_cache? {prompt_tokens, cached_tokens,
//  hit_rate, local_prefills}, first_error?}.
nlohmann::ordered_json RowJson(const BenchRow& row);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_RESULTS_H_
