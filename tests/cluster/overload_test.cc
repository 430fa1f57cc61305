// Overload with real processes: more requests than the decode KV pool
// holds. The router holds back what finds no decode room in its queue, so a
// burst of several pools' worth completes with every stream exact, no
// worker is ejected and no prefill work is thrown away; past the queue's
// bounds (its length, a request's wait) a request is refused at once with
// RESOURCE_EXHAUSTED / 429 and a retry-after, before any prefill work; and
// workers answer health checks and status probes in time while loaded.
//
// A pool is held full for as long as a test needs by one long request on a
// decode worker slowed by --fault_step_delay_ms, cancelled once the test is
// done with it. Plaintext: the raw HTTP client speaks no TLS.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "engine/generation.h"
#include "base/health_check.h"
#include "model/model.h"
#include "text/tokenizer.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "pdserve/v1/worker.grpc.pb.h"
#include "tests/cluster/cluster_harness.h"
#include "tests/cluster/reference_stream.h"
#include "tests/support/default_model.h"
#include "tests/support/http_client.h"

namespace pdserve {
namespace {

using testing_support::HttpExchange;
using testing_support::HttpReply;
using testing_support::HttpRequest;

constexpr int kBlock = 16;  // positions per KV block (the workers' default)

// Enough text for one full prompt block: a request that reached the
// prefill worker would show in its prefix cache lookups.
constexpr char kBlockPrompt[] =
    "And God said, Let there be light: and there was light. And God saw the light, that it was good";
constexpr char kShortPrompt[] = "In the beginning God created";

// What a refused call came to, and how long it took.
struct Refusal {
  grpc::Status status;
  std::string retry_after;  // the trailing metadata entry; "" if none
  int tokens = 0;
  absl::Duration took;
};

class OverloadTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    // The servers take the matrix path the reference engine does (see
    // cluster_test.cc): both must run the same arithmetic.
    absl::StatusOr<testing_support::DefaultModel> m = testing_support::LoadDefaultModel(1, true);
    ASSERT_TRUE(m.ok()) << m.status();
    loaded_ = new testing_support::DefaultModel(*std::move(m));
    setenv("PDSERVE_MATRIX_PATH", std::string(kernels::cpu::MatrixPathName(loaded_->backend->matrix_path())).c_str(),
           1);
  }
  static void TearDownTestSuite() {
    delete loaded_;
    loaded_ = nullptr;
  }

 protected:
  static int PromptTokens(const std::string& text) {
    return static_cast<int>(loaded_->tokenizer->Encode(text, false)->size());
  }

  static v1::GenerateRequest Text(const std::string& text, int max_tokens, uint64_t seed) {
    v1::GenerateRequest r;
    r.set_text(text);
    r.set_max_tokens(max_tokens);
    r.set_ignore_eos(true);
    r.mutable_sampling()->set_temperature(0.8f);
    r.mutable_sampling()->set_seed(seed);
    return r;
  }

  static Output Reference(const v1::GenerateRequest& req) {
    return ReferenceStream(*loaded_->model, *loaded_->tokenizer, req);
  }
  static void ExpectSame(const Output& got, const Output& want, const std::string& what) {
    ExpectSameStream(got, want, what);
  }

  // `n` requests of two blocks each (a short prompt + 16 tokens), distinct seeds.
  static std::vector<v1::GenerateRequest> TwoBlockRequests(int n) {
    const int prompt = PromptTokens(kShortPrompt);
    EXPECT_GT(prompt + 16, kBlock);
    EXPECT_LE(prompt + 16, 2 * kBlock);
    std::vector<v1::GenerateRequest> reqs;
    for (int i = 0; i < n; ++i) reqs.push_back(Text(kShortPrompt, 16, 3000 + i));
    return reqs;
  }

  // Every request at once, each from its own thread.
  static std::vector<Output> Burst(Cluster& c, const std::vector<v1::GenerateRequest>& reqs) {
    std::vector<Output> got(reqs.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < reqs.size(); ++i) threads.emplace_back([&, i] { got[i] = c.Generate(reqs[i]); });
    for (auto& t : threads) t.join();
    return got;
  }

  // A request refused by the router's queue: its status, trailing
  // retry-after and what it streamed before ending.
  static Refusal Call(Cluster& c, const v1::GenerateRequest& req) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    const absl::Time start = absl::Now();
    auto reader = c.stub()->Generate(&ctx, req);
    Output got;
    ReadToEnd(*reader, got);
    Refusal out;
    out.took = absl::Now() - start;
    out.status = got.status;
    out.tokens = static_cast<int>(got.tokens.size());
    const auto& trailers = ctx.GetServerTrailingMetadata();
    if (auto it = trailers.find("retry-after"); it != trailers.end()) {
      out.retry_after.assign(it->second.data(), it->second.size());
    }
    return out;
  }

  static void ExpectRetryAfter(const std::string& value) {
    int64_t seconds = 0;
    EXPECT_TRUE(absl::SimpleAtoi(value, &seconds)) << "retry-after '" << value << "' is not an integer";
    EXPECT_GE(seconds, 1) << value;
  }

  // Polls ClusterStatus until `done` holds or 20 s pass; returns the last answer.
  template <typename Pred>
  static v1::ClusterStatusResponse AwaitStatus(Cluster& c, Pred done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    v1::ClusterStatusResponse st = c.Status();
    while (!done(st) && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
      st = c.Status();
    }
    return st;
  }

  // The prefill worker's counters that grow with any request it is given:
  // handoffs, prefix cache lookups (one per full prompt block) and its queue.
  struct PrefillWork {
    double transfers = 0;
    double lookups = 0;
    double queue_depth = 0;
    bool operator==(const PrefillWork&) const = default;
  };
  static PrefillWork ReadPrefillWork(Cluster& c) {
    const std::string page = HttpGet(c.prefill_metrics(), "/metrics");
    PrefillWork w;
    w.transfers = MetricValue(page, "pdserve_handoff_transfers_total");
    w.lookups = MetricValue(page, "pdserve_prefix_cache_blocks_total{result=\"hit\"}") +
                MetricValue(page, "pdserve_prefix_cache_blocks_total{result=\"miss\"}");
    w.queue_depth = MetricValue(page, "pdserve_prefill_queue_depth");
    EXPECT_GE(w.transfers, 0) << page;
    return w;
  }
  // The prefill worker counts a handoff once the decode worker's commit is
  // back, which may be after the stream's first tokens reached the client.
  static PrefillWork AwaitPrefillTransfers(Cluster& c, double transfers) {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    PrefillWork w = ReadPrefillWork(c);
    while (w.transfers != transfers && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
      w = ReadPrefillWork(c);
    }
    return w;
  }
  static std::string Describe(const PrefillWork& w) {
    return absl::StrCat("transfers ", w.transfers, ", prefix cache lookups ", w.lookups, ", queue depth ",
                        w.queue_depth);
  }

  // A stream that takes the whole decode pool of `pool` positions and
  // holds it while the decode worker is slowed; constructed once its first
  // token came (placed and prefilled). Cancel() frees the pool, as does
  // going away.
  class Holder {
   public:
    Holder(Cluster& c, int pool) {
      const int prompt = PromptTokens(kShortPrompt);
      req_ = Text(kShortPrompt, pool - prompt, 1);
      ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      reader_ = c.stub()->Generate(&ctx_, req_);
      ReadAtLeast(*reader_, 1, got_);
    }
    Holder(const Holder&) = delete;
    Holder& operator=(const Holder&) = delete;
    ~Holder() { Cancel(); }

    bool streaming() const { return !got_.tokens.empty(); }
    void Cancel() {
      if (ended_) return;
      ctx_.TryCancel();
      ReadToEnd(*reader_, got_);
      ended_ = true;
    }
    const Output& got() const { return got_; }

   private:
    v1::GenerateRequest req_;
    grpc::ClientContext ctx_;
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader_;
    Output got_;
    bool ended_ = false;
  };

  static testing_support::DefaultModel* loaded_;
};

testing_support::DefaultModel* OverloadTest::loaded_ = nullptr;

// 32 blocks hold 16 requests of 2 blocks at once; 64 arrive together.
TEST_F(OverloadTest, ABurstOfFourTimesTheDecodePoolCompletesEveryStreamExactly) {
  Cluster c;
  c.tls = false;
  const absl::Status s = c.Start(TempDir() + "/burst", /*colocated=*/false, {"--kv_positions", "512"});
  ASSERT_TRUE(s.ok()) << s;
  const std::vector<v1::GenerateRequest> reqs = TwoBlockRequests(64);
  const absl::Time start = absl::Now();
  const std::vector<Output> got = Burst(c, reqs);
  std::cout << "64 requests in " << absl::Now() - start << "\n";
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Reference(reqs[i]), absl::StrCat("stream ", i));

  const v1::ClusterStatusResponse st = c.Status();
  EXPECT_EQ(st.prefill_ejections(), 0) << st.ShortDebugString() << "\n" << c.Logs();
  EXPECT_EQ(st.decode_ejections(), 0) << st.ShortDebugString() << "\n" << c.Logs();
  EXPECT_EQ(st.queue().placed(), 64) << st.queue().ShortDebugString();
  EXPECT_GT(st.queue().placed_waited(), 0) << "a pool's worth at a time: the rest waited";
  EXPECT_EQ(st.queue().refused_full(), 0);
  EXPECT_EQ(st.queue().refused_wait(), 0);
  ASSERT_EQ(st.prefill_size(), 1);
  EXPECT_EQ(st.prefill(0).prefill_discarded_tokens(), 0) << st.ShortDebugString();
  EXPECT_EQ(MetricValue(HttpGet(c.prefill_metrics(), "/metrics"), "pdserve_prefill_discarded_tokens_total"), 0);
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString();
}

// --max_queued_requests 2: with the pool held and two requests waiting, the
// next is refused at once, over gRPC and HTTP, and never reaches a worker.
TEST_F(OverloadTest, TheQueueBoundRefusesAtOnceBeforeAnyPrefill) {
  Cluster c;
  c.tls = false;
  c.extra_router_flags = {"--max_queued_requests", "2"};
  const absl::Status s =
      c.Start(TempDir() + "/full", /*colocated=*/false, {"--kv_positions", "64", "--fault_step_delay_ms", "300"});
  ASSERT_TRUE(s.ok()) << s;
  Holder holder(c, 4 * kBlock);
  ASSERT_TRUE(holder.streaming()) << holder.got().status.error_message() << "\n" << c.Logs();

  // Two blocks each, and a full prompt block each.
  const int prompt = PromptTokens(kBlockPrompt);
  ASSERT_GE(prompt, kBlock);
  ASSERT_LT(prompt + 4, 2 * kBlock);
  std::vector<Output> waited(2);
  std::vector<std::thread> waiters;
  for (int i = 0; i < 2; ++i) {
    waiters.emplace_back([&, i] { waited[i] = c.Generate(Text(kBlockPrompt, 4, 10 + i)); });
  }
  // No ASSERT from here until the waiters are joined: they end only once
  // the holder is cancelled.
  v1::ClusterStatusResponse st = AwaitStatus(c, [](const auto& st) { return st.queue().waiting() == 2; });
  EXPECT_EQ(st.queue().waiting(), 2) << st.ShortDebugString() << "\n" << c.Logs();

  const PrefillWork before = AwaitPrefillTransfers(c, 1);
  EXPECT_EQ(before.transfers, 1) << "only the holder was handed off: " << Describe(before);

  const Refusal refused = Call(c, Text(kBlockPrompt, 4, 20));
  std::cout << "gRPC refusal took " << refused.took << "\n";
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.status.error_message();
  EXPECT_EQ(refused.status.error_message(), "the router's queue is full: 2 requests waiting (--max_queued_requests)");
  ExpectRetryAfter(refused.retry_after);
  EXPECT_EQ(refused.tokens, 0);

  const std::string body = absl::StrCat(R"({"model":"kjv-tiny","prompt":")", kBlockPrompt,
                                        R"(","max_tokens":4,"temperature":0.8,"seed":21})");
  const absl::Time http_start = absl::Now();
  const HttpReply http = HttpExchange(c.http_port(), HttpRequest("POST", "/v1/completions", body));
  std::cout << "HTTP refusal took " << absl::Now() - http_start << "\n";
  EXPECT_EQ(http.status, 429) << http.body;
  EXPECT_TRUE(absl::StrContains(http.body, "--max_queued_requests")) << http.body;
  EXPECT_TRUE(http.headers.contains("retry-after")) << http.body;
  if (http.headers.contains("retry-after")) ExpectRetryAfter(http.headers.at("retry-after"));

  const PrefillWork after = ReadPrefillWork(c);
  EXPECT_EQ(after, before) << "a refused request reached the prefill worker: before " << Describe(before) << "; after "
                           << Describe(after);
  st = c.Status();
  EXPECT_EQ(st.queue().refused_full(), 2) << st.queue().ShortDebugString();
  EXPECT_EQ(st.queue().waiting(), 2) << st.queue().ShortDebugString();
  EXPECT_EQ(MetricValue(HttpGet(c.router_metrics(), "/metrics"), "pdserve_requests_total{outcome=\"queue_full\"}"), 2);

  // Room freed: the two that waited run to their end.
  holder.Cancel();
  for (auto& t : waiters) t.join();
  for (const Output& w : waited) {
    EXPECT_TRUE(w.status.ok()) << w.status.error_message() << "\n" << c.Logs();
    EXPECT_EQ(w.tokens.size(), 4u);
  }
  const PrefillWork end = AwaitPrefillTransfers(c, 3);
  EXPECT_EQ(end.transfers, 3) << Describe(end);
  EXPECT_EQ(end.lookups, before.lookups + 2) << "each prompt block looked up once: " << Describe(end);
  EXPECT_EQ(c.Status().prefill(0).prefill_discarded_tokens(), 0);
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString();
}

// --max_queue_wait_s 0.5: a request that finds the pool held waits that
// long and is refused, never having reached a worker.
TEST_F(OverloadTest, AWaitPastTheBoundIsRefusedBeforeAnyPrefill) {
  Cluster c;
  c.tls = false;
  c.extra_router_flags = {"--max_queue_wait_s", "0.5"};
  const absl::Status s =
      c.Start(TempDir() + "/wait", /*colocated=*/false, {"--kv_positions", "64", "--fault_step_delay_ms", "300"});
  ASSERT_TRUE(s.ok()) << s;
  Holder holder(c, 4 * kBlock);
  ASSERT_TRUE(holder.streaming()) << holder.got().status.error_message() << "\n" << c.Logs();
  const PrefillWork before = AwaitPrefillTransfers(c, 1);
  EXPECT_EQ(before.transfers, 1) << Describe(before);

  const Refusal refused = Call(c, Text(kBlockPrompt, 4, 30));
  std::cout << "refused after " << refused.took << " in the queue\n";
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.status.error_message();
  EXPECT_TRUE(absl::StartsWith(refused.status.error_message(), "waited ")) << refused.status.error_message();
  EXPECT_TRUE(absl::EndsWith(refused.status.error_message(),
                             " s in the router's queue for decode KV room (--max_queue_wait_s)"))
      << refused.status.error_message();
  ExpectRetryAfter(refused.retry_after);
  EXPECT_EQ(refused.tokens, 0);

  const PrefillWork after = ReadPrefillWork(c);
  EXPECT_EQ(after, before) << "a refused request reached the prefill worker: before " << Describe(before) << "; after "
                           << Describe(after);
  const v1::ClusterStatusResponse st = c.Status();
  EXPECT_EQ(st.queue().refused_wait(), 1) << st.queue().ShortDebugString();
  EXPECT_EQ(st.queue().waiting(), 0) << st.queue().ShortDebugString();
  EXPECT_EQ(MetricValue(HttpGet(c.router_metrics(), "/metrics"), "pdserve_requests_total{outcome=\"queue_wait\"}"), 1);

  holder.Cancel();
  EXPECT_EQ(holder.got().status.error_code(), grpc::StatusCode::CANCELLED) << holder.got().status.error_message();
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString();
}

// While a burst of sixteen pools' worth runs (both workers' cores busy
// for seconds), each worker's health check and Status answer every 100 ms
// within a 2 s deadline.
TEST_F(OverloadTest, WorkersAnswerHealthWithinTheirDeadlineUnderFullLoad) {
  Cluster c;
  c.tls = false;
  const absl::Status s = c.Start(TempDir() + "/health", /*colocated=*/false, {"--kv_positions", "512"});
  ASSERT_TRUE(s.ok()) << s;
  const v1::ClusterStatusResponse initial = c.Status();
  ASSERT_EQ(initial.prefill_size(), 1);
  ASSERT_EQ(initial.decode_size(), 1);

  struct Probed {
    std::string role, address;
    std::shared_ptr<grpc::Channel> channel;
    int health_calls = 0, health_failures = 0, status_calls = 0, status_failures = 0;
    absl::Duration slowest;
    std::string first_failure;
  };
  std::vector<Probed> workers(2);
  workers[0].role = "prefill";
  workers[0].address = initial.prefill(0).address();
  workers[1].role = "decode";
  workers[1].address = initial.decode(0).address();
  for (Probed& w : workers) w.channel = TestChannel(w.address, "", /*tls=*/false);
  absl::Notification stop;
  std::thread prober([&] {
    do {
      for (Probed& w : workers) {
        absl::Time start = absl::Now();
        const absl::StatusOr<HealthStatus> h = CheckHealth(w.channel, absl::Seconds(2));
        w.slowest = std::max(w.slowest, absl::Now() - start);
        ++w.health_calls;
        if (!h.ok() || *h != HealthStatus::kServing) {
          ++w.health_failures;
          if (w.first_failure.empty()) {
            w.first_failure = h.ok() ? absl::StrCat("health ", static_cast<int>(*h)) : h.status().ToString();
          }
        }
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
        worker::v1::WorkerInfo info;
        start = absl::Now();
        const grpc::Status st = w.role == "prefill"
                                    ? worker::v1::PrefillWorker::NewStub(w.channel)->Status(&ctx, {}, &info)
                                    : worker::v1::DecodeWorker::NewStub(w.channel)->Status(&ctx, {}, &info);
        w.slowest = std::max(w.slowest, absl::Now() - start);
        ++w.status_calls;
        if (!st.ok()) {
          ++w.status_failures;
          if (w.first_failure.empty()) w.first_failure = absl::StrCat("Status: ", st.error_message());
        }
      }
    } while (!stop.WaitForNotificationWithTimeout(absl::Milliseconds(100)));
  });

  const std::vector<v1::GenerateRequest> reqs = TwoBlockRequests(256);
  const absl::Time start = absl::Now();
  const std::vector<Output> got = Burst(c, reqs);
  std::cout << "256 requests in " << absl::Now() - start << "\n";
  stop.Notify();
  prober.join();
  for (size_t i = 0; i < reqs.size(); ++i) ExpectSame(got[i], Reference(reqs[i]), absl::StrCat("stream ", i));
  for (const Probed& w : workers) {
    std::cout << w.role << ": " << w.health_calls << " health checks, " << w.status_calls << " Status calls, slowest "
              << w.slowest << "\n";
    EXPECT_GT(w.health_calls, 0) << w.role;
    EXPECT_EQ(w.health_failures, 0) << w.role << " " << w.address << ": " << w.first_failure;
    EXPECT_EQ(w.status_failures, 0) << w.role << " " << w.address << ": " << w.first_failure;
  }
  const v1::ClusterStatusResponse st = c.Status();
  EXPECT_EQ(st.prefill_ejections(), 0) << st.ShortDebugString() << "\n" << c.Logs();
  EXPECT_EQ(st.decode_ejections(), 0) << st.ShortDebugString() << "\n" << c.Logs();
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString();
}

}  // namespace
}  // namespace pdserve
