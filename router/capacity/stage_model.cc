#include "router/capacity/stage_model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace pdserve::capacity {
namespace {

// Rounds up, but not past an exact decimal quotient that floating point put
// a hair above an integer (2.0000000001 groups is 2).
int64_t CeilCount(double x) { return static_cast<int64_t>(std::ceil(x * (1 - 1e-9))); }

}  // namespace

absl::string_view StageName(Stage s) {
  switch (s) {
    case Stage::kPrefill:
      return "prefill";
    case Stage::kHandoff:
      return "handoff";
    case Stage::kDecode:
      return "decode";
  }
  return "?";
}

PrefillEstimate EstimatePrefill(const PlanInputs& in) {
  const ModelShape& m = in.model;
  const double s = static_cast<double>(in.workload.prompt_tokens);
  const double flops_per_s =
      static_cast<double>(in.prefill.chips_per_group) * in.chip.peak_flops * in.prefill.utilization;
  PrefillEstimate e;
  // Cached positions are not projected again, but the computed ones still
  // attend over them.
  const double c = s * (in.prefix.pool_hit_rate + in.prefix.tier2_hit_rate);
  e.cached_tokens = c;
  e.computed_tokens = s - c;
  e.projection_flops = 2.0 * m.params * e.computed_tokens;
  e.attention_flops = 4.0 * static_cast<double>(m.head_dim) * static_cast<double>(m.q_heads) *
                      static_cast<double>(m.layers) * (s * (s + 1) - c * (c + 1)) / 2.0;
  e.projections_only_s = e.projection_flops / flops_per_s;
  e.with_attention_s = (e.projection_flops + e.attention_flops) / flops_per_s;
  e.seconds_given = in.prefill.seconds_per_request.has_value();
  e.seconds_per_request = in.prefill.seconds_per_request.value_or(e.with_attention_s);
  return e;
}

StageRates CombineStages(double prefill, double handoff, double decode) {
  StageRates r{prefill, handoff, decode, prefill, Stage::kPrefill};
  if (handoff < r.system) r = {prefill, handoff, decode, handoff, Stage::kHandoff};
  if (decode < r.system) r = {prefill, handoff, decode, decode, Stage::kDecode};
  return r;
}

Latency EndToEndLatency(double ttft_s, double itl_s, double output_tokens) {
  Latency l;
  l.ttft_s = ttft_s;
  l.itl_s = itl_s;
  l.total_s = ttft_s + (output_tokens - 1) * itl_s;
  l.total_half_ttft_s = ttft_s / 2 + (output_tokens - 1) * itl_s;
  l.total_half_itl_s = ttft_s + (output_tokens - 1) * itl_s / 2;
  return l;
}

absl::StatusOr<SystemPlan> PlanSystem(const PlanInputs& in, const DecodePlan& decode) {
  const double prefill_weights_per_chip =
      in.model.params * in.model.bytes_per_weight / static_cast<double>(in.prefill.chips_per_group);
  const double usable = in.chip.memory_bytes - in.chip.reserved_bytes;
  if (prefill_weights_per_chip > usable) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "prefill.chips_per_group: weights per chip (%.3f GB) exceed chip.memory_bytes - chip.reserved_bytes "
        "(%.3f GB); use more chips per group",
        prefill_weights_per_chip / 1e9, usable / 1e9));
  }
  SystemPlan p;
  p.prefill = EstimatePrefill(in);
  p.handoff_bytes_given = in.handoff.kv_bytes_per_request.has_value();
  p.handoff_kv_bytes_per_request = in.handoff.kv_bytes_per_request.value_or(
      static_cast<double>(in.workload.prompt_tokens) * decode.kv_bytes_per_token);

  // The second tier reads back on its own threads while the compute serves
  // other requests: a group runs at the slower of the two, and one
  // request waits for both.
  const double c_kv = 2.0 * static_cast<double>(in.model.layers * in.model.kv_heads * in.model.head_dim) *
                      in.model.bytes_per_kv_element;
  const double prompt = static_cast<double>(in.workload.prompt_tokens);
  if (in.prefix.tier2_hit_rate > 0) {
    p.tier2.bytes_per_request = prompt * in.prefix.tier2_hit_rate * c_kv;
    p.tier2.seconds_per_request = p.tier2.bytes_per_request / *in.prefix.tier2_read_bytes_per_s;
  }
  if (in.prefix.tier2_bytes_per_group.has_value()) p.tier2.prompts_held = *in.prefix.tier2_bytes_per_group / (prompt * c_kv);
  p.tier2.bounds_prefill = p.tier2.seconds_per_request > p.prefill.seconds_per_request;
  p.prefill_group_seconds = std::max(p.prefill.seconds_per_request, p.tier2.seconds_per_request);

  const double out_tokens = in.workload.mean_output_tokens;
  const double t_step = decode.step.step_s;
  const double batch = static_cast<double>(decode.step.batch);
  // Requests/s one decode group finishes: B tokens per step, out_tokens each.
  const double decode_group_rate = batch / t_step / out_tokens;
  p.rates = CombineStages(static_cast<double>(in.prefill.groups) / p.prefill_group_seconds,
                          in.handoff.link_bytes_per_s / p.handoff_kv_bytes_per_request,
                          static_cast<double>(in.decode.groups) * decode_group_rate);

  if (in.workload.target_requests_per_s.has_value()) {
    const double rate = *in.workload.target_requests_per_s;
    p.target = TargetPlan{rate, CeilCount(rate * p.prefill_group_seconds), CeilCount(rate / decode_group_rate),
                          rate * p.handoff_kv_bytes_per_request};
  }
  p.latency = EndToEndLatency(p.prefill.seconds_per_request + p.tier2.seconds_per_request, t_step, out_tokens);
  p.total_chips = in.prefill.groups * in.prefill.chips_per_group + in.decode.groups * in.decode.chips_per_group;
  if (in.chip.price_per_hour.has_value()) {
    const double price_per_s = *in.chip.price_per_hour * static_cast<double>(p.total_chips) / 3600.0;
    p.cost_per_million_tokens = price_per_s / (p.rates.system * out_tokens) * 1e6;
  }
  return p;
}

}  // namespace pdserve::capacity
