// pdctl as a user runs it: the real binary, its output parsed.
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace {

struct Result {
  int exit_code;
  std::string out;
};

Result RunPdctl(const std::string& args) {
  const std::string cmd = std::string(PDCTL_BINARY) + " " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

const std::string kModel = std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/models/llama_untied_bf16";

TEST(PdctlTest, LogitsPrintsOneJsonArrayPerPosition) {
  std::ifstream f(kModel + "/reference_logits.json");
  const nlohmann::json ref = nlohmann::json::parse(f);
  const auto ids = ref["cases"][0]["token_ids"].get<std::vector<int>>();
  std::string id_list;
  for (size_t i = 0; i < 6; ++i) id_list += (i ? "," : "") + std::to_string(ids[i]);
  Result r = RunPdctl("logits --model " + kModel + " --token-ids " + id_list +
                 " --all-positions --weights f32 --threads 2");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  std::istringstream lines(r.out);
  std::string line;
  int pos = 0;
  while (std::getline(lines, line)) {
    const auto row = nlohmann::json::parse(line).get<std::vector<double>>();
    const auto want = ref["cases"][0]["logits"][pos].get<std::vector<double>>();
    ASSERT_EQ(row.size(), want.size());
    for (size_t v = 0; v < row.size(); ++v) EXPECT_NEAR(row[v], want[v], 1e-3) << pos << "," << v;
    ++pos;
  }
  EXPECT_EQ(pos, 6);
  Result last = RunPdctl("logits --model " + kModel + " --token-ids " + id_list);
  ASSERT_EQ(last.exit_code, 0);
  EXPECT_EQ(std::count(last.out.begin(), last.out.end(), '\n'), 1);
}

TEST(PdctlTest, GenerateIsGreedyAndDeterministic) {
  Result a = RunPdctl("generate --model " + kModel + " --prompt-ids 1,17,42 --max-tokens 8");
  Result b = RunPdctl("generate --model " + kModel + " --prompt-ids 1,17,42 --max-tokens 8 --threads 2 --isa scalar");
  ASSERT_EQ(a.exit_code, 0) << a.out;
  ASSERT_EQ(b.exit_code, 0) << b.out;
  EXPECT_EQ(a.out, b.out);
  EXPECT_THAT(a.out, ::testing::MatchesRegex("[0-9]+(,[0-9]+){0,7}\n"));
}

TEST(PdctlTest, ErrorsAreClearAndNonZero) {
  Result r = RunPdctl("logits --model /nonexistent/dir --token-ids 1");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, ::testing::HasSubstr("/nonexistent/dir/config.json: no such file"));
  r = RunPdctl("logits --model " + kModel + " --token-ids 1,x");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, ::testing::HasSubstr("--token-ids: 'x' is not a non-negative integer"));
  r = RunPdctl("logits --model " + kModel + " --token-ids 1,100000");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, ::testing::HasSubstr("outside the vocabulary"));
  r = RunPdctl("logits --model " + kModel + " --token-ids 1 --weights int3");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, ::testing::HasSubstr("--weights"));
  r = RunPdctl("frobnicate");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.out, ::testing::HasSubstr("unknown command"));
}

TEST(PdctlTest, MakeModelWritesALoadableModel) {
  const std::string dir = ::testing::TempDir() + "/pdctl_make_model";
  Result r = RunPdctl("make-model --shape tiny --dtype bf16 --out " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  Result g = RunPdctl("generate --model " + dir + " --prompt-ids 3,4 --max-tokens 3");
  EXPECT_EQ(g.exit_code, 0) << g.out;
}

}  // namespace
