// The relay in-process: every retry and migration path the fault tests
// drive with real processes (tests/cluster/fault_test.cc,
// unparseable_test.cc), here with fake workers and a fake clock, each
// asserting the states taken, the stream the client got (the same tokens
// as a run that met no fault), how the request ended, what the router now
// thinks of the workers involved, and that every worker's load returns to
// zero.
#include "router/relay.h"

#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/router/in_process_router.h"

namespace pdserve::router::testing {
namespace {

using S = RelayState;

std::string Trace(const std::vector<RelayState>& t) {
  std::string s;
  for (RelayState r : t) s += std::string(s.empty() ? "" : " ") + RelayStateName(r);
  return s;
}

// Every worker's load from this router is back to zero.
void ExpectNoLoad(const InProcessRouter& r) {
  for (const Role role : {Role::kPrefill, Role::kDecode}) {
    for (const WorkerPtr& w : r.pool->Snapshot(role)) {
      EXPECT_EQ(w->in_flight.load(), 0) << w->address();
      EXPECT_EQ(w->queued_tokens.load(), 0) << w->address();
    }
  }
  EXPECT_EQ(r.in_flight.load(), 0);
}

// Which of `w`'s Decode calls it was told to release (Release), by index,
// in order; decodes.size() for an id it never had a call for. A call that
// ends without a final message is released; one that ends with one, or a
// colocated one (no handoff), is not.
std::vector<size_t> ReleasedCalls(const FakeWorker& w) {
  std::vector<size_t> out;
  for (const std::string& id : w.releases) {
    size_t i = 0;
    while (i < w.decodes.size() && w.decodes[i].request().request_id() != id) ++i;
    out.push_back(i);
  }
  return out;
}
using Calls = std::vector<size_t>;

// Every report a relay makes, in order, one line each.
class RecordingObserver final : public RelayObserver {
 public:
  void Arrived() override { events.push_back("arrived"); }
  void Queued(absl::Duration) override { events.push_back("queued"); }
  void Placed(PrefillPlacement where) override {
    events.push_back(absl::StrCat("placed ", static_cast<int>(where)));
  }
  void Migrated() override { events.push_back("migrated"); }
  void PrefillRetried() override { events.push_back("prefill_retried"); }
  void Prefilled(const std::string& worker, int64_t context_tokens, int64_t cached_tokens, double) override {
    events.push_back(absl::StrCat("prefilled ", worker, " ", context_tokens, " ", cached_tokens));
  }
  void HandedOff(const std::string& prefill, const std::string& decode, double, double) override {
    events.push_back(absl::StrCat("handed_off ", prefill, " ", decode));
  }
  void TokenGap(double) override { ++gaps; }
  void EndedEarly(const char* outcome) override { events.push_back(absl::StrCat("ended_early ", outcome)); }
  void Finished(const char* outcome, const v1::Timings&, int32_t completion_tokens, bool handed_off) override {
    events.push_back(absl::StrCat("finished ", outcome, " ", completion_tokens, handed_off ? " handed_off" : ""));
  }
  std::vector<std::string> events;
  int gaps = 0;
};

class RelayTest : public ::testing::Test {
 protected:
  void Cluster(int prefill, int decode) {
    for (int i = 0; i < prefill; ++i) rig_.AddWorker(Role::kPrefill, "p" + std::to_string(i));
    for (int i = 0; i < decode; ++i) rig_.AddWorker(Role::kDecode, "d" + std::to_string(i));
    rig_.ProbeAll();
  }
  InProcessRouter rig_;
};

TEST_F(RelayTest, AHandedOffRequestStreamsEveryTokenOnce) {
  Cluster(1, 1);
  const GenerationRequest req = InProcessRouter::Request(12);
  const Relayed got = rig_.Run(req);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_EQ(Trace(got.trace), "place prefill decode finish");
  EXPECT_EQ(got.tokens, InProcessRouter::Expected(req));
  ASSERT_TRUE(got.final.has_value());
  EXPECT_EQ(got.final->finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(got.final->usage().prompt_tokens(), 40);
  EXPECT_EQ(got.final->usage().completion_tokens(), 12);
  EXPECT_FALSE(got.text.empty());
  // The prefill worker was told where the chosen decode worker's KV goes.
  EXPECT_EQ(rig_.workers.at("p0").prefills.at(0).decode_kv_address(), "d0-kv");
  EXPECT_FALSE(rig_.workers.at("d0").decodes.at(0).prefill_here());
  EXPECT_EQ(rig_.Count("pdserve_requests_total", "outcome=\"length\""), 1);
  EXPECT_EQ(rig_.Count("pdserve_prefill_placements_total", "placement=\"prefill_pool\""), 1);
  EXPECT_EQ(ReleasedCalls(rig_.workers.at("d0")), Calls{});  // Its call claimed the handoff.
  ExpectNoLoad(rig_);
}

// A prefill worker lost before its first token: it dies (UNAVAILABLE), or
// it shuts down (SIGTERM) as the call arrives and its server ends the call
// CANCELLED, which the client did not ask for (the chaos test provokes it).
// Either way the request is retried on another prefill worker.
class PrefillLossTest : public RelayTest, public ::testing::WithParamInterface<PrefillFault> {};

TEST_P(PrefillLossTest, BeforeTheFirstTokenIsRetriedOnAnotherPrefillWorker) {
  Cluster(2, 1);
  // p0 is chosen first (pool order breaks the tie) and is lost.
  rig_.workers.at("p0").prefill_faults.push_back(GetParam());
  const GenerationRequest req = InProcessRouter::Request(10);
  const Relayed got = rig_.Run(req);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_EQ(Trace(got.trace), "place prefill retry_prefill prefill decode finish");
  EXPECT_EQ(got.tokens, InProcessRouter::Expected(req));
  ASSERT_TRUE(got.final.has_value());
  EXPECT_EQ(got.final->finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_FALSE(rig_.Find(Role::kPrefill, "p0")->healthy());  // marked down at once, not at the next probe
  EXPECT_TRUE(rig_.Find(Role::kPrefill, "p1")->healthy());
  EXPECT_TRUE(rig_.Find(Role::kDecode, "d0")->healthy());
  // One decode call: the decode worker kept waiting under the same request id.
  ASSERT_EQ(rig_.workers.at("d0").decodes.size(), 1u);
  EXPECT_EQ(rig_.workers.at("p1").prefills.at(0).request().request_id(),
            rig_.workers.at("d0").decodes.at(0).request().request_id());
  EXPECT_EQ(rig_.Count("pdserve_prefill_retries_total"), 1);
  EXPECT_EQ(rig_.Count("pdserve_migrations_total"), 0);
  EXPECT_EQ(rig_.Count("pdserve_requests_total", "outcome=\"cancelled\""), 0);
  EXPECT_EQ(ReleasedCalls(rig_.workers.at("d0")), Calls{});  // Its call waited on.
  ExpectNoLoad(rig_);
}

INSTANTIATE_TEST_SUITE_P(Faults, PrefillLossTest, ::testing::Values(PrefillFault::kDieBeforeFirst, PrefillFault::kShutDown),
                         [](const ::testing::TestParamInfo<PrefillFault>& info) {
                           return info.param == PrefillFault::kShutDown ? "shut_down" : "died";
                         });

TEST_F(RelayTest, MeasurementsGoToTheObserverInTheOrderTheyHappen) {
  Cluster(2, 2);
  RecordingObserver seen;
  rig_.context.observer = &seen;
  // p0 dies after its first token (the prefill is retried on p1); p1's
  // handoff is refused by the decode side (the sequence migrates); the
  // prefill for the new decode worker hands off.
  rig_.workers.at("p0").prefill_faults.push_back(PrefillFault::kDieAfterFirst);
  rig_.workers.at("p1").prefill_faults.push_back(PrefillFault::kRefuseHandoff);
  const GenerationRequest req = InProcessRouter::Request(10);
  const Relayed got = rig_.Run(req);
  ASSERT_TRUE(got.status.ok()) << got.status;
  ASSERT_EQ(Trace(got.trace), "place prefill retry_prefill prefill migrate place prefill decode finish");
  EXPECT_EQ(got.tokens, InProcessRouter::Expected(req));
  // The retried prefill's first token is the one already sent: it is not
  // measured again. Handoffs are measured on the first decode attempt only
  // (a migration's handoff carries the tokens streamed so far too).
  EXPECT_EQ(seen.events, (std::vector<std::string>{"arrived", "placed 0", "prefilled p0 40 0", "prefill_retried",
                                                   "migrated", "prefilled p1 41 0", "finished length 10 handed_off"}));
  EXPECT_GT(seen.gaps, 0);
  // Nothing reached the router's own metrics: the observer took it all.
  EXPECT_EQ(rig_.Count("pdserve_requests_total", "outcome=\"length\""), 0);
  ExpectNoLoad(rig_);
}

TEST_F(RelayTest, AHandoffOnTheFirstAttemptIsMeasured) {
  Cluster(1, 1);
  RecordingObserver seen;
  rig_.context.observer = &seen;
  ASSERT_TRUE(rig_.Run(InProcessRouter::Request(6)).status.ok());
  EXPECT_EQ(seen.events, (std::vector<std::string>{"arrived", "placed 0", "prefilled p0 40 0", "handed_off p0 d0",
                                                   "finished length 6 handed_off"}));
}

TEST_F(RelayTest, PrefillDeathAfterTheFirstTokenBeforeTheCommitSendsTheFirstTokenOnce) {
  Cluster(2, 1);
  rig_.workers.at("p0").prefill_faults.push_back(PrefillFault::kDieAfterFirst);
  const GenerationRequest req = InProcessRouter::Request(10);
  const Relayed got = rig_.Run(req);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_EQ(Trace(got.trace), "place prefill retry_prefill prefill decode finish");
  // The retried prefill samples the same first token; it is not sent again.
  EXPECT_EQ(got.tokens, InProcessRouter::Expected(req));
  EXPECT_EQ(rig_.workers.at("p1").prefills.size(), 1u);
  ExpectNoLoad(rig_);
}

TEST_F(RelayTest, TheLastPrefillWorkerDyingEndsTheRequestUnavailableWithItsError) {
  Cluster(1, 1);
  rig_.workers.at("p0").prefill_faults.push_back(PrefillFault::kDieBeforeFirst);
  const absl::Time start = rig_.clock.now;
  const Relayed got = rig_.Run(InProcessRouter::Request(10));
  EXPECT_EQ(got.status.code(), absl::StatusCode::kUnavailable) << got.status;
  EXPECT_TRUE(absl::StrContains(got.status.message(), "no prefill worker could serve the request (last: p0: Socket closed)"))
      << got.status;
  // It waited pick_wait for one to come back, on the relay's clock.
  EXPECT_GE(rig_.clock.now - start, rig_.context.options.pick_wait);
  EXPECT_EQ(Trace(got.trace), "place prefill retry_prefill decode finish");
  // The decode call it had opened was cancelled.
  EXPECT_EQ(rig_.Count("pdserve_requests_total", "outcome=\"unavailable\""), 1);
  ExpectNoLoad(rig_);
}

TEST_F(RelayTest, AHandoffTheDecodeSideRefusesMigratesToAnotherDecodeWorker) {
  Cluster(1, 2);
  rig_.workers.at("p0").prefill_faults.push_back(PrefillFault::kRefuseHandoff);
  const GenerationRequest req = InProcessRouter::Request(10);
  const Relayed got = rig_.Run(req);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_EQ(Trace(got.trace), "place prefill migrate place prefill decode finish");
  EXPECT_EQ(got.tokens, InProcessRouter::Expected(req));
  // The prefill worker still answers: it is not blamed. The decode worker is.
  EXPECT_TRUE(rig_.Find(Role::kPrefill, "p0")->healthy());
  const std::string first = rig_.workers.at("d0").decodes.empty() ? "d1" : "d0";
  const std::string second = first == "d0" ? "d1" : "d0";
  EXPECT_FALSE(rig_.Find(Role::kDecode, first)->healthy());
  ASSERT_EQ(rig_.workers.at(second).decodes.size(), 1u);
  EXPECT_EQ(rig_.workers.at("p0").prefills.at(1).decode_kv_address(), second + "-kv");
  EXPECT_EQ(rig_.Count("pdserve_migrations_total"), 1);
  EXPECT_EQ(rig_.Count("pdserve_prefill_retries_total"), 0);
  // The first decode worker is told the request is done there.
  EXPECT_EQ(ReleasedCalls(rig_.workers.at(first)), Calls{0});
  EXPECT_EQ(ReleasedCalls(rig_.workers.at(second)), Calls{});
  ExpectNoLoad(rig_);
}

// A decode worker lost mid-stream: it dies (UNAVAILABLE), or its server
// shuts down with the call still open and ends it CANCELLED, which the
// client did not ask for. Either way the sequence migrates and the stream
// completes.
class DecodeLossTest : public RelayTest, public ::testing::WithParamInterface<DecodeFault> {};

TEST_P(DecodeLossTest, MidStreamContinuesFromPromptPlusStreamedTokens) {
  Cluster(1, 2);
  const GenerationRequest req = InProcessRouter::Request(20);
  // d0 is chosen first (pool order breaks the tie) and is lost after 5 tokens.
  rig_.workers.at("d0").decode_faults.push_back({GetParam(), 5});
  const Relayed got = rig_.Run(req);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_EQ(Trace(got.trace), "place prefill decode migrate place prefill decode finish");
  EXPECT_EQ(got.tokens, InProcessRouter::Expected(req));
  ASSERT_TRUE(got.final.has_value());
  EXPECT_EQ(got.final->finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_FALSE(rig_.Find(Role::kDecode, "d0")->healthy());
  // The migrated attempt prefills prompt + the 6 tokens sent (1 + 5).
  ASSERT_EQ(rig_.workers.at("d1").decodes.size(), 1u);
  const worker::v1::WorkRequest& work = rig_.workers.at("d1").decodes[0].request();
  const std::vector<int32_t> expected = InProcessRouter::Expected(req);
  EXPECT_EQ(std::vector<int32_t>(work.generated_ids().begin(), work.generated_ids().end()),
            std::vector<int32_t>(expected.begin(), expected.begin() + 6));
  EXPECT_EQ(rig_.workers.at("p0").prefills.at(1).request().generated_ids_size(), 6);
  EXPECT_EQ(got.final->usage().completion_tokens(), 20);
  EXPECT_EQ(rig_.Count("pdserve_migrations_total"), 1);
  EXPECT_EQ(rig_.Count("pdserve_requests_total", "outcome=\"cancelled\""), 0);
  EXPECT_EQ(ReleasedCalls(rig_.workers.at("d0")), Calls{0});
  EXPECT_EQ(ReleasedCalls(rig_.workers.at("d1")), Calls{});
  ExpectNoLoad(rig_);
}

INSTANTIATE_TEST_SUITE_P(Faults, DecodeLossTest, ::testing::Values(DecodeFault::kDieAfter, DecodeFault::kShutDownAfter),
                         [](const ::testing::TestParamInfo<DecodeFault>& info) {
                           return info.param == DecodeFault::kShutDownAfter ? "shut_down" : "died";
                         });

// A decode worker that still serves and cancels the stream (its reader
// stalled) ends the request as cancelled: no migration, no worker marked
// down.
TEST_F(RelayTest, AStreamTheDecodeWorkerCancelsWhileServingEndsCancelled) {
  Cluster(1, 2);
  rig_.workers.at("d0").decode_faults.push_back({DecodeFault::kCancelAfter, 5});
  const Relayed got = rig_.Run(InProcessRouter::Request(20));
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_EQ(Trace(got.trace), "place prefill decode finish");
  ASSERT_TRUE(got.final.has_value());
  EXPECT_EQ(got.final->finish_reason(), v1::FINISH_REASON_CANCELLED);
  EXPECT_EQ(got.tokens.size(), 6u);
  EXPECT_TRUE(rig_.Find(Role::kDecode, "d0")->healthy());
  EXPECT_TRUE(rig_.workers.at("d1").decodes.empty());
  EXPECT_EQ(rig_.Count("pdserve_migrations_total"), 0);
  ExpectNoLoad(rig_);
}

TEST_F(RelayTest, AColocatedDecodeWorkerDyingMidStreamMigrates) {
  InProcessRouter rig({.colocated = true});
  rig.AddWorker(Role::kDecode, "d0");
  rig.AddWorker(Role::kDecode, "d1");
  rig.ProbeAll();
  rig.workers.at("d0").decode_faults.push_back({DecodeFault::kDieAfter, 7});
  const GenerationRequest req = InProcessRouter::Request(20);
  const Relayed got = rig.Run(req);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_EQ(Trace(got.trace), "place decode migrate place decode finish");
  EXPECT_EQ(got.tokens, InProcessRouter::Expected(req));
  EXPECT_TRUE(rig.workers.at("d1").decodes.at(0).prefill_here());
  EXPECT_EQ(rig.workers.at("d1").decodes.at(0).request().generated_ids_size(), 7);
  EXPECT_EQ(rig.Count("pdserve_prefill_placements_total", "placement=\"colocated\""), 1);
  // Prefilled where it decodes: no handoff to release.
  EXPECT_EQ(ReleasedCalls(rig.workers.at("d0")), Calls{});
  EXPECT_EQ(ReleasedCalls(rig.workers.at("d1")), Calls{});
  ExpectNoLoad(rig);
}

TEST_F(RelayTest, EveryDecodeWorkerDeadEndsWithTheLastError) {
  Cluster(1, 1);
  rig_.workers.at("d0").decode_faults.push_back({DecodeFault::kDieAfter, 3});
  const Relayed got = rig_.Run(InProcessRouter::Request(20));
  // Tokens were sent, so the stream ends with a final message that carries
  // the error rather than with a status.
  ASSERT_TRUE(got.status.ok()) << got.status;
  ASSERT_TRUE(got.final.has_value());
  EXPECT_EQ(got.final->finish_reason(), v1::FINISH_REASON_ERROR);
  EXPECT_TRUE(absl::StrContains(got.final->error(), "no decode worker left to continue on (last: d0: Socket closed)"))
      << got.final->error();
  EXPECT_EQ(got.tokens.size(), 4u);
  ExpectNoLoad(rig_);
}

TEST_F(RelayTest, NoServingDecodeWorkerIsUnavailableNamingWhy) {
  rig_.AddWorker(Role::kPrefill, "p0");
  FakeWorker& d = rig_.AddWorker(Role::kDecode, "d0");
  d.serving = false;
  d.unhealthy_reason = "KV transport: no UCX transport";
  rig_.ProbeAll();
  const Relayed got = rig_.Run(InProcessRouter::Request(5));
  EXPECT_EQ(got.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(got.status.message(), "no healthy decode worker (d0: KV transport: no UCX transport)");
  EXPECT_EQ(Trace(got.trace), "place finish");
  EXPECT_TRUE(rig_.workers.at("p0").prefills.empty());
  ExpectNoLoad(rig_);
}

TEST_F(RelayTest, NoServingPrefillWorkerIsUnavailableAndTheDecodeCallIsCancelled) {
  rig_.AddWorker(Role::kPrefill, "p0").alive = false;
  rig_.AddWorker(Role::kDecode, "d0");
  rig_.ProbeAll();
  const Relayed got = rig_.Run(InProcessRouter::Request(5));
  EXPECT_EQ(got.status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StartsWith(got.status.message(), "no healthy prefill worker (p0: failed to connect"))
      << got.status;
  EXPECT_EQ(Trace(got.trace), "place decode finish");
  EXPECT_EQ(ReleasedCalls(rig_.workers.at("d0")), Calls{0});
  ExpectNoLoad(rig_);
}

TEST_F(RelayTest, AWorkerThatComesBackWithinThePickWaitIsUsed) {
  FakeWorker& d = rig_.AddWorker(Role::kDecode, "d0");
  rig_.AddWorker(Role::kPrefill, "p0");
  d.serving = false;
  rig_.ProbeAll();
  d.serving = true;
  // A probe round a second into the wait brings d0 back, and the relay
  // picks it then (the fake wait stands in for the pool's wake-up).
  const absl::Time start = rig_.clock.now;
  rig_.context.options.await_serving = [&](uint64_t seen, absl::Duration timeout) {
    rig_.clock.now += std::min(timeout, absl::Seconds(1));
    rig_.ProbeAll();
    EXPECT_NE(rig_.pool->serving_epoch(), seen);  // d0's admission is a change.
  };
  const GenerationRequest req = InProcessRouter::Request(5);
  const Relayed got = rig_.Run(req);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_EQ(got.tokens, InProcessRouter::Expected(req));
  EXPECT_LT(rig_.clock.now - start, absl::Seconds(2));
}

class UnparseableRelayTest : public RelayTest, public ::testing::WithParamInterface<Role> {};

TEST_P(UnparseableRelayTest, TheFirstBadMessageCostsOneMigrationAndBlamesNoWorker) {
  Cluster(1, 2);
  if (GetParam() == Role::kPrefill) {
    rig_.workers.at("p0").prefill_faults.push_back(PrefillFault::kUnparseable);
  } else {
    rig_.workers.at("d0").decode_faults.push_back({DecodeFault::kUnparseableAfter, 4});
  }
  const GenerationRequest req = InProcessRouter::Request(15);
  const Relayed got = rig_.Run(req);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_EQ(Trace(got.trace), GetParam() == Role::kPrefill
                                  ? "place prefill migrate place prefill decode finish"
                                  : "place prefill decode migrate place prefill decode finish");
  EXPECT_EQ(got.tokens, InProcessRouter::Expected(req));
  // The first placement's id is released where its call went; the second's
  // call ended with its final message.
  Calls released;
  for (const char* d : {"d0", "d1"}) {
    for (size_t i : ReleasedCalls(rig_.workers.at(d))) released.push_back(i);
  }
  EXPECT_EQ(released, Calls{0});
  // A message that fails deterministically would otherwise eject every
  // worker in turn: none is marked down.
  for (const char* w : {"p0", "d0", "d1"}) {
    EXPECT_TRUE(rig_.Find(w[0] == 'p' ? Role::kPrefill : Role::kDecode, w)->healthy()) << w;
  }
  ExpectNoLoad(rig_);
}

TEST_P(UnparseableRelayTest, TheSecondBadMessageEndsTheRequestWithInternalNamingTheField) {
  Cluster(1, 2);
  for (int i = 0; i < 2; ++i) {
    if (GetParam() == Role::kPrefill) {
      rig_.workers.at("p0").prefill_faults.push_back(PrefillFault::kUnparseable);
    } else {
      rig_.workers.at("d0").decode_faults.push_back({DecodeFault::kUnparseableAfter, 2});
      rig_.workers.at("d1").decode_faults.push_back({DecodeFault::kUnparseableAfter, 2});
    }
  }
  const Relayed got = rig_.Run(InProcessRouter::Request(15));
  EXPECT_EQ(got.status.code(), absl::StatusCode::kInternal) << got.status;
  EXPECT_TRUE(absl::StrContains(got.status.message(), "pdserve.v1.TokenChunk.text: not valid UTF-8 (after one retry)"))
      << got.status;
  EXPECT_FALSE(got.final.has_value());
  EXPECT_EQ(got.trace.back(), S::kFinish);
  ExpectNoLoad(rig_);
}

INSTANTIATE_TEST_SUITE_P(Hops, UnparseableRelayTest, ::testing::Values(Role::kPrefill, Role::kDecode),
                         [](const auto& info) { return std::string(RoleName(info.param)); });

TEST_F(RelayTest, AnInvalidArgumentFromAPrefillWorkerIsTheRequestsError) {
  Cluster(2, 1);
  rig_.workers.at("p0").prefill_faults.push_back(PrefillFault::kInvalid);
  rig_.workers.at("p1").prefill_faults.push_back(PrefillFault::kInvalid);
  const Relayed got = rig_.Run(InProcessRouter::Request(5));
  ASSERT_TRUE(got.final.has_value());
  EXPECT_EQ(got.final->finish_reason(), v1::FINISH_REASON_ERROR);
  EXPECT_TRUE(absl::StrContains(got.final->error(), "prompt_ids: empty")) << got.final->error();
  // Not retried: the request is at fault, not the worker.
  EXPECT_EQ(Trace(got.trace), "place prefill decode finish");
  EXPECT_TRUE(rig_.Find(Role::kPrefill, "p0")->healthy());
  ExpectNoLoad(rig_);
}

TEST_F(RelayTest, TheFirstTokenEndingTheRequestCancelsTheDecodeCall) {
  Cluster(1, 1);
  const GenerationRequest req = InProcessRouter::Request(1);
  const Relayed got = rig_.Run(req);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_EQ(got.tokens, InProcessRouter::Expected(req));
  EXPECT_EQ(got.final->finish_reason(), v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(Trace(got.trace), "place prefill decode finish");
  // The cancelled call may never have reached d0: the handoff it would
  // have claimed must not wait there for it.
  EXPECT_EQ(ReleasedCalls(rig_.workers.at("d0")), Calls{0});
  ExpectNoLoad(rig_);
}

TEST_F(RelayTest, ACancellingClientEndsTheDecodeCallItWaitsOn) {
  Cluster(1, 1);
  rig_.workers.at("d0").decode_faults.push_back({DecodeFault::kHoldAfter, 3});
  Relayed got;
  std::thread canceller;
  got = rig_.Run(InProcessRouter::Request(50), [&](Relay& relay) {
    canceller = std::thread([&relay] {
      absl::SleepFor(absl::Milliseconds(50));
      relay.Cancel();
    });
  }, [&] { canceller.join(); });
  EXPECT_EQ(got.status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(got.tokens.size(), 4u);
  EXPECT_EQ(rig_.Count("pdserve_requests_total", "outcome=\"cancelled\""), 1);
  EXPECT_EQ(ReleasedCalls(rig_.workers.at("d0")), Calls{0});
  ExpectNoLoad(rig_);
}

TEST_F(RelayTest, ACancelWhileADownstreamCallIsStillStartingEndsIt) {
  Cluster(1, 1);
  // The prefill worker takes no request: the call's start blocks.
  rig_.workers.at("p0").prefill_faults.push_back(PrefillFault::kHoldStart);
  std::thread canceller;
  const Relayed got = rig_.Run(InProcessRouter::Request(5), [&](Relay& relay) {
    canceller = std::thread([&relay] {
      absl::SleepFor(absl::Milliseconds(50));
      relay.Cancel();
    });
  }, [&] { canceller.join(); });
  EXPECT_EQ(got.status.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(got.tokens.empty());
  ExpectNoLoad(rig_);
}

TEST_F(RelayTest, TheRelayCostAndTimingsAreMeasuredOnTheInjectedClock) {
  Cluster(1, 1);
  rig_.context.options.clock = [this] {
    rig_.clock.now += absl::Microseconds(10);  // every reading is 10 us after the last
    return rig_.clock.now;
  };
  const Relayed got = rig_.Run(InProcessRouter::Request(6));
  ASSERT_TRUE(got.status.ok()) << got.status;
  const v1::Timings& t = got.final->timings();
  EXPECT_DOUBLE_EQ(t.router_relay_p50(), 10e-6);
  EXPECT_GT(t.ttft(), 0);
  EXPECT_GT(t.total(), t.ttft());
  EXPECT_DOUBLE_EQ(t.prefill(), 0.01);
  EXPECT_DOUBLE_EQ(t.handoff(), 0.002);
}

// Every call to a worker carries a deadline: the client's, or the router's
// bound from the request's arrival when the client gave none (or a later one).
TEST(RelayDeadlineTest, CallsToWorkersAlwaysCarryADeadline) {
  InProcessRouter rig;
  rig.AddWorker(Role::kPrefill, "p0");
  rig.AddWorker(Role::kDecode, "d0");
  rig.ProbeAll();
  rig.context.options.max_request_duration = absl::Seconds(600);
  const absl::Time arrival = rig.clock.now;
  ASSERT_TRUE(rig.Run(InProcessRouter::Request(3)).status.ok());
  const FakeWorker& p = rig.workers.at("p0");
  const FakeWorker& d = rig.workers.at("d0");
  ASSERT_EQ(p.prefill_deadlines.size(), 1u);
  ASSERT_EQ(d.decode_deadlines.size(), 1u);
  EXPECT_EQ(p.prefill_deadlines[0], arrival + absl::Seconds(600));
  EXPECT_EQ(d.decode_deadlines[0], arrival + absl::Seconds(600));
  // An earlier client deadline wins; a later one is cut to the bound.
  for (const absl::Duration client : {absl::Seconds(5), absl::Seconds(6000)}) {
    const absl::Time now = rig.clock.now;
    Relay relay(rig.context, InProcessRouter::Request(3), "t", now + client, now);
    ASSERT_TRUE(relay.Run([](const v1::GenerateResponse&) { return true; }).ok());
    EXPECT_EQ(d.decode_deadlines.back(), now + std::min(client, absl::Seconds(600)));
  }
}

}  // namespace
}  // namespace pdserve::router::testing
