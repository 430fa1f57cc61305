#include "router/capacity/decode_model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve::capacity {
namespace {

// Inputs are decimal; keep 1e9 / 1e6 from flooring to 999 through rounding.
constexpr double kSlack = 1e-9;
// Batches are searched up to this many units; past it the model is not the
// question any more.
constexpr int64_t kMaxUnits = int64_t{1} << 40;

int64_t FloorCount(double x) {
  return static_cast<int64_t>(std::min(std::floor(x * (1 + kSlack)), static_cast<double>(kMaxUnits)));
}

double KvBytesPerRequestPerChip(const PlanInputs& in) {
  const double request = static_cast<double>(in.workload.history_tokens) * KvBytesPerToken(in.model);
  if (in.decode.kv_layout == KvLayout::kRequestSharded) return request;
  return request / static_cast<double>(std::min(in.decode.chips_per_group, in.model.kv_heads));
}

double WeightBytesPerChip(const PlanInputs& in) {
  return in.model.params * in.model.bytes_per_weight / static_cast<double>(in.decode.chips_per_group);
}

// KV held (and read each step) by one chip at batch B.
double KvBytesPerChip(const PlanInputs& in, int64_t batch) {
  const double requests_per_chip = in.decode.kv_layout == KvLayout::kRequestSharded
                                       ? static_cast<double>(batch) / static_cast<double>(in.decode.chips_per_group)
                                       : static_cast<double>(batch);
  return requests_per_chip * KvBytesPerRequestPerChip(in);
}

std::string Gb(double bytes) { return absl::StrFormat("%.3f GB", bytes / 1e9); }

}  // namespace

double KvBytesPerToken(const ModelShape& m) {
  return 2.0 * static_cast<double>(m.layers) * static_cast<double>(m.kv_heads) * static_cast<double>(m.head_dim) *
         m.bytes_per_kv_element;
}

int64_t KvCopies(const PlanInputs& in) {
  if (in.decode.kv_layout == KvLayout::kRequestSharded) return 1;
  return in.decode.chips_per_group / std::min(in.decode.chips_per_group, in.model.kv_heads);
}

int64_t BatchUnit(const PlanInputs& in) {
  return in.decode.kv_layout == KvLayout::kRequestSharded ? in.decode.chips_per_group : 1;
}

absl::string_view StepBoundName(StepBound b) { return b == StepBound::kCompute ? "compute" : "bandwidth"; }

absl::string_view BatchLimitName(BatchLimit l) { return l == BatchLimit::kMemory ? "memory" : "step-time target"; }

DecodeStep ComputeDecodeStep(const PlanInputs& in, int64_t batch) {
  const double chips = static_cast<double>(in.decode.chips_per_group);
  const double beta = in.chip.bandwidth_bytes_per_s;
  const double weight_bytes = WeightBytesPerChip(in);
  DecodeStep s;
  s.batch = batch;
  s.projection_compute_s = 2.0 * (in.model.params / chips) * static_cast<double>(batch) / in.chip.peak_flops;
  s.weight_read_s = weight_bytes / beta;
  s.kv_bytes_per_chip = KvBytesPerChip(in, batch);
  s.kv_read_s = s.kv_bytes_per_chip / beta;
  s.exchange_s = in.decode.exchange_s_per_step.value_or(0);
  s.allreduce_s = in.decode.allreduce_s_per_step.value_or(0);
  s.step_s = std::max(s.projection_compute_s, s.weight_read_s) + s.kv_read_s + s.exchange_s + s.allreduce_s;
  s.memory_bytes_per_chip = weight_bytes + s.kv_bytes_per_chip;
  s.fits = s.memory_bytes_per_chip <= (in.chip.memory_bytes - in.chip.reserved_bytes) * (1 + kSlack);
  s.bound = s.projection_compute_s > s.weight_read_s ? StepBound::kCompute : StepBound::kBandwidth;
  s.kv_share = s.kv_read_s / s.step_s;
  s.tokens_per_s = static_cast<double>(batch) / s.step_s;
  s.tokens_per_s_per_chip = s.tokens_per_s / chips;
  return s;
}

absl::StatusOr<DecodePlan> PlanDecode(const PlanInputs& in) {
  const int64_t unit = BatchUnit(in);
  const double target = in.workload.step_time_target_s;
  DecodePlan p;
  p.kv_bytes_per_token = KvBytesPerToken(in.model);
  p.kv_copies = KvCopies(in);
  p.kv_bytes_per_token_per_chip =
      in.decode.kv_layout == KvLayout::kRequestSharded
          ? p.kv_bytes_per_token
          : p.kv_bytes_per_token / static_cast<double>(std::min(in.decode.chips_per_group, in.model.kv_heads));
  p.kv_bytes_per_request = static_cast<double>(in.workload.history_tokens) * p.kv_bytes_per_token;
  p.kv_bytes_per_request_per_chip = KvBytesPerRequestPerChip(in);
  p.weight_bytes_per_chip = WeightBytesPerChip(in);
  p.usable_bytes_per_chip = in.chip.memory_bytes - in.chip.reserved_bytes;
  p.compute_bound_batch = in.model.bytes_per_weight * in.chip.peak_flops / (2.0 * in.chip.bandwidth_bytes_per_s);

  const double kv_room = p.usable_bytes_per_chip - p.weight_bytes_per_chip;
  if (kv_room <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("decode.chips_per_group: weights per chip (", Gb(p.weight_bytes_per_chip),
                     ") leave no room for KV in chip.memory_bytes - chip.reserved_bytes (", Gb(p.usable_bytes_per_chip),
                     "); use more chips per group"));
  }
  p.max_batch_memory = unit * FloorCount(kv_room / KvBytesPerChip(in, unit));
  if (p.max_batch_memory < unit) {
    return absl::InvalidArgumentError(absl::StrCat("workload.history_tokens: the KV of a batch of ", unit, " (",
                                                   Gb(KvBytesPerChip(in, unit)), " per chip) does not fit in the ",
                                                   Gb(kv_room), " per chip the weights leave"));
  }

  auto meets = [&](int64_t units) { return ComputeDecodeStep(in, units * unit).step_s <= target * (1 + kSlack); };
  if (!meets(1)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("workload.step_time_target_s: %g s is below the step time at the smallest batch (%d): %g s",
                        target, unit, ComputeDecodeStep(in, unit).step_s));
  }
  // t_step grows with B (every request adds KV reads), so the target holds on
  // a prefix of the batches: find its end by doubling, then bisection.
  int64_t lo = 1, hi = 2;
  while (meets(hi)) {
    lo = hi;
    if (hi == kMaxUnits) break;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (meets(mid) ? lo : hi) = mid;
  }
  p.max_batch_target = lo * unit;

  p.limit = p.max_batch_memory <= p.max_batch_target ? BatchLimit::kMemory : BatchLimit::kStepTimeTarget;
  p.step = ComputeDecodeStep(in, std::min(p.max_batch_memory, p.max_batch_target));
  if (in.chip.price_per_hour.has_value()) {
    const double group_price_per_s = *in.chip.price_per_hour * static_cast<double>(in.decode.chips_per_group) / 3600.0;
    p.cost_per_million_tokens = group_price_per_s / p.step.tokens_per_s * 1e6;
  }
  for (int64_t b : in.table_batches) p.table.push_back(ComputeDecodeStep(in, b));
  return p;
}

}  // namespace pdserve::capacity
