// Reads a capacity plan config (JSON or YAML) into PlanInputs.
//
// Both formats describe the same tree; YAML is converted to the JSON tree
// first so one reader serves both. Layout (units: bytes, seconds, FLOP/s):
//
//   notes:    a string or a list of strings (assumptions; optional)
//   model:    name?, layers, hidden, q_heads, kv_heads, head_dim, params,
//             bytes_per_weight, bytes_per_kv_element
//   chip:     name?, memory_bytes, reserved_bytes, bandwidth_bytes_per_s,
//             peak_flops, price_per_hour?
//   decode:   groups, chips_per_group, kv_layout (head-sharded |
//             request-sharded), exchange_s_per_step?, allreduce_s_per_step?
//   prefill:  groups, chips_per_group, utilization, seconds_per_request?
//   handoff:  link_bytes_per_s, kv_bytes_per_request?
//   workload: prompt_tokens, history_tokens, mean_output_tokens,
//             step_time_target_s, target_requests_per_s?
//   prefix:   pool_hit_rate?, tier2_hit_rate?, tier2_bytes_per_group?,
//             tier2_read_bytes_per_s? (the prefix cache by tier; optional)
//   report:   batch_sizes? (list of batches for the per-batch table; optional)
//
// Fields marked ? are optional. Errors are INVALID_ARGUMENT naming the
// dotted field: missing, wrong type, not an integer, unknown (a misspelt key
// is refused rather than silently ignored). Values are range-checked by
// Validate() (plan_inputs.h), not here.
#ifndef PDSERVE_ROUTER_CAPACITY_PLAN_CONFIG_H_
#define PDSERVE_ROUTER_CAPACITY_PLAN_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "router/capacity/plan_inputs.h"

namespace pdserve::capacity {

enum class ConfigFormat { kJson, kYaml };

absl::StatusOr<PlanInputs> ParsePlanConfig(absl::string_view text, ConfigFormat format);

// Reads `path`; the format follows the extension (.json, .yaml, .yml).
// Errors are prefixed with the path.
absl::StatusOr<PlanInputs> LoadPlanConfig(const std::string& path);

}  // namespace pdserve::capacity

#endif  // PDSERVE_ROUTER_CAPACITY_PLAN_CONFIG_H_
