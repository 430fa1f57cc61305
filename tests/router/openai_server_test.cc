// The HTTP server in-process, over the relay and fake workers
// (in_process_router.h): its lifecycle (a stream in flight when it stops,
// a drain), its address parsing and its metrics. The wire behaviour
// against real workers: tests/cluster/http_api_test.cc.
#include "router/openai/server.h"

#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/router/in_process_router.h"
#include "tests/support/http_client.h"

namespace pdserve::router::openai {
namespace {

using ::pdserve::router::testing::DecodeFault;
using ::pdserve::router::testing::InProcessRouter;
using ::pdserve::testing_support::HttpConnection;
using ::pdserve::testing_support::HttpExchange;
using ::pdserve::testing_support::HttpReply;
using ::pdserve::testing_support::HttpRequest;
using ::pdserve::testing_support::SseData;

const char kStream[] =
    R"({"prompt":[100,101,102,103,104,105,106,107],"max_tokens":6,"temperature":0,"seed":7,"stream":true,)"
    R"("stream_options":{"include_usage":true}})";

bool HasTwoEvents(const std::string& raw) {
  return std::vector<std::string>(absl::StrSplit(raw, "data: {")).size() > 2;
}

class OpenAiServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    rig_.AddWorker(Role::kPrefill, "p0");
    rig_.AddWorker(Role::kDecode, "d0");
    rig_.ProbeAll();
    resolver_ = *RequestResolver::Create(std::string(PDSERVE_SOURCE_DIR) + "/deploy/models/kjv-tiny", "kjv-tiny");
    backend_.resolver = resolver_.get();
    backend_.relay = &rig_.context;
    backend_.ready = [] { return absl::OkStatus(); };
    backend_.metrics = &rig_.metrics;
  }
  std::unique_ptr<HttpServer> Start() {
    HttpServerOptions o;
    o.address = "127.0.0.1:0";
    absl::StatusOr<std::unique_ptr<HttpServer>> s = HttpServer::Start(o, backend_);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *std::move(s) : nullptr;
  }

  InProcessRouter rig_;
  std::unique_ptr<RequestResolver> resolver_;
  HttpBackend backend_;
};

TEST(SplitHostPortTest, TakesV4V6AndNamesAndRefusesTheRest) {
  EXPECT_EQ(*SplitHostPort("127.0.0.1:8000"), (std::pair<std::string, int>("127.0.0.1", 8000)));
  EXPECT_EQ(*SplitHostPort("[::1]:0"), (std::pair<std::string, int>("::1", 0)));
  EXPECT_EQ(*SplitHostPort("localhost:65535"), (std::pair<std::string, int>("localhost", 65535)));
  for (const char* bad : {"8000", ":8000", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:-1", "[::1", "[::1]8000",
                          "host:port"}) {
    EXPECT_EQ(SplitHostPort(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST_F(OpenAiServerTest, AStreamFromFakeWorkersWithUsageAndMetrics) {
  std::unique_ptr<HttpServer> server = Start();
  ASSERT_NE(server, nullptr);
  const HttpReply r = HttpExchange(server->port(), HttpRequest("POST", "/v1/completions", kStream));
  ASSERT_EQ(r.status, 200) << r.body;
  const std::vector<std::string> events = SseData(r.body);
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back(), "[DONE]");
  const nlohmann::json usage = nlohmann::json::parse(events[events.size() - 2]);
  EXPECT_EQ(usage["usage"]["completion_tokens"], 6);
  EXPECT_EQ(usage["usage"]["prompt_tokens"], 8);
  // One event per token (the fake workers send a token a message), then
  // the finish, the usage and [DONE].
  EXPECT_EQ(events.size(), 6u + 3u);
  EXPECT_EQ(nlohmann::json::parse(events[6])["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(rig_.Count("pdserve_http_replies_total", "code=\"200\""), 1);
  EXPECT_GE(rig_.Count("pdserve_http_event_write_delay_seconds_count"), 1);
  EXPECT_EQ(HttpExchange(server->port(), HttpRequest("GET", "/nope", "")).status, 404);
  EXPECT_EQ(rig_.Count("pdserve_http_replies_total", "code=\"404\""), 1);
}

TEST_F(OpenAiServerTest, APlausibleRequestIdIsEchoedAndOthersAreDropped) {
  std::unique_ptr<HttpServer> server = Start();
  ASSERT_NE(server, nullptr);
  const char kWhole[] = R"({"prompt":[100,101,102],"max_tokens":2})";
  HttpReply r = HttpExchange(server->port(), HttpRequest("POST", "/v1/completions", kWhole, {"X-Request-Id: trace-42"}));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers["x-request-id"], "trace-42");
  r = HttpExchange(server->port(), HttpRequest("POST", "/v1/completions", kStream, {"X-Request-Id: trace-43"}));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers["x-request-id"], "trace-43");
  // Too long for the logs: not used, not echoed; the request is served.
  r = HttpExchange(server->port(),
                   HttpRequest("POST", "/v1/completions", kWhole, {"X-Request-Id: " + std::string(200, 'x')}));
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers.count("x-request-id"), 0u);
}

TEST_F(OpenAiServerTest, StoppingTheServerCancelsStreamsInFlight) {
  rig_.workers.at("d0").decode_faults.push_back({DecodeFault::kHoldAfter, 2});
  std::unique_ptr<HttpServer> server = Start();
  ASSERT_NE(server, nullptr);
  HttpConnection c(server->port());
  ASSERT_TRUE(c.Send(HttpRequest("POST", "/v1/completions", kStream)));
  const HttpReply partial = c.Read(absl::Seconds(10), &HasTwoEvents);
  ASSERT_EQ(partial.status, 200);
  const absl::Time start = absl::Now();
  server.reset();  // cancels the held stream, waits for its relay thread
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(rig_.Count("pdserve_requests_total", "outcome=\"cancelled\""), 1);
  EXPECT_EQ(rig_.in_flight.load(), 0);
}

TEST_F(OpenAiServerTest, ADrainRefusesNewWorkAndWaitsForWhatRuns) {
  rig_.workers.at("d0").decode_faults.push_back({DecodeFault::kHoldAfter, 2});
  std::unique_ptr<HttpServer> server = Start();
  ASSERT_NE(server, nullptr);
  HttpConnection held(server->port());
  ASSERT_TRUE(held.Send(HttpRequest("POST", "/v1/completions", kStream)));
  ASSERT_EQ(held.Read(absl::Seconds(10), &HasTwoEvents).status, 200);
  std::thread drain([&server] { server->Drain(absl::Now() + absl::Milliseconds(300)); });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(HttpExchange(server->port(), HttpRequest("GET", "/health", "")).status, 503);
  const HttpReply refused = HttpExchange(server->port(), HttpRequest("POST", "/v1/completions", kStream));
  EXPECT_EQ(refused.status, 503) << refused.body;
  drain.join();  // the held stream still runs: the drain ended at its deadline
  held.Close();  // the client goes: its relay is cancelled
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (rig_.in_flight.load() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(rig_.in_flight.load(), 0);
  EXPECT_EQ(rig_.Count("pdserve_requests_total", "outcome=\"cancelled\""), 1);
}

// A request that fails or is cancelled after its first tokens: a stream
// ends with an error event; a whole reply is an error reply naming the
// cause, never a 200 whose text stops short.
TEST_F(OpenAiServerTest, ARequestThatFailsMidWayIsAnErrorReplyNotAShortAnswer) {
  std::unique_ptr<HttpServer> server = Start();
  ASSERT_NE(server, nullptr);
  const char kWhole[] = R"({"prompt":[100,101,102],"max_tokens":6,"temperature":0,"seed":7})";
  rig_.workers.at("d0").decode_faults.push_back({DecodeFault::kErrorAfter, 2});
  HttpReply r = HttpExchange(server->port(), HttpRequest("POST", "/v1/completions", kWhole));
  EXPECT_EQ(r.status, 500) << r.body;
  nlohmann::json j = nlohmann::json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j.contains("error")) << r.body;
  EXPECT_EQ(j["error"]["type"], "server_error");
  // The prefill worker's token and the decode worker's two.
  EXPECT_EQ(j["error"]["message"], "decode worker d0: the sampler found a NaN logit (after 3 tokens)");

  rig_.workers.at("d0").decode_faults.push_back({DecodeFault::kCancelAfter, 2});
  r = HttpExchange(server->port(), HttpRequest("POST", "/v1/completions", kWhole));
  EXPECT_EQ(r.status, 503) << r.body;
  j = nlohmann::json::parse(r.body, nullptr, false);
  ASSERT_TRUE(j.is_object() && j.contains("error")) << r.body;
  EXPECT_EQ(j["error"]["message"], "the request was cancelled after 3 tokens");

  rig_.workers.at("d0").decode_faults.push_back({DecodeFault::kErrorAfter, 2});
  r = HttpExchange(server->port(), HttpRequest("POST", "/v1/completions", kStream));
  ASSERT_EQ(r.status, 200) << r.body;
  const std::vector<std::string> events = SseData(r.body);
  ASSERT_EQ(events.size(), 5u) << r.body;  // 3 tokens, the error, [DONE]
  j = nlohmann::json::parse(events[3]);
  EXPECT_EQ(j["error"]["message"], "decode worker d0: the sampler found a NaN logit") << events[3];
  EXPECT_EQ(events.back(), "[DONE]");

  // The server serves on, and counted each outcome.
  rig_.workers.at("d0").decode_faults.clear();
  r = HttpExchange(server->port(), HttpRequest("POST", "/v1/completions", kWhole));
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["usage"]["completion_tokens"], 6);
  EXPECT_EQ(rig_.Count("pdserve_requests_total", "outcome=\"error\""), 2);
  EXPECT_EQ(rig_.Count("pdserve_requests_total", "outcome=\"cancelled\""), 1);
  EXPECT_EQ(rig_.Count("pdserve_http_replies_total", "code=\"500\""), 1);
  EXPECT_EQ(rig_.Count("pdserve_http_replies_total", "code=\"503\""), 1);
}

TEST_F(OpenAiServerTest, BadOrTakenAddressesAreRefused) {
  HttpServerOptions o;
  o.address = "no-port";
  EXPECT_EQ(HttpServer::Start(o, backend_).status().code(), absl::StatusCode::kInvalidArgument);
  std::unique_ptr<HttpServer> first = Start();
  ASSERT_NE(first, nullptr);
  o.address = absl::StrCat("127.0.0.1:", first->port());
  EXPECT_EQ(HttpServer::Start(o, backend_).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace pdserve::router::openai
