// The three stages, the target-rate inversion, latency and cost, on
// BaseInputs() (test_inputs.h). By hand:
//   prefill: 2 * 1e9 * 500 = 1e12 FLOP of projections; attention
//            4 * 64 * 16 * 4 * 500 * 501 / 2 = 2.052096e9 FLOP; at 0.5 of
//            1e14 FLOP/s: 20 ms and 20.04104192 ms per request.
//   handoff: 500 positions * 4096 B = 2.048e6 B per request.
//   decode:  B = 2075 at t = 2075 * 2.4096e-5 s (decode_model_test.cc), so a
//            group finishes 2075 / t / 100 = 1 / 2.4096e-3 = 415.0066 req/s.
#include "router/capacity/stage_model.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "router/capacity/capacity_model.h"
#include "tests/capacity/test_inputs.h"

namespace pdserve::capacity {
namespace {

using ::testing::HasSubstr;

void ExpectClose(double got, double want) { EXPECT_NEAR(got, want, 1e-9 * std::abs(want)) << want; }

constexpr double kPrefillS = 0.02004104192;
constexpr double kDecodeGroupRate = 1 / 2.4096e-3;
constexpr double kHandoffBytes = 2.048e6;

SystemPlan Plan(const PlanInputs& in) {
  absl::StatusOr<CapacityPlan> p = PlanCapacity(in);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? p->system : SystemPlan{};
}

TEST(CapacityStageTest, PrefillTimeWithAndWithoutAttention) {
  const PrefillEstimate e = EstimatePrefill(BaseInputs());
  ExpectClose(e.projection_flops, 1e12);
  ExpectClose(e.attention_flops, 2.052096e9);
  ExpectClose(e.projections_only_s, 0.02);
  ExpectClose(e.with_attention_s, kPrefillS);
  ExpectClose(e.seconds_per_request, kPrefillS);
  EXPECT_FALSE(e.seconds_given);

  // Two chips per group at full utilisation: four times faster.
  PlanInputs in = BaseInputs();
  in.prefill.chips_per_group = 2;
  in.prefill.utilization = 1;
  ExpectClose(EstimatePrefill(in).with_attention_s, kPrefillS / 4);
  // A measured time replaces the estimate; both estimates are still reported.
  in.prefill.seconds_per_request = 0.5;
  const PrefillEstimate given = EstimatePrefill(in);
  EXPECT_TRUE(given.seconds_given);
  ExpectClose(given.seconds_per_request, 0.5);
  ExpectClose(given.projections_only_s, 0.005);
}

TEST(CapacityStageTest, CachedPrefixesAreNotComputedAndTheSecondTiersReadBackCanBoundThePrefill) {
  // 30 % of the 500 prompt tokens from the pool and 40 % from tier 2:
  // c = 350 cached, 150 computed. Projections 2 * 1e9 * 150 = 3e11 FLOP;
  // attention 4 * 64 * 16 * 4 * (500 * 501 - 350 * 351) / 2 = 1.0457088e9;
  // at 5e13 FLOP/s: 6.020914176 ms. Tier 2 reads 500 * 0.4 * 4096 B =
  // 819,200 B per request: at 1e8 B/s, 8.192 ms, longer than the compute.
  PlanInputs in = BaseInputs();
  in.prefix.pool_hit_rate = 0.3;
  in.prefix.tier2_hit_rate = 0.4;
  in.prefix.tier2_read_bytes_per_s = 1e8;
  in.prefix.tier2_bytes_per_group = 4e9;
  const SystemPlan p = Plan(in);
  ExpectClose(p.prefill.cached_tokens, 350);
  ExpectClose(p.prefill.computed_tokens, 150);
  ExpectClose(p.prefill.projection_flops, 3e11);
  ExpectClose(p.prefill.attention_flops, 1.0457088e9);
  ExpectClose(p.prefill.seconds_per_request, 6.020914176e-3);
  ExpectClose(p.tier2.bytes_per_request, 819200);
  ExpectClose(p.tier2.seconds_per_request, 8.192e-3);
  EXPECT_TRUE(p.tier2.bounds_prefill);
  ExpectClose(p.prefill_group_seconds, 8.192e-3);
  ExpectClose(p.rates.prefill, 1 / 8.192e-3);
  ExpectClose(p.latency.ttft_s, 6.020914176e-3 + 8.192e-3);
  ExpectClose(p.tier2.prompts_held, 4e9 / (500 * 4096.0));
  // A faster disk: the compute sets the rate again.
  in.prefix.tier2_read_bytes_per_s = 1e9;
  const SystemPlan fast = Plan(in);
  EXPECT_FALSE(fast.tier2.bounds_prefill);
  ExpectClose(fast.rates.prefill, 1 / 6.020914176e-3);
}

TEST(CapacityStageTest, PrefillIsTheBottleneck) {
  // prefill 1 / 20.04 ms = 49.90; handoff 1e9 / 2.048e6 = 488.3; decode 415.0.
  const SystemPlan p = Plan(BaseInputs());
  ExpectClose(p.rates.prefill, 1 / kPrefillS);
  ExpectClose(p.rates.handoff, 1e9 / kHandoffBytes);
  ExpectClose(p.rates.decode, kDecodeGroupRate);
  ExpectClose(p.rates.system, 1 / kPrefillS);
  EXPECT_EQ(p.rates.bottleneck, Stage::kPrefill);
  ExpectClose(p.handoff_kv_bytes_per_request, kHandoffBytes);
  EXPECT_FALSE(p.handoff_bytes_given);
}

TEST(CapacityStageTest, DecodeIsTheBottleneck) {
  // 10 prefill groups: 499.0 req/s; decode stays at 415.0.
  PlanInputs in = BaseInputs();
  in.prefill.groups = 10;
  const SystemPlan p = Plan(in);
  ExpectClose(p.rates.prefill, 10 / kPrefillS);
  EXPECT_EQ(p.rates.bottleneck, Stage::kDecode);
  ExpectClose(p.rates.system, kDecodeGroupRate);
  // Adding decode groups moves the bottleneck to the handoff link (488.3).
  in.decode.groups = 2;
  const SystemPlan two = Plan(in);
  ExpectClose(two.rates.decode, 2 * kDecodeGroupRate);
  EXPECT_EQ(two.rates.bottleneck, Stage::kHandoff);
}

TEST(CapacityStageTest, HandoffIsTheBottleneck) {
  // A given 8e6 B per request over 1e9 B/s: 125 req/s, below prefill 499 and decode 830.
  PlanInputs in = BaseInputs();
  in.prefill.groups = 10;
  in.decode.groups = 2;
  in.handoff.kv_bytes_per_request = 8e6;
  const SystemPlan p = Plan(in);
  EXPECT_TRUE(p.handoff_bytes_given);
  ExpectClose(p.rates.handoff, 125);
  ExpectClose(p.rates.system, 125);
  EXPECT_EQ(p.rates.bottleneck, Stage::kHandoff);
}

TEST(CapacityStageTest, AddingToANonBottleneckPoolBuysNothing) {
  PlanInputs in = BaseInputs();
  const double before = Plan(in).rates.system;
  in.decode.groups = 5;
  ExpectClose(Plan(in).rates.system, before);
}

TEST(CapacityStageTest, CombineStagesTakesTheMinimum) {
  const StageRates r = CombineStages(3, 2, 1);
  EXPECT_EQ(r.bottleneck, Stage::kDecode);
  EXPECT_EQ(r.system, 1);
  EXPECT_EQ(CombineStages(2, 1, 3).bottleneck, Stage::kHandoff);
  EXPECT_EQ(CombineStages(1, 2, 3).bottleneck, Stage::kPrefill);
  EXPECT_EQ(CombineStages(2, 2, 2).bottleneck, Stage::kPrefill);  // ties go to the earlier stage
}

TEST(CapacityStageTest, TargetRateInversion) {
  // 1000 req/s: ceil(1000 * 20.04104192 ms) = 21 prefill groups,
  // ceil(1000 / 415.0066) = ceil(2.4096) = 3 decode groups, 2.048e9 B/s of link.
  PlanInputs in = BaseInputs();
  in.workload.target_requests_per_s = 1000;
  const SystemPlan p = Plan(in);
  ASSERT_TRUE(p.target.has_value());
  EXPECT_EQ(p.target->prefill_groups, 21);
  EXPECT_EQ(p.target->decode_groups, 3);
  ExpectClose(p.target->link_bytes_per_s, 2.048e9);
  EXPECT_FALSE(Plan(BaseInputs()).target.has_value());

  // Exactly two groups' worth needs two groups, not three.
  in.prefill.seconds_per_request = 0.02;
  in.workload.target_requests_per_s = 100;
  EXPECT_EQ(Plan(in).target->prefill_groups, 2);

  // The sized deployment sustains the target.
  in = BaseInputs();
  in.workload.target_requests_per_s = 1000;
  in.prefill.groups = p.target->prefill_groups;
  in.decode.groups = p.target->decode_groups;
  in.handoff.link_bytes_per_s = p.target->link_bytes_per_s;
  EXPECT_GE(Plan(in).rates.system, 1000 * (1 - 1e-12));
}

TEST(CapacityStageTest, EndToEndLatencyFromTtftAndItl) {
  // total = TTFT + (N_out - 1) * ITL = 0.2 + 100 * 0.05.
  const Latency l = EndToEndLatency(0.2, 0.05, 101);
  ExpectClose(l.total_s, 5.2);
  ExpectClose(l.total_half_ttft_s, 5.1);
  ExpectClose(l.total_half_itl_s, 2.7);
  // One output token: the ITL does not enter.
  ExpectClose(EndToEndLatency(0.2, 0.05, 1).total_s, 0.2);

  // From the plan: TTFT is the prefill time, ITL the step at the operating batch.
  const SystemPlan p = Plan(BaseInputs());
  ExpectClose(p.latency.ttft_s, kPrefillS);
  ExpectClose(p.latency.itl_s, 2075 * 2.4096e-5);
  ExpectClose(p.latency.total_s, kPrefillS + 99 * 2075 * 2.4096e-5);
}

TEST(CapacityStageTest, SystemCostCountsBothPoolsAtTheSystemRate) {
  // 2 chips at 0.001 per chip-second; 49.90 req/s * 100 tokens.
  PlanInputs in = BaseInputs();
  in.chip.price_per_hour = 3.6;
  const SystemPlan p = Plan(in);
  EXPECT_EQ(p.total_chips, 2);
  ASSERT_TRUE(p.cost_per_million_tokens.has_value());
  ExpectClose(*p.cost_per_million_tokens, 0.002 * 1e6 * kPrefillS / 100);
  // A decode group the bottleneck does not need only adds cost.
  in.decode.groups = 3;
  EXPECT_GT(*Plan(in).cost_per_million_tokens, *p.cost_per_million_tokens);
}

TEST(CapacityStageTest, PrefillWeightsMustFit) {
  PlanInputs in = BaseInputs();
  in.model.params = 10e9;         // 20 GB of weights
  in.decode.chips_per_group = 2;  // 10 GB per decode chip fits
  absl::StatusOr<CapacityPlan> p = PlanCapacity(in);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("prefill.chips_per_group: weights per chip (20.000 GB)"));
  in.prefill.chips_per_group = 2;
  EXPECT_TRUE(PlanCapacity(in).ok());
}

}  // namespace
}  // namespace pdserve::capacity
