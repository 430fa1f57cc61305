// Response formats through the cluster: constrained streams equal the
// in-process engine's, token for token, on a disaggregated cluster (the
// first token sampled by the prefill worker under the format, the state
// carried in the handoff) and on a colocated one; a decode worker killed
// mid-stream leaves the stream unchanged; every complete output parses as
// JSON; bad schemas are refused naming their path.
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/generation.grpc.pb.h"
#include "tests/cluster/cluster_harness.h"
#include "tests/cluster/reference_stream.h"
#include "tests/support/default_model.h"
#include "tests/support/http_get.h"

namespace pdserve {
namespace {

struct Case {
  std::string name, prompt, schema;
};

std::vector<Case> Schemas() {
  std::ifstream f(std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/structured/schemas.json");
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(f);
  std::vector<Case> out;
  for (const auto& c : j) out.push_back({c["name"], c["prompt"], c["schema"].dump()});
  // A schema that refers to itself: its depth is the model's choice, so it
  // is here, where a truncated output is allowed, not in the ajv run.
  out.push_back({"tree", "The generations of Adam:",
                 R"({"$defs":{"node":{"type":"object","properties":{"name":{"type":"string","maxLength":12},
                 "children":{"type":"array","items":{"$ref":"#/$defs/node"},"maxItems":2}},
                 "required":["name","children"],"additionalProperties":false}},"$ref":"#/$defs/node"})"});
  return out;
}

v1::GenerateRequest Constrained(const Case& c, float temperature, uint64_t seed, int max_tokens) {
  v1::GenerateRequest r;
  r.set_text(c.prompt);
  r.set_max_tokens(max_tokens);
  r.mutable_sampling()->set_temperature(temperature);
  r.mutable_sampling()->set_seed(seed);
  r.mutable_response_format()->mutable_json_schema()->set_name(c.name);
  r.mutable_response_format()->mutable_json_schema()->set_schema(c.schema);
  return r;
}

class StructuredOutputTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    absl::StatusOr<testing_support::DefaultModel> m = testing_support::LoadDefaultModel(1, true);
    ASSERT_TRUE(m.ok()) << m.status();
    loaded_ = new testing_support::DefaultModel(*std::move(m));
    setenv("PDSERVE_MATRIX_PATH", std::string(kernels::cpu::MatrixPathName(loaded_->backend->matrix_path())).c_str(),
           1);
    dir_ = new std::string(TempDir());
    disagg_ = new Cluster();
    absl::Status s = disagg_->Start(*dir_ + "/disagg", false);
    ASSERT_TRUE(s.ok()) << s;
    colocated_ = new Cluster();
    s = colocated_->Start(*dir_ + "/colocated", true);
    ASSERT_TRUE(s.ok()) << s;
  }
  static void TearDownTestSuite() {
    delete disagg_;
    delete colocated_;
  }
  static Output Reference(const v1::GenerateRequest& req) {
    return ReferenceStream(*loaded_->model, *loaded_->tokenizer, req);
  }

  static testing_support::DefaultModel* loaded_;
  static std::string* dir_;
  static Cluster* disagg_;
  static Cluster* colocated_;
};

testing_support::DefaultModel* StructuredOutputTest::loaded_ = nullptr;
std::string* StructuredOutputTest::dir_ = nullptr;
Cluster* StructuredOutputTest::disagg_ = nullptr;
Cluster* StructuredOutputTest::colocated_ = nullptr;

TEST_F(StructuredOutputTest, ConstrainedStreamsEqualTheEngineOnBothClustersAndCompleteOnesParse) {
  int complete = 0, total = 0;
  for (const Case& c : Schemas()) {
    for (const auto& [temperature, seed] : {std::pair{0.0f, 1ull}, std::pair{0.8f, 2ull}, std::pair{1.0f, 3ull}}) {
      const v1::GenerateRequest req = Constrained(c, temperature, seed, 160);
      const std::string what = absl::StrCat(c.name, " at temperature ", temperature);
      const Output want = Reference(req);
      ExpectSameStream(disagg_->Generate(req), want, what + " (disaggregated)");
      ExpectSameStream(colocated_->Generate(req), want, what + " (colocated)");
      ++total;
      if (want.finish == v1::FINISH_REASON_STOP) {
        ++complete;
        const nlohmann::json j = nlohmann::json::parse(want.text, nullptr, false);
        EXPECT_FALSE(j.is_discarded()) << what << ": " << want.text;
      }
      std::fprintf(stderr, "%s: %zu tokens, %s: %s\n", what.c_str(), want.tokens.size(),
                   want.finish == v1::FINISH_REASON_STOP ? "stop" : "length", want.text.c_str());
    }
  }
  // The default model writes English, not JSON: unconstrained it would
  // complete none of these. A long string can still run out of tokens.
  EXPECT_GE(complete * 10, total * 7) << complete << " of " << total << " complete";
}

TEST_F(StructuredOutputTest, JsonModeWritesAnObject) {
  v1::GenerateRequest req;
  req.set_text("The LORD is my shepherd;");
  req.set_max_tokens(120);
  req.mutable_sampling()->set_temperature(0.7f);
  req.mutable_sampling()->set_seed(4);
  req.mutable_response_format()->mutable_json_object();
  const Output want = Reference(req);
  ExpectSameStream(disagg_->Generate(req), want, "json_object");
  ASSERT_FALSE(want.text.empty());
  EXPECT_EQ(want.text[0], '{') << want.text;
  if (want.finish == v1::FINISH_REASON_STOP) {
    EXPECT_TRUE(nlohmann::json::parse(want.text, nullptr, false).is_object()) << want.text;
  }
}

TEST_F(StructuredOutputTest, BadSchemasAreRefusedNamingThePath) {
  struct Bad {
    const char* schema;
    const char* message;
  };
  for (const Bad& b : {Bad{R"({"type":"object","properties":{"age":{"type":"integer","minimum":0}}})",
                           "response_format.json_schema.schema: schema at #/properties/age: 'minimum' is not supported"},
                       Bad{R"({"type":"object","properties":{"a":{"$ref":"#/$defs/nope"}}})",
                           "schema at #/properties/a/$ref: '#/$defs/nope' refers to nothing in the schema"},
                       Bad{"{not json", "response_format.json_schema.schema: schema: not valid JSON"}}) {
    Case c{"bad", "x", b.schema};
    const Output got = disagg_->Generate(Constrained(c, 0, 1, 8));
    EXPECT_EQ(got.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << b.schema;
    EXPECT_TRUE(absl::StrContains(got.status.error_message(), b.message)) << got.status.error_message();
  }
  const std::string router = HttpGet(disagg_->router_metrics(), "/metrics");
  EXPECT_GE(MetricValue(router, "pdserve_grammar_compiles_total{outcome=\"refused\"}"), 2) << router;
}

v1::GenerateRequest ToolCallRequest(uint64_t seed) {
  v1::GenerateRequest r;
  v1::ChatMessage* m = r.mutable_chat()->add_messages();
  m->set_role("user");
  m->set_content("Add 2 and 3.");
  v1::Tool* add = r.add_tools();
  add->set_name("add");
  add->set_parameters(R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"integer"}},
      "required":["a","b"],"additionalProperties":false})");
  v1::Tool* find = r.add_tools();
  find->set_name("find");
  find->set_parameters(R"({"type":"object","properties":{"w":{"type":"string","maxLength":8}}})");
  r.set_max_tokens(120);
  r.mutable_sampling()->set_temperature(0.9f);
  r.mutable_sampling()->set_seed(seed);
  return r;
}

// A required or named call is generated under the tools' grammar, alike on
// both clusters (the handoff carries the call's grammar state like any
// format's), and the final carries the calls read from the text, each one's
// arguments valid against its tool's schema.
TEST_F(StructuredOutputTest, RequiredAndNamedToolCallsAreTheSameOnBothClustersAndParse) {
  const std::string model = LongContextModel(*dir_ + "/long-model", 2048);
  Cluster disagg, colocated;
  disagg.model = colocated.model = model;
  absl::Status s = disagg.Start(*dir_ + "/tools-disagg", false);
  ASSERT_TRUE(s.ok()) << s;
  s = colocated.Start(*dir_ + "/tools-colocated", true);
  ASSERT_TRUE(s.ok()) << s;
  int complete = 0;
  for (const bool named : {false, true}) {
    for (uint64_t seed = 1; seed <= 4; ++seed) {
      v1::GenerateRequest req = ToolCallRequest(seed);
      if (named) {
        req.mutable_tool_choice()->set_function("find");
      } else {
        req.mutable_tool_choice()->set_mode(v1::ToolChoice::MODE_REQUIRED);
      }
      const std::string what = absl::StrCat(named ? "named" : "required", " seed ", seed);
      const Output got = disagg.Generate(req);
      ASSERT_TRUE(got.status.ok()) << what << ": " << got.status.error_message();
      ExpectSameStream(colocated.Generate(req), got, what + " (colocated against disaggregated)");
      std::fprintf(stderr, "%s: %s\n", what.c_str(), got.text.c_str());
      EXPECT_TRUE(absl::StartsWith(got.text, "<tool_call>\n{\"name\": \"")) << what << ": " << got.text;
      if (got.finish == v1::FINISH_REASON_LENGTH) continue;
      ++complete;
      EXPECT_EQ(got.finish, v1::FINISH_REASON_TOOL_CALLS) << what;
      ASSERT_GE(got.final.tool_calls_size(), 1) << what << ": " << got.text;
      if (named) EXPECT_EQ(got.final.tool_calls_size(), 1) << what;
      for (const v1::ToolCall& call : got.final.tool_calls()) {
        const nlohmann::json args = nlohmann::json::parse(call.arguments(), nullptr, false);
        ASSERT_TRUE(args.is_object()) << what << ": " << call.arguments();
        EXPECT_FALSE(call.id().empty());
        if (named) EXPECT_EQ(call.name(), "find");
        if (call.name() == "add") {
          EXPECT_EQ(args.size(), 2u) << call.arguments();
          EXPECT_TRUE(args["a"].is_number_integer() && args["b"].is_number_integer()) << call.arguments();
        } else {
          ASSERT_EQ(call.name(), "find");
          EXPECT_EQ(args.size(), 1u) << call.arguments();
          EXPECT_TRUE(args["w"].is_string()) << call.arguments();
        }
      }
    }
  }
  EXPECT_GE(complete, 4);
  // auto: the model answers in words; nothing is read as a call that is not one.
  v1::GenerateRequest req = ToolCallRequest(9);
  const Output got = disagg.Generate(req);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  if (!absl::StrContains(got.text, "<tool_call>")) {
    EXPECT_EQ(got.final.tool_calls_size(), 0);
    EXPECT_NE(got.finish, v1::FINISH_REASON_TOOL_CALLS);
  }
}

// The router compiles each format once; the workers compile it on first
// sight and compute masks, and say so in their metrics.
TEST_F(StructuredOutputTest, CompilesAndMasksAreCounted) {
  const Case c = Schemas()[3];
  for (uint64_t seed : {1, 2, 3}) ASSERT_TRUE(disagg_->Generate(Constrained(c, 0.8f, seed, 40)).status.ok());
  const std::string router = HttpGet(disagg_->router_metrics(), "/metrics");
  EXPECT_GE(MetricValue(router, "pdserve_grammar_compiles_total{outcome=\"compiled\"}"), 1) << router;
  EXPECT_GE(MetricValue(router, "pdserve_grammar_cache_hits_total"), 2) << router;
  const std::string decode = HttpGet(disagg_->decode_metrics(), "/metrics");
  EXPECT_GE(MetricValue(decode, "pdserve_grammar_compiles_total{outcome=\"compiled\"}"), 1) << decode;
  EXPECT_GT(MetricValue(decode, "pdserve_grammar_masks_total{outcome=\"computed\"}"), 0) << decode;
  EXPECT_GT(MetricValue(decode, "pdserve_grammar_masks_total{outcome=\"cached\"}"), 0) << decode;
  EXPECT_GT(MetricValue(decode, "pdserve_grammar_mask_seconds_total"), 0) << decode;
  const std::string prefill = HttpGet(disagg_->prefill_metrics(), "/metrics");
  EXPECT_GE(MetricValue(prefill, "pdserve_grammar_masks_total{outcome=\"computed\"}"), 1) << prefill;
}

// Eight constrained streams on a colocated worker with room for two or
// three: sequences are preempted, their KV dropped and recomputed, and the
// grammar state (held by the request's Generation) carries on.
TEST_F(StructuredOutputTest, PreemptedConstrainedStreamsRecomputeAndStayExact) {
  Cluster small;
  absl::Status s = small.Start(*dir_ + "/small", true, {"--kv_positions", "192", "--max_batch", "8"});
  ASSERT_TRUE(s.ok()) << s;
  const std::vector<Case> cases = Schemas();
  std::vector<v1::GenerateRequest> reqs;
  for (int i = 0; i < 8; ++i) reqs.push_back(Constrained(cases[3 + i % 6], 0.8f, 50 + i, 80));
  std::vector<Output> got(reqs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < reqs.size(); ++i) threads.emplace_back([&, i] { got[i] = small.Generate(reqs[i]); });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSameStream(got[i], Reference(reqs[i]), absl::StrCat("stream ", i));
  EXPECT_GT(small.Status().decode(0).preemptions(), 0) << small.Logs();
}

// A live move (decode worker to decode worker, with the KV) halfway through
// a constrained output: the target's matcher replays the tokens so far and
// must reach the digest the source sent; the stream is exact.
TEST(StructuredOutputFaultTest, ALiveMoveMidOutputKeepsTheConstrainedStreamExact) {
  const std::string dir = TempDir();
  Case c{"six", "List the names:",
         R"({"type":"array","items":{"type":"string","maxLength":24},"minItems":6,"maxItems":6})"};
  const v1::GenerateRequest req = Constrained(c, 0.9f, 5, 200);
  const Output want = Undisturbed(dir, false, req);
  ASSERT_EQ(want.finish, v1::FINISH_REASON_STOP) << want.text;
  ASSERT_GT(want.tokens.size(), 30u) << want.text;
  Cluster cl;
  ASSERT_TRUE(cl.Start(dir + "/move", false, {"--fault_move_at_token", "20"}, {}, 1, {}, 2).ok());
  ExpectSameStream(cl.Generate(req), want, "constrained stream across a live move");
  EXPECT_EQ(MetricValue(HttpGet(cl.router_metrics(), "/metrics"),
                        "pdserve_decode_moves_total{reason=\"rebalance\",outcome=\"moved\"}"),
            1)
      << cl.Logs();
  EXPECT_EQ(MetricValue(HttpGet(cl.router_metrics(), "/metrics"), "pdserve_migrations_total"), 0) << cl.Logs();
}

TEST(StructuredOutputFaultTest, ADecodeWorkerKilledMidStreamLeavesTheConstrainedStreamUnchanged) {
  const std::string dir = TempDir();
  // A long array of strings, so that the stream outlives the kill.
  Case c{"tags", "List the names:", R"({"type":"array","items":{"type":"string"}})"};
  v1::GenerateRequest req = Constrained(c, 0.9f, 21, 300);
  const Output want = Undisturbed(dir, false, req);
  ASSERT_GE(want.tokens.size(), 60u) << want.text;
  Cluster cl;
  absl::Status s = cl.Start(dir + "/faulty", false, {}, {}, 1, {}, /*num_decode=*/2);
  ASSERT_TRUE(s.ok()) << s;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto reader = cl.stub()->Generate(&ctx, req);
  Output got;
  ReadAtLeast(*reader, 20, got);
  ASSERT_GE(got.tokens.size(), 20u);
  const v1::ClusterStatusResponse st = cl.Status();
  cl.decode(st.decode(0).kv_blocks_used() > 0 ? 0 : 1).Kill();  // kill -9 mid-stream.
  ReadToEnd(*reader, got);
  ExpectSameStream(got, want, "constrained stream across a migration");
}

}  // namespace
}  // namespace pdserve
