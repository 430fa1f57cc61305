// The cluster end to end: real router, prefill and decode worker processes
// on loopback, KV over UCX. Every stream must equal the in-process engine
// token for token and byte for byte.
#include <signal.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/generation.h"
#include "model/model.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/generation.grpc.pb.h"
#include "tests/cluster/cluster_harness.h"
#include "tests/cluster/reference_stream.h"
#include "tests/support/default_model.h"
#include "tests/support/subprocess.h"

namespace pdserve {
namespace {

using testing_support::Subprocess;

class ClusterTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    // The reference engine takes the matrix path the servers would, and the
    // servers (children of this process) are told that path, so both run
    // the same arithmetic whatever the start-up probe would say in each.
    absl::StatusOr<testing_support::DefaultModel> m = testing_support::LoadDefaultModel(1, true);
    ASSERT_TRUE(m.ok()) << m.status();
    loaded_ = new testing_support::DefaultModel(*std::move(m));
    setenv("PDSERVE_MATRIX_PATH", std::string(kernels::cpu::MatrixPathName(loaded_->backend->matrix_path())).c_str(),
           1);
    model_ = loaded_->model.get();
    tokenizer_ = loaded_->tokenizer.get();
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

  static Output Reference(const v1::GenerateRequest& req) { return ReferenceStream(*model_, *tokenizer_, req); }

  static v1::GenerateRequest Text(const std::string& text, int max_tokens, float temperature, uint64_t seed) {
    v1::GenerateRequest r;
    r.set_text(text);
    r.set_max_tokens(max_tokens);
    r.mutable_sampling()->set_temperature(temperature);
    if (temperature > 0) r.mutable_sampling()->set_top_p(0.9f);
    r.mutable_sampling()->set_seed(seed);
    return r;
  }

  static void ExpectSame(const Output& got, const Output& want, const std::string& what) {
    ExpectSameStream(got, want, what);
  }

  static testing_support::DefaultModel* loaded_;
  static Model* model_;
  static tok::Tokenizer* tokenizer_;
  static std::string* dir_;
  static Cluster* disagg_;
  static Cluster* colocated_;
};

testing_support::DefaultModel* ClusterTest::loaded_ = nullptr;
Model* ClusterTest::model_ = nullptr;
tok::Tokenizer* ClusterTest::tokenizer_ = nullptr;
std::string* ClusterTest::dir_ = nullptr;
Cluster* ClusterTest::disagg_ = nullptr;
Cluster* ClusterTest::colocated_ = nullptr;

const char kLong[] =
    "And it came to pass, when men began to multiply on the face of the earth, and daughters were born unto "
    "them, that the sons of God saw the daughters of men that they were fair; and they took them wives of all "
    "which they chose.";

std::vector<v1::GenerateRequest> Requests() {
  std::vector<v1::GenerateRequest> reqs;
  for (float temp : {0.0f, 0.8f}) {
    reqs.push_back(ClusterTest::Text("In the beginning God created", 24, temp, 42));
    reqs.push_back(ClusterTest::Text(kLong, 20, temp, 7));  // Longer than a prefill chunk (32).
    v1::GenerateRequest ids = ClusterTest::Text("", 16, temp, 9);
    ids.mutable_token_ids()->add_ids(5);
    ids.mutable_token_ids()->add_ids(100);
    ids.mutable_token_ids()->add_ids(200);
    reqs.push_back(ids);
  }
  v1::GenerateRequest chat = ClusterTest::Text("", 24, 0.7f, 11);
  v1::ChatMessage* m = chat.mutable_chat()->add_messages();
  m->set_role("user");
  m->set_content("Who was the father of Isaac?");
  reqs.push_back(chat);
  v1::GenerateRequest knobs = ClusterTest::Text("And Moses said unto the LORD,", 30, 1.1f, 13);
  knobs.mutable_sampling()->set_top_k(40);
  knobs.mutable_sampling()->set_min_p(0.05f);
  knobs.mutable_sampling()->set_repetition_penalty(1.3f);
  knobs.mutable_sampling()->set_presence_penalty(0.5f);
  knobs.mutable_sampling()->set_frequency_penalty(0.4f);
  knobs.add_stop_token_ids(47);
  knobs.set_logprobs(3);
  reqs.push_back(knobs);
  v1::GenerateRequest stop = ClusterTest::Text("The LORD is my shepherd;", 40, 0.7f, 5);
  stop.add_stop("LORD");
  reqs.push_back(stop);
  return reqs;
}

TEST_F(ClusterTest, StreamsEqualTheInProcessEngine) {
  for (const auto& req : Requests()) {
    const Output want = Reference(req);
    ExpectSame(disagg_->Generate(req), want, "disaggregated " + req.ShortDebugString());
    ExpectSame(colocated_->Generate(req), want, "colocated " + req.ShortDebugString());
  }
}

TEST_F(ClusterTest, CompleteAndListModels) {
  const v1::GenerateRequest req = Text("In the beginning God created", 16, 0.8f, 21);
  grpc::ClientContext ctx;
  v1::CompleteResponse out;
  ASSERT_TRUE(disagg_->stub()->Complete(&ctx, req, &out).ok());
  const Output want = Reference(req);
  EXPECT_EQ(std::vector<int32_t>(out.token_ids().begin(), out.token_ids().end()), want.tokens);
  EXPECT_EQ(out.text(), want.text);
  EXPECT_EQ(out.final().usage().completion_tokens(), static_cast<int>(want.tokens.size()));
  grpc::ClientContext ctx2;
  v1::ListModelsResponse models;
  ASSERT_TRUE(disagg_->stub()->ListModels(&ctx2, {}, &models).ok());
  ASSERT_EQ(models.models_size(), 1);
  EXPECT_EQ(models.models(0).name(), "kjv-tiny");
  EXPECT_EQ(models.models(0).context_length(), model_->config().max_position_embeddings);
}

TEST_F(ClusterTest, TimingsAndUsageAreReported) {
  const Output got = disagg_->Generate(Text("In the beginning", 8, 0, 1));
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  const v1::GenerateFinal& f = got.final;
  EXPECT_EQ(f.usage().completion_tokens(), 8);
  EXPECT_GT(f.usage().prompt_tokens(), 0);
  EXPECT_EQ(f.seed(), 1u);
  EXPECT_GT(f.timings().ttft(), 0);
  EXPECT_GT(f.timings().prefill(), 0);
  EXPECT_GT(f.timings().handoff(), 0);
  EXPECT_GT(f.timings().first_gap(), 0);
  EXPECT_GT(f.timings().total(), f.timings().ttft());
  EXPECT_FALSE(f.timings().colocated());
}

// With the prefill worker's layer-by-layer KV streaming off (every layer
// sent after the forward: tools/bench/first_gap.sh's comparison) the
// streams are the same and the first gap is still reported.
TEST_F(ClusterTest, StreamsAreTheSameWithoutLayerStreaming) {
  Cluster c;
  const absl::Status s = c.Start(*dir_ + "/unstreamed", false, {}, {}, 1, {"--kv_stream_layers=false"});
  ASSERT_TRUE(s.ok()) << s;
  for (const auto& req : Requests()) ExpectSame(c.Generate(req), Reference(req), "unstreamed " + req.ShortDebugString());
  const Output got = c.Generate(Text("In the beginning", 8, 0, 1));
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_GT(got.final.timings().handoff(), 0);
  EXPECT_GT(got.final.timings().first_gap(), 0);
}

TEST_F(ClusterTest, SixtyFourConcurrentStreams) {
  std::vector<v1::GenerateRequest> reqs;
  for (int i = 0; i < 64; ++i) {
    reqs.push_back(Text(i % 2 == 0 ? "In the beginning God created" : kLong, 12 + i % 5, i % 3 == 0 ? 0.0f : 0.9f,
                        1000 + i));
  }
  std::vector<Output> got(reqs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < reqs.size(); ++i) {
    threads.emplace_back([&, i] { got[i] = disagg_->Generate(reqs[i]); });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Reference(reqs[i]), absl::StrCat("stream ", i));
  // Everything freed on both sides.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  v1::ClusterStatusResponse st;
  do {
    st = disagg_->Status();
    if (st.decode(0).kv_blocks_used() == 0 && st.prefill(0).kv_blocks_used() == 0) break;
    absl::SleepFor(absl::Milliseconds(50));
  } while (absl::Now() < deadline);
  EXPECT_EQ(st.decode(0).kv_blocks_used(), 0) << st.ShortDebugString();
  EXPECT_EQ(st.prefill(0).kv_blocks_used(), 0) << st.ShortDebugString();
  // And the prefill worker's queued-token count, including a prompt whose
  // first token comes before its call is marked admitted.
  EXPECT_EQ(QueuedPrefillTokensAfterSettling(*disagg_), 0) << disagg_->Status().ShortDebugString();
}

TEST_F(ClusterTest, CancelledStreamFreesItsKv) {
  v1::GenerateRequest req = Text("In the beginning", 400, 0.9f, 3);
  req.set_ignore_eos(true);
  grpc::ClientContext ctx;
  auto reader = disagg_->stub()->Generate(&ctx, req);
  v1::GenerateResponse m;
  int chunks = 0;
  while (chunks < 5 && reader->Read(&m)) chunks += m.has_chunk();
  ASSERT_EQ(chunks, 5);
  EXPECT_GT(disagg_->Status().decode(0).kv_blocks_used(), 0);
  ctx.TryCancel();
  while (reader->Read(&m)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_EQ(AllKvUsedAfterSettling(*disagg_), 0);
}

TEST_F(ClusterTest, ClientDeadlineEndsTheStreamAndFreesItsKv) {
  v1::GenerateRequest req = Text("In the beginning", 480, 0.9f, 3);
  req.set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  auto reader = disagg_->stub()->Generate(&ctx, req);
  v1::GenerateResponse m;
  int tokens = 0;
  while (reader->Read(&m)) tokens += m.has_chunk() ? m.chunk().token_ids_size() : 0;
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_LT(tokens, 480);
  EXPECT_EQ(AllKvUsedAfterSettling(*disagg_), 0);
}

TEST_F(ClusterTest, BadInputIsRefusedNamingTheField) {
  struct Case {
    v1::GenerateRequest req;
    std::string field;
  };
  std::vector<Case> cases;
  cases.push_back({Text("", 4, 0, 1), "text"});
  {
    v1::GenerateRequest r = Text("hi", 4, 0, 1);
    r.clear_prompt();
    cases.push_back({r, "prompt"});
  }
  {
    v1::GenerateRequest r = Text("hi", 4, 0, 1);
    r.set_model("no-such-model");
    cases.push_back({r, "model"});
  }
  cases.push_back({Text("hi", 0, 0, 1), "max_tokens"});
  cases.push_back({Text("hi", 100000, 0, 1), "max_tokens"});
  {
    std::string huge;
    for (int i = 0; i < 200; ++i) huge += "and the LORD said ";
    cases.push_back({Text(huge, 4, 0, 1), "max_tokens"});  // Prompt over the context.
  }
  {
    v1::GenerateRequest r = Text("hi", 4, 0, 1);
    r.mutable_sampling()->set_top_p(1.5f);
    cases.push_back({r, "top_p"});
  }
  {
    v1::GenerateRequest r = Text("hi", 4, 0, 1);
    r.mutable_sampling()->set_temperature(-1);
    cases.push_back({r, "temperature"});
  }
  {
    v1::GenerateRequest r = Text("hi", 4, 0, 1);
    v1::ChatMessage* m = r.mutable_chat()->add_messages();
    m->set_role("wizard");
    m->set_content("hello");
    cases.push_back({r, "chat"});
  }
  {
    v1::GenerateRequest r = Text("hi", 4, 0, 1);
    r.mutable_chat();
    cases.push_back({r, "chat.messages"});
  }
  {
    v1::GenerateRequest r = Text("hi", 4, 0, 1);
    r.mutable_token_ids()->add_ids(-3);
    cases.push_back({r, "token_ids"});
  }
  {
    v1::GenerateRequest r = Text("hi", 4, 0, 1);
    r.GetReflection()->MutableUnknownFields(&r)->AddVarint(999, 1);  // A field from a newer client.
    cases.push_back({r, "unknown field"});
  }
  for (const Case& c : cases) {
    const Output got = disagg_->Generate(c.req);
    EXPECT_EQ(got.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.req.ShortDebugString();
    EXPECT_NE(got.status.error_message().find(c.field), std::string::npos)
        << got.status.error_message() << " should name " << c.field;
  }
  // Still serving.
  const v1::GenerateRequest ok = Text("In the beginning", 6, 0, 1);
  ExpectSame(disagg_->Generate(ok), Reference(ok), "after bad input");
}

TEST_F(ClusterTest, SmallDecodePoolPreemptsAndRecomputes) {
  Cluster small;
  // 12 blocks of 16 positions for 8 concurrent requests of ~40-80 positions.
  absl::Status s = small.Start(*dir_ + "/small", true, {"--kv_positions", "192", "--max_batch", "8"});
  ASSERT_TRUE(s.ok()) << s;
  std::vector<v1::GenerateRequest> reqs;
  for (int i = 0; i < 8; ++i) reqs.push_back(Text(i % 2 ? kLong : "In the beginning God created", 40, 0.8f, 50 + i));
  std::vector<Output> got(reqs.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < reqs.size(); ++i) threads.emplace_back([&, i] { got[i] = small.Generate(reqs[i]); });
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Reference(reqs[i]), absl::StrCat("stream ", i));
  EXPECT_GT(small.Status().decode(0).preemptions(), 0) << small.Logs();
}

TEST_F(ClusterTest, EveryServiceExportsPrometheusMetrics) {
  Cluster c;
  ASSERT_TRUE(c.Start(*dir_ + "/metrics", false).ok());
  // The same long prompt three times: the second and third find its full
  // blocks in the prefill worker's prefix cache.
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(c.Generate(Text(kLong, 8, 0, 1)).status.ok());
  ASSERT_EQ(c.Generate(Text("", 8, 0, 1)).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  const std::string router = HttpGet(c.router_metrics(), "/metrics");
  EXPECT_NE(router.find("# TYPE pdserve_time_to_first_token_seconds histogram"), std::string::npos) << router;
  EXPECT_EQ(MetricValue(router, "pdserve_requests_total{outcome=\"length\"}"), 3) << router;
  EXPECT_EQ(MetricValue(router, "pdserve_requests_total{outcome=\"invalid\"}"), 1);
  EXPECT_EQ(MetricValue(router, "pdserve_time_to_first_token_seconds_count"), 3);
  EXPECT_EQ(MetricValue(router, "pdserve_inter_token_latency_seconds_count") > 0, true);
  EXPECT_EQ(MetricValue(router, "pdserve_requests_in_flight"), 0);
  const std::string decode = HttpGet(c.decode_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(decode, "pdserve_handoff_transfers_total"), 3) << decode;
  EXPECT_GT(MetricValue(decode, "pdserve_handoff_bytes_total"), 0);
  EXPECT_EQ(MetricValue(decode, "pdserve_kv_blocks{state=\"used\"}"), 0);
  EXPECT_EQ(MetricValue(decode, "pdserve_kv_blocks{state=\"quarantined\"}"), 0);
  const std::string prefill = HttpGet(c.prefill_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(prefill, "pdserve_handoff_transfers_total"), 3) << prefill;
  const double hits = MetricValue(prefill, "pdserve_prefix_cache_blocks_total{result=\"hit\"}");
  const double misses = MetricValue(prefill, "pdserve_prefix_cache_blocks_total{result=\"miss\"}");
  EXPECT_GT(misses, 0) << prefill;  // The first request's blocks.
  EXPECT_EQ(hits, 2 * misses) << prefill;  // Found again by the other two.
  EXPECT_EQ(HttpGet(c.router_metrics(), "/other").find("not found"), 0u);
}

TEST_F(ClusterTest, ServingBenchRunsAgainstTheClusterAndTheEngine) {
  const std::string out = *dir_ + "/bench.json";
  const std::string cmd = absl::StrCat(kBin, "/tools/pdctl/pdctl bench --tls_ca ", TestTls("router").ca, " --router ",
                                       disagg_->address(),
                                       " --requests 6 --concurrency 3 --prompt-tokens 20:40 --output-tokens 8",
                                       " --in-process-model ", kModel, " --json > ", out, " 2>/dev/null");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream f(out);
  const nlohmann::json j = nlohmann::json::parse(f, nullptr, false);
  ASSERT_TRUE(j.is_object());
  ASSERT_EQ(j["runs"].size(), 2u);
  for (const auto& r : j["runs"]) {
    EXPECT_EQ(r["failed"].get<int>(), 0) << r.dump();
    EXPECT_GT(r["output_tokens_per_second"].get<double>(), 0);
    EXPECT_GT(r["ttft_seconds"]["p50"].get<double>(), 0);
  }
}

// A cancelled call ends its relay at once, whether or not anything was
// written to the client: the cancel arrives as the call's OnCancel. Each
// step takes 80 ms, so the 400 tokens would take 32 s.
TEST(SlowClusterTest, ACancelledCallEndsItsRelayAndFreesItsKvWhetherOrNotItWrote) {
  Cluster c;
  c.tls = false;
  ASSERT_TRUE(c.Start(TempDir() + "/slow", /*colocated=*/false, {"--fault_step_delay_ms", "80"}).ok());
  auto cancelled = [&c] {
    return MetricValue(HttpGet(c.router_metrics(), "/metrics"), "pdserve_requests_total{outcome=\"cancelled\"}");
  };
  auto await_cancelled = [&](double n) {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (cancelled() < n && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
    return cancelled();
  };
  v1::GenerateRequest req = ClusterTest::Text("In the beginning", 400, 0.9f, 3);
  req.set_ignore_eos(true);
  {  // Complete: nothing is written before the end.
    grpc::ClientContext ctx;
    v1::CompleteResponse out;
    grpc::Status st;
    std::thread call([&] { st = c.stub()->Complete(&ctx, req, &out); });
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (c.Status().decode(0).kv_blocks_used() == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
    EXPECT_GT(c.Status().decode(0).kv_blocks_used(), 0);
    ctx.TryCancel();
    call.join();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_EQ(await_cancelled(1), 1);
    EXPECT_EQ(AllKvUsedAfterSettling(c), 0);  // 32 s of decode were it not cancelled
  }
  {  // Generate, cancelled while its prefill runs: before its first write.
    grpc::ClientContext ctx;
    auto reader = c.stub()->Generate(&ctx, req);
    absl::SleepFor(absl::Milliseconds(30));
    ctx.TryCancel();
    v1::GenerateResponse m;
    while (reader->Read(&m)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
    EXPECT_EQ(await_cancelled(2), 2);
    EXPECT_EQ(AllKvUsedAfterSettling(c), 0);
  }
}

}  // namespace
}  // namespace pdserve
