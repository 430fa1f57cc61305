#include "router/capacity/plan_inputs.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace pdserve::capacity {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

absl::Status Positive(absl::string_view field, double v) {
  if (!std::isfinite(v)) return Invalid(field, "must be a finite number");
  if (v < 0) return Invalid(field, absl::StrCat("must be positive, got ", v, " (negative)"));
  if (v == 0) return Invalid(field, "must be positive, got 0");
  return absl::OkStatus();
}

absl::Status Positive(absl::string_view field, int64_t v) {
  if (v < 0) return Invalid(field, absl::StrCat("must be positive, got ", v, " (negative)"));
  if (v == 0) return Invalid(field, "must be positive, got 0");
  return absl::OkStatus();
}

absl::Status NonNegative(absl::string_view field, double v) {
  if (!std::isfinite(v)) return Invalid(field, "must be a finite number");
  if (v < 0) return Invalid(field, absl::StrCat("must not be negative, got ", v));
  return absl::OkStatus();
}

absl::Status ValidateModel(const ModelShape& m) {
  for (auto [field, v] : {std::pair<const char*, int64_t>{"model.layers", m.layers},
                          {"model.hidden", m.hidden},
                          {"model.q_heads", m.q_heads},
                          {"model.kv_heads", m.kv_heads},
                          {"model.head_dim", m.head_dim}}) {
    if (absl::Status s = Positive(field, v); !s.ok()) return s;
  }
  for (auto [field, v] : {std::pair<const char*, double>{"model.params", m.params},
                          {"model.bytes_per_weight", m.bytes_per_weight},
                          {"model.bytes_per_kv_element", m.bytes_per_kv_element}}) {
    if (absl::Status s = Positive(field, v); !s.ok()) return s;
  }
  if (m.q_heads % m.kv_heads != 0) {
    return Invalid("model.q_heads", absl::StrCat(m.q_heads, " is not a multiple of model.kv_heads (", m.kv_heads, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateChip(const ChipSpec& c) {
  if (absl::Status s = Positive("chip.memory_bytes", c.memory_bytes); !s.ok()) return s;
  if (absl::Status s = NonNegative("chip.reserved_bytes", c.reserved_bytes); !s.ok()) return s;
  if (c.reserved_bytes >= c.memory_bytes) {
    return Invalid("chip.reserved_bytes",
                   absl::StrCat(c.reserved_bytes, " leaves nothing of chip.memory_bytes (", c.memory_bytes, ")"));
  }
  if (absl::Status s = Positive("chip.bandwidth_bytes_per_s", c.bandwidth_bytes_per_s); !s.ok()) return s;
  if (absl::Status s = Positive("chip.peak_flops", c.peak_flops); !s.ok()) return s;
  if (c.price_per_hour.has_value()) {
    if (absl::Status s = Positive("chip.price_per_hour", *c.price_per_hour); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ValidateDecode(const DecodePoolSpec& d, const ModelShape& m) {
  if (absl::Status s = Positive("decode.groups", d.groups); !s.ok()) return s;
  if (absl::Status s = Positive("decode.chips_per_group", d.chips_per_group); !s.ok()) return s;
  if (d.kv_layout == KvLayout::kHeadSharded) {
    const bool divides = d.chips_per_group <= m.kv_heads && m.kv_heads % d.chips_per_group == 0;
    const bool replicates = d.chips_per_group > m.kv_heads && d.chips_per_group % m.kv_heads == 0;
    if (!divides && !replicates) {
      return Invalid("decode.chips_per_group",
                     absl::StrCat(d.chips_per_group, " neither divides model.kv_heads (", m.kv_heads,
                                  ") nor is a multiple of it, as the head-sharded layout needs"));
    }
    if (d.exchange_s_per_step.has_value()) {
      return Invalid("decode.exchange_s_per_step",
                     "applies only to decode.kv_layout request-sharded (head-sharded moves no Q/outputs)");
    }
  } else {
    if (!d.exchange_s_per_step.has_value()) {
      return Invalid("decode.exchange_s_per_step",
                     "is missing: request-sharded needs the per-step time to move new Q and attention outputs");
    }
    if (absl::Status s = NonNegative("decode.exchange_s_per_step", *d.exchange_s_per_step); !s.ok()) return s;
  }
  if (d.allreduce_s_per_step.has_value()) {
    if (absl::Status s = NonNegative("decode.allreduce_s_per_step", *d.allreduce_s_per_step); !s.ok()) {
      return s;
    }
    if (d.chips_per_group == 1 && *d.allreduce_s_per_step > 0) {
      return Invalid("decode.allreduce_s_per_step", "a one-chip group has no tensor-parallel all-reduce");
    }
  }
  return absl::OkStatus();
}

absl::Status ValidatePrefill(const PrefillPoolSpec& p) {
  if (absl::Status s = Positive("prefill.groups", p.groups); !s.ok()) return s;
  if (absl::Status s = Positive("prefill.chips_per_group", p.chips_per_group); !s.ok()) return s;
  if (absl::Status s = Positive("prefill.utilization", p.utilization); !s.ok()) return s;
  if (p.utilization > 1) {
    return Invalid("prefill.utilization", absl::StrCat("is a fraction of peak, at most 1, got ", p.utilization));
  }
  if (p.seconds_per_request.has_value()) {
    if (absl::Status s = Positive("prefill.seconds_per_request", *p.seconds_per_request); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ValidateHandoff(const HandoffSpec& h) {
  if (absl::Status s = Positive("handoff.link_bytes_per_s", h.link_bytes_per_s); !s.ok()) return s;
  if (h.kv_bytes_per_request.has_value()) {
    if (absl::Status s = Positive("handoff.kv_bytes_per_request", *h.kv_bytes_per_request); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ValidatePrefix(const PrefixSpec& p) {
  for (const auto& [field, v] : {std::pair{"prefix.pool_hit_rate", p.pool_hit_rate},
                                 std::pair{"prefix.tier2_hit_rate", p.tier2_hit_rate}}) {
    if (!(v >= 0 && v < 1)) return Invalid(field, absl::StrCat("is a share of prompt tokens in [0, 1), got ", v));
  }
  if (!(p.pool_hit_rate + p.tier2_hit_rate < 1)) {
    return Invalid("prefix.tier2_hit_rate",
                   absl::StrCat("with prefix.pool_hit_rate covers ", p.pool_hit_rate + p.tier2_hit_rate,
                                " of the prompt; the last position is always computed, so the sum is below 1"));
  }
  if (p.tier2_bytes_per_group.has_value()) {
    if (absl::Status s = Positive("prefix.tier2_bytes_per_group", *p.tier2_bytes_per_group); !s.ok()) return s;
  }
  if (p.tier2_read_bytes_per_s.has_value()) {
    if (absl::Status s = Positive("prefix.tier2_read_bytes_per_s", *p.tier2_read_bytes_per_s); !s.ok()) return s;
  } else if (p.tier2_hit_rate > 0) {
    return Invalid("prefix.tier2_read_bytes_per_s",
                   "is required with prefix.tier2_hit_rate above 0 (pdctl bench-tier2 measures it)");
  }
  return absl::OkStatus();
}

absl::Status ValidateWorkload(const WorkloadSpec& w) {
  if (absl::Status s = Positive("workload.prompt_tokens", w.prompt_tokens); !s.ok()) return s;
  if (absl::Status s = Positive("workload.history_tokens", w.history_tokens); !s.ok()) return s;
  if (w.history_tokens < w.prompt_tokens) {
    return Invalid("workload.history_tokens",
                   absl::StrCat(w.history_tokens, " is less than workload.prompt_tokens (", w.prompt_tokens,
                                "); the decode history includes the prompt"));
  }
  if (absl::Status s = Positive("workload.mean_output_tokens", w.mean_output_tokens); !s.ok()) return s;
  if (w.mean_output_tokens < 1) {
    return Invalid("workload.mean_output_tokens", absl::StrCat("must be at least 1, got ", w.mean_output_tokens));
  }
  if (absl::Status s = Positive("workload.step_time_target_s", w.step_time_target_s); !s.ok()) return s;
  if (w.target_requests_per_s.has_value()) {
    if (absl::Status s = Positive("workload.target_requests_per_s", *w.target_requests_per_s); !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view KvLayoutName(KvLayout layout) {
  return layout == KvLayout::kHeadSharded ? "head-sharded" : "request-sharded";
}

absl::StatusOr<KvLayout> ParseKvLayout(absl::string_view name) {
  if (name == "head-sharded") return KvLayout::kHeadSharded;
  if (name == "request-sharded") return KvLayout::kRequestSharded;
  return Invalid("decode.kv_layout", absl::StrCat("unknown layout '", name, "' (head-sharded, request-sharded)"));
}

absl::Status Validate(const PlanInputs& in) {
  if (absl::Status s = ValidateModel(in.model); !s.ok()) return s;
  if (absl::Status s = ValidateChip(in.chip); !s.ok()) return s;
  if (absl::Status s = ValidateDecode(in.decode, in.model); !s.ok()) return s;
  if (absl::Status s = ValidatePrefill(in.prefill); !s.ok()) return s;
  if (absl::Status s = ValidateHandoff(in.handoff); !s.ok()) return s;
  if (absl::Status s = ValidateWorkload(in.workload); !s.ok()) return s;
  if (absl::Status s = ValidatePrefix(in.prefix); !s.ok()) return s;
  const bool request_sharded = in.decode.kv_layout == KvLayout::kRequestSharded;
  for (int64_t b : in.table_batches) {
    if (absl::Status s = Positive("report.batch_sizes", b); !s.ok()) return s;
    if (request_sharded && b % in.decode.chips_per_group != 0) {
      return Invalid("report.batch_sizes",
                     absl::StrCat(b, " is not a multiple of decode.chips_per_group (", in.decode.chips_per_group,
                                  "), as the request-sharded layout needs"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pdserve::capacity
