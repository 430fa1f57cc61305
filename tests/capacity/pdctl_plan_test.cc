// `pdctl plan` as a user runs it, on each shipped example config.
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <ostream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace {

using ::testing::HasSubstr;

struct Result {
  int exit_code;
  std::string out;
};

// Runs pdctl; stderr is merged into the output unless `stdout_only`.
Result RunPdctl(const std::string& args, bool stdout_only = false) {
  const std::string cmd = std::string(PDCTL_BINARY) + " " + args + (stdout_only ? " 2>/dev/null" : " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string Example(const std::string& name) { return std::string(PDSERVE_SOURCE_DIR) + "/deploy/plans/" + name; }

struct Expected {
  std::string file;
  std::string bottleneck;
  std::string limit;
};

// Names the case by its file in test listings instead of dumping its bytes.
void PrintTo(const Expected& e, std::ostream* os) { *os << e.file; }

class CapacityPdctlPlanTest : public ::testing::TestWithParam<Expected> {};

TEST_P(CapacityPdctlPlanTest, JsonReportIsConsistent) {
  const Expected& e = GetParam();
  Result r = RunPdctl("plan --config " + Example(e.file) + " --json", /*stdout_only=*/true);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const nlohmann::json& d = j["decode"];
  const nlohmann::json& st = j["stages"];
  EXPECT_EQ(d["limit"], e.limit);
  EXPECT_EQ(st["bottleneck"], e.bottleneck);
  EXPECT_GT(d["batch"].get<int64_t>(), 0);
  EXPECT_LE(d["batch"].get<int64_t>(), d["max_batch_memory"].get<int64_t>());
  EXPECT_LE(d["batch"].get<int64_t>(), d["max_batch_target"].get<int64_t>());
  EXPECT_TRUE(d["step"]["fits"].get<bool>());
  const double system = st["system_requests_per_s"].get<double>();
  EXPECT_DOUBLE_EQ(system,
                   std::min({st["prefill_requests_per_s"].get<double>(), st["handoff_requests_per_s"].get<double>(),
                             st["decode_requests_per_s"].get<double>()}));
  EXPECT_DOUBLE_EQ(st[e.bottleneck + "_requests_per_s"].get<double>(), system);
  const nlohmann::json& l = j["latency"];
  EXPECT_LT(l["total_half_itl_s"].get<double>(), l["total_s"].get<double>());
  EXPECT_LT(l["total_half_ttft_s"].get<double>(), l["total_s"].get<double>());
  EXPECT_FALSE(j["notes"].empty());
}

TEST_P(CapacityPdctlPlanTest, TextReportNamesTheKeyResults) {
  Result r = RunPdctl("plan --config " + Example(GetParam().file), /*stdout_only=*/true);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_THAT(r.out, HasSubstr("max batch (memory)"));
  EXPECT_THAT(r.out, HasSubstr("limited by " + GetParam().limit));
  EXPECT_THAT(r.out, HasSubstr("bottleneck: " + GetParam().bottleneck));
  EXPECT_THAT(r.out, HasSubstr("latency of one request: TTFT"));
}

INSTANTIATE_TEST_SUITE_P(ShippedExamples, CapacityPdctlPlanTest,
                         ::testing::Values(Expected{"llama3_70b_h100.yaml", "prefill", "memory"},
                                           Expected{"llama3_8b_h100.json", "decode", "step-time target"},
                                           Expected{"local_cpu_125m.yaml", "prefill", "step-time target"}),
                         [](const auto& info) {
                           std::string n = info.param.file.substr(0, info.param.file.find('.'));
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

TEST(CapacityPdctlPlanErrorsTest, BadConfigsFailWithTheField) {
  Result missing = RunPdctl("plan");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.out, HasSubstr("pdctl plan: --config is required"));

  const std::string path = ::testing::TempDir() + "/capacity_bad_plan.yaml";
  std::ifstream in(Example("local_cpu_125m.yaml"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  text.replace(text.find("kv_heads: 4"), 11, "kv_heads: 5");
  std::ofstream(path) << text;
  Result bad = RunPdctl("plan --config " + path);
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.out, HasSubstr(path + ": model.q_heads: 12 is not a multiple of model.kv_heads (5)"));
}

}  // namespace
