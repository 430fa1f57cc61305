// Placement in-process: which workers a request may go to (serving, not
// failed for it in their current incarnation, with KV room), what the
// selectors are given (the prefix index's cached positions, headroom),
// conditional disaggregation, and that admission judges the very placement
// the request then runs with, by the configured selector.
#include "router/placement.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/router/in_process_router.h"

namespace pdserve::router::testing {
namespace {

// KV events saying `w` stores the first `blocks` blocks of `context`
// (hashed as fake decode workers hash).
worker::v1::KvEvents Stored(const FakeWorker& w, const std::vector<int32_t>& context, int blocks) {
  const BlockHasher hasher(w.prefix_hash->model, w.prefix_hash->kv_dtype, w.prefix_hash->block_size);
  const std::vector<BlockHash> chain = hasher.FullBlockHashes(context);
  worker::v1::KvEvents ke;
  ke.set_snapshot(true);
  BlockHash parent;
  for (int i = 0; i < blocks; ++i) {
    worker::v1::KvEvent* e = ke.add_events();
    e->set_id(static_cast<uint64_t>(i + 1));
    e->set_kind(worker::v1::KvEvent::STORED);
    e->set_hash_lo(chain[i].lo);
    e->set_hash_hi(chain[i].hi);
    e->set_parent_lo(parent.lo);
    e->set_parent_hi(parent.hi);
    parent = chain[i];
  }
  ke.set_last_id(static_cast<uint64_t>(blocks));
  return ke;
}

TEST(PlacementTest, OnlyServingWorkersNotFailedForThisRequestArePicked) {
  InProcessRouter rig;
  FakeWorker& d0 = rig.AddWorker(Role::kDecode, "d0");
  rig.AddWorker(Role::kDecode, "d1");
  rig.AddWorker(Role::kDecode, "d2");
  d0.serving = false;
  rig.ProbeAll();
  const GenerationRequest req = InProcessRouter::Request(10);
  PromptChains chains(req.prompt);
  Exclusions failed;
  failed.Add(*rig.Find(Role::kDecode, "d1"), "Socket closed");
  EXPECT_EQ(rig.placement->PickDecode(50, failed, chains)->address(), "d2");
  failed.Add(*rig.Find(Role::kDecode, "d2"));
  EXPECT_EQ(rig.placement->PickDecode(50, failed, chains), nullptr);
  EXPECT_EQ(failed.last_address(), "d2");
}

TEST(PlacementTest, AnAssignedPrefillQueuesTheTokensItWillComputeUntilReleased) {
  InProcessRouter rig;
  FakeWorker& p0 = rig.AddWorker(Role::kPrefill, "p0");
  p0.prefix_hash = HashScheme{ModelIdentity{1, 2}, DType::kF32, p0.kv_block_size};
  const GenerationRequest req = InProcessRouter::Request(10);
  p0.kv_events = Stored(p0, req.prompt, 2);  // 32 of 40 cached: 8 to compute
  rig.AddWorker(Role::kDecode, "d0");
  rig.ProbeAll();
  PromptChains chains(req.prompt);
  const WorkerPtr p = rig.Find(Role::kPrefill, "p0");
  const WorkerPtr d = rig.Find(Role::kDecode, "d0");
  {
    Assignment prefill = rig.placement->AssignPrefill(p, chains);
    Assignment decode = Placement::AssignDecode(d);
    EXPECT_EQ(p->in_flight.load(), 1);
    EXPECT_EQ(p->queued_tokens.load(), 8);
    EXPECT_EQ(d->in_flight.load(), 1);
    EXPECT_EQ(rig.placement->CachedTokens(*p, chains), 32);
    prefill.DequeueTokens();  // the first token came back
    EXPECT_EQ(p->queued_tokens.load(), 0);
    EXPECT_EQ(p->in_flight.load(), 1);
  }
  EXPECT_EQ(p->in_flight.load(), 0);
  EXPECT_EQ(d->in_flight.load(), 0);
}

// A prefill assigned to a worker that holds less of the prompt than another
// serving prefill worker counts the difference: prompt tokens computed that
// a fetch from that worker would have saved. A worker that is not serving
// does not count, and an assignment makes its worker expected to hold the
// prompt from then on.
TEST(PlacementTest, APrefillComputingWhatAnotherWorkerHoldsIsCounted) {
  InProcessRouter rig;
  FakeWorker& p0 = rig.AddWorker(Role::kPrefill, "p0");
  FakeWorker& p1 = rig.AddWorker(Role::kPrefill, "p1");
  FakeWorker& p2 = rig.AddWorker(Role::kPrefill, "p2");
  for (FakeWorker* w : {&p0, &p1, &p2}) w->prefix_hash = HashScheme{ModelIdentity{1, 2}, DType::kF32, w->kv_block_size};
  const GenerationRequest req = InProcessRouter::Request(10);
  p0.kv_events = Stored(p0, req.prompt, 1);  // 16 of the 40 positions cached
  p1.kv_events = Stored(p1, req.prompt, 2);  // 32
  p1.serving = false;
  rig.ProbeAll();
  PromptChains chains(req.prompt);
  { Assignment a = rig.placement->AssignPrefill(rig.Find(Role::kPrefill, "p2"), chains); }
  EXPECT_EQ(rig.placement->tokens_cached_elsewhere(), 16) << "p0 held 16; p1 does not serve";
  p1.serving = true;
  rig.ProbeAll();
  { Assignment a = rig.placement->AssignPrefill(rig.Find(Role::kPrefill, "p1"), chains); }
  EXPECT_EQ(rig.placement->tokens_cached_elsewhere(), 16) << "p1 holds as much as any other";
  { Assignment a = rig.placement->AssignPrefill(rig.Find(Role::kPrefill, "p0"), chains); }
  EXPECT_EQ(rig.placement->tokens_cached_elsewhere(), 16 + 16) << "p1 and p2 held 16 more than p0";
}

// Three prefill workers with pull receivers; p0 holds 32 of the context's
// 40 positions, p2 16, p1 none.
struct PullRig {
  // `no_pulls`: the workers without a pull receiver.
  explicit PullRig(absl::Duration overhead = absl::ZeroDuration(), const std::vector<std::string>& no_pulls = {},
                   bool always = false)
      : rig(RigOptions{.pull_min_tokens = 16, .pull_overhead = overhead, .pull_always = always}) {
    for (const char* name : {"p0", "p1", "p2"}) {
      FakeWorker& w = rig.AddWorker(Role::kPrefill, name);
      w.prefix_hash = HashScheme{ModelIdentity{1, 2}, DType::kF32, w.kv_block_size};
      w.pulls = std::find(no_pulls.begin(), no_pulls.end(), name) == no_pulls.end();
    }
    rig.AddWorker(Role::kDecode, "d0");
    FakeWorker& p0 = rig.workers.at("p0");
    FakeWorker& p2 = rig.workers.at("p2");
    p0.kv_events = Stored(p0, req.prompt, 2);
    p2.kv_events = Stored(p2, req.prompt, 1);
    rig.ProbeAll();
  }
  // p1 computes 1,000 tokens/s; KV moves at 1 GB/s (fake workers report
  // 64 bytes per position: 32 positions take 2 us).
  void Measure() {
    rig.measured.RecordPrefill("p1", 40, 40, 0.04);
    rig.measured.RecordHandoff("p0", "d0", 1e6, 1e-3);
  }
  std::optional<PullPlan> Plan() {
    PromptChains chains(req.prompt);
    return rig.placement->PlanPull(*rig.Find(Role::kPrefill, "p1"), chains);
  }
  InProcessRouter rig;
  GenerationRequest req = InProcessRouter::Request(10);
};

TEST(PlacementTest, APrefixAnotherPrefillWorkerHoldsIsPulledFromTheOneHoldingMostWhenThatIsFaster) {
  PullRig r;
  EXPECT_FALSE(r.Plan().has_value()) << "nothing measured yet";
  EXPECT_EQ(r.rig.placement->pull_stats().unmeasured.load(), 1);
  r.Measure();
  std::optional<PullPlan> plan = r.Plan();
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->from->address(), "p0");
  EXPECT_EQ(plan->positions, 32);
  EXPECT_EQ(plan->gain, 32);
  EXPECT_NEAR(plan->compute_s, 0.032, 1e-9);
  EXPECT_NEAR(plan->transfer_s, 32 * 64 / 1e9, 1e-9);
  // From p2 (16 held) to p0 nothing is worth pulling: p0 holds more.
  PromptChains chains(r.req.prompt);
  EXPECT_FALSE(r.rig.placement->PlanPull(*r.rig.Find(Role::kPrefill, "p0"), chains).has_value());
}

TEST(PlacementTest, PullAlwaysTakesThePrefixWithoutMeasuringOrPredicting) {
  PullRig r(absl::Milliseconds(40), {}, /*always=*/true);  // Unmeasured, and predicted slower if it were.
  std::optional<PullPlan> plan = r.Plan();
  ASSERT_TRUE(plan.has_value());
  EXPECT_EQ(plan->from->address(), "p0");
  EXPECT_EQ(plan->gain, 32);
  EXPECT_EQ(r.rig.placement->pull_stats().unmeasured.load(), 0);
  EXPECT_EQ(r.rig.placement->pull_stats().slower.load(), 0);
}

TEST(PlacementTest, NoPullWhereComputingIsPredictedFasterOrAWorkerTakesNone) {
  {
    PullRig r(absl::Milliseconds(40));  // The fixed cost alone exceeds the 32 ms compute.
    r.Measure();
    EXPECT_FALSE(r.Plan().has_value());
    EXPECT_EQ(r.rig.placement->pull_stats().slower.load(), 1);
  }
  {
    PullRig r(absl::ZeroDuration(), {"p0"});  // p0 sends none: p2's 16 remain, and they are enough.
    r.Measure();
    std::optional<PullPlan> plan = r.Plan();
    ASSERT_TRUE(plan.has_value());
    EXPECT_EQ(plan->from->address(), "p2");
    EXPECT_EQ(plan->gain, 16);
  }
  {
    PullRig r(absl::ZeroDuration(), {"p1"});  // p1 takes none.
    r.Measure();
    EXPECT_FALSE(r.Plan().has_value());
  }
}

TEST(PlacementTest, AFailedWorkerThatRestartedMayServeTheRequestAgain) {
  InProcessRouter rig;
  FakeWorker& d0 = rig.AddWorker(Role::kDecode, "d0");
  rig.ProbeAll();
  PromptChains chains(InProcessRouter::Request(10).prompt);
  Exclusions failed;
  failed.Add(*rig.Find(Role::kDecode, "d0"));
  EXPECT_EQ(rig.placement->PickDecode(50, failed, chains), nullptr);
  d0.instance = 2;  // a new process at the same address
  rig.ProbeAll();
  ASSERT_NE(rig.placement->PickDecode(50, failed, chains), nullptr);
}

TEST(PlacementTest, WithoutRoomAnywhereTheWorkerWithTheMostFreeKvIsPicked) {
  InProcessRouter rig;
  rig.AddWorker(Role::kDecode, "d0").kv_blocks_free = 4;
  rig.AddWorker(Role::kDecode, "d1").kv_blocks_free = 9;
  rig.AddWorker(Role::kDecode, "d2").kv_blocks_free = 2;
  rig.ProbeAll();
  PromptChains chains(InProcessRouter::Request(10).prompt);
  EXPECT_EQ(rig.placement->PickDecode(1000, {}, chains)->address(), "d1");
  // With room (d0: 64 positions), only the roomy ones are candidates.
  EXPECT_EQ(rig.placement->PickDecode(60, {}, chains)->address(), "d0");
}

TEST(PlacementTest, TheDecodeWorkerHoldingTheContextsPrefixIsChosen) {
  InProcessRouter rig;
  rig.AddWorker(Role::kDecode, "d0");
  FakeWorker& d1 = rig.AddWorker(Role::kDecode, "d1");
  const GenerationRequest req = InProcessRouter::Request(10);
  d1.kv_events = Stored(d1, req.prompt, 2);
  rig.ProbeAll();  // the pool applies d1's events to the index
  PromptChains chains(req.prompt);
  EXPECT_EQ(rig.placement->CachedTokens(*rig.Find(Role::kDecode, "d1"), chains), 32);
  EXPECT_EQ(rig.placement->CachedTokens(*rig.Find(Role::kDecode, "d0"), chains), 0);
  EXPECT_EQ(rig.placement->PickDecode(50, {}, chains)->address(), "d1");
}

TEST(PlacementTest, AShortUncachedPartIsPrefilledOnTheDecodeWorkerWithHeadroom) {
  InProcessRouter rig({.local_prefill_max_tokens = 10});
  rig.AddWorker(Role::kPrefill, "p0");
  rig.AddWorker(Role::kDecode, "d0");
  FakeWorker& d1 = rig.AddWorker(Role::kDecode, "d1");
  const GenerationRequest req = InProcessRouter::Request(10);
  d1.kv_events = Stored(d1, req.prompt, 2);  // 32 of 40 cached: 8 to compute
  rig.ProbeAll();
  PromptChains chains(req.prompt);
  const Placed p = rig.placement->Place(50, chains);
  ASSERT_NE(p.decode, nullptr);
  EXPECT_EQ(p.decode->address(), "d1");
  EXPECT_TRUE(p.local);
  EXPECT_EQ(p.prefill, nullptr);
  EXPECT_FALSE(rig.placement->PrefillOnDecode(*rig.Find(Role::kDecode, "d0"), chains));
  // Without batch headroom it goes to the prefill pool after all.
  rig.Find(Role::kDecode, "d1")->in_flight = 64;
  EXPECT_FALSE(rig.placement->PrefillOnDecode(*rig.Find(Role::kDecode, "d1"), chains));
  rig.Find(Role::kDecode, "d1")->in_flight = 0;
  // Through the relay: one decode call, prefilled there, no prefill call.
  const Relayed got = rig.Run(req);
  ASSERT_TRUE(got.status.ok()) << got.status;
  EXPECT_TRUE(rig.workers.at("d1").decodes.at(0).prefill_here());
  EXPECT_TRUE(rig.workers.at("p0").prefills.empty());
  EXPECT_EQ(got.tokens, InProcessRouter::Expected(req));
  EXPECT_EQ(rig.Count("pdserve_prefill_placements_total", "placement=\"decode_local\""), 1);
}

TEST(PlacementTest, ColocatedPlacesEveryContextOnTheDecodeWorker) {
  InProcessRouter rig({.colocated = true});
  rig.AddWorker(Role::kDecode, "d0");
  rig.ProbeAll();
  PromptChains chains(InProcessRouter::Request(10).prompt);
  const Placed p = rig.placement->Place(50, chains);
  EXPECT_EQ(p.decode->address(), "d0");
  EXPECT_TRUE(p.local);
  EXPECT_EQ(p.prefill, nullptr);
}

// Admission is given the prefill worker the request will run on, chosen
// by the configured selector, not an estimate for some other worker.
class AdmissionPlacementTest : public ::testing::TestWithParam<const char*> {};

TEST_P(AdmissionPlacementTest, AdmissionJudgesThePlacementTheRequestRunsWith) {
  const std::string policy = GetParam();
  AdmissionOptions a;
  a.ttft_target = absl::Milliseconds(100);
  a.min_samples = 3;
  InProcessRouter rig({.prefill_policy = policy, .admission = a});
  rig.AddWorker(Role::kPrefill, "p0");
  rig.AddWorker(Role::kPrefill, "p1");
  rig.AddWorker(Role::kDecode, "d0");
  rig.ProbeAll();
  // p0 computes 40 tokens in 0.4 s, p1 in 4 ms.
  for (int i = 0; i < 3; ++i) {
    rig.measured.RecordPrefill("p0", 40, 40, 0.4);
    rig.measured.RecordPrefill("p1", 40, 40, 0.004);
  }
  const GenerationRequest req = InProcessRouter::Request(5);
  const Relayed got = rig.Run(req);
  if (policy == "least_loaded") {
    // Both idle: least_loaded takes p0, the slow one, so the predicted
    // TTFT is p0's and the request is refused.
    EXPECT_EQ(got.status.code(), absl::StatusCode::kResourceExhausted) << got.status;
    EXPECT_TRUE(absl::StrContains(got.status.message(), "predicted TTFT 0.40 s")) << got.status;
    EXPECT_TRUE(rig.workers.at("p0").prefills.empty());
    EXPECT_EQ(rig.Count("pdserve_requests_total", "outcome=\"rejected\""), 1);
  } else {
    // prefix_aware weighs measured speed: p1, predicted 4 ms, admitted,
    // and it runs on p1.
    ASSERT_TRUE(got.status.ok()) << got.status;
    EXPECT_EQ(rig.workers.at("p1").prefills.size(), 1u);
    EXPECT_TRUE(rig.workers.at("p0").prefills.empty());
    EXPECT_EQ(got.tokens, InProcessRouter::Expected(req));
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, AdmissionPlacementTest, ::testing::Values("least_loaded", "prefix_aware"));

TEST(PlacementTest, RoundRobinAdvancesOncePerRequestWithAdmission) {
  AdmissionOptions a;
  InProcessRouter rig({.prefill_policy = "round_robin", .admission = a});
  rig.AddWorker(Role::kPrefill, "p0");
  rig.AddWorker(Role::kPrefill, "p1");
  rig.AddWorker(Role::kDecode, "d0");
  rig.ProbeAll();
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(rig.Run(InProcessRouter::Request(3)).status.ok());
  EXPECT_EQ(rig.workers.at("p0").prefills.size(), 2u);
  EXPECT_EQ(rig.workers.at("p1").prefills.size(), 2u);
}

}  // namespace
}  // namespace pdserve::router::testing
