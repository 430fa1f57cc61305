// The deployment the capacity tests start from, chosen so the formulas give
// round numbers by hand. Tests change one field and derive the expectation.
#ifndef PDSERVE_TESTS_CAPACITY_TEST_INPUTS_H_
#define PDSERVE_TESTS_CAPACITY_TEST_INPUTS_H_

#include "router/capacity/plan_inputs.h"

namespace pdserve::capacity {

// c_kv = 2 * 4 layers * 4 KV heads * 64 * 2 B = 4096 B per position; a
// 1000-position history is 4.096e6 B. Weights 1e9 * 2 B = 2e9 B. The chip
// has 18e9 B usable, reads 1e12 B/s and does 1e14 FLOP/s, so projections
// turn compute-bound at B = 2 * 1e14 / (2 * 1e12) = 100.
inline PlanInputs BaseInputs() {
  PlanInputs in;
  in.model = {.name = "test",
              .layers = 4,
              .hidden = 1024,
              .q_heads = 16,
              .kv_heads = 4,
              .head_dim = 64,
              .params = 1e9,
              .bytes_per_weight = 2,
              .bytes_per_kv_element = 2};
  in.chip = {.name = "chip",
             .memory_bytes = 20e9,
             .reserved_bytes = 2e9,
             .bandwidth_bytes_per_s = 1e12,
             .peak_flops = 1e14,
             .price_per_hour = std::nullopt};
  in.decode.groups = 1;
  in.decode.chips_per_group = 1;
  in.decode.kv_layout = KvLayout::kHeadSharded;
  in.prefill.groups = 1;
  in.prefill.chips_per_group = 1;
  in.prefill.utilization = 0.5;
  in.handoff.link_bytes_per_s = 1e9;
  in.workload.prompt_tokens = 500;
  in.workload.history_tokens = 1000;
  in.workload.mean_output_tokens = 100;
  in.workload.step_time_target_s = 0.05;
  return in;
}

}  // namespace pdserve::capacity

#endif  // PDSERVE_TESTS_CAPACITY_TEST_INPUTS_H_
