// The official `openai` npm client, over HTTPS (the clusters' default TLS;
// the client trusts the test CA through NODE_EXTRA_CA_CERTS), against two
// real clusters: one with API
// keys (chat and completions, streamed and not, stop strings, seeds equal
// to the gRPC stream, logprobs, usage, 401, 400, 404, 64 concurrent
// streams) and one whose admission queue holds two requests behind a
// stalled prefill (429 with Retry-After). The checks are in
// tests/openai_client/test.mjs; the client is pinned by its
// package-lock.json and installed by deploy/test.sh.
#include <stdio.h>
#include <sys/wait.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "router/api_keys.h"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {
namespace {

const std::string kClientDir = std::string(PDSERVE_SOURCE_DIR) + "/tests/openai_client";

// Runs a node command, echoing and returning its output; true when it
// exited with 0.
bool RunNode(const std::string& command, std::string* output) {
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) return false;
  std::array<char, 4096> buf;
  while (fgets(buf.data(), buf.size(), p) != nullptr) *output += buf.data();
  const int status = pclose(p);
  std::cout << *output;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

TEST(OpenAiClientTest, TheOfficialClientWorksUnchanged) {
  ASSERT_TRUE(std::filesystem::exists(kClientDir + "/node_modules/openai/package.json"))
      << "the openai npm client is not installed: deploy/test.sh installs it (or: npm ci --prefix " << kClientDir
      << ")";
  ASSERT_EQ(std::system("node --version > /dev/null 2>&1"), 0) << "node is not installed (deploy/test.sh installs it)";
  const std::string dir = TempDir();
  const std::string keys = dir + "/api_keys";
  std::filesystem::create_directories(dir);
  std::ofstream(keys) << "npm-test:" << router::Sha256Hex("sk-pdserve-npm") << "\n";

  Cluster main;
  main.extra_router_flags = {"--api_keys_file", keys};
  absl::Status s = main.Start(dir + "/main", /*colocated=*/false);
  ASSERT_TRUE(s.ok()) << s;
  Cluster admission;
  admission.extra_router_flags = {"--admission", "--max_queued", "2"};
  s = admission.Start(dir + "/admission", false, {}, {}, 1, {"--fault_stall_prefill_ms", "1500"});
  ASSERT_TRUE(s.ok()) << s;

  // test.mjs's GRPC_REQUEST, over gRPC.
  v1::GenerateRequest req;
  req.set_text("In the beginning God created");
  req.set_max_tokens(24);
  req.mutable_sampling()->set_temperature(0.8f);
  req.mutable_sampling()->set_seed(4242);
  const Output grpc = main.Generate(req, "Bearer sk-pdserve-npm");
  ASSERT_TRUE(grpc.status.ok()) << grpc.status.error_message();
  std::ofstream(dir + "/grpc_text") << grpc.text;

  const std::string command = absl::StrCat(
      "cd ", kClientDir, " && NODE_EXTRA_CA_CERTS=", TestTls("router").ca,
      " PDSERVE_URL=https://127.0.0.1:", main.http_port(), "/v1 PDSERVE_KEY=sk-pdserve-npm ",
      "PDSERVE_ADMISSION_URL=https://127.0.0.1:", admission.http_port(), "/v1 ",
      "PDSERVE_GRPC_TEXT=\"$(cat ", dir, "/grpc_text)\" node --test-reporter=tap test.mjs 2>&1");
  std::string output;
  const bool passed = RunNode(command, &output);
  EXPECT_TRUE(passed) << output << "\n" << main.Logs() << admission.Logs();
  if (!passed) {
    // Where requests stand (a stuck stream shows as running somewhere), and
    // the router's request counters.
    std::cout << "cluster status: " << main.Status().ShortDebugString() << "\n";
    std::cout << HttpGet(main.router_metrics(), "/metrics") << "\n";
  }
  // Every test ran (none skipped or left out).
  EXPECT_NE(output.find("# pass 12"), std::string::npos) << output;
}

// Runs `script` (with `env`, "NAME=value ...") from tests/openai_client
// against a disaggregated cluster of `model` with one API key, and returns
// whether it passed; its output goes to `output`.
void RunScript(const std::string& script, const std::string& env, const std::string& model, std::string* output) {
  ASSERT_TRUE(std::filesystem::exists(kClientDir + "/node_modules/ajv/package.json"))
      << "ajv is not installed: deploy/test.sh installs it (or: npm ci --prefix " << kClientDir << ")";
  const std::string dir = TempDir();
  const std::string keys = dir + "/api_keys";
  std::ofstream(keys) << "npm-test:" << router::Sha256Hex("sk-pdserve-npm") << "\n";
  Cluster c;
  c.model = model.empty() ? kModel : model;
  c.extra_router_flags = {"--api_keys_file", keys};
  absl::Status s = c.Start(dir + "/cluster", /*colocated=*/false);
  ASSERT_TRUE(s.ok()) << s;
  const std::string command =
      absl::StrCat("cd ", kClientDir, " && NODE_EXTRA_CA_CERTS=", TestTls("router").ca,
                   " PDSERVE_URL=https://127.0.0.1:", c.http_port(), "/v1 PDSERVE_KEY=sk-pdserve-npm ", env, " node ",
                   script, " 2>&1");
  EXPECT_TRUE(RunNode(command, output)) << *output << "\n" << c.Logs();
}

// Structured outputs: 200 seeded requests for each of ten schemas of
// growing complexity (tests/fixtures/structured/schemas.json) through the
// official client, each reply validated by ajv (structured.mjs).
TEST(OpenAiClientTest, EveryStructuredOutputValidatesAgainstItsSchema) {
  std::string output;
  RunScript("structured.mjs", "PDSERVE_STRUCTURED_N=200", "", &output);
  EXPECT_NE(output.find("family: 200/200 valid"), std::string::npos) << output;
}

// A tool-call round trip (call, tool result, answer) through the official
// client, streamed and not, every call's arguments validated by ajv
// (tools.mjs). The tools' system turn passes the default model's 512
// positions, so the cluster serves it with a longer context.
TEST(OpenAiClientTest, AToolCallRoundTripWorks) {
  std::string output;
  RunScript("tools.mjs", "", LongContextModel(TempDir(), 2048), &output);
  EXPECT_NE(output.find("tools: round trips passed"), std::string::npos) << output;
}

}  // namespace
}  // namespace pdserve
