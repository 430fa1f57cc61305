// A decode worker whose KV pool is full when a prefill worker's reservation
// arrives: the prefill worker waits for room with the prompt not yet
// computed, and hands off once the room frees (the prefill runs once); it
// gives up at --handoff_room_wait_s with RESOURCE_EXHAUSTED naming the wait;
// a caller's cancel ends the wait at once. The wait is asked again when
// the decode worker tells of freed room (kv::RoomFreed), never by a timer.
//
// The test plays the router over the workers' own RPCs: the router holds a
// request back while its ledger says a decode worker is full, and here the
// pool must be full exactly when the reservation arrives. The pool is
// filled by a committed handoff nobody claims, and freed by the router's
// Release of it: both events the test controls.
//
// Plaintext, so no grants: a decode worker with a grant key counts a grant
// as used when it checks it, before the pool refuses the reservation.
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "pdserve/v1/worker.grpc.pb.h"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {
namespace {

using worker::v1::DecodeEvent;
using worker::v1::DecodeWorker;
using worker::v1::PrefillEvent;
using worker::v1::PrefillWorker;

constexpr int kPromptTokens = 20;  // One full block of 16 and a partial one.

// One prefill worker and one decode worker with a pool of 128 positions.
class Pair {
 public:
  absl::Status Start(const std::string& dir, const std::string& room_wait_s) {
    std::filesystem::create_directories(dir);
    const std::string dready = dir + "/decode.ready";
    if (absl::Status s = decode_.Start({kBin + "/decode_worker/pdserve-decode-worker", "--model", kModel,
                                        "--ready_file", dready, "--kv_positions", "128", "--insecure"},
                                       dir + "/decode.log");
        !s.ok()) {
      return s;
    }
    absl::StatusOr<int> dport = decode_.WaitReady(dready, absl::Seconds(60));
    if (!dport.ok()) return dport.status();
    decode_stub_ = DecodeWorker::NewStub(TestChannel(absl::StrCat("127.0.0.1:", *dport), "decode", false));
    const std::string pready = dir + "/prefill.ready";
    if (absl::Status s = prefill_.Start({kBin + "/prefill_worker/pdserve-prefill-worker", "--model", kModel,
                                         "--ready_file", pready, "--handoff_room_wait_s", room_wait_s, "--insecure"},
                                        dir + "/prefill.log");
        !s.ok()) {
      return s;
    }
    absl::StatusOr<int> pport = prefill_.WaitReady(pready, absl::Seconds(60));
    if (!pport.ok()) return pport.status();
    prefill_stub_ = PrefillWorker::NewStub(TestChannel(absl::StrCat("127.0.0.1:", *pport), "prefill", false));
    prefill_metrics_ = MetricsPort(pready);
    const worker::v1::WorkerInfo info = DecodeInfo();
    kv_address_ = info.kv_address();
    pool_positions_ = info.status().kv_blocks_total() * info.status().kv_block_size();
    return absl::OkStatus();
  }

  worker::v1::WorkerInfo DecodeInfo() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    worker::v1::WorkerInfo info;
    EXPECT_TRUE(decode_stub_->Status(&ctx, {}, &info).ok());
    return info;
  }
  v1::WorkerStatus PrefillStatus() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    worker::v1::WorkerInfo info;
    EXPECT_TRUE(prefill_stub_->Status(&ctx, {}, &info).ok());
    return info.status();
  }
  double PrefillMetric(const std::string& series) { return MetricValue(HttpGet(prefill_metrics_, "/metrics"), series); }
  // Polls the prefill worker's metric until it reads `value` or `limit`
  // passes; returns the last reading.
  double AwaitPrefillMetric(const std::string& series, double value, absl::Duration limit = absl::Seconds(10)) {
    const absl::Time deadline = absl::Now() + limit;
    double got = PrefillMetric(series);
    while (got != value && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
      got = PrefillMetric(series);
    }
    return got;
  }

  // Greedy, to its max_tokens: a prompt of kPromptTokens ids from `first_id`.
  static worker::v1::WorkRequest Work(const std::string& id, int first_id, int max_tokens) {
    worker::v1::WorkRequest w;
    w.set_request_id(id);
    for (int i = 0; i < kPromptTokens; ++i) w.add_prompt_ids(first_id + 7 * i);
    w.set_top_p(1.0f);
    w.set_repetition_penalty(1.0f);
    w.set_max_tokens(max_tokens);
    w.set_ignore_eos(true);
    return w;
  }

  struct Prefilled {
    int firsts = 0;
    int dones = 0;
    grpc::Status status;
  };
  // One Prefill call to its end. `ctx` lets another thread cancel it.
  Prefilled Prefill(const worker::v1::WorkRequest& work, grpc::ClientContext* ctx = nullptr) {
    grpc::ClientContext own;
    if (ctx == nullptr) ctx = &own;
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    worker::v1::PrefillRequest req;
    *req.mutable_request() = work;
    req.set_decode_kv_address(kv_address_);
    auto reader = prefill_stub_->Prefill(ctx, req);
    Prefilled out;
    PrefillEvent ev;
    while (reader->Read(&ev)) {
      out.firsts += ev.has_first() ? 1 : 0;
      out.dones += ev.has_done() ? 1 : 0;
    }
    out.status = reader->Finish();
    return out;
  }

  // Commits a handoff that fills the decode pool; nobody claims it.
  void FillDecodePool(const std::string& id) {
    const Prefilled p = Prefill(Work(id, 100, pool_positions_ - kPromptTokens));
    ASSERT_TRUE(p.status.ok()) << p.status.error_message() << "\n" << Logs();
    ASSERT_EQ(p.dones, 1);
    ASSERT_EQ(DecodeInfo().status().kv_blocks_free(), 0) << DecodeInfo().ShortDebugString();
  }
  bool Release(const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    worker::v1::ReleaseRequest req;
    req.set_request_id(id);
    worker::v1::ReleaseResponse out;
    return decode_stub_->Release(&ctx, req, &out).ok() && out.freed();
  }
  // The handed-off request decoded to its end: the tokens it streamed.
  std::pair<int, grpc::Status> Decode(const worker::v1::WorkRequest& work) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    worker::v1::DecodeRequest req;
    *req.mutable_request() = work;
    auto reader = decode_stub_->Decode(&ctx, req);
    int tokens = 0;
    DecodeEvent ev;
    while (reader->Read(&ev)) tokens += ev.has_chunk() ? ev.chunk().token_ids_size() : 0;
    return {tokens, reader->Finish()};
  }

  const std::string& kv_address() const { return kv_address_; }
  std::string Logs() { return absl::StrCat("decode:\n", decode_.LogTail(), "\nprefill:\n", prefill_.LogTail()); }

 private:
  Subprocess decode_, prefill_;
  std::unique_ptr<DecodeWorker::Stub> decode_stub_;
  std::unique_ptr<PrefillWorker::Stub> prefill_stub_;
  int prefill_metrics_ = 0;
  std::string kv_address_;
  int pool_positions_ = 0;
};

TEST(HandoffRoomTest, AFullDecodePoolIsWaitedForAndThePrefillRunsOnce) {
  Pair w;
  absl::Status s = w.Start(TempDir(), "30");
  ASSERT_TRUE(s.ok()) << s;
  w.FillDecodePool("holder");

  const worker::v1::WorkRequest waiter = Pair::Work("waiter", 900, 12);
  Pair::Prefilled got;
  std::thread call([&] { got = w.Prefill(waiter); });
  // Refused for room, the reservation waits; nothing is computed meanwhile.
  EXPECT_EQ(w.AwaitPrefillMetric("pdserve_handoff_room_waits_total", 1), 1) << w.Logs();
  EXPECT_EQ(w.PrefillStatus().queued(), 1);
  // Nothing frees for a while: the reservation is not asked again (the
  // decode worker tells when room frees; no timer asks for it).
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ(w.PrefillMetric("pdserve_handoff_room_retries_total"), 0);
  ASSERT_TRUE(w.Release("holder")) << w.Logs();
  call.join();
  // One free, one RoomFreed, one retry that succeeds.
  EXPECT_EQ(w.PrefillMetric("pdserve_handoff_room_retries_total"), 1);

  ASSERT_TRUE(got.status.ok()) << got.status.error_message() << "\n" << w.Logs();
  EXPECT_EQ(got.firsts, 1);
  EXPECT_EQ(got.dones, 1);
  const auto [tokens, decoded] = w.Decode(waiter);
  EXPECT_TRUE(decoded.ok()) << decoded.error_message() << "\n" << w.Logs();
  EXPECT_EQ(tokens, 11) << "the first token came from the prefill worker";

  // Each request prefilled once: its one full prompt block looked up once.
  EXPECT_EQ(w.PrefillMetric("pdserve_prefix_cache_blocks_total{result=\"miss\"}") +
                w.PrefillMetric("pdserve_prefix_cache_blocks_total{result=\"hit\"}"),
            2);
  EXPECT_EQ(w.PrefillMetric("pdserve_handoff_transfers_total"), 2);
  EXPECT_EQ(w.PrefillMetric("pdserve_prefill_discarded_tokens_total"), 0);
  EXPECT_GT(w.PrefillMetric("pdserve_handoff_room_wait_seconds_total"), 0);
}

TEST(HandoffRoomTest, RoomThatNeverFreesEndsTheCallAtTheBound) {
  Pair w;
  absl::Status s = w.Start(TempDir(), "0.5");
  ASSERT_TRUE(s.ok()) << s;
  w.FillDecodePool("holder");

  const absl::Time start = absl::Now();
  const Pair::Prefilled got = w.Prefill(Pair::Work("waiter", 900, 12));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << got.status.error_message();
  EXPECT_TRUE(absl::StartsWith(got.status.error_message(),
                               absl::StrCat("no KV room on decode worker ", w.kv_address(), " for 0.5 s: ")))
      << got.status.error_message();
  EXPECT_TRUE(absl::StrContains(got.status.error_message(), "KV block pool exhausted")) << got.status.error_message();
  EXPECT_GE(took, absl::Milliseconds(500));
  EXPECT_LT(took, absl::Seconds(10));
  EXPECT_EQ(got.firsts, 0) << "nothing is computed while waiting";
  EXPECT_EQ(w.PrefillMetric("pdserve_handoff_room_waits_total"), 1);
  EXPECT_EQ(w.PrefillMetric("pdserve_prefill_discarded_tokens_total"), 0);
  EXPECT_EQ(w.PrefillMetric("pdserve_handoff_transfers_total"), 1);
}

TEST(HandoffRoomTest, ACancelledCallStopsWaitingAtOnce) {
  Pair w;
  absl::Status s = w.Start(TempDir(), "30");
  ASSERT_TRUE(s.ok()) << s;
  w.FillDecodePool("holder");

  grpc::ClientContext ctx;
  Pair::Prefilled got;
  std::thread call([&] { got = w.Prefill(Pair::Work("waiter", 900, 12), &ctx); });
  ASSERT_EQ(w.AwaitPrefillMetric("pdserve_handoff_room_waits_total", 1), 1) << w.Logs();
  const absl::Time cancelled = absl::Now();
  ctx.TryCancel();
  call.join();
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::CANCELLED);
  // The worker ends its side too (the call is no longer running), long
  // before the 30 s bound.
  const absl::Time deadline = cancelled + absl::Seconds(5);
  while (w.PrefillStatus().running() != 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  const v1::WorkerStatus st = w.PrefillStatus();
  EXPECT_EQ(st.running(), 0) << st.ShortDebugString();
  EXPECT_EQ(st.queued(), 0) << st.ShortDebugString();
  EXPECT_GT(w.PrefillMetric("pdserve_handoff_room_wait_seconds_total"), 0);
  EXPECT_EQ(w.PrefillMetric("pdserve_prefill_discarded_tokens_total"), 0);
}

}  // namespace
}  // namespace pdserve
