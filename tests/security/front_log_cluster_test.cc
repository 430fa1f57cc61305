// Attack: invalid UTF-8 in strings the router logs, against a real router.
// The API key file's lines reach the log through its parse errors (a limit
// field is quoted back), so whoever can write that file, or a Secret
// update gone wrong, could stop the router with a byte that is not UTF-8.
// What a throwing log line does, and what the tests rule out:
// - a router started with such a file dies by SIGABRT (status 134,
//   "terminate called after throwing an instance of
//   nlohmann::...::type_error") instead of exiting with its start error;
// - a running router whose key file is rewritten with such a line dies
//   ("terminate called after throwing ...") on the first HTTP request after
//   the rewrite: the file is read again on a request's own thread, which
//   logs the parse error (a gRPC request there fails UNKNOWN, "Unexpected
//   error in RPC handling", as gRPC catches the throw).
// Client-chosen strings are kept out of the log's reach otherwise (gRPC
// strings must be UTF-8 to parse; an X-Request-Id that is not printable
// ASCII is ignored; the Authorization header is never logged); the last
// test holds those lines too.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
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

constexpr char kReplacement[] = "\xEF\xBF\xBD";  // U+FFFD
constexpr char kCompletion[] = R"({"prompt": "And God said", "max_tokens": 2})";
constexpr char kAlice[] = "Authorization: Bearer sk-test-alice";

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// Every line of a server's log, parsed strictly (nlohmann::json::parse
// refuses invalid UTF-8); a line that does not parse fails the test. The
// protobuf library logs on its own, in its own format (a message that
// does not parse, naming the field, not its bytes): those lines are left.
std::vector<nlohmann::json> LogLines(const std::string& path) {
  std::vector<nlohmann::json> out;
  for (absl::string_view line : absl::StrSplit(ReadFile(path), '\n', absl::SkipEmpty())) {
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) {
      ADD_FAILURE() << "not a JSON log line: " << line;
      continue;
    }
    out.push_back(std::move(j));
  }
  return out;
}

const nlohmann::json* FindEvent(const std::vector<nlohmann::json>& lines, const std::string& event) {
  for (const nlohmann::json& j : lines) {
    if (j.value("event", "") == event) return &j;
  }
  return nullptr;
}

// A key line whose limit field holds bytes that are not UTF-8: the parse
// error quotes that field back.
std::string PoisonedKeyLine() { return absl::StrCat("mallory:", router::Sha256Hex("sk-mallory"), " rate=\xff\xfe\n"); }

TEST(FrontLogClusterTest, ARouterGivenAKeyFileWithInvalidUtf8ExitsWithALegibleError) {
  const std::string dir = TempDir();
  const std::string keys = dir + "/api_keys";
  std::ofstream(keys) << PoisonedKeyLine();
  testing_support::Subprocess router;
  const std::string log = dir + "/router.log";
  ASSERT_TRUE(router
                  .Start({kBin + "/router/pdserve-router", "--model", kModel, "--insecure", "--colocated", "--decode",
                          "127.0.0.1:1", "--api_keys_file", keys},
                         log)
                  .ok());
  // 2: the router's own start error, not 134 (SIGABRT from a throw).
  EXPECT_EQ(router.Wait(absl::Seconds(60)), 2) << router.LogTail();
  const std::vector<nlohmann::json> lines = LogLines(log);
  const nlohmann::json* failed = FindEvent(lines, "start_failed");
  ASSERT_NE(failed, nullptr) << router.LogTail();
  const std::string error = (*failed)["error"];
  EXPECT_TRUE(absl::StrContains(error, "api_keys:1: 'rate=")) << error;
  EXPECT_TRUE(absl::StrContains(error, kReplacement)) << error;
}

TEST(FrontLogClusterTest, AKeyFileRewrittenWithInvalidUtf8LeavesTheRouterServingWithTheOldKeys) {
  const std::string dir = TempDir();
  const std::string keys = dir + "/api_keys";
  std::ofstream(keys) << "alice:" << router::Sha256Hex("sk-test-alice") << "\n";
  Cluster c;
  c.tls = false;
  c.extra_router_flags = {"--api_keys_file", keys};
  ASSERT_TRUE(c.Start(dir + "/c", /*colocated=*/true).ok());
  ASSERT_TRUE(c.Generate(SeededRequest(2), "Bearer sk-test-alice").status.ok()) << c.Logs();
  {
    std::ofstream(keys + ".new") << "alice:" << router::Sha256Hex("sk-test-alice") << "\n" << PoisonedKeyLine();
    std::filesystem::rename(keys + ".new", keys);
  }
  // The file is looked at again at most once a second, on a request: send
  // requests until the router says it kept the old keys (or stops answering).
  const std::string log = dir + "/c/router.log";
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  HttpReply got;
  while (absl::Now() < deadline) {
    got = HttpExchange(c.http_port(), HttpRequest("POST", "/v1/completions", kCompletion, {kAlice}));
    if (got.status != 200 || absl::StrContains(ReadFile(log), "api_keys_not_reloaded")) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_EQ(got.status, 200) << got.body << "\n" << c.Logs();
  const std::vector<nlohmann::json> lines = LogLines(log);
  const nlohmann::json* kept = FindEvent(lines, "api_keys_not_reloaded");
  ASSERT_NE(kept, nullptr) << c.Logs();
  const std::string error = (*kept)["error"];
  EXPECT_TRUE(absl::StrContains(error, std::string("'rate=") + kReplacement)) << error;
  // Still serving, over both APIs, with the keys it had.
  const Output after = c.Generate(SeededRequest(2), "Bearer sk-test-alice");
  EXPECT_TRUE(after.status.ok()) << after.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(after.tokens.size(), 2u);
  const HttpReply http = HttpExchange(c.http_port(), HttpRequest("POST", "/v1/completions", kCompletion, {kAlice}));
  EXPECT_EQ(http.status, 200) << http.body;
}

TEST(FrontLogClusterTest, ClientStringsWithInvalidUtf8NeverReachTheLogRaw) {
  const std::string dir = TempDir();
  const std::string keys = dir + "/api_keys";
  std::ofstream(keys) << "alice:" << router::Sha256Hex("sk-test-alice") << "\n";
  Cluster c;
  c.tls = false;
  c.extra_router_flags = {"--api_keys_file", keys, "--log_level", "debug"};
  ASSERT_TRUE(c.Start(dir + "/c", /*colocated=*/true).ok());
  // gRPC: a request id that is not UTF-8 does not parse as the message.
  v1::GenerateRequest bad_id = SeededRequest(2);
  bad_id.set_request_id("id-\xff\xfe");
  const Output refused = c.Generate(bad_id, "Bearer sk-test-alice");
  EXPECT_FALSE(refused.status.ok());
  // HTTP: such an X-Request-Id is ignored (not echoed, not logged); a key
  // that is not UTF-8 is refused without being logged.
  const HttpReply http = HttpExchange(
      c.http_port(), HttpRequest("POST", "/v1/completions", R"({"prompt": "And God said", "max_tokens": 2})",
                                 {"Authorization: Bearer sk-test-alice", "X-Request-Id: id-\xff\xfe"}));
  EXPECT_EQ(http.status, 200) << http.body;
  EXPECT_EQ(http.headers.count("x-request-id"), 0u);
  const HttpReply bad_key = HttpExchange(
      c.http_port(), HttpRequest("POST", "/v1/completions", R"({"prompt": "And God said", "max_tokens": 2})",
                                 {"Authorization: Bearer sk-\xff\xfe"}));
  EXPECT_EQ(bad_key.status, 401) << bad_key.body;
  const Output after = c.Generate(SeededRequest(2), "Bearer sk-test-alice");
  EXPECT_TRUE(after.status.ok()) << after.status.error_message() << "\n" << c.Logs();
  // Every line parses; none holds the client's bytes.
  const std::string raw = ReadFile(dir + "/c/router.log");
  EXPECT_FALSE(absl::StrContains(raw, "\xff\xfe")) << raw;
  const std::vector<nlohmann::json> lines = LogLines(dir + "/c/router.log");
  EXPECT_NE(FindEvent(lines, "unauthenticated"), nullptr) << raw;
  // libprotobuf's own complaint about the request id, as a JSON line.
  const nlohmann::json* protobuf = FindEvent(lines, "protobuf");
  ASSERT_NE(protobuf, nullptr) << raw;
  EXPECT_TRUE(absl::StrContains(protobuf->value("message", ""), "invalid UTF-8")) << raw;
}

}  // namespace
}  // namespace pdserve
