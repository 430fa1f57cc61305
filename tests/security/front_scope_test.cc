// Attacks on what the router's client APIs give a client beyond its own
// generation, against real processes.
//
// Reply amplification: a reply that is not streamed is held whole until its
// last token, with every token's logprob entry and its alternatives. Served
// as asked, a non-streamed chat asking for top_logprobs 20 and no
// max_tokens (the rest of the context) gets a 200 whose body holds 21
// entries for each of the ~500 tokens kjv-tiny's 512-position context
// leaves (a few hundred bytes each, built as a JSON tree first; a
// 128K-context model: ~900 MB per request), and so does gRPC Complete with
// max_tokens 480 and logprobs 20. Both are refused naming max_tokens (HTTP
// 400 with "param", gRPC INVALID_ARGUMENT), counted as invalid; the same
// requests streamed are served.
//
// Cluster status for anyone: ClusterStatus on the router's public port
// answers with every worker's address, KV sizes and failure reasons, after
// calling every worker, so it must not answer a client with no key or a
// wrong one. It needs a valid key when keys are on (UNAUTHENTICATED,
// counted), and pdctl status sends its --api_key.
//
// Cross-tenant prompt probing: with block hashes the same for every API
// key, a prompt prefix one key has sent is a cache hit for any other, and
// the hit shows in the reply (cached_prompt_tokens over gRPC,
// usage.prompt_tokens_details.cached_tokens over HTTP): bob, sending
// alice's 160-token prefix, is told 160 of his tokens are cached, and can
// so test guesses at another tenant's prompt block by block. With
// --prefix_cache_scope=per_key each key's chains are salted apart: bob is
// told 0 (and computes the prefix himself), alice still hits her own. The
// shared scope, the default, keeps reuse across keys (the test holds both).
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "router/api_keys.h"
#include "tests/cluster/cluster_harness.h"
#include "tests/support/http_client.h"

namespace pdserve {
namespace {

using testing_support::HttpExchange;
using testing_support::HttpReply;
using testing_support::HttpRequest;
using testing_support::SseData;

constexpr char kAlice[] = "sk-test-alice";

std::string WriteKeys(const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string keys = dir + "/api_keys";
  std::ofstream(keys) << "alice:" << router::Sha256Hex(kAlice) << "\n"
                      << "bob:" << router::Sha256Hex("sk-test-bob") << "\n";
  return keys;
}

double InvalidCount(const Cluster& c) {
  return MetricValue(HttpGet(c.router_metrics(), "/metrics"), "pdserve_requests_total{outcome=\"invalid\"}");
}

TEST(FrontScopeTest, AWholeReplyOverTheEntryLimitIsRefusedAndTheSameStreamIsServed) {
  const std::string dir = TempDir();
  Cluster c;
  c.tls = false;
  c.extra_router_flags = {"--max_reply_entries", "1000"};
  ASSERT_TRUE(c.Start(dir + "/c", /*colocated=*/true).ok()) << c.Logs();

  // gRPC: Complete holds the reply whole; Generate streams it.
  v1::GenerateRequest big = SeededRequest(480);
  big.set_logprobs(20);
  big.set_ignore_eos(true);
  {
    grpc::ClientContext ctx;
    v1::CompleteResponse out;
    const grpc::Status st = c.stub()->Complete(&ctx, big, &out);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_TRUE(absl::StartsWith(st.error_message(), "max_tokens: ")) << st.error_message();
    EXPECT_TRUE(absl::StrContains(st.error_message(), "10080 logprob entries")) << st.error_message();
    EXPECT_EQ(out.logprobs_size(), 0);
  }
  EXPECT_GE(InvalidCount(c), 1);
  const Output streamed = c.Generate(big);
  ASSERT_TRUE(streamed.status.ok()) << streamed.status.error_message();
  EXPECT_EQ(streamed.tokens.size(), 480u);
  v1::GenerateRequest small = SeededRequest(40);  // 840 entries
  small.set_logprobs(20);
  {
    grpc::ClientContext ctx;
    v1::CompleteResponse out;
    const grpc::Status st = c.stub()->Complete(&ctx, small, &out);
    ASSERT_TRUE(st.ok()) << st.error_message();
    EXPECT_GT(out.logprobs_size(), 0);
  }

  // HTTP: no max_tokens is the rest of the context.
  const std::string chat =
      R"({"messages": [{"role": "user", "content": "In the beginning"}], "logprobs": true, "top_logprobs": 20,
          "ignore_eos": true)";
  const HttpReply whole = HttpExchange(c.http_port(), HttpRequest("POST", "/v1/chat/completions", chat + "}"));
  EXPECT_EQ(whole.status, 400) << whole.body.substr(0, 500);
  const nlohmann::json error = nlohmann::json::parse(whole.body, nullptr, false);
  ASSERT_TRUE(error.is_object() && error.contains("error")) << whole.body.substr(0, 500);
  EXPECT_EQ(error["error"].value("param", ""), "max_tokens") << whole.body;
  const HttpReply bounded =
      HttpExchange(c.http_port(), HttpRequest("POST", "/v1/chat/completions", chat + R"(, "max_tokens": 40})"));
  EXPECT_EQ(bounded.status, 200) << bounded.body.substr(0, 500);  // 840 entries
  const HttpReply stream =
      HttpExchange(c.http_port(), HttpRequest("POST", "/v1/chat/completions", chat + R"(, "stream": true})"));
  EXPECT_EQ(stream.status, 200) << stream.body.substr(0, 500);
  ASSERT_FALSE(SseData(stream.body).empty());
  EXPECT_EQ(SseData(stream.body).back(), "[DONE]");
}

TEST(FrontScopeTest, ClusterStatusNeedsAValidKeyWhenKeysAreOn) {
  const std::string dir = TempDir();
  Cluster c;
  c.tls = false;
  c.extra_router_flags = {"--api_keys_file", WriteKeys(dir)};
  ASSERT_TRUE(c.Start(dir + "/c", /*colocated=*/true).ok()) << c.Logs();
  const std::string metrics_key = "pdserve_requests_total{outcome=\"unauthenticated\"}";
  const double before = std::max(0.0, MetricValue(HttpGet(c.router_metrics(), "/metrics"), metrics_key));
  for (const std::string authorization : {"", "Bearer sk-test-mallory"}) {
    grpc::ClientContext ctx;
    if (!authorization.empty()) ctx.AddMetadata("authorization", authorization);
    v1::ClusterStatusResponse out;
    const grpc::Status st = c.stub()->ClusterStatus(&ctx, {}, &out);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << authorization;
    EXPECT_EQ(out.decode_size(), 0) << out.ShortDebugString();
  }
  EXPECT_EQ(MetricValue(HttpGet(c.router_metrics(), "/metrics"), metrics_key), before + 2);
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", absl::StrCat("Bearer ", kAlice));
    v1::ClusterStatusResponse out;
    const grpc::Status st = c.stub()->ClusterStatus(&ctx, {}, &out);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(out.decode_size(), 1);
    EXPECT_EQ(out.decode(0).address(), c.decode_address());
  }
  // pdctl status sends its key ($PDSERVE_API_KEY here), and fails without.
  const std::string pdctl = absl::StrCat(kBin, "/tools/pdctl/pdctl status --router ", c.address(), " > ", dir,
                                         "/pdctl.out 2>&1");
  EXPECT_NE(std::system(pdctl.c_str()), 0);
  EXPECT_EQ(std::system(absl::StrCat("PDSERVE_API_KEY=", kAlice, " ", pdctl).c_str()), 0);
  std::ifstream f(dir + "/pdctl.out");
  const std::string printed((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(absl::StrContains(printed, c.decode_address())) << printed;
}

constexpr int kPrefix = 160;  // 10 blocks of 16

// The same 160-token prefix, then 24 tokens particular to `variant`.
v1::GenerateRequest PrefixRequest(int variant) {
  v1::GenerateRequest r;
  for (int i = 0; i < kPrefix; ++i) r.mutable_token_ids()->add_ids(100 + (i * 37) % 3000);
  for (int i = 0; i < 24; ++i) r.mutable_token_ids()->add_ids(200 + variant * 131 + i);
  r.set_max_tokens(4);
  r.mutable_sampling()->set_seed(5 + static_cast<uint64_t>(variant));
  return r;
}

// PrefixRequest(variant) as an HTTP completions body.
std::string PrefixBody(int variant) {
  const v1::GenerateRequest r = PrefixRequest(variant);
  nlohmann::json body = {{"prompt", nlohmann::json::array()}, {"max_tokens", r.max_tokens()},
                         {"seed", r.sampling().seed()}};
  for (int32_t id : r.token_ids().ids()) body["prompt"].push_back(id);
  return body.dump();
}

// The cached prompt tokens alice, alice again and then bob are told of, and
// bob again: [alice, alice, bob, bob]; over gRPC, or over HTTP
// (usage.prompt_tokens_details.cached_tokens).
std::vector<int32_t> CachedAsSeen(const std::string& dir, const std::string& scope, bool colocated,
                                  bool http = false) {
  Cluster c;
  c.tls = false;
  c.extra_router_flags = {"--api_keys_file", WriteKeys(dir), "--prefix_cache_scope", scope};
  const absl::Status started = c.Start(dir + "/c", colocated);
  EXPECT_TRUE(started.ok()) << started << c.Logs();
  if (!started.ok()) return {};
  std::vector<int32_t> cached;
  int variant = 0;
  for (const char* key : {kAlice, kAlice, "sk-test-bob", "sk-test-bob"}) {
    if (http) {
      const HttpReply reply = HttpExchange(
          c.http_port(), HttpRequest("POST", "/v1/completions", PrefixBody(variant++),
                                     {absl::StrCat("Authorization: Bearer ", key)}));
      EXPECT_EQ(reply.status, 200) << reply.body.substr(0, 500);
      const nlohmann::json j = nlohmann::json::parse(reply.body, nullptr, false);
      cached.push_back(j.is_object() ? j["usage"]["prompt_tokens_details"].value("cached_tokens", -1) : -1);
      continue;
    }
    const Output got = c.Generate(PrefixRequest(variant++), absl::StrCat("Bearer ", key));
    EXPECT_TRUE(got.status.ok()) << got.status.error_message() << c.Logs();
    EXPECT_EQ(got.tokens.size(), 4u);
    cached.push_back(got.final.timings().cached_prompt_tokens());
  }
  return cached;
}

TEST(FrontScopeTest, PerKeyScopeHidesOneKeysCachedPromptFromAnother) {
  const std::string dir = TempDir();
  using V = std::vector<int32_t>;
  EXPECT_EQ(CachedAsSeen(dir + "/per_key", "per_key", /*colocated=*/false), (V{0, kPrefix, 0, kPrefix}));
  // The decode worker's own prefills (colocated) are scoped alike.
  EXPECT_EQ(CachedAsSeen(dir + "/per_key_colocated", "per_key", /*colocated=*/true), (V{0, kPrefix, 0, kPrefix}));
  // The OpenAI HTTP API's usage is scoped alike.
  EXPECT_EQ(CachedAsSeen(dir + "/per_key_http", "per_key", /*colocated=*/false, /*http=*/true),
            (V{0, kPrefix, 0, kPrefix}));
  // Shared: bob is a hit on alice's prefix (what per_key takes away).
  EXPECT_EQ(CachedAsSeen(dir + "/shared", "shared", /*colocated=*/false), (V{0, kPrefix, kPrefix, kPrefix}));
}

}  // namespace
}  // namespace pdserve
