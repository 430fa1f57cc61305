// The worker pool in-process: probes (health, reports, ejection reasons,
// backoff on the injected clock, probes that time out on a busy worker),
// restarts, KV-event ingestion into the prefix index, and discovery of
// fixed targets.
#include "router/worker_pool.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "base/metrics.h"
#include "gtest/gtest.h"
#include "tests/router/in_process_router.h"

namespace pdserve::router::testing {
namespace {

// A snapshot of `n` stored blocks, each the child of the one before.
worker::v1::KvEvents StoredBlocks(uint64_t n) {
  worker::v1::KvEvents ke;
  ke.set_snapshot(true);
  for (uint64_t i = 1; i <= n; ++i) {
    worker::v1::KvEvent* e = ke.add_events();
    e->set_id(i);
    e->set_kind(worker::v1::KvEvent::STORED);
    e->set_hash_lo(i);
    e->set_parent_lo(i - 1);
  }
  ke.set_last_id(n);
  return ke;
}

// A pool over fake workers on a fake clock that counts its ejections.
struct ProbedPool {
  ProbedPool() : measured(OptionsOn<MeasuredOptions>(clock)) {
    WorkerPoolOptions o;
    o.clock = clock.clock();
    o.prefill_ejections = &prefill_ejections;
    o.decode_ejections = &decode_ejections;
    pool = std::make_unique<WorkerPool>(o, &workers, &measured, &index);
  }
  // A worker in the pool, serving: its first probe has answered.
  std::pair<FakeWorker*, WorkerPtr> AddServing(Role role, const std::string& address) {
    FakeWorker& f = workers.Add(role, address);
    f.kv_events = StoredBlocks(3);
    WorkerPtr w = pool->Add(role, address);
    pool->ProbeDue(/*force_all=*/true);
    EXPECT_TRUE(w->healthy()) << address;
    EXPECT_EQ(index.NumBlocks(address), 3) << address;
    return {&f, w};
  }
  // Moves the clock on by `d`, 10 ms at a time, running the probes due.
  void Advance(absl::Duration d) {
    for (const absl::Time end = clock.now + d; clock.now < end;) {
      clock.now += absl::Milliseconds(10);
      pool->ProbeDue(/*force_all=*/false);
    }
  }

  FakeClock clock;
  FakeWorkers workers;
  MeasuredInputs measured;
  PrefixIndex index;
  Counter prefill_ejections;
  Counter decode_ejections;
  std::unique_ptr<WorkerPool> pool;
};

TEST(WorkerPoolTest, AProbeAdmitsAWorkerAndKeepsItsReport) {
  InProcessRouter rig;
  FakeWorker& d = rig.AddWorker(Role::kDecode, "d0");
  d.kv_blocks_free = 7;
  d.max_batch = 12;
  const WorkerPtr w = rig.Find(Role::kDecode, "d0");
  EXPECT_FALSE(w->healthy());  // not probed yet
  EXPECT_EQ(rig.pool->NoHealthyWorker(Role::kDecode), "no healthy decode worker (d0: not probed yet)");
  rig.ProbeAll();
  EXPECT_TRUE(w->healthy());
  const WorkerReport r = w->report();
  EXPECT_EQ(r.free_positions, 7 * 16);
  EXPECT_EQ(r.max_batch, 12);
  EXPECT_EQ(r.kv_address, "d0-kv");
  ASSERT_TRUE(r.prefix_hash.has_value());
  EXPECT_EQ(r.prefix_hash->block_size, 16);
  EXPECT_EQ(rig.pool->Serving(Role::kDecode), 1);
  EXPECT_EQ(rig.pool->MaxDecodeBatch(), 12);
}

TEST(WorkerPoolTest, AWorkerThatStopsAnsweringIsEjectedAndProbedWithBackoff) {
  InProcessRouter rig;
  FakeWorker& d = rig.AddWorker(Role::kDecode, "d0");
  rig.ProbeAll();
  d.alive = false;
  rig.ProbeAll();
  const WorkerPtr w = rig.Find(Role::kDecode, "d0");
  EXPECT_FALSE(w->healthy());
  EXPECT_EQ(rig.pool->NoHealthyWorker(Role::kDecode),
            "no healthy decode worker (d0: failed to connect to all addresses)");
  // Failures back off: 100 ms, 200, 400, ... up to max_backoff (2 s). Step
  // the clock 10 ms at a time for 3 s and count the probes sent.
  const int before = d.status_calls;
  for (int i = 0; i < 300; ++i) {
    rig.clock.now += absl::Milliseconds(10);
    rig.pool->ProbeDue(/*force_all=*/false);
  }
  // Due at +100, +300, +700, +1500, +3100: four within 3 s.
  EXPECT_EQ(d.status_calls - before, 4);
  d.alive = true;
  rig.clock.now += absl::Seconds(2);
  rig.pool->ProbeDue(false);
  EXPECT_TRUE(w->healthy());
  EXPECT_EQ(rig.pool->NoHealthyWorker(Role::kDecode), "no healthy decode worker");
}

// The probe loop sleeps until the time a round returns: the earliest
// probe due, each worker's period or backoff; a worker not yet probed is
// due at once, and an empty pool never.
TEST(WorkerPoolTest, AProbeRoundSaysWhenTheNextProbeIsDue) {
  ProbedPool p;
  EXPECT_EQ(p.pool->ProbeDue(false), absl::InfiniteFuture());
  p.workers.Add(Role::kDecode, "d0");
  p.pool->Add(Role::kDecode, "d0");
  const absl::Time t0 = p.clock.now;
  EXPECT_EQ(p.pool->ProbeDue(false), t0 + absl::Milliseconds(100));  // probed: next in a period
  FakeWorker& dead = p.workers.Add(Role::kPrefill, "p0");
  dead.alive = false;
  p.pool->Add(Role::kPrefill, "p0");
  p.clock.now += absl::Milliseconds(30);
  // d0 is not due; p0 is probed, fails and backs off 100 ms from now.
  EXPECT_EQ(p.pool->ProbeDue(false), t0 + absl::Milliseconds(100));
  p.clock.now = t0 + absl::Milliseconds(100);
  EXPECT_EQ(p.pool->ProbeDue(false), t0 + absl::Milliseconds(130));  // p0's backoff comes first now
  p.clock.now = t0 + absl::Milliseconds(130);
  EXPECT_EQ(p.pool->ProbeDue(false), t0 + absl::Milliseconds(200));  // d0 again; p0 backs off 200 ms
}

TEST(WorkerPoolTest, ANotServingAnswerCarriesTheWorkersReason) {
  InProcessRouter rig;
  FakeWorker& p = rig.AddWorker(Role::kPrefill, "p0");
  p.serving = false;
  p.unhealthy_reason = "draining";
  rig.ProbeAll();
  EXPECT_FALSE(rig.Find(Role::kPrefill, "p0")->healthy());
  EXPECT_EQ(rig.pool->NoHealthyWorker(Role::kPrefill), "no healthy prefill worker (p0: draining)");
  EXPECT_EQ(rig.Find(Role::kPrefill, "p0")->ejection_reason(), "draining");
}

TEST(WorkerPoolTest, KvEventsReachThePrefixIndexAndADeadWorkersEntriesAreDropped) {
  InProcessRouter rig;
  FakeWorker& d = rig.AddWorker(Role::kDecode, "d0");
  d.kv_events = StoredBlocks(3);
  rig.ProbeAll();
  EXPECT_EQ(rig.index.NumBlocks("d0"), 3);
  EXPECT_EQ(rig.index.NextAfter("d0"), 3u);
  d.alive = false;
  rig.ProbeAll();
  EXPECT_EQ(rig.index.NumBlocks("d0"), 0);
}

// A busy machine answers health late: a worker whose probes time out but
// whose requests move keeps serving, probed at the normal period.
TEST(WorkerPoolTest, AWorkerWhoseProbesTimeOutWhileItMakesProgressKeepsServing) {
  ProbedPool p;
  auto [d, w] = p.AddServing(Role::kDecode, "d0");
  d->status_error = absl::DeadlineExceededError("Deadline Exceeded");
  const int before = d->status_calls;
  for (int s = 0; s < 60; ++s) {
    w->NoteProgress(p.clock.now);
    p.Advance(absl::Seconds(1));
    ASSERT_TRUE(w->healthy()) << "after " << s + 1 << " s";
  }
  EXPECT_EQ(d->status_calls - before, 600);  // every 100 ms: no backoff
  EXPECT_EQ(p.decode_ejections.value(), 0);
  EXPECT_EQ(w->ejection_reason(), "");
  EXPECT_EQ(p.index.NumBlocks("d0"), 3);
  EXPECT_EQ(p.pool->Serving(Role::kDecode), 1);
  d->status_error = absl::OkStatus();
  p.Advance(absl::Milliseconds(100));
  EXPECT_TRUE(w->healthy());
  EXPECT_EQ(p.decode_ejections.value(), 0);
}

TEST(WorkerPoolTest, AWorkerWhoseProbesTimeOutWithoutProgressIsEjectedAtProbeStall) {
  ProbedPool p;
  auto [d, w] = p.AddServing(Role::kDecode, "d0");
  d->status_error = absl::DeadlineExceededError("Deadline Exceeded");
  // Its last answer was now; probe_stall is 10 s.
  p.Advance(absl::Seconds(10) - absl::Milliseconds(10));
  EXPECT_TRUE(w->healthy());
  EXPECT_EQ(p.decode_ejections.value(), 0);
  EXPECT_EQ(p.index.NumBlocks("d0"), 3);
  p.Advance(absl::Milliseconds(10));
  EXPECT_FALSE(w->healthy());
  EXPECT_EQ(p.decode_ejections.value(), 1);
  EXPECT_EQ(w->ejection_reason(), "no probe answered within 500ms for 10s and no progress since");
  EXPECT_EQ(p.index.NumBlocks("d0"), 0);
  // Ejected, it stays out while its probes time out, counted once.
  p.Advance(absl::Seconds(5));
  EXPECT_FALSE(w->healthy());
  EXPECT_EQ(p.decode_ejections.value(), 1);
  d->status_error = absl::OkStatus();
  p.Advance(absl::Seconds(2));  // max_backoff
  EXPECT_TRUE(w->healthy());
  EXPECT_EQ(w->ejection_reason(), "");
}

TEST(WorkerPoolTest, AWorkerThatNeverAnsweredStaysOutWhileItsProbesTimeOut) {
  ProbedPool p;
  FakeWorker& d = p.workers.Add(Role::kDecode, "d0");
  d.status_error = absl::DeadlineExceededError("Deadline Exceeded");
  const WorkerPtr w = p.pool->Add(Role::kDecode, "d0");
  w->NoteProgress(p.clock.now);
  p.pool->ProbeDue(/*force_all=*/true);
  p.Advance(absl::Seconds(3));
  EXPECT_FALSE(w->healthy());
  EXPECT_EQ(w->ejection_reason(), "Deadline Exceeded");
  EXPECT_EQ(d.status_calls, 5);  // at 0, then backing off: +100, +300, +700, +1500 ms
  EXPECT_EQ(p.decode_ejections.value(), 0);
}

// Any error but a timeout ejects at once: the process is gone, or broken.
TEST(WorkerPoolTest, AProbeErrorOtherThanATimeoutEjectsAtTheFirstFailure) {
  for (const absl::Status& error :
       {absl::UnavailableError("failed to connect to all addresses"), absl::InternalError("stream reset")}) {
    SCOPED_TRACE(error.ToString());
    ProbedPool p;
    auto [pf, w] = p.AddServing(Role::kPrefill, "p0");
    pf->status_error = error;
    p.Advance(absl::Milliseconds(100));
    EXPECT_FALSE(w->healthy());
    EXPECT_EQ(p.prefill_ejections.value(), 1);
    EXPECT_EQ(w->ejection_reason(), error.message());
    EXPECT_EQ(p.index.NumBlocks("p0"), 0);
  }
}

TEST(WorkerPoolTest, AWorkerThatStopsAnsweringAltogetherIsEjectedAtTheFirstFailedProbe) {
  ProbedPool p;
  auto [d, w] = p.AddServing(Role::kDecode, "d0");
  w->NoteProgress(p.clock.now);
  d->alive = false;
  p.Advance(absl::Milliseconds(100));
  EXPECT_FALSE(w->healthy());
  EXPECT_EQ(p.decode_ejections.value(), 1);
  EXPECT_EQ(p.index.NumBlocks("d0"), 0);
}

TEST(WorkerPoolTest, AnAnswerThatSaysNotServingEjectsAtOnce) {
  ProbedPool p;
  auto [pf, w] = p.AddServing(Role::kPrefill, "p0");
  w->NoteProgress(p.clock.now);
  pf->serving = false;
  pf->unhealthy_reason = "draining";
  p.Advance(absl::Milliseconds(100));
  EXPECT_FALSE(w->healthy());
  EXPECT_EQ(p.prefill_ejections.value(), 1);
  EXPECT_EQ(w->ejection_reason(), "draining");
}

TEST(WorkerPoolTest, TheServingEpochMovesOnEveryChangeToTheServingWorkers) {
  ProbedPool p;
  const uint64_t empty = p.pool->serving_epoch();
  auto [pf, w] = p.AddServing(Role::kPrefill, "p0");
  const uint64_t serving = p.pool->serving_epoch();
  EXPECT_NE(serving, empty);  // added, then admitted
  p.Advance(absl::Milliseconds(100));
  EXPECT_EQ(p.pool->serving_epoch(), serving) << "a probe that changes nothing is no change";
  pf->serving = false;
  p.Advance(absl::Milliseconds(100));
  ASSERT_FALSE(w->healthy());
  const uint64_t ejected = p.pool->serving_epoch();
  EXPECT_NE(ejected, serving);
  p.pool->Remove(Role::kPrefill, "p0");
  EXPECT_NE(p.pool->serving_epoch(), ejected);
}

TEST(WorkerPoolTest, AWaiterWakesOnAnAdmissionOrItsStopAndOtherwiseAtItsTimeout) {
  ProbedPool p;
  // No change: the full timeout (real time, short).
  const uint64_t seen = p.pool->serving_epoch();
  const absl::Time t0 = absl::Now();
  p.pool->AwaitServingChange(seen, absl::Milliseconds(50), nullptr);
  EXPECT_GE(absl::Now() - t0, absl::Milliseconds(45));
  // An admission from another thread ends the wait long before its timeout.
  std::thread admit([&] {
    absl::SleepFor(absl::Milliseconds(20));
    p.AddServing(Role::kDecode, "d0");
  });
  const absl::Time t1 = absl::Now();
  p.pool->AwaitServingChange(seen, absl::Seconds(30), nullptr);
  EXPECT_LT(absl::Now() - t1, absl::Seconds(20));
  EXPECT_NE(p.pool->serving_epoch(), seen);
  admit.join();
  // A stop flag set and the waiters woken ends it too.
  std::atomic<bool> stop{false};
  const uint64_t now_seen = p.pool->serving_epoch();
  std::thread stopper([&] {
    absl::SleepFor(absl::Milliseconds(20));
    stop.store(true);
    p.pool->WakeWaiters();
  });
  const absl::Time t2 = absl::Now();
  p.pool->AwaitServingChange(now_seen, absl::Seconds(30), &stop);
  EXPECT_LT(absl::Now() - t2, absl::Seconds(20));
  stopper.join();
}

TEST(WorkerPoolTest, ARestartIsSeenAsANewInstance) {
  InProcessRouter rig;
  FakeWorker& d = rig.AddWorker(Role::kDecode, "d0");
  rig.ProbeAll();
  const WorkerPtr w = rig.Find(Role::kDecode, "d0");
  EXPECT_EQ(w->instance(), 1u);
  d.instance = 9;
  rig.ProbeAll();
  EXPECT_EQ(w->instance(), 9u);
}

TEST(WorkerPoolTest, DiscoveryAddsFixedTargetsAndRemovesNothingThatStays) {
  FakeWorkers workers;
  workers.Add(Role::kPrefill, "127.0.0.1:5001");
  workers.Add(Role::kDecode, "127.0.0.1:5002");
  workers.Add(Role::kDecode, "[::1]:5003");
  MeasuredInputs measured;
  PrefixIndex index;
  WorkerPoolOptions o;
  o.prefill_targets.push_back(*ParseWorkerTarget("127.0.0.1:5001"));
  o.decode_targets.push_back(*ParseWorkerTarget("127.0.0.1:5002"));
  o.decode_targets.push_back(*ParseWorkerTarget("[::1]:5003"));
  WorkerPool pool(o, &workers, &measured, &index);
  pool.Discover();
  pool.Discover();
  ASSERT_EQ(pool.Snapshot(Role::kPrefill).size(), 1u);
  ASSERT_EQ(pool.Snapshot(Role::kDecode).size(), 2u);
  EXPECT_EQ(pool.Snapshot(Role::kDecode)[1]->address(), "[::1]:5003");
  const absl::Status st = pool.WaitForWorkers(absl::Seconds(1), {Role::kPrefill, Role::kDecode}, true);
  EXPECT_TRUE(st.ok()) << st;
  pool.Remove(Role::kDecode, "[::1]:5003");
  EXPECT_EQ(pool.Snapshot(Role::kDecode).size(), 1u);
}

TEST(WorkerPoolTest, WaitForWorkersNamesTheEmptyPoolAndTheSilentAddresses) {
  FakeWorkers workers;
  workers.Add(Role::kPrefill, "127.0.0.1:5001").alive = false;
  workers.Add(Role::kDecode, "127.0.0.1:5002");
  MeasuredInputs measured;
  PrefixIndex index;
  WorkerPoolOptions o;
  o.prefill_targets.push_back(*ParseWorkerTarget("127.0.0.1:5001"));
  o.decode_targets.push_back(*ParseWorkerTarget("127.0.0.1:5002"));
  WorkerPool pool(o, &workers, &measured, &index);
  const absl::Status st = pool.WaitForWorkers(absl::Milliseconds(150), {Role::kPrefill, Role::kDecode}, true);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(st.message(), "no live prefill worker; not answering: 127.0.0.1:5001 (failed to connect to all addresses)");
}

// A DNS target that resolves to nothing yet (a headless Service before its
// first pod is ready) leaves its pool empty: the wait goes on until the
// deadline instead of declaring the pools ready.
TEST(WorkerPoolTest, WaitForWorkersWaitsForAPoolWhoseNameResolvesToNothing) {
  FakeWorkers workers;
  workers.Add(Role::kDecode, "127.0.0.1:5002");
  MeasuredInputs measured;
  PrefixIndex index;
  WorkerPoolOptions o;
  o.resolve_timeout = absl::Milliseconds(200);
  o.prefill_targets.push_back(*ParseWorkerTarget("dns:///pdserve-no-such-service.invalid:7001"));
  o.decode_targets.push_back(*ParseWorkerTarget("127.0.0.1:5002"));
  WorkerPool pool(o, &workers, &measured, &index);
  const absl::Time start = absl::Now();
  const absl::Status st = pool.WaitForWorkers(absl::Milliseconds(600), {Role::kPrefill, Role::kDecode}, true);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_TRUE(absl::StartsWith(st.message(), "no live prefill worker")) << st;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(600));
}

}  // namespace
}  // namespace pdserve::router::testing
