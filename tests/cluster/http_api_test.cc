// The router's OpenAI HTTP API on the wire, against real processes: the
// same tokens as the gRPC API, SSE framing and flushing, a disconnect
// cancelling the request and freeing its KV on both workers, and clear
// errors for malformed, huge and invalid bodies with the router serving on.
// (The official openai client's view: openai_client_test.cc.)
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/cluster/cluster_harness.h"
#include "tests/support/http_client.h"

namespace pdserve {
namespace {

using json = nlohmann::json;
using testing_support::HttpConnection;
using testing_support::HttpExchange;
using testing_support::HttpReply;
using testing_support::HttpRequest;
using testing_support::SseData;

HttpReply Post(int port, const std::string& path, const std::string& body,
               const std::vector<std::string>& headers = {}) {
  return HttpExchange(port, HttpRequest("POST", path, body, headers));
}

// The token events of an SSE body: chunks before the finish (not chat's
// role chunk, not the finish or usage chunks, not [DONE]). A token that
// ends inside a UTF-8 character still has its event, with empty text.
int TokenEvents(const std::string& raw) {
  int n = 0;
  for (const std::string& d : SseData(raw)) {
    if (d == "[DONE]") continue;
    const json j = json::parse(d, nullptr, false);
    if (!j.is_object() || !j.contains("choices") || j["choices"].empty()) continue;
    const json& c = j["choices"][0];
    if (!c["finish_reason"].is_null()) continue;
    if (c.contains("delta") && c["delta"].contains("role")) continue;
    ++n;
  }
  return n;
}

class HttpApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new Cluster();
    cluster_->tls = false;  // plain HTTP for the raw client; HTTPS: openai_client_test, tls_test
    const absl::Status s = cluster_->Start(TempDir() + "/http", /*colocated=*/false);
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_GT(cluster_->http_port(), 0);
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  static Cluster* cluster_;
};
Cluster* HttpApiTest::cluster_ = nullptr;

TEST_F(HttpApiTest, CompletionsGiveTheGrpcStreamsTokens) {
  v1::GenerateRequest req;
  req.set_text("In the beginning God created");
  req.set_max_tokens(20);
  req.mutable_sampling()->set_temperature(0.8f);
  req.mutable_sampling()->set_seed(1234);
  const Output grpc = cluster_->Generate(req);
  ASSERT_TRUE(grpc.status.ok()) << grpc.status.error_message();

  const std::string body =
      R"({"model":"kjv-tiny","prompt":"In the beginning God created","max_tokens":20,"temperature":0.8,"seed":1234})";
  const HttpReply whole = Post(cluster_->http_port(), "/v1/completions", body);
  ASSERT_EQ(whole.status, 200) << whole.body;
  EXPECT_EQ(whole.headers.at("content-type"), "application/json");
  const json j = json::parse(whole.body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_TRUE(absl::StartsWith(j["id"].get<std::string>(), "cmpl-"));
  EXPECT_EQ(j["model"], "kjv-tiny");
  EXPECT_EQ(j["choices"][0]["text"], grpc.text);
  EXPECT_EQ(j["choices"][0]["finish_reason"], grpc.finish == v1::FINISH_REASON_STOP ? "stop" : "length");
  EXPECT_EQ(j["usage"]["prompt_tokens"], grpc.final.usage().prompt_tokens());
  EXPECT_EQ(j["usage"]["completion_tokens"], static_cast<int>(grpc.tokens.size()));
  EXPECT_EQ(j["pdserve"]["seed"], 1234u);

  // Streamed: the same text, one event per token, then [DONE].
  const HttpReply streamed =
      Post(cluster_->http_port(), "/v1/completions", body.substr(0, body.size() - 1) + R"(,"stream":true})");
  ASSERT_EQ(streamed.status, 200) << streamed.body;
  EXPECT_EQ(streamed.headers.at("content-type"), "text/event-stream");
  const std::vector<std::string> events = SseData(streamed.body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  std::string finish;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json e = json::parse(events[i]);
    EXPECT_EQ(e["id"], json::parse(events[0])["id"]);
    text += e["choices"][0]["text"].get<std::string>();
    if (!e["choices"][0]["finish_reason"].is_null()) finish = e["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(text, grpc.text);
  EXPECT_EQ(finish, "length");
  // Every event is framed "data: {...}\n\n".
  EXPECT_TRUE(absl::StartsWith(streamed.body, "data: {"));
  EXPECT_TRUE(absl::EndsWith(streamed.body, "\n\ndata: [DONE]\n\n"));
  // One event per chunk the relay got; a decode worker whose stream lags
  // may send two tokens in one chunk (the flushing test slows it down).
  EXPECT_GE(TokenEvents(streamed.body), 1);
  EXPECT_LE(TokenEvents(streamed.body), static_cast<int>(grpc.tokens.size()));
}

TEST_F(HttpApiTest, ChatStreamedAndWholeAgreeAndCarryUsage) {
  const std::string body =
      R"({"messages":[{"role":"user","content":"Who was the father of Isaac?"}],"max_tokens":12,"seed":5,)"
      R"("temperature":0.7)";
  const HttpReply whole = Post(cluster_->http_port(), "/v1/chat/completions", body + "}");
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json w = json::parse(whole.body);
  EXPECT_EQ(w["object"], "chat.completion");
  EXPECT_EQ(w["choices"][0]["message"]["role"], "assistant");
  const HttpReply s = Post(cluster_->http_port(), "/v1/chat/completions",
                           body + R"(,"stream":true,"stream_options":{"include_usage":true}})");
  ASSERT_EQ(s.status, 200) << s.body;
  const std::vector<std::string> events = SseData(s.body);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(json::parse(events[0])["choices"][0]["delta"]["role"], "assistant");
  std::string content;
  for (size_t i = 0; i + 2 < events.size(); ++i) {
    const json e = json::parse(events[i]);
    EXPECT_EQ(e["object"], "chat.completion.chunk");
    EXPECT_TRUE(e["usage"].is_null());
    if (e["choices"][0]["delta"].contains("content")) content += e["choices"][0]["delta"]["content"].get<std::string>();
  }
  EXPECT_EQ(content, w["choices"][0]["message"]["content"]);
  const json usage = json::parse(events[events.size() - 2]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["prompt_tokens"], w["usage"]["prompt_tokens"]);
  EXPECT_EQ(usage["usage"]["completion_tokens"], w["usage"]["completion_tokens"]);
  // The same prompt again: its whole blocks come from the prefix cache.
  EXPECT_GT(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 0) << usage.dump();
  EXPECT_EQ(events.back(), "[DONE]");
}

TEST_F(HttpApiTest, MalformedHugeAndInvalidBodiesGetClearErrorsAndTheRouterServesOn) {
  const int port = cluster_->http_port();
  auto expect_error = [](const HttpReply& r, int status, const std::string& param, const std::string& what) {
    EXPECT_EQ(r.status, status) << what << ": " << r.body;
    const json j = json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("error")) << what << ": " << r.body;
    EXPECT_EQ(j["error"]["param"], param) << what;
    EXPECT_FALSE(j["error"]["message"].get<std::string>().empty()) << what;
  };
  expect_error(Post(port, "/v1/completions", R"({"prompt": "a", "max_tokens": )"), 400, "body", "truncated JSON");
  expect_error(Post(port, "/v1/completions", "not json"), 400, "body", "not JSON");
  expect_error(Post(port, "/v1/completions", "[1,2]"), 400, "body", "not an object");
  expect_error(Post(port, "/v1/completions", "{\"prompt\": \"In the \xff\xfe beginning\"}"), 400, "body",
               "invalid UTF-8");
  expect_error(Post(port, "/v1/chat/completions", R"({"messages":[{"role":"user","content":"hi"}],"functions":[]})"),
               400, "functions", "unsupported field");
  expect_error(Post(port, "/v1/completions", R"({"prompt":"a","temperature":"hot"})"), 400, "temperature",
               "bad value");
  expect_error(Post(port, "/v1/completions", R"({"prompt":"a","max_tokens":100000})"), 400, "max_tokens",
               "beyond the context");
  expect_error(Post(port, "/v1/completions", R"({"prompt":"a","model":"gpt-4"})"), 404, "model", "unknown model");
  // Over the 8 MiB limit: an OpenAI error; far over it: libevent refuses
  // it unread. Either way the router goes on serving.
  const std::string big = absl::StrCat(R"({"prompt":")", std::string(9 << 20, 'a'), R"("})");
  expect_error(Post(port, "/v1/completions", big), 413, "body", "9 MiB body");
  const std::string huge = absl::StrCat(R"({"prompt":")", std::string(40 << 20, 'a'), R"("})");
  const HttpReply refused = Post(port, "/v1/completions", huge);
  EXPECT_TRUE(refused.status == 413 || refused.status == 0) << refused.status;
  // Errors outside the generation endpoints.
  EXPECT_EQ(HttpExchange(port, HttpRequest("GET", "/v1/completions", "")).status, 405);
  EXPECT_EQ(HttpExchange(port, HttpRequest("GET", "/v2/nothing", "")).status, 404);

  // ignore_eos: the count is exact whatever is sampled. (A reply cut short
  // by a failure is an error naming it, never a 200 with fewer tokens.)
  const HttpReply ok =
      Post(port, "/v1/completions", R"({"prompt":"In the beginning","max_tokens":3,"ignore_eos":true})");
  ASSERT_EQ(ok.status, 200) << ok.body << "\n" << cluster_->Logs();
  EXPECT_EQ(json::parse(ok.body)["usage"]["completion_tokens"], 3) << ok.body << "\n" << cluster_->Logs();
  EXPECT_EQ(json::parse(ok.body)["choices"][0]["finish_reason"], "length") << ok.body;
}

TEST_F(HttpApiTest, ModelsAndHealth) {
  const HttpReply models = HttpExchange(cluster_->http_port(), HttpRequest("GET", "/v1/models", ""));
  ASSERT_EQ(models.status, 200) << models.body;
  const json m = json::parse(models.body);
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "kjv-tiny");
  EXPECT_EQ(m["data"][0]["object"], "model");
  const HttpReply health = HttpExchange(cluster_->http_port(), HttpRequest("GET", "/health", ""));
  EXPECT_EQ(health.status, 200) << health.body;
}

// A decode worker that takes 80 ms a step: each token's event must reach
// the client on its own, long before the next one exists; and a client
// that goes away mid-request has its KV freed on both workers.
class SlowHttpTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new Cluster();
    cluster_->tls = false;
    const absl::Status s =
        cluster_->Start(TempDir() + "/http-slow", /*colocated=*/false, {"--fault_step_delay_ms", "80"});
    ASSERT_TRUE(s.ok()) << s;
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }
  static double Cancelled() {
    return MetricValue(HttpGet(cluster_->router_metrics(), "/metrics"), "pdserve_requests_total{outcome=\"cancelled\"}");
  }
  static Cluster* cluster_;
};
Cluster* SlowHttpTest::cluster_ = nullptr;

TEST_F(SlowHttpTest, EachTokenIsFlushedAsItsOwnEvent) {
  constexpr int kTokens = 8;
  const HttpReply r = Post(cluster_->http_port(), "/v1/completions",
                           absl::StrCat(R"({"prompt":"In the beginning","max_tokens":)", kTokens,
                                        R"(,"ignore_eos":true,"stream":true})"));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(TokenEvents(r.body), kTokens);
  int reads_with_tokens = 0, most_in_one_read = 0;
  for (const std::string& piece : r.reads) {
    const int n = static_cast<int>(std::vector<std::string>(absl::StrSplit(piece, "data: {")).size()) - 1;
    reads_with_tokens += n > 0;
    most_in_one_read = std::max(most_in_one_read, n);
  }
  // 80 ms apart, so they come in separate reads; a scheduling hiccup on a
  // loaded machine may still merge a pair, never the whole stream.
  EXPECT_GE(reads_with_tokens, kTokens - 2) << "the events were buffered: " << r.reads.size() << " reads";
  EXPECT_LE(most_in_one_read, 3);
}

TEST_F(SlowHttpTest, ClosingTheConnectionCancelsTheRequestAndFreesItsKv) {
  const double before = Cancelled();
  {  // Mid-stream.
    HttpConnection c(cluster_->http_port());
    ASSERT_TRUE(c.Send(HttpRequest("POST", "/v1/completions",
                                   R"({"prompt":"In the beginning","max_tokens":400,"ignore_eos":true,"stream":true})")));
    const HttpReply partial = c.Read(absl::Seconds(30), +[](const std::string& raw) {
      return std::vector<std::string>(absl::StrSplit(raw, "data: {")).size() > 3;
    });
    ASSERT_EQ(partial.status, 200);
    const v1::ClusterStatusResponse st = cluster_->Status();
    EXPECT_GT(st.decode(0).kv_blocks_used(), 0) << st.ShortDebugString();
    c.Close();
  }
  EXPECT_EQ(AllKvUsedAfterSettling(*cluster_), 0);
  {  // Not streamed: nothing has been written when the client leaves.
    HttpConnection c(cluster_->http_port());
    ASSERT_TRUE(c.Send(HttpRequest("POST", "/v1/chat/completions",
                                   R"({"messages":[{"role":"user","content":"Who was Isaac?"}],"max_tokens":400,)"
                                   R"("ignore_eos":true})")));
    absl::SleepFor(absl::Milliseconds(400));
    EXPECT_GT(cluster_->Status().decode(0).kv_blocks_used(), 0);
    c.Close();
  }
  EXPECT_EQ(AllKvUsedAfterSettling(*cluster_), 0);
  // Both ended as cancelled, long before their 400 tokens (32 s here).
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (Cancelled() < before + 2 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(Cancelled(), before + 2);
}

// A client that stops reading: its events pile up in the router until the
// stream's unsent bytes pass --http_max_buffered_bytes, then the request is
// cancelled and its KV freed, as a gRPC stall is.
TEST(HttpStallTest, AClientThatStopsReadingIsCancelledAndItsKvFreed) {
  Cluster c;
  c.tls = false;
  // Small kernel buffers on both sides, so the stream's ~1 MB outgrows them.
  c.extra_router_flags = {"--http_max_buffered_bytes", "65536", "--http_socket_send_buffer_bytes", "65536"};
  const absl::Status s = c.Start(TempDir() + "/http-stall", /*colocated=*/false);
  ASSERT_TRUE(s.ok()) << s;
  HttpConnection stalled(c.http_port(), /*receive_buffer=*/4096);
  // Big events: 20 alternatives a token.
  ASSERT_TRUE(stalled.Send(HttpRequest(
      "POST", "/v1/completions",
      R"({"prompt":"In the beginning","max_tokens":480,"ignore_eos":true,"stream":true,"logprobs":20})")));
  auto metric = [&c](const std::string& series) {
    return MetricValue(HttpGet(c.router_metrics(), "/metrics"), series);
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (metric("pdserve_http_stalled_streams_total") < 1 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(metric("pdserve_http_stalled_streams_total"), 1) << c.Logs();
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0);
  EXPECT_EQ(metric("pdserve_requests_total{outcome=\"cancelled\"}"), 1);
  // Others are served meanwhile.
  const HttpReply ok = HttpExchange(c.http_port(), HttpRequest("POST", "/v1/completions", R"({"prompt":"a"})"));
  EXPECT_EQ(ok.status, 200) << ok.body;
}

// /health answers 503 once no request can be placed (colocated here: the
// decode pool is the only one), and 200 again when a worker is back.
TEST(HttpHealthTest, HealthFollowsWhetherARequestCanBePlaced) {
  Cluster c;
  c.tls = false;
  const absl::Status s = c.Start(TempDir() + "/http-health", /*colocated=*/true);
  ASSERT_TRUE(s.ok()) << s;
  auto health = [&c] { return HttpExchange(c.http_port(), HttpRequest("GET", "/health", "")).status; };
  EXPECT_EQ(health(), 200);
  c.decode(0).Kill();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (health() != 503 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(health(), 503);
  const HttpReply r = HttpExchange(c.http_port(), HttpRequest("POST", "/v1/completions", R"({"prompt":"a"})"));
  EXPECT_EQ(r.status, 503) << r.body;
  ASSERT_TRUE(c.RestartDecode(0).ok());
  const absl::Time back = absl::Now() + absl::Seconds(20);
  while (health() != 200 && absl::Now() < back) absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(health(), 200);
}

}  // namespace
}  // namespace pdserve
