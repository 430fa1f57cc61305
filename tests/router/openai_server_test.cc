// The HTTP server in-process, over the relay and fake workers
// (in_process_router.h): its lifecycle (a stream in flight when it stops,
// a drain), its address parsing and its metrics. The wire behaviour
// against real workers: tests/cluster/http_api_test.cc.
#include "router/openai/server.h"

#include <linux/sockios.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
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

// This process's socket whose local port is `local` and peer port `peer`
// (-1: none): the server's end of a test client's connection.
int SocketOf(int local, int peer) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    int fd;
    if (!absl::SimpleAtoi(entry.path().filename().string(), &fd)) continue;
    sockaddr_in a{}, b{};
    socklen_t la = sizeof(a), lb = sizeof(b);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&a), &la) != 0 ||
        getpeername(fd, reinterpret_cast<sockaddr*>(&b), &lb) != 0 || a.sin_family != AF_INET) {
      continue;
    }
    if (ntohs(a.sin_port) == local && ntohs(b.sin_port) == peer) return fd;
  }
  return -1;
}

// The bytes in a socket's kernel queue: `request` FIONREAD (received, not
// read) or SIOCOUTQ (sent, not acknowledged).
int Queued(int fd, unsigned long request) {
  int n = 0;
  return fd >= 0 && ioctl(fd, request, &n) == 0 ? n : 0;
}

// `f()` once it has held the same value for 10 ms.
template <typename F>
int Settled(F f) {
  int last = f(), same = 0;
  for (int i = 0; i < 2000 && same < 5; ++i) {
    absl::SleepFor(absl::Milliseconds(2));
    const int now = f();
    same = now == last ? same + 1 : 0;
    last = now;
  }
  return last;
}

bool WaitFor(const std::function<bool()>& f, absl::Duration timeout) {
  for (const absl::Time end = absl::Now() + timeout; absl::Now() < end; absl::SleepFor(absl::Milliseconds(1))) {
    if (f()) return true;
  }
  return f();
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


// A TLS server with a small send buffer, its decode worker's events let
// out a permit at a time, and an authentication that holds the loop
// ("Bearer stall") until told to go on.
class TlsStreamTest : public OpenAiServerTest {
 protected:
  static constexpr int kTokens = 500;  // the kjv-tiny context is 512

  void SetUp() override {
    OpenAiServerTest::SetUp();
    certs_ = ::testing::TempDir() + "/openai_server_test_certs";
    ASSERT_EQ(
        std::system(absl::StrCat("'", PDSERVE_SOURCE_DIR, "/deploy/make_certs.sh' '", certs_, "' > /dev/null").c_str()),
        0);
    rig_.workers.at("d0").decode_permits = permits_;
    backend_.authenticate = [this](absl::string_view authorization,
                                   absl::string_view) -> absl::StatusOr<std::string> {
      if (authorization == "Bearer stall") {
        stalled_.Notify();
        resume_.WaitForNotification();
      }
      return std::string("test");
    };
    HttpServerOptions o;
    o.address = "127.0.0.1:0";
    o.tls = {certs_ + "/router.pem", certs_ + "/router.key", ca()};
    o.socket_send_buffer = 4096;
    absl::StatusOr<std::unique_ptr<HttpServer>> server = HttpServer::Start(o, backend_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  void TearDown() override {
    if (!resume_.HasBeenNotified()) resume_.Notify();  // a loop still held
    server_.reset();
  }

  std::string ca() const { return certs_ + "/ca.pem"; }
  int port() const { return server_->port(); }
  // Bytes in the kernel between the server and `stream`'s client.
  int InKernel(const HttpConnection& stream) const {
    return Queued(stream.fd(), FIONREAD) + Queued(server_fd_, SIOCOUTQ);
  }

  // Starts a stream of kTokens on `stream` whose client reads nothing, and
  // lets its tokens out one at a time until two in a row stay with the
  // server: the kernel queues hold no more, and the server's output has
  // bytes waiting for the socket to be writable.
  void StartAndFillTheKernelQueues(HttpConnection& stream) {
    ASSERT_TRUE(stream.ok());
    ASSERT_TRUE(stream.Send(HttpRequest(
        "POST", "/v1/completions",
        absl::StrCat(R"({"prompt":[100,101,102],"max_tokens":)", kTokens, R"(,"temperature":0,"stream":true})"))));
    ASSERT_TRUE(WaitFor([&] { return rig_.Count(kPumps) >= 1; }, absl::Seconds(10)));  // the first token's event
    server_fd_ = SocketOf(port(), stream.local_port());
    ASSERT_GE(server_fd_, 0);
    auto in_kernel = [&] { return InKernel(stream); };
    int stayed = 0;
    for (int i = 0; i < kTokens - 10 && stayed < 2; ++i) {
      const int before = Settled(in_kernel);
      const double pumped = rig_.Count(kPumps);
      permits_->fetch_add(1);
      ASSERT_TRUE(WaitFor([&] { return rig_.Count(kPumps) > pumped; }, absl::Seconds(10))) << "token " << i;
      stayed = Settled(in_kernel) == before ? stayed + 1 : 0;
    }
    ASSERT_EQ(stayed, 2) << "the kernel queues never filled";
  }

  // Lets the rest of the stream out and waits until its generation has
  // handed the last events to the loop (Drain: until every generation's
  // thread is done; the test sends no generation after this).
  void EndTheGeneration() {
    permits_->fetch_add(kTokens);
    server_->Drain(absl::Now() + absl::Seconds(10));
    ASSERT_EQ(rig_.Count("pdserve_requests_total", "outcome=\"length\""), 1);
  }

  static constexpr char kPumps[] = "pdserve_http_event_write_delay_seconds_count";
  std::string certs_;
  std::shared_ptr<std::atomic<int>> permits_ = std::make_shared<std::atomic<int>>(0);
  absl::Notification stalled_, resume_;
  std::unique_ptr<HttpServer> server_;
  int server_fd_ = -1;
};

// Under TLS libevent runs a connection's write callback on the loop's turn
// after a write empties the output, without looking at the output again.
// A stream's last events, handed over in the same turn as such a write,
// were taken for written by that callback: the request was freed and the
// connection stopped writing with them queued, and the client waited for
// the stream's end forever (the npm client test's intermittent 300 s
// hang; with "Connection: close", as here, the connection closed with
// them unsent). The test lines that turn up exactly: with the server's
// output waiting on a full socket, an authentication holds the loop; the
// client reads everything the kernel holds (the socket becomes writable
// first) and the generation ends (its wake-up comes second); the loop then
// writes what was waiting and takes the stream's end in one turn.
TEST_F(TlsStreamTest, AStreamsEndQueuedInTheTurnOfAWriteThatEmptiedTheOutputIsWritten) {
  HttpConnection stream(port(), /*receive_buffer=*/4096, ca());
  StartAndFillTheKernelQueues(stream);
  if (HasFatalFailure()) return;
  HttpConnection models(port(), 0, ca());
  ASSERT_TRUE(models.Send(HttpRequest("GET", "/v1/models", "", {"Authorization: Bearer stall"})));
  ASSERT_TRUE(stalled_.WaitForNotificationWithTimeout(absl::Seconds(10)));
  for (const absl::Time end = absl::Now() + absl::Seconds(10);
       absl::Now() < end && Settled([&] { return InKernel(stream); }) > 0;) {
    stream.Read(absl::Milliseconds(5));
  }
  ASSERT_EQ(InKernel(stream), 0);
  EndTheGeneration();
  if (HasFatalFailure()) return;
  resume_.Notify();

  const HttpReply r = stream.Read(absl::Seconds(10));
  ASSERT_EQ(r.status, 200);
  const std::vector<std::string> events = SseData(r.body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(events.size(), kTokens + 2u);  // a token an event, the finish, [DONE]
  EXPECT_EQ(models.Read(absl::Seconds(10)).status, 200);
  EXPECT_TRUE(WaitFor([&] { return rig_.Count("pdserve_http_requests_open") == 0; }, absl::Seconds(10)));
}

// A client that goes away while its stream's last bytes wait for the
// socket: the server closes its end and the request, held for those bytes,
// is ended with it; the server still answers.
TEST_F(TlsStreamTest, AClientGoneWhileTheStreamsEndWaitsIsLetGo) {
  HttpConnection stream(port(), /*receive_buffer=*/4096, ca());
  StartAndFillTheKernelQueues(stream);
  if (HasFatalFailure()) return;
  EndTheGeneration();
  if (HasFatalFailure()) return;
  // The loop runs: the last events' hand-over to libevent is its last
  // event written (the client reads nothing, so they stay queued there).
  Settled([&] { return static_cast<int>(rig_.Count(kPumps)); });
  EXPECT_EQ(rig_.Count("pdserve_http_requests_open"), 1);
  const int client_port = stream.local_port();
  stream.Close();
  EXPECT_TRUE(WaitFor([&] { return SocketOf(port(), client_port) < 0; }, absl::Seconds(10)))
      << "the server kept its end of a closed connection";
  EXPECT_TRUE(WaitFor([&] { return rig_.Count("pdserve_http_requests_open") == 0; }, absl::Seconds(10)))
      << "the stream's request was never ended";
  // Draining (EndTheGeneration): a new generation is refused, but answered.
  HttpConnection next(port(), 0, ca());
  ASSERT_TRUE(next.Send(HttpRequest("POST", "/v1/completions", R"({"prompt":[100,101],"max_tokens":2})")));
  EXPECT_EQ(next.Read(absl::Seconds(10)).status, 503);
}

}  // namespace
}  // namespace pdserve::router::openai
