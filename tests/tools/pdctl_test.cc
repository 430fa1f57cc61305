// pdctl as a user runs it: the real binary, its output parsed.
#include <sys/wait.h>

#include <algorithm>
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

// Runs pdctl; stderr is merged into the output unless `stdout_only`.
Result RunPdctl(const std::string& args, bool stdout_only = false) {
  const std::string cmd =
      std::string(PDCTL_BINARY) + " " + args + (stdout_only ? " 2>/dev/null" : " 2>&1");
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
  Result last = RunPdctl("logits --model " + kModel + " --token-ids " + id_list, true);
  ASSERT_EQ(last.exit_code, 0);
  EXPECT_EQ(std::count(last.out.begin(), last.out.end(), '\n'), 1);
}

TEST(PdctlTest, GenerateIsGreedyAndDeterministic) {
  Result a = RunPdctl("generate --model " + kModel + " --prompt-ids 1,17,42 --max-tokens 8", true);
  Result b = RunPdctl(
      "generate --model " + kModel + " --prompt-ids 1,17,42 --max-tokens 8 --threads 2 --isa scalar",
      true);
  ASSERT_EQ(a.exit_code, 0) << a.out;
  ASSERT_EQ(b.exit_code, 0) << b.out;
  EXPECT_EQ(a.out, b.out);
  EXPECT_THAT(a.out, ::testing::MatchesRegex("[0-9]+(,[0-9]+){0,7}\n"));
}

TEST(PdctlTest, SeededSamplingRepeatsAcrossRunsAndIsas) {
  const std::string args = "generate --model " + kModel +
                           " --prompt-ids 1,17,42 --max-tokens 12 --temperature 0.9 --top-p 0.95"
                           " --top-k 40 --seed 1234 --ignore-eos";
  Result a = RunPdctl(args, true);
  Result b = RunPdctl(args + " --isa scalar --threads 2", true);
  ASSERT_EQ(a.exit_code, 0) << a.out;
  EXPECT_EQ(a.out, b.out);
  EXPECT_THAT(RunPdctl(args).out, ::testing::HasSubstr("seed=1234 finish=length tokens=12"));
  Result other = RunPdctl("generate --model " + kModel +
                          " --prompt-ids 1,17,42 --max-tokens 12 --temperature 0.9 --seed 99 --ignore-eos",
                          true);
  EXPECT_NE(a.out.substr(0, a.out.find('\n')), other.out.substr(0, other.out.find('\n')));
  Result unseeded = RunPdctl("generate --model " + kModel + " --prompt-ids 1 --max-tokens 2 --temperature 1");
  EXPECT_THAT(unseeded.out, ::testing::ContainsRegex("seed=[0-9]+ finish="));
  Result lp = RunPdctl("generate --model " + kModel + " --prompt-ids 1,2 --max-tokens 2 --logprobs 3");
  EXPECT_THAT(lp.out, ::testing::ContainsRegex("\\{\"token\":[0-9]+,\"logprob\":-?[0-9.e-]+,\"top\":\\[\\["));
  Result bad = RunPdctl("generate --model " + kModel + " --prompt-ids 1 --top-p 0");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.out, ::testing::HasSubstr("'top_p'"));
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

TEST(PdctlTest, BenchSweepFlagErrorsNameTheFlagBeforeAnyRequest) {
  // Nothing listens on port 1: every case must fail before the router is asked.
  const std::string bench = "bench --router 127.0.0.1:1 ";
  Result r = RunPdctl(bench + "--rates 4,x");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, ::testing::HasSubstr("--rates: 'x' is not a positive number"));
  r = RunPdctl(bench + "--rates 4 --rate 2");
  EXPECT_THAT(r.out, ::testing::HasSubstr("give --rate or --rates, not both"));
  r = RunPdctl(bench + "--shared-prefix 4");
  EXPECT_THAT(r.out, ::testing::HasSubstr("--shared-prefix: bench expects GROUPS:PREFIX_TOKENS"));
  const std::string trace = ::testing::TempDir() + "/pdctl_bench_trace.jsonl";
  {
    std::ofstream f(trace);
    f << "{\"prompt_tokens\": 8, \"output_tokens\": 2}\n{\"prompt_tokens\": 8}\n";
  }
  r = RunPdctl(bench + "--trace " + trace);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, ::testing::HasSubstr(trace + " line 2: 'output_tokens' is missing"));
  r = RunPdctl(bench + "--trace " + trace + " --shared-prefix 2:8");
  EXPECT_THAT(r.out, ::testing::HasSubstr("--trace and --shared-prefix do not go together"));
}

const std::string kTok = std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/tokenizers/";

TEST(PdctlTest, TokenizeDetokenizeAndChatTemplateOnTokenizerOnlyDirectories) {
  Result r = RunPdctl("tokenize --model " + kTok + "llama2 --text 'Hello world' --add-special-tokens", true);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out, "[1,22557,1526]\n");
  r = RunPdctl("detokenize --model " + kTok + "llama2 --ids 1,22557,1526 --skip-special-tokens", true);
  EXPECT_EQ(r.out, "Hello world\n");
  const std::string file = ::testing::TempDir() + "/pdctl_lines.txt";
  {
    std::ofstream f(file, std::ios::binary);
    f << "a b\r\nc\n\nd";  // Split on \n only: the \r stays in line one.
  }
  r = RunPdctl("tokenize --model " + kTok + "qwen3 --text-file " + file + " --jsonl", true);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 4);
  EXPECT_THAT(r.out, ::testing::HasSubstr("\n[]\n"));
  const std::string messages = ::testing::TempDir() + "/pdctl_messages.json";
  {
    std::ofstream f(messages);
    f << R"([{"role": "user", "content": "Hi"}])";
  }
  r = RunPdctl("chat-template --model " + kTok + "qwen3 --messages-file " + messages +
                   " --add-generation-prompt",
               true);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["text"], "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(j["ids"].size(), 9u);
  r = RunPdctl("chat-template --model " + kTok + "llama2 --messages-file " + messages);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, ::testing::HasSubstr("no chat_template; pass an explicit family"));
  r = RunPdctl("chat-template --model " + kTok + "llama2 --messages-file " + messages +
               " --chat-template-family zephyr", true);
  EXPECT_EQ(r.exit_code, 0);
  {
    std::ofstream f(messages);
    f << R"([{"role": "user"}])";
  }
  r = RunPdctl("chat-template --model " + kTok + "qwen3 --messages-file " + messages);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.out, ::testing::HasSubstr("messages[0]: 'content' must be a string"));
}

TEST(PdctlTest, MakeModelWritesALoadableModel) {
  const std::string dir = ::testing::TempDir() + "/pdctl_make_model";
  Result r = RunPdctl("make-model --shape tiny --dtype bf16 --out " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  Result g = RunPdctl("generate --model " + dir + " --prompt-ids 3,4 --max-tokens 3");
  EXPECT_EQ(g.exit_code, 0) << g.out;
}

}  // namespace
