// A worker message the router cannot parse, on each hop (prefill → router:
// a first token with malformed wire data; decode → router: a chunk whose
// text is not valid UTF-8), injected by the workers' fault flag. The first
// costs one migration and the stream is unchanged; a second ends the
// request with INTERNAL naming the field, within a second. Neither ejects
// the worker that sent it, and no KV is left behind.
#include <chrono>
#include <cstdio>
#include <ostream>
#include <string>

#include "gtest/gtest.h"
#include "pdserve/v1/worker.grpc.pb.h"
#include "tests/cluster/cluster_harness.h"

namespace pdserve {
namespace {

struct Hop {
  const char* name;
  bool prefill;       // Which worker sends the bad message.
  const char* field;  // What the error must name.
};

void PrintTo(const Hop& h, std::ostream* os) { *os << h.name; }

class UnparseableTest : public ::testing::TestWithParam<Hop> {
 protected:
  // A cluster whose `hop` worker sends one unparseable message in each of
  // its first `streams` streams (-1: all).
  absl::Status Start(Cluster& c, const std::string& dir, int streams) {
    const std::vector<std::string> fault = {"--fault_unparseable_streams", std::to_string(streams)};
    return c.Start(dir, false, GetParam().prefill ? std::vector<std::string>{} : fault, {}, 1,
                   GetParam().prefill ? fault : std::vector<std::string>{});
  }

  static void ExpectNoEjection(Cluster& c) {
    const std::string router = HttpGet(c.router_metrics(), "/metrics");
    EXPECT_EQ(MetricValue(router, "pdserve_worker_ejections_total{role=\"prefill\"}"), 0) << router;
    EXPECT_EQ(MetricValue(router, "pdserve_worker_ejections_total{role=\"decode\"}"), 0) << router;
    const v1::ClusterStatusResponse st = c.Status();
    for (const v1::WorkerStatus& w : st.prefill()) EXPECT_TRUE(w.healthy()) << w.ShortDebugString();
    for (const v1::WorkerStatus& w : st.decode()) EXPECT_TRUE(w.healthy()) << w.ShortDebugString();
  }
};

TEST_P(UnparseableTest, FirstBadMessageCostsOneMigrationAndChangesNothing) {
  const std::string dir = TempDir();
  const Output want = Undisturbed(dir, false, SeededRequest(24));
  Cluster c;
  ASSERT_TRUE(Start(c, dir + "/faulty", 1).ok());
  const Output got = c.Generate(SeededRequest(24));
  ExpectUndisturbed(got, want, c);
  const std::string router = HttpGet(c.router_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(router, "pdserve_migrations_total"), 1) << router;
  ExpectNoEjection(c);
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString() << "\n" << c.Logs();
  // The worker goes on serving: the next request meets no fault.
  ExpectUndisturbed(c.Generate(SeededRequest(24)), want, c);
  EXPECT_EQ(QueuedPrefillTokensAfterSettling(c), 0) << c.Status().ShortDebugString();
}

TEST_P(UnparseableTest, SecondBadMessageFailsWithInternalNamingTheField) {
  const std::string dir = TempDir();
  Cluster c;
  ASSERT_TRUE(Start(c, dir, -1).ok());
  const auto start = std::chrono::steady_clock::now();
  const Output got = c.Generate(SeededRequest(24));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::INTERNAL) << got.status.error_message() << "\n" << c.Logs();
  EXPECT_NE(got.status.error_message().find(GetParam().field), std::string::npos) << got.status.error_message();
  EXPECT_LT(seconds, 1.0) << "the request must end, not wait for its deadline";
  std::printf("%s: %s (%.3f s)\n", GetParam().name, got.status.error_message().c_str(), seconds);
  const std::string router = HttpGet(c.router_metrics(), "/metrics");
  EXPECT_EQ(MetricValue(router, "pdserve_migrations_total"), 1) << router;
  EXPECT_EQ(MetricValue(router, "pdserve_requests_total{outcome=\"error\"}"), 1) << router;
  ExpectNoEjection(c);
  EXPECT_EQ(AllKvUsedAfterSettling(c), 0) << c.Status().ShortDebugString() << "\n" << c.Logs();
  EXPECT_EQ(c.Status().requests_in_flight(), 0);
}

// The race behind a rare leak: the router gives up on a request (two
// unparseable first events) and ends its Decode call while the prefill
// worker's commit is still on its way. The decode worker must free that
// late commit's KV on arrival, not hold it for the 30 s an unclaimed
// handoff waits for its call.
TEST(LateCommitTest, ACommitThatLandsAfterItsDecodeCallEndedIsFreedAtOnce) {
  const std::string dir = TempDir();
  Cluster c;
  ASSERT_TRUE(c.Start(dir, false, {}, {}, 1,
                      {"--fault_unparseable_streams", "-1", "--fault_stall_before_commit_ms", "600"})
                  .ok());
  const Output got = c.Generate(SeededRequest(24));
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::INTERNAL) << got.status.error_message() << "\n" << c.Logs();
  // Both attempts' commits land ~0.6 s after their first events; 5 s is far
  // below the unclaimed-handoff wait.
  EXPECT_EQ(AllKvUsedAfterSettling(c, absl::Seconds(5)), 0) << c.Status().ShortDebugString() << "\n" << c.Logs();
}

// The other form of that race: the router ends its Decode call before the
// decode worker ever ran it (a request whose first token ends it, a second
// bad first event), so the worker holds no call, no trace that one was
// wanted, and the prefill worker's commit lands as an unclaimed handoff.
// The fault stands for it: the worker's first Decode call ends CANCELLED
// unregistered. Only the router's Release frees that KV before the 30 s an
// unclaimed handoff waits.
TEST(LostDecodeCallTest, AHandoffWhoseCallNeverRanIsFreedByTheRoutersRelease) {
  const std::string dir = TempDir();
  Cluster c;
  ASSERT_TRUE(c.Start(dir, false, {"--fault_lose_decode_calls", "1"}).ok());
  const Output lost = c.Generate(SeededRequest(24));
  // The worker ended the stream CANCELLED while still serving: the request
  // ends cancelled after its first token (not migrated).
  EXPECT_TRUE(lost.status.ok()) << lost.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(lost.finish, v1::FINISH_REASON_CANCELLED) << c.Logs();
  EXPECT_EQ(AllKvUsedAfterSettling(c, absl::Seconds(5)), 0) << c.Status().ShortDebugString() << "\n" << c.Logs();
  EXPECT_NE(c.Logs().find("released_handoff_freed"), std::string::npos) << c.Logs();
  // The next request meets no fault and is whole.
  const Output next = c.Generate(SeededRequest(24));
  EXPECT_TRUE(next.status.ok()) << next.status.error_message();
  EXPECT_TRUE(next.finish == v1::FINISH_REASON_LENGTH || next.finish == v1::FINISH_REASON_STOP) << next.finish;
  EXPECT_FALSE(next.tokens.empty());
  EXPECT_EQ(AllKvUsedAfterSettling(c, absl::Seconds(5)), 0) << c.Status().ShortDebugString();
}

// The same with the commits late: every first event is unparseable and
// every commit waits 0.6 s, so both placements' Releases reach the decode
// worker before their commits, which it must free on arrival.
TEST(LostDecodeCallTest, ACommitThatLandsAfterItsReleaseIsFreedOnArrival) {
  const std::string dir = TempDir();
  Cluster c;
  ASSERT_TRUE(c.Start(dir, false, {"--fault_lose_decode_calls", "-1"}, {}, 1,
                      {"--fault_unparseable_streams", "-1", "--fault_stall_before_commit_ms", "600"})
                  .ok());
  const Output got = c.Generate(SeededRequest(24));
  EXPECT_EQ(got.status.error_code(), grpc::StatusCode::INTERNAL) << got.status.error_message() << "\n" << c.Logs();
  EXPECT_EQ(AllKvUsedAfterSettling(c, absl::Seconds(5)), 0) << c.Status().ShortDebugString() << "\n" << c.Logs();
  EXPECT_NE(c.Logs().find("\"when\":\"on arrival\""), std::string::npos) << c.Logs();
}

// Release itself, on the decode worker's RPC: an empty id is refused, and
// a Decode call for an id already released is refused rather than left
// waiting 30 s for a handoff that no one will send.
TEST(LostDecodeCallTest, ADecodeCallForAReleasedIdIsRefused) {
  const std::string dir = TempDir();
  Cluster c;
  ASSERT_TRUE(c.Start(dir, false).ok());
  auto stub = worker::v1::DecodeWorker::NewStub(TestChannel(c.decode_address(), "decode"));
  auto deadline = [] { return std::chrono::system_clock::now() + std::chrono::seconds(5); };
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline());
    worker::v1::ReleaseResponse out;
    const grpc::Status st = stub->Release(&ctx, worker::v1::ReleaseRequest{}, &out);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  }
  worker::v1::ReleaseRequest rel;
  rel.set_request_id("released-1");
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline());
    worker::v1::ReleaseResponse out;
    ASSERT_TRUE(stub->Release(&ctx, rel, &out).ok());
    EXPECT_FALSE(out.freed());  // Nothing was waiting.
  }
  worker::v1::DecodeRequest req;
  worker::v1::WorkRequest* w = req.mutable_request();
  w->set_request_id("released-1");
  for (int id : {17, 230, 411}) w->add_prompt_ids(id);
  w->set_temperature(1.0f);
  w->set_top_p(1.0f);
  w->set_repetition_penalty(1.0f);
  w->set_max_tokens(8);
  grpc::ClientContext ctx;
  ctx.set_deadline(deadline());
  auto reader = stub->Decode(&ctx, req);
  worker::v1::DecodeEvent ev;
  while (reader->Read(&ev)) {
  }
  const grpc::Status st = reader->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << st.error_message();
  EXPECT_NE(st.error_message().find("released-1 was released by the router"), std::string::npos)
      << st.error_message();
  EXPECT_EQ(AllKvUsedAfterSettling(c, absl::Seconds(2)), 0) << c.Status().ShortDebugString();
}

INSTANTIATE_TEST_SUITE_P(Hops, UnparseableTest,
                         ::testing::Values(Hop{"PrefillToRouter", true, "pdserve.worker.v1.PrefillEvent.first"},
                                           Hop{"DecodeToRouter", false, "pdserve.v1.TokenChunk.text"}),
                         [](const ::testing::TestParamInfo<Hop>& i) { return i.param.name; });

}  // namespace
}  // namespace pdserve
