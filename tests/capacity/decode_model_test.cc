// Decode memory, step time and batch, hand-computed from the formulas in
// decode_model.h on BaseInputs() (test_inputs.h): c_kv = 4096 B, a request
// of 1000 positions holds 4.096e6 B, weights 2e9 B, 18e9 B usable per chip,
// beta = 1e12 B/s, C = 1e14 FLOP/s.
#include "router/capacity/decode_model.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/capacity/test_inputs.h"

namespace pdserve::capacity {
namespace {

using ::testing::HasSubstr;

// Relative tolerance: every expectation is a decimal computed by hand.
void ExpectClose(double got, double want) { EXPECT_NEAR(got, want, 1e-9 * std::abs(want)) << want; }

DecodePlan Plan(const PlanInputs& in) {
  EXPECT_TRUE(Validate(in).ok()) << Validate(in);
  absl::StatusOr<DecodePlan> p = PlanDecode(in);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : DecodePlan{};
}

TEST(CapacityDecodeTest, KvBytesFollowTheModelShape) {
  // 2 * L * N_kv * H * p_kv = 2 * 4 * 4 * 64 * 2.
  EXPECT_EQ(KvBytesPerToken(BaseInputs().model), 4096);
  ModelShape int8_kv = BaseInputs().model;
  int8_kv.bytes_per_kv_element = 1;
  EXPECT_EQ(KvBytesPerToken(int8_kv), 2048);
  // Weight quantization does not shrink the KV (fact 11).
  ModelShape int4_weights = BaseInputs().model;
  int4_weights.bytes_per_weight = 0.5;
  EXPECT_EQ(KvBytesPerToken(int4_weights), 4096);
}

TEST(CapacityDecodeTest, OneChipStepTime) {
  // t(B) = max(2 * 1e9 * B / 1e14, 2e9 / 1e12) + B * 4.096e6 / 1e12.
  const PlanInputs in = BaseInputs();
  const DecodeStep one = ComputeDecodeStep(in, 1);
  ExpectClose(one.projection_compute_s, 2e-5);
  ExpectClose(one.weight_read_s, 2e-3);
  ExpectClose(one.kv_read_s, 4.096e-6);
  ExpectClose(one.step_s, 2e-3 + 4.096e-6);
  EXPECT_EQ(one.bound, StepBound::kBandwidth);
  ExpectClose(one.memory_bytes_per_chip, 2e9 + 4.096e6);
  const DecodeStep big = ComputeDecodeStep(in, 200);
  ExpectClose(big.step_s, 200 * 2e-5 + 200 * 4.096e-6);  // 4.8192 ms
  EXPECT_EQ(big.bound, StepBound::kCompute);
  ExpectClose(big.tokens_per_s, 200 / 4.8192e-3);
}

TEST(CapacityDecodeTest, TheLabelIsTheBranchTheStepFormulaTook) {
  // Batch 110: projections 2.2 ms > weights 2 ms, so the formula takes the
  // compute branch: the step is 2.2 ms of FLOPs + 0.45 ms of KV reads,
  // compute-bound, with the KV read 0.45 / 2.65 of it.
  PlanInputs in = BaseInputs();
  const DecodeStep mid = ComputeDecodeStep(in, 110);
  ExpectClose(mid.step_s, 2.2e-3 + 110 * 4.096e-6);
  EXPECT_EQ(mid.bound, StepBound::kCompute);
  ExpectClose(mid.kv_share, 110 * 4.096e-6 / (2.2e-3 + 110 * 4.096e-6));
  // A 32x longer history: the formula still takes the compute branch, so
  // the step is compute-bound, though the KV read (14.4 ms) is most of it:
  // the share says so, the label does not flip.
  in.workload.history_tokens *= 32;
  const DecodeStep long_history = ComputeDecodeStep(in, 110);
  ExpectClose(long_history.step_s, 2.2e-3 + 32 * 110 * 4.096e-6);
  EXPECT_EQ(long_history.bound, StepBound::kCompute);
  EXPECT_GT(long_history.kv_share, 0.8);
  // Batch 1: the weights' read is the branch taken.
  EXPECT_EQ(ComputeDecodeStep(in, 1).bound, StepBound::kBandwidth);
}

// A 70B-class model with int8 weights and KV at S = 2048, B = 128 on one
// 8-chip group (8 KV heads, head-sharded) of H100-like chips: 2 * 8.825e9 *
// 128 / 989e12 = 2.284 ms of FLOPs against 8.825e9 / 3.35e12 = 2.634 ms of
// weights (bandwidth); at 300 TFLOP/s the FLOPs take 7.531 ms, the branch is
// the compute one, and the step (7.531 ms + 1.603 ms of KV) is compute-bound.
TEST(CapacityDecodeTest, A70bInt8StepOnTheComputeBranchIsComputeBound) {
  PlanInputs in = BaseInputs();
  in.model = {.name = "70b-class",
              .layers = 80,
              .hidden = 8192,
              .q_heads = 64,
              .kv_heads = 8,
              .head_dim = 128,
              .params = 70.6e9,
              .bytes_per_weight = 1,
              .bytes_per_kv_element = 1};
  in.chip.memory_bytes = 80e9;
  in.chip.reserved_bytes = 8e9;
  in.chip.bandwidth_bytes_per_s = 3.35e12;
  in.chip.peak_flops = 989e12;
  in.decode.chips_per_group = 8;
  in.workload.history_tokens = 2048;
  const DecodeStep h100 = ComputeDecodeStep(in, 128);
  ExpectClose(h100.projection_compute_s, 2 * 8.825e9 * 128 / 989e12);
  ExpectClose(h100.weight_read_s, 8.825e9 / 3.35e12);
  EXPECT_EQ(h100.bound, StepBound::kBandwidth);
  in.chip.peak_flops = 300e12;
  const DecodeStep slow = ComputeDecodeStep(in, 128);
  const double kv = 2.0 * 80 * 8 * 128 * 2048 * 128 / 8 / 3.35e12;
  ExpectClose(slow.step_s, 2 * 8.825e9 * 128 / 300e12 + kv);
  EXPECT_EQ(slow.bound, StepBound::kCompute);
  ExpectClose(slow.kv_share, kv / slow.step_s);
}

TEST(CapacityDecodeTest, ComputeBoundBatchIsWeightBytesTimesFlopsOverTwiceBandwidth) {
  PlanInputs in = BaseInputs();
  ExpectClose(Plan(in).compute_bound_batch, 100);  // 2 * 1e14 / (2 * 1e12)
  // Split over chips, both sides shrink alike: the crossing does not move.
  in.decode.chips_per_group = 4;
  ExpectClose(Plan(in).compute_bound_batch, 100);
  // int8 weights halve the bytes, not the multiply-adds (fact 11).
  in.model.bytes_per_weight = 1;
  ExpectClose(Plan(in).compute_bound_batch, 50);
  // At the crossing the two projection terms are equal.
  in.decode.chips_per_group = 1;
  in.model.bytes_per_weight = 2;
  const DecodeStep at = ComputeDecodeStep(in, 100);
  ExpectClose(at.projection_compute_s, at.weight_read_s);
}

// The four binding constraints: the batch stops at memory or at the target,
// and the step it runs is compute- or bandwidth-bound.
TEST(CapacityDecodeTest, TargetBindsAndTheStepIsComputeBound) {
  // Above B = 100: t = B * (2e-5 + 4.096e-6) = 2.4096e-5 B <= 0.05 -> B <= 2075.03.
  // Memory: floor((18e9 - 2e9) / 4.096e6) = floor(3906.25) = 3906.
  const DecodePlan p = Plan(BaseInputs());
  EXPECT_EQ(p.max_batch_memory, 3906);
  EXPECT_EQ(p.max_batch_target, 2075);
  EXPECT_EQ(p.limit, BatchLimit::kStepTimeTarget);
  EXPECT_EQ(p.step.batch, 2075);
  ExpectClose(p.step.step_s, 2075 * 2.4096e-5);
  EXPECT_EQ(p.step.bound, StepBound::kCompute);  // 41.5 ms of FLOPs vs 10.5 ms of reads
}

TEST(CapacityDecodeTest, MemoryBindsAndTheStepIsComputeBound) {
  PlanInputs in = BaseInputs();
  in.workload.step_time_target_s = 1;  // allows 41500
  const DecodePlan p = Plan(in);
  EXPECT_EQ(p.max_batch_target, 41500);
  EXPECT_EQ(p.limit, BatchLimit::kMemory);
  EXPECT_EQ(p.step.batch, 3906);
  ExpectClose(p.step.step_s, 3906 * 2.4096e-5);
  EXPECT_EQ(p.step.bound, StepBound::kCompute);
  EXPECT_TRUE(p.step.fits);
  EXPECT_FALSE(ComputeDecodeStep(in, 3907).fits);
}

TEST(CapacityDecodeTest, MemoryBindsAndTheStepIsBandwidthBound) {
  // A 100000-position history: 409.6 MB per request, floor(16e9 / 409.6e6) = 39.
  // t(39) = max(7.8e-4, 2e-3) + 39 * 4.096e-4 = 17.9744 ms < 50 ms.
  PlanInputs in = BaseInputs();
  in.workload.history_tokens = 100000;
  const DecodePlan p = Plan(in);
  EXPECT_EQ(p.max_batch_memory, 39);
  EXPECT_EQ(p.limit, BatchLimit::kMemory);
  ExpectClose(p.step.step_s, 2e-3 + 39 * 4.096e-4);
  EXPECT_EQ(p.step.bound, StepBound::kBandwidth);
}

TEST(CapacityDecodeTest, TargetBindsAndTheStepIsBandwidthBound) {
  // t(B) = 2e-3 + 4.096e-4 B <= 0.01 -> B <= 19.53.
  PlanInputs in = BaseInputs();
  in.workload.history_tokens = 100000;
  in.workload.step_time_target_s = 0.01;
  const DecodePlan p = Plan(in);
  EXPECT_EQ(p.limit, BatchLimit::kStepTimeTarget);
  EXPECT_EQ(p.step.batch, 19);
  ExpectClose(p.step.step_s, 2e-3 + 19 * 4.096e-4);
  EXPECT_EQ(p.step.bound, StepBound::kBandwidth);
}

TEST(CapacityDecodeTest, HeadShardedSplitsKvHeadsOverChips) {
  // 2 chips, 4 KV heads: half of each request per chip, half the weights.
  PlanInputs in = BaseInputs();
  in.decode.chips_per_group = 2;
  const DecodePlan p = Plan(in);
  EXPECT_EQ(p.kv_copies, 1);
  ExpectClose(p.kv_bytes_per_token_per_chip, 2048);
  ExpectClose(p.kv_bytes_per_request, 4.096e6);
  ExpectClose(p.kv_bytes_per_request_per_chip, 2.048e6);
  ExpectClose(p.weight_bytes_per_chip, 1e9);
  EXPECT_EQ(p.max_batch_memory, 8300);  // floor((18e9 - 1e9) / 2.048e6) = floor(8300.78)
}

TEST(CapacityDecodeTest, HeadShardedReplicatesKvWhenChipsOutnumberKvHeads) {
  // 8 chips, 4 KV heads: two chips hold each head, so a chip still holds
  // 1/min(8, 4) = 1/4 of a request; only the weights keep shrinking.
  PlanInputs in = BaseInputs();
  in.decode.chips_per_group = 8;
  const DecodePlan p8 = Plan(in);
  EXPECT_EQ(p8.kv_copies, 2);
  ExpectClose(p8.kv_bytes_per_request_per_chip, 1.024e6);
  ExpectClose(p8.weight_bytes_per_chip, 0.25e9);
  EXPECT_EQ(p8.max_batch_memory, 17333);  // floor(17.75e9 / 1.024e6) = floor(17333.98)
  // t(100) = max(2 * 1.25e8 * 100 / 1e14, 0.25e9 / 1e12) + 100 * 1.024e6 / 1e12.
  ExpectClose(ComputeDecodeStep(in, 100).step_s, 2.5e-4 + 1.024e-4);

  // Doubling the chips past the KV heads leaves the KV per chip where 4 chips put it.
  const double kv_read_8 = ComputeDecodeStep(in, 100).kv_read_s;
  in.decode.chips_per_group = 4;
  const DecodePlan p4 = Plan(in);
  EXPECT_EQ(p4.kv_copies, 1);
  ExpectClose(p4.kv_bytes_per_request_per_chip, p8.kv_bytes_per_request_per_chip);
  ExpectClose(ComputeDecodeStep(in, 100).kv_read_s, kv_read_8);
}

TEST(CapacityDecodeTest, RequestShardedKeepsWholeRequestsAndAddsTheExchange) {
  // 4 chips, exchange 1 ms: t(B) = max(5e-6 B, 5e-4) + (B / 4) * 4.096e-6 + 1e-3.
  PlanInputs in = BaseInputs();
  in.decode.kv_layout = KvLayout::kRequestSharded;
  in.decode.chips_per_group = 4;
  in.decode.exchange_s_per_step = 1e-3;
  const DecodeStep s = ComputeDecodeStep(in, 400);
  ExpectClose(s.kv_bytes_per_chip, 100 * 4.096e6);
  ExpectClose(s.step_s, 400 * 5e-6 + 100 * 4.096e-6 + 1e-3);
  const DecodePlan p = Plan(in);
  EXPECT_EQ(p.kv_copies, 1);
  ExpectClose(p.kv_bytes_per_request_per_chip, 4.096e6);
  ExpectClose(p.kv_bytes_per_token_per_chip, 4096);

  // With 8 chips on 4 KV heads the request-sharded layout holds half the KV
  // per chip that head-sharding (replicated twice) does.
  in.decode.chips_per_group = 8;
  PlanInputs heads = in;
  heads.decode.kv_layout = KvLayout::kHeadSharded;
  heads.decode.exchange_s_per_step.reset();
  ExpectClose(ComputeDecodeStep(in, 64).kv_bytes_per_chip, 8 * 4.096e6);
  ExpectClose(ComputeDecodeStep(heads, 64).kv_bytes_per_chip, 64 * 1.024e6);
}

TEST(CapacityDecodeTest, RequestShardedBatchIsAMultipleOfTheChips) {
  PlanInputs in = BaseInputs();
  in.decode.kv_layout = KvLayout::kRequestSharded;
  in.decode.chips_per_group = 4;
  in.decode.exchange_s_per_step = 1e-3;
  in.workload.step_time_target_s = 0.006;
  // Target: 6.024e-6 B + 1e-3 <= 6e-3 -> B <= 830.02, rounded down to 828.
  // Memory: 4 * floor((18e9 - 0.5e9) / 4.096e6) = 4 * 4272 = 17088 (not 17089).
  const DecodePlan p = Plan(in);
  EXPECT_EQ(p.max_batch_target, 828);
  EXPECT_EQ(p.max_batch_memory, 17088);
  EXPECT_EQ(p.step.batch, 828);
  ExpectClose(p.step.step_s, 828 * 6.024e-6 + 1e-3);

  // Memory binding rounds down too.
  in.workload.step_time_target_s = 1;
  EXPECT_EQ(Plan(in).step.batch, 17088);
}

TEST(CapacityDecodeTest, AllReduceIsCountedOnlyWhenGiven) {
  PlanInputs in = BaseInputs();
  in.decode.chips_per_group = 2;
  const double without = ComputeDecodeStep(in, 10).step_s;
  in.decode.allreduce_s_per_step = 2e-3;
  const DecodeStep with = ComputeDecodeStep(in, 10);
  ExpectClose(with.allreduce_s, 2e-3);
  ExpectClose(with.step_s, without + 2e-3);
}

TEST(CapacityDecodeTest, CostPerMillionTokens) {
  // 3.6 per chip-hour = 0.001 per chip-second; 2075 tokens every 2075 * 2.4096e-5 s.
  PlanInputs in = BaseInputs();
  in.chip.price_per_hour = 3.6;
  const DecodePlan p = Plan(in);
  ASSERT_TRUE(p.cost_per_million_tokens.has_value());
  ExpectClose(*p.cost_per_million_tokens, 0.001 * 2.4096e-5 * 1e6);
  EXPECT_FALSE(Plan(BaseInputs()).cost_per_million_tokens.has_value());
}

TEST(CapacityDecodeTest, TableRowsFollowTheRequestedBatches) {
  PlanInputs in = BaseInputs();
  in.table_batches = {1, 100, 5000};
  const DecodePlan p = Plan(in);
  ASSERT_EQ(p.table.size(), 3u);
  EXPECT_EQ(p.table[1].batch, 100);
  ExpectClose(p.table[1].step_s, 2e-3 + 100 * 4.096e-6);
  EXPECT_TRUE(p.table[1].fits);
  EXPECT_FALSE(p.table[2].fits);  // past the 3906 memory allows
}

TEST(CapacityDecodeTest, InfeasibleDeploymentsNameTheField) {
  PlanInputs heavy = BaseInputs();
  heavy.model.params = 10e9;  // 20 GB of weights on one chip with 18 GB usable
  EXPECT_THAT(std::string(PlanDecode(heavy).status().message()),
              HasSubstr("decode.chips_per_group: weights per chip (20.000 GB) leave no room for KV"));

  PlanInputs long_history = BaseInputs();
  long_history.workload.history_tokens = 10'000'000;  // 40.96 GB per request
  EXPECT_THAT(std::string(PlanDecode(long_history).status().message()),
              HasSubstr("workload.history_tokens: the KV of a batch of 1"));

  PlanInputs request_sharded = BaseInputs();
  request_sharded.decode.kv_layout = KvLayout::kRequestSharded;
  request_sharded.decode.chips_per_group = 4;
  request_sharded.decode.exchange_s_per_step = 0;
  request_sharded.workload.history_tokens = 5'000'000;  // 20.48 GB: not one request per chip
  EXPECT_THAT(std::string(PlanDecode(request_sharded).status().message()), HasSubstr("the KV of a batch of 4"));

  PlanInputs fast = BaseInputs();
  fast.workload.step_time_target_s = 1e-3;  // t(1) = 2.004096 ms
  absl::Status s = PlanDecode(fast).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("workload.step_time_target_s: 0.001 s is below the step time at the smallest batch (1)"));
}

}  // namespace
}  // namespace pdserve::capacity
