// The three stages of a request in requests/s (DESIGN.md facts 9, 10, 13,
// 16): prefill, KV handoff and decode, the system's sustainable rate (their
// minimum, never the inverse of summed latencies), what a target rate takes,
// one request's end-to-end latency, and cost.
//
//   prefill:  t_pre = (2 * P * S_c [+ 4 * H * N_q * L * (S_p (S_p + 1) - c (c + 1)) / 2])
//                     / (chips_per_group * C * utilization), with c = S_p * (pool + tier 2
//                     hit rates) positions cached and S_c = S_p - c computed
//             t_t2  = S_p * tier2_hit_rate * c_kv / tier2_read_bytes_per_s (the
//                     second tier's read-back, on its own threads)
//             rate  = groups / max(seconds_per_request (given, else t_pre with
//                     the attention term), t_t2)
//   handoff:  rate  = link_bytes_per_s / kv_bytes_per_request (given, else
//                     S_p * c_kv: the whole prompt's KV crosses the link)
//   decode:   rate  = groups * B / t_step / mean_output_tokens
//   latency:  total = TTFT + (mean_output_tokens - 1) * ITL, with TTFT the
//             prefill time of one request and ITL the decode step
//
// Pure functions of their inputs; thread-compatible.
#ifndef PDSERVE_ROUTER_CAPACITY_STAGE_MODEL_H_
#define PDSERVE_ROUTER_CAPACITY_STAGE_MODEL_H_

#include <cstdint>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "router/capacity/decode_model.h"
#include "router/capacity/plan_inputs.h"

namespace pdserve::capacity {

struct PrefillEstimate {
  double cached_tokens = 0;        // c: S_p * (pool + tier 2 hit rates)
  double computed_tokens = 0;      // S_c = S_p - c
  double projection_flops = 0;     // 2 * P * S_c
  double attention_flops = 0;      // 4 * H * N_q * L * (S_p (S_p + 1) - c (c + 1)) / 2
  double projections_only_s = 0;   // projection_flops at the given utilisation
  double with_attention_s = 0;     // both terms
  double seconds_per_request = 0;  // prefill.seconds_per_request, else with_attention_s
  bool seconds_given = false;
};

// REQUIRES: Validate(in) is OK.
PrefillEstimate EstimatePrefill(const PlanInputs& in);

enum class Stage { kPrefill, kHandoff, kDecode };
absl::string_view StageName(Stage s);

struct StageRates {
  double prefill = 0;  // requests/s of the whole prefill pool
  double handoff = 0;
  double decode = 0;                   // requests/s of the whole decode pool
  double system = 0;                   // min of the three
  Stage bottleneck = Stage::kPrefill;  // the stage at the minimum (first of prefill, handoff, decode on ties)
};

// What a target rate takes, each stage sized on its own.
struct TargetPlan {
  double requests_per_s = 0;
  int64_t prefill_groups = 0;   // ceil(rate * seconds_per_request)
  int64_t decode_groups = 0;    // ceil(rate * mean_output_tokens * t_step / B)
  double link_bytes_per_s = 0;  // rate * kv_bytes_per_request
};

struct Latency {
  double ttft_s = 0;             // the prefill time of one request
  double itl_s = 0;              // the decode step at the operating batch
  double total_s = 0;            // ttft + (mean_output_tokens - 1) * itl
  double total_half_ttft_s = 0;  // the same with TTFT halved
  double total_half_itl_s = 0;   // the same with ITL halved
};

// The second tier's part of a prefill (zero without one).
struct Tier2Estimate {
  double bytes_per_request = 0;   // S_p * tier2_hit_rate * c_kv
  double seconds_per_request = 0;  // t_t2
  double prompts_held = 0;        // tier2_bytes_per_group / (S_p * c_kv): whole prompts' KV one group keeps
  bool bounds_prefill = false;    // t_t2 > the compute: the disk, not the compute, sets the prefill rate
};

struct SystemPlan {
  PrefillEstimate prefill;
  Tier2Estimate tier2;
  // One group's seconds per request at its rate: max(compute, t_t2).
  double prefill_group_seconds = 0;
  double handoff_kv_bytes_per_request = 0;
  bool handoff_bytes_given = false;
  StageRates rates;
  std::optional<TargetPlan> target;  // when workload.target_requests_per_s is given
  Latency latency;
  int64_t total_chips = 0;  // both pools
  // All chips of both pools at the system rate, per million output tokens.
  std::optional<double> cost_per_million_tokens;
};

// INVALID_ARGUMENT naming prefill.chips_per_group when the weights do not
// fit on a prefill group's chips. REQUIRES: Validate(in) is OK and `decode`
// is PlanDecode(in).
absl::StatusOr<SystemPlan> PlanSystem(const PlanInputs& in, const DecodePlan& decode);

// Requests/s per stage and the bottleneck, from each pool's capacity.
StageRates CombineStages(double prefill, double handoff, double decode);

// total = ttft + (output_tokens - 1) * itl, and the totals with either halved.
Latency EndToEndLatency(double ttft_s, double itl_s, double output_tokens);

}  // namespace pdserve::capacity

#endif  // PDSERVE_ROUTER_CAPACITY_STAGE_MODEL_H_
