// Config files: JSON and YAML read into the same inputs; every structural
// error names its field; the shipped examples load and plan.
#include "router/capacity/plan_config.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "router/capacity/capacity_model.h"

namespace pdserve::capacity {
namespace {

using ::testing::HasSubstr;

constexpr char kJson[] = R"({
  "notes": ["a note"],
  "model": {"name": "m", "layers": 4, "hidden": 1024, "q_heads": 16, "kv_heads": 4, "head_dim": 64,
            "params": 1e9, "bytes_per_weight": 2, "bytes_per_kv_element": 2},
  "chip": {"memory_bytes": 20e9, "reserved_bytes": 2e9, "bandwidth_bytes_per_s": 1e12, "peak_flops": 1e14,
           "price_per_hour": 3.6},
  "decode": {"groups": 1, "chips_per_group": 4, "kv_layout": "request-sharded", "exchange_s_per_step": 0.001},
  "prefill": {"groups": 2, "chips_per_group": 1, "utilization": 0.5},
  "handoff": {"link_bytes_per_s": 1e9},
  "workload": {"prompt_tokens": 500, "history_tokens": 1000, "mean_output_tokens": 100,
               "step_time_target_s": 0.05, "target_requests_per_s": 10},
  "prefix": {"pool_hit_rate": 0.25, "tier2_hit_rate": 0.5, "tier2_read_bytes_per_s": 2e9},
  "report": {"batch_sizes": [4, 8]}
})";

constexpr char kYaml[] = R"(
notes: a note   # a string is one note
model:
  name: m
  layers: 4
  hidden: 1024
  q_heads: 16
  kv_heads: 4
  head_dim: 64
  params: 1e9
  bytes_per_weight: 2
  bytes_per_kv_element: 2
chip:
  memory_bytes: 20e9
  reserved_bytes: 2e9
  bandwidth_bytes_per_s: 1.0e12
  peak_flops: 1e14
  price_per_hour: 3.6
decode: {groups: 1, chips_per_group: 4, kv_layout: request-sharded, exchange_s_per_step: 0.001}
prefill: {groups: 2, chips_per_group: 1, utilization: 0.5}
handoff:
  link_bytes_per_s: 1e9
workload:
  prompt_tokens: 500
  history_tokens: 1000
  mean_output_tokens: 100
  step_time_target_s: 0.05
  target_requests_per_s: 10
prefix: {pool_hit_rate: 0.25, tier2_hit_rate: 0.5, tier2_read_bytes_per_s: 2e9}
report:
  batch_sizes: [4, 8]
)";

std::string Error(absl::string_view text, ConfigFormat format = ConfigFormat::kJson) {
  absl::StatusOr<PlanInputs> in = ParsePlanConfig(text, format);
  EXPECT_FALSE(in.ok());
  EXPECT_EQ(in.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(in.status().message());
}

// kJson with `from` replaced by `to` (exactly one occurrence).
std::string JsonWith(const std::string& from, const std::string& to) {
  std::string s = kJson;
  const size_t at = s.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  EXPECT_EQ(s.find(from, at + 1), std::string::npos) << from;
  return s.replace(at, from.size(), to);
}

TEST(CapacityConfigTest, JsonAndYamlReadTheSame) {
  absl::StatusOr<PlanInputs> j = ParsePlanConfig(kJson, ConfigFormat::kJson);
  absl::StatusOr<PlanInputs> y = ParsePlanConfig(kYaml, ConfigFormat::kYaml);
  ASSERT_TRUE(j.ok()) << j.status();
  ASSERT_TRUE(y.ok()) << y.status();
  for (const PlanInputs* in : {&*j, &*y}) {
    EXPECT_EQ(in->notes, std::vector<std::string>{"a note"});
    EXPECT_EQ(in->model.name, "m");
    EXPECT_EQ(in->model.layers, 4);
    EXPECT_EQ(in->model.params, 1e9);
    EXPECT_EQ(in->chip.memory_bytes, 20e9);
    EXPECT_EQ(in->chip.bandwidth_bytes_per_s, 1e12);
    EXPECT_EQ(in->chip.price_per_hour, 3.6);
    EXPECT_EQ(in->decode.kv_layout, KvLayout::kRequestSharded);
    EXPECT_EQ(in->decode.chips_per_group, 4);
    EXPECT_EQ(in->decode.exchange_s_per_step, 0.001);
    EXPECT_FALSE(in->decode.allreduce_s_per_step.has_value());
    EXPECT_EQ(in->prefill.groups, 2);
    EXPECT_FALSE(in->prefill.seconds_per_request.has_value());
    EXPECT_EQ(in->handoff.link_bytes_per_s, 1e9);
    EXPECT_EQ(in->workload.history_tokens, 1000);
    EXPECT_EQ(in->workload.target_requests_per_s, 10);
    EXPECT_EQ(in->table_batches, (std::vector<int64_t>{4, 8}));
    EXPECT_EQ(in->prefix.pool_hit_rate, 0.25);
    EXPECT_EQ(in->prefix.tier2_hit_rate, 0.5);
    EXPECT_EQ(in->prefix.tier2_read_bytes_per_s, 2e9);
    EXPECT_FALSE(in->prefix.tier2_bytes_per_group.has_value());
    EXPECT_TRUE(PlanCapacity(*in).ok());
  }
}

TEST(CapacityConfigTest, StructuralErrorsNameTheField) {
  EXPECT_THAT(Error(JsonWith(R"("layers": 4, )", "")), HasSubstr("model.layers is missing"));
  EXPECT_THAT(Error(JsonWith(R"("layers": 4)", R"("layers": "4")")),
              HasSubstr("model.layers must be an integer, got string"));
  EXPECT_THAT(Error(JsonWith(R"("layers": 4)", R"("layers": 4.5)")),
              HasSubstr("model.layers must be an integer, got 4.5"));
  EXPECT_THAT(Error(JsonWith(R"("params": 1e9)", R"("params": null)")),
              HasSubstr("model.params must be a number, got null"));
  EXPECT_THAT(Error(JsonWith(R"("layers": 4)", R"("layer": 4)")), HasSubstr("model.layers is missing"));
  EXPECT_THAT(Error(JsonWith(R"("name": "m", )", R"("name": "m", "layer": 4, )")),
              HasSubstr("model.layer is not a known field"));
  EXPECT_THAT(Error(JsonWith(R"("handoff": {"link_bytes_per_s": 1e9},)", "")), HasSubstr("handoff is missing"));
  EXPECT_THAT(Error(JsonWith(R"("handoff": {"link_bytes_per_s": 1e9})", R"("handoff": 1e9)")),
              HasSubstr("handoff must be an object, got number"));
  EXPECT_THAT(Error(JsonWith(R"("notes": ["a note"],)", R"("note": "x",)")), HasSubstr("note is not a known section"));
  EXPECT_THAT(Error(JsonWith(R"("notes": ["a note"],)", R"("notes": [1],)")),
              HasSubstr("notes must be a string or a list of strings"));
  EXPECT_THAT(Error(JsonWith(R"("request-sharded")", R"("tp")")), HasSubstr("decode.kv_layout: unknown layout 'tp'"));
  EXPECT_THAT(Error(JsonWith(R"("kv_layout": "request-sharded", )", "")), HasSubstr("decode.kv_layout is missing"));
  EXPECT_THAT(Error(JsonWith(R"([4, 8])", R"([4, "8"])")),
              HasSubstr("report.batch_sizes must be an integer, got string"));
  EXPECT_THAT(Error("[1, 2]"), HasSubstr("the config must be an object, got array"));
  EXPECT_THAT(Error(R"({"model": )"), HasSubstr("JSON: "));
  // The report section is optional.
  EXPECT_TRUE(ParsePlanConfig(JsonWith(R"(,
  "report": {"batch_sizes": [4, 8]})",
                                       ""),
                              ConfigFormat::kJson)
                  .ok());
}

TEST(CapacityConfigTest, YamlErrors) {
  EXPECT_THAT(Error("model: [1, 2", ConfigFormat::kYaml), HasSubstr("YAML: "));
  std::string quoted = kYaml;
  quoted.replace(quoted.find("layers: 4"), 9, "layers: \"4\"");
  EXPECT_THAT(Error(quoted, ConfigFormat::kYaml), HasSubstr("model.layers must be an integer, got string"));
  std::string empty = kYaml;
  empty.replace(empty.find("head_dim: 64"), 12, "head_dim:");
  EXPECT_THAT(Error(empty, ConfigFormat::kYaml), HasSubstr("model.head_dim must be an integer, got null"));
}

TEST(CapacityConfigTest, ValuesAreRangeCheckedByTheModel) {
  absl::StatusOr<PlanInputs> in =
      ParsePlanConfig(JsonWith(R"("kv_heads": 4)", R"("kv_heads": -4)"), ConfigFormat::kJson);
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_THAT(std::string(PlanCapacity(*in).status().message()),
              HasSubstr("model.kv_heads: must be positive, got -4 (negative)"));
}

TEST(CapacityConfigTest, LoadNamesTheFile) {
  EXPECT_THAT(std::string(LoadPlanConfig("/nonexistent/plan.json").status().message()),
              HasSubstr("/nonexistent/plan.json: cannot open"));
  EXPECT_THAT(std::string(LoadPlanConfig("plan.toml").status().message()),
              HasSubstr("plan.toml: unknown config format"));
}

TEST(CapacityConfigTest, ShippedExamplesLoadAndPlan) {
  for (const char* name : {"llama3_70b_h100.yaml", "llama3_8b_h100.json", "local_cpu_125m.yaml"}) {
    const std::string path = std::string(PDSERVE_SOURCE_DIR) + "/deploy/plans/" + name;
    absl::StatusOr<PlanInputs> in = LoadPlanConfig(path);
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_FALSE(in->notes.empty()) << name << ": state the assumptions";
    absl::StatusOr<CapacityPlan> plan = PlanCapacity(*in);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_GT(plan->decode.step.batch, 0) << name;
    EXPECT_GT(plan->system.rates.system, 0) << name;
  }
}

}  // namespace
}  // namespace pdserve::capacity
