// The decode side of the capacity model (DESIGN.md facts 4, 5, 9, 10, 12,
// 16): memory per chip, the time of one decode step at batch B, and the
// largest batch that both fits and meets the step-time target.
//
// For a group of N chips, weights split evenly (P_chip = P / N, W_chip =
// P * bytes_per_weight / N), KV bytes per position c_kv = 2 * L * N_kv * H *
// p_kv and S = workload.history_tokens:
//
//   t_step(B) = max(2 * P_chip * B / C, W_chip / beta)   projections
//             + KV_chip(B) / beta                        attention reads
//             [+ exchange_s_per_step]                    request-sharded only
//             [+ allreduce_s_per_step]                   when given
//   memory:     W_chip + KV_chip(B) <= memory_bytes - reserved_bytes
//
//   head-sharded:    KV_chip(B) = B * S * c_kv / min(N, N_kv)
//   request-sharded: KV_chip(B) = (B / N) * S * c_kv,  B a multiple of N
//
// Pure functions of their inputs; thread-compatible.
#ifndef PDSERVE_ROUTER_CAPACITY_DECODE_MODEL_H_
#define PDSERVE_ROUTER_CAPACITY_DECODE_MODEL_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "router/capacity/plan_inputs.h"

namespace pdserve::capacity {

// KV bytes per sequence position of the whole model: 2 * L * N_kv * H * p_kv.
double KvBytesPerToken(const ModelShape& m);

// How many chips hold a copy of each KV head: N / min(N, N_kv) for
// head-sharded, 1 for request-sharded (each request lives on one chip).
int64_t KvCopies(const PlanInputs& in);

// The smallest batch the layout allows and the step between allowed batches:
// 1 for head-sharded, N for request-sharded.
int64_t BatchUnit(const PlanInputs& in);

// Which resource a time is spent on (see DecodeStep's two labels).
enum class StepBound { kCompute, kBandwidth };
absl::string_view StepBoundName(StepBound b);

// One decode step of one group at a given batch.
struct DecodeStep {
  int64_t batch = 0;
  double projection_compute_s = 0;  // 2 * P_chip * B / C
  double weight_read_s = 0;         // W_chip / beta
  double kv_read_s = 0;             // KV_chip(B) / beta
  double exchange_s = 0;
  double allreduce_s = 0;
  double step_s = 0;
  double kv_bytes_per_chip = 0;      // KV_chip(B)
  double memory_bytes_per_chip = 0;  // W_chip + KV_chip(B)
  bool fits = false;                 // memory_bytes_per_chip <= usable memory
  // The step's label: the branch of max(projections, weights) its formula
  // took. Compute when the projections' FLOP time exceeds the weights'
  // read: that part of the step runs at the chip's peak, and a faster chip
  // (not faster memory) shortens it. The KV read is added after it and is
  // reported as its own share of the step (kv_share), not folded into the
  // label.
  StepBound bound = StepBound::kBandwidth;
  double kv_share = 0;               // kv_read_s / step_s
  double tokens_per_s = 0;           // B / t_step, the group
  double tokens_per_s_per_chip = 0;  // B / (N * t_step)
};

// REQUIRES: Validate(in) is OK; batch >= 1 (a multiple of N for
// request-sharded).
DecodeStep ComputeDecodeStep(const PlanInputs& in, int64_t batch);

// What stops the batch from growing.
enum class BatchLimit { kMemory, kStepTimeTarget };
absl::string_view BatchLimitName(BatchLimit l);

struct DecodePlan {
  double kv_bytes_per_token = 0;             // c_kv
  double kv_bytes_per_token_per_chip = 0;    // c_kv / min(N, N_kv), or c_kv when request-sharded
  double kv_bytes_per_request = 0;           // S * c_kv
  double kv_bytes_per_request_per_chip = 0;  // on each chip holding part of the request
  int64_t kv_copies = 1;                     // see KvCopies()
  double weight_bytes_per_chip = 0;          // W_chip
  double usable_bytes_per_chip = 0;          // memory_bytes - reserved_bytes
  int64_t max_batch_memory = 0;              // largest allowed batch that fits
  // The batch from which the projections are compute-bound:
  // 2 * P_chip * B / C >= W_chip / beta  <=>  B >= p_w * C / (2 * beta).
  double compute_bound_batch = 0;
  int64_t max_batch_target = 0;  // largest allowed batch meeting the target, memory ignored
  BatchLimit limit = BatchLimit::kMemory;
  DecodeStep step;                                // at the operating batch min(memory, target)
  std::optional<double> cost_per_million_tokens;  // group chips * price at full load
  std::vector<DecodeStep> table;                  // one per report.batch_sizes entry
};

// The decode plan of one group. INVALID_ARGUMENT naming the field when the
// weights leave no memory for KV, when not even the smallest allowed batch
// fits, or when the smallest allowed batch already misses
// workload.step_time_target_s.
// REQUIRES: Validate(in) is OK.
absl::StatusOr<DecodePlan> PlanDecode(const PlanInputs& in);

}  // namespace pdserve::capacity

#endif  // PDSERVE_ROUTER_CAPACITY_DECODE_MODEL_H_
