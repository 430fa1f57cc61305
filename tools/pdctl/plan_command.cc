#include "tools/pdctl/plan_command.h"

#include <cmath>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "router/capacity/capacity_model.h"
#include "router/capacity/plan_config.h"

namespace pdserve::pdctl {
namespace {

using capacity::CapacityPlan;
using capacity::DecodePlan;
using capacity::DecodeStep;
using capacity::KvLayout;
using capacity::PlanInputs;
using capacity::SystemPlan;
using nlohmann::json;

// Decimal units, three significant figures: 327.7 kB, 17.65 GB.
std::string Scaled(double v, absl::string_view unit) {
  static constexpr struct {
    double scale;
    const char* prefix;
  } kPrefixes[] = {{1e15, "P"}, {1e12, "T"}, {1e9, "G"}, {1e6, "M"}, {1e3, "k"}};
  for (const auto& p : kPrefixes) {
    if (std::fabs(v) >= p.scale) return absl::StrFormat("%.4g %s%s", v / p.scale, p.prefix, unit);
  }
  return absl::StrFormat("%.4g %s", v, unit);
}

std::string Bytes(double v) { return Scaled(v, "B"); }

std::string Time(double s) {
  if (s >= 1) return absl::StrFormat("%.4g s", s);
  if (s >= 1e-3) return absl::StrFormat("%.4g ms", s * 1e3);
  return absl::StrFormat("%.4g us", s * 1e6);
}

// Four significant figures, without an exponent for counts up to 1e9.
std::string Num(double v) {
  if (std::fabs(v) >= 1e4 && std::fabs(v) < 1e9) return absl::StrFormat("%.0f", v);
  return absl::StrFormat("%.4g", v);
}

std::string Count(int64_t n, absl::string_view noun) { return absl::StrCat(n, " ", noun, n == 1 ? "" : "s"); }

std::string StepFormula(const DecodeStep& s) {
  std::string f = absl::StrCat(Time(s.step_s), " = max(projections ", Time(s.projection_compute_s), ", weights ",
                               Time(s.weight_read_s), ") + KV ", Time(s.kv_read_s));
  if (s.exchange_s > 0) absl::StrAppend(&f, " + exchange ", Time(s.exchange_s));
  if (s.allreduce_s > 0) absl::StrAppend(&f, " + all-reduce ", Time(s.allreduce_s));
  return f;
}

void PrintText(const std::string& path, const PlanInputs& in, const CapacityPlan& plan) {
  const capacity::ModelShape& m = in.model;
  const capacity::ChipSpec& c = in.chip;
  const DecodePlan& d = plan.decode;
  const SystemPlan& sys = plan.system;
  absl::PrintF("capacity plan: %s\n", path);
  absl::PrintF(
      "model  %s: %d layers, hidden %d, %d query / %d KV heads x %d, %s params, %g B/weight, "
      "%g B/KV element\n",
      m.name.empty() ? "(unnamed)" : m.name, m.layers, m.hidden, m.q_heads, m.kv_heads, m.head_dim,
      Scaled(m.params, ""), m.bytes_per_weight, m.bytes_per_kv_element);
  absl::PrintF("chip   %s: %s (%s reserved), %s, %s%s\n", c.name.empty() ? "(unnamed)" : c.name, Bytes(c.memory_bytes),
               Bytes(c.reserved_bytes), Scaled(c.bandwidth_bytes_per_s, "B/s"), Scaled(c.peak_flops, "FLOP/s"),
               c.price_per_hour ? absl::StrFormat(", %g per chip-hour", *c.price_per_hour) : "");
  for (const std::string& n : in.notes) absl::PrintF("note   %s\n", n);

  const int64_t chips = in.decode.chips_per_group;
  absl::PrintF("\ndecode group: %s, %s", Count(chips, "chip"), KvLayoutName(in.decode.kv_layout));
  if (d.kv_copies > 1) absl::PrintF(" (KV heads replicated: %d copies of each)", d.kv_copies);
  absl::PrintF("\n  KV per token          %s (%s per chip)\n", Bytes(d.kv_bytes_per_token),
               Bytes(d.kv_bytes_per_token_per_chip));
  absl::PrintF("  KV per request        %s at %d positions (%s per chip%s)\n", Bytes(d.kv_bytes_per_request),
               in.workload.history_tokens, Bytes(d.kv_bytes_per_request_per_chip),
               in.decode.kv_layout == KvLayout::kRequestSharded ? ", all on the chip that holds it" : "");
  absl::PrintF("  weights per chip      %s of %s usable\n", Bytes(d.weight_bytes_per_chip),
               Bytes(d.usable_bytes_per_chip));
  absl::PrintF("  max batch (memory)    %d\n", d.max_batch_memory);
  absl::PrintF("  compute-bound from    batch %d (p_w * C / (2 * beta) = %s)\n",
               static_cast<int64_t>(std::ceil(d.compute_bound_batch)), Num(d.compute_bound_batch));
  absl::PrintF("  max batch (target)    %d for a step <= %s\n", d.max_batch_target,
               Time(in.workload.step_time_target_s));
  absl::PrintF("  batch                 %d, limited by %s; the step %s-bound, KV reads %.0f%% of it\n",
               d.step.batch, BatchLimitName(d.limit), StepBoundName(d.step.bound), 100 * d.step.kv_share);
  absl::PrintF("  step time             %s\n", StepFormula(d.step));
  absl::PrintF("  memory per chip       %s\n", Bytes(d.step.memory_bytes_per_chip));
  absl::PrintF("  tokens/s              %s per group, %s per chip\n", Num(d.step.tokens_per_s),
               Num(d.step.tokens_per_s_per_chip));
  if (d.cost_per_million_tokens) {
    absl::PrintF("  cost                  %s per million tokens (decode only, full load)\n",
                 Num(*d.cost_per_million_tokens));
  }
  if (!d.table.empty()) {
    absl::PrintF("\n  %7s %10s %10s %10s %11s %11s %5s %11s %11s\n", "batch", "step", "bound", "KV share", "KV/chip",
                 "mem/chip", "fits", "tok/s", "tok/s/chip");
    for (const DecodeStep& s : d.table) {
      absl::PrintF("  %7d %10s %10s %9.0f%% %11s %11s %5s %11s %11s\n", s.batch, Time(s.step_s),
                   StepBoundName(s.bound), 100 * s.kv_share,
                   Bytes(s.kv_bytes_per_chip), Bytes(s.memory_bytes_per_chip), s.fits ? "yes" : "no",
                   Num(s.tokens_per_s), Num(s.tokens_per_s_per_chip));
    }
  }

  absl::PrintF("\nprefill: %d-token prompt on %s at %g of peak\n", in.workload.prompt_tokens,
               Count(in.prefill.chips_per_group, "chip"), in.prefill.utilization);
  const capacity::PrefixSpec& px = in.prefix;
  if (px.pool_hit_rate > 0 || px.tier2_hit_rate > 0 || px.tier2_bytes_per_group.has_value()) {
    absl::PrintF("  prefix cache          %.0f%% of prompt tokens from the pool, %.0f%% from tier 2: %s computed\n",
                 100 * px.pool_hit_rate, 100 * px.tier2_hit_rate, Num(sys.prefill.computed_tokens));
  }
  if (sys.tier2.bytes_per_request > 0) {
    absl::PrintF("  tier 2 read-back      %s per request at %s: %s%s\n", Bytes(sys.tier2.bytes_per_request),
                 Scaled(*px.tier2_read_bytes_per_s, "B/s"), Time(sys.tier2.seconds_per_request),
                 sys.tier2.bounds_prefill ? " (bounds the prefill rate: a faster disk or fewer tier-2 hits)" : "");
  }
  if (px.tier2_bytes_per_group.has_value()) {
    absl::PrintF("  tier 2 capacity       %s per group: the KV of %s whole prompts\n",
                 Bytes(*px.tier2_bytes_per_group), Num(sys.tier2.prompts_held));
  }
  absl::PrintF("  projections only      %s per request (%s)\n", Time(sys.prefill.projections_only_s),
               Scaled(sys.prefill.projection_flops, "FLOP"));
  absl::PrintF("  with attention        %s per request (+%s)\n", Time(sys.prefill.with_attention_s),
               Scaled(sys.prefill.attention_flops, "FLOP"));
  if (sys.prefill.seconds_given) {
    absl::PrintF("  given                 %s per request (used)\n", Time(sys.prefill.seconds_per_request));
  }

  absl::PrintF("\nthree stages (requests/s):\n");
  absl::PrintF("  prefill   %10s   %s / %s per request\n", Num(sys.rates.prefill), Count(in.prefill.groups, "group"),
               Time(sys.prefill_group_seconds));
  absl::PrintF("  handoff   %10s   %s / %s KV per request%s\n", Num(sys.rates.handoff),
               Scaled(in.handoff.link_bytes_per_s, "B/s"), Bytes(sys.handoff_kv_bytes_per_request),
               sys.handoff_bytes_given ? " (given)" : "");
  absl::PrintF("  decode    %10s   %s x %d / %s / %g output tokens\n", Num(sys.rates.decode),
               Count(in.decode.groups, "group"), d.step.batch, Time(d.step.step_s), in.workload.mean_output_tokens);
  absl::PrintF("  system    %10s   bottleneck: %s\n", Num(sys.rates.system), StageName(sys.rates.bottleneck));
  if (sys.target) {
    absl::PrintF("  %s requests/s takes %s, %s, %s of handoff link\n", Num(sys.target->requests_per_s),
                 Count(sys.target->prefill_groups, "prefill group"), Count(sys.target->decode_groups, "decode group"),
                 Scaled(sys.target->link_bytes_per_s, "B/s"));
  }

  const capacity::Latency& l = sys.latency;
  absl::PrintF("\nlatency of one request: TTFT %s + (%g - 1) x ITL %s = %s\n", Time(l.ttft_s),
               in.workload.mean_output_tokens, Time(l.itl_s), Time(l.total_s));
  absl::PrintF("  TTFT halved: %s; ITL halved: %s\n", Time(l.total_half_ttft_s), Time(l.total_half_itl_s));
  absl::PrintF("\ncost: %s", Count(sys.total_chips, "chip"));
  if (sys.cost_per_million_tokens) {
    absl::PrintF(", %s per million output tokens at the system rate", Num(*sys.cost_per_million_tokens));
  }
  absl::PrintF("\n");
}

json StepJson(const DecodeStep& s) {
  return {{"batch", s.batch},
          {"step_s", s.step_s},
          {"projection_compute_s", s.projection_compute_s},
          {"weight_read_s", s.weight_read_s},
          {"kv_read_s", s.kv_read_s},
          {"exchange_s", s.exchange_s},
          {"allreduce_s", s.allreduce_s},
          {"bound", StepBoundName(s.bound)},
          {"kv_share", s.kv_share},
          {"kv_bytes_per_chip", s.kv_bytes_per_chip},
          {"memory_bytes_per_chip", s.memory_bytes_per_chip},
          {"fits", s.fits},
          {"tokens_per_s", s.tokens_per_s},
          {"tokens_per_s_per_chip", s.tokens_per_s_per_chip}};
}

json PlanJson(const std::string& path, const PlanInputs& in, const CapacityPlan& plan) {
  const DecodePlan& d = plan.decode;
  const SystemPlan& sys = plan.system;
  json decode = {{"groups", in.decode.groups},
                 {"chips_per_group", in.decode.chips_per_group},
                 {"kv_layout", KvLayoutName(in.decode.kv_layout)},
                 {"kv_copies", d.kv_copies},
                 {"kv_bytes_per_token", d.kv_bytes_per_token},
                 {"kv_bytes_per_token_per_chip", d.kv_bytes_per_token_per_chip},
                 {"kv_bytes_per_request", d.kv_bytes_per_request},
                 {"kv_bytes_per_request_per_chip", d.kv_bytes_per_request_per_chip},
                 {"weight_bytes_per_chip", d.weight_bytes_per_chip},
                 {"usable_bytes_per_chip", d.usable_bytes_per_chip},
                 {"max_batch_memory", d.max_batch_memory},
                 {"compute_bound_batch", d.compute_bound_batch},
                 {"max_batch_target", d.max_batch_target},
                 {"batch", d.step.batch},
                 {"limit", BatchLimitName(d.limit)},
                 {"step", StepJson(d.step)},
                 {"cost_per_million_tokens", d.cost_per_million_tokens ? json(*d.cost_per_million_tokens) : json()}};
  json table = json::array();
  for (const DecodeStep& s : d.table) table.push_back(StepJson(s));
  decode["table"] = std::move(table);
  json out = {{"config", path},
              {"notes", in.notes},
              {"model", in.model.name},
              {"chip", in.chip.name},
              {"decode", std::move(decode)},
              {"prefill",
               {{"groups", in.prefill.groups},
                {"chips_per_group", in.prefill.chips_per_group},
                {"projection_flops", sys.prefill.projection_flops},
                {"attention_flops", sys.prefill.attention_flops},
                {"projections_only_s", sys.prefill.projections_only_s},
                {"with_attention_s", sys.prefill.with_attention_s},
                {"seconds_per_request", sys.prefill.seconds_per_request},
                {"seconds_given", sys.prefill.seconds_given},
                {"group_seconds_per_request", sys.prefill_group_seconds}}},
              {"prefix",
               {{"pool_hit_rate", in.prefix.pool_hit_rate},
                {"tier2_hit_rate", in.prefix.tier2_hit_rate},
                {"cached_tokens", sys.prefill.cached_tokens},
                {"computed_tokens", sys.prefill.computed_tokens},
                {"tier2_bytes_per_request", sys.tier2.bytes_per_request},
                {"tier2_seconds_per_request", sys.tier2.seconds_per_request},
                {"tier2_bytes_per_group",
                 in.prefix.tier2_bytes_per_group ? json(*in.prefix.tier2_bytes_per_group) : json()},
                {"tier2_prompts_held", sys.tier2.prompts_held},
                {"tier2_bounds_prefill", sys.tier2.bounds_prefill}}},
              {"handoff",
               {{"link_bytes_per_s", in.handoff.link_bytes_per_s},
                {"kv_bytes_per_request", sys.handoff_kv_bytes_per_request},
                {"kv_bytes_given", sys.handoff_bytes_given}}},
              {"stages",
               {{"prefill_requests_per_s", sys.rates.prefill},
                {"handoff_requests_per_s", sys.rates.handoff},
                {"decode_requests_per_s", sys.rates.decode},
                {"system_requests_per_s", sys.rates.system},
                {"bottleneck", StageName(sys.rates.bottleneck)}}},
              {"latency",
               {{"ttft_s", sys.latency.ttft_s},
                {"itl_s", sys.latency.itl_s},
                {"total_s", sys.latency.total_s},
                {"total_half_ttft_s", sys.latency.total_half_ttft_s},
                {"total_half_itl_s", sys.latency.total_half_itl_s}}},
              {"cost",
               {{"total_chips", sys.total_chips},
                {"per_million_tokens", sys.cost_per_million_tokens ? json(*sys.cost_per_million_tokens) : json()}}}};
  if (sys.target) {
    out["target"] = {{"requests_per_s", sys.target->requests_per_s},
                     {"prefill_groups", sys.target->prefill_groups},
                     {"decode_groups", sys.target->decode_groups},
                     {"link_bytes_per_s", sys.target->link_bytes_per_s}};
  }
  return out;
}

}  // namespace

absl::Status RunPlan(const std::string& config_path, bool json_output) {
  if (config_path.empty()) return absl::InvalidArgumentError("--config is required");
  absl::StatusOr<PlanInputs> in = capacity::LoadPlanConfig(config_path);
  if (!in.ok()) return in.status();
  absl::StatusOr<CapacityPlan> plan = capacity::PlanCapacity(*in);
  if (!plan.ok()) {
    return absl::Status(plan.status().code(), absl::StrCat(config_path, ": ", plan.status().message()));
  }
  if (json_output) {
    std::printf("%s\n", PlanJson(config_path, *in, *plan).dump(2).c_str());
  } else {
    PrintText(config_path, *in, *plan);
  }
  return absl::OkStatus();
}

}  // namespace pdserve::pdctl
