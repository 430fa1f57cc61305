// Every invalid input is refused with a message naming its field.
#include "router/capacity/plan_inputs.h"

#include <cmath>
#include <functional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/capacity/test_inputs.h"

namespace pdserve::capacity {
namespace {

using ::testing::HasSubstr;

TEST(CapacityInputsTest, BaseInputsAreValid) { EXPECT_TRUE(Validate(BaseInputs()).ok()); }

struct BadCase {
  std::string name;
  std::function<void(PlanInputs&)> mutate;
  std::string message;
};

TEST(CapacityInputsTest, InvalidInputsNameTheirField) {
  const BadCase cases[] = {
      {"zero layers", [](PlanInputs& in) { in.model.layers = 0; }, "model.layers: must be positive, got 0"},
      {"hit rate above 1", [](PlanInputs& in) { in.prefix.pool_hit_rate = 1.2; },
       "prefix.pool_hit_rate: is a share of prompt tokens in [0, 1), got 1.2"},
      {"hit rates cover the prompt",
       [](PlanInputs& in) {
         in.prefix.pool_hit_rate = 0.5;
         in.prefix.tier2_hit_rate = 0.5;
         in.prefix.tier2_read_bytes_per_s = 1e9;
       },
       "prefix.tier2_hit_rate: with prefix.pool_hit_rate covers 1 of the prompt"},
      {"tier 2 hits without a read rate", [](PlanInputs& in) { in.prefix.tier2_hit_rate = 0.2; },
       "prefix.tier2_read_bytes_per_s: is required with prefix.tier2_hit_rate above 0"},
      {"negative kv heads", [](PlanInputs& in) { in.model.kv_heads = -4; },
       "model.kv_heads: must be positive, got -4 (negative)"},
      {"zero head dim", [](PlanInputs& in) { in.model.head_dim = 0; }, "model.head_dim: must be positive"},
      {"zero hidden", [](PlanInputs& in) { in.model.hidden = 0; }, "model.hidden: must be positive"},
      {"negative params", [](PlanInputs& in) { in.model.params = -1e9; }, "model.params: must be positive"},
      {"zero weight bytes", [](PlanInputs& in) { in.model.bytes_per_weight = 0; },
       "model.bytes_per_weight: must be positive, got 0"},
      {"zero kv bytes", [](PlanInputs& in) { in.model.bytes_per_kv_element = 0; },
       "model.bytes_per_kv_element: must be positive"},
      {"GQA groups", [](PlanInputs& in) { in.model.q_heads = 10; },
       "model.q_heads: 10 is not a multiple of model.kv_heads (4)"},
      {"zero memory", [](PlanInputs& in) { in.chip.memory_bytes = 0; }, "chip.memory_bytes: must be positive"},
      {"negative reserved", [](PlanInputs& in) { in.chip.reserved_bytes = -1; },
       "chip.reserved_bytes: must not be negative"},
      {"reserved is all", [](PlanInputs& in) { in.chip.reserved_bytes = 20e9; },
       "chip.reserved_bytes: 2e+10 leaves nothing of chip.memory_bytes"},
      {"zero bandwidth", [](PlanInputs& in) { in.chip.bandwidth_bytes_per_s = 0; },
       "chip.bandwidth_bytes_per_s: must be positive"},
      {"nan flops", [](PlanInputs& in) { in.chip.peak_flops = std::nan(""); },
       "chip.peak_flops: must be a finite number"},
      {"zero price", [](PlanInputs& in) { in.chip.price_per_hour = 0; }, "chip.price_per_hour: must be positive"},
      {"zero decode groups", [](PlanInputs& in) { in.decode.groups = 0; }, "decode.groups: must be positive"},
      {"negative decode chips", [](PlanInputs& in) { in.decode.chips_per_group = -2; },
       "decode.chips_per_group: must be positive, got -2"},
      {"3 chips, 4 KV heads", [](PlanInputs& in) { in.decode.chips_per_group = 3; },
       "decode.chips_per_group: 3 neither divides model.kv_heads (4) nor is a multiple of it"},
      {"6 chips, 4 KV heads", [](PlanInputs& in) { in.decode.chips_per_group = 6; },
       "decode.chips_per_group: 6 neither divides"},
      {"exchange on head-sharded", [](PlanInputs& in) { in.decode.exchange_s_per_step = 1e-3; },
       "decode.exchange_s_per_step: applies only to decode.kv_layout request-sharded"},
      {"request-sharded without exchange",
       [](PlanInputs& in) {
         in.decode.kv_layout = KvLayout::kRequestSharded;
         in.decode.chips_per_group = 4;
       },
       "decode.exchange_s_per_step: is missing"},
      {"negative exchange",
       [](PlanInputs& in) {
         in.decode.kv_layout = KvLayout::kRequestSharded;
         in.decode.exchange_s_per_step = -1;
       },
       "decode.exchange_s_per_step: must not be negative"},
      {"all-reduce on one chip", [](PlanInputs& in) { in.decode.allreduce_s_per_step = 1e-3; },
       "decode.allreduce_s_per_step: a one-chip group has no tensor-parallel all-reduce"},
      {"negative all-reduce",
       [](PlanInputs& in) {
         in.decode.chips_per_group = 2;
         in.decode.allreduce_s_per_step = -1e-3;
       },
       "decode.allreduce_s_per_step: must not be negative"},
      {"zero prefill groups", [](PlanInputs& in) { in.prefill.groups = 0; }, "prefill.groups: must be positive"},
      {"zero prefill chips", [](PlanInputs& in) { in.prefill.chips_per_group = 0; },
       "prefill.chips_per_group: must be positive"},
      {"utilisation above 1", [](PlanInputs& in) { in.prefill.utilization = 1.5; },
       "prefill.utilization: is a fraction of peak, at most 1, got 1.5"},
      {"zero utilisation", [](PlanInputs& in) { in.prefill.utilization = 0; }, "prefill.utilization: must be positive"},
      {"negative prefill seconds", [](PlanInputs& in) { in.prefill.seconds_per_request = -1; },
       "prefill.seconds_per_request: must be positive"},
      {"zero link", [](PlanInputs& in) { in.handoff.link_bytes_per_s = 0; },
       "handoff.link_bytes_per_s: must be positive"},
      {"zero handoff bytes", [](PlanInputs& in) { in.handoff.kv_bytes_per_request = 0; },
       "handoff.kv_bytes_per_request: must be positive"},
      {"zero prompt", [](PlanInputs& in) { in.workload.prompt_tokens = 0; },
       "workload.prompt_tokens: must be positive"},
      {"history shorter than prompt", [](PlanInputs& in) { in.workload.history_tokens = 400; },
       "workload.history_tokens: 400 is less than workload.prompt_tokens (500)"},
      {"fraction of an output token", [](PlanInputs& in) { in.workload.mean_output_tokens = 0.5; },
       "workload.mean_output_tokens: must be at least 1"},
      {"zero step target", [](PlanInputs& in) { in.workload.step_time_target_s = 0; },
       "workload.step_time_target_s: must be positive"},
      {"negative target rate", [](PlanInputs& in) { in.workload.target_requests_per_s = -3; },
       "workload.target_requests_per_s: must be positive, got -3 (negative)"},
      {"zero table batch",
       [](PlanInputs& in) {
         in.table_batches = {1, 0};
       },
       "report.batch_sizes: must be positive, got 0"},
      {"table batch off the request-sharded grid",
       [](PlanInputs& in) {
         in.decode.kv_layout = KvLayout::kRequestSharded;
         in.decode.chips_per_group = 4;
         in.decode.exchange_s_per_step = 0;
         in.table_batches = {8, 6};
       },
       "report.batch_sizes: 6 is not a multiple of decode.chips_per_group (4)"},
  };
  for (const BadCase& c : cases) {
    PlanInputs in = BaseInputs();
    c.mutate(in);
    absl::Status s = Validate(in);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message)) << c.name;
  }
}

TEST(CapacityInputsTest, LayoutNamesRoundTrip) {
  for (KvLayout l : {KvLayout::kHeadSharded, KvLayout::kRequestSharded}) {
    EXPECT_EQ(*ParseKvLayout(KvLayoutName(l)), l);
  }
  EXPECT_THAT(std::string(ParseKvLayout("tp").status().message()), HasSubstr("decode.kv_layout: unknown layout 'tp'"));
}

}  // namespace
}  // namespace pdserve::capacity
