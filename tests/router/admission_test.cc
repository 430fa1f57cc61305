// AdmissionController on a fake clock with injected capacities: each rule's
// rejection and message, the sample thresholds, queue accounting, and a
// simulated overload in which every admitted request's predicted TTFT stays
// under the target and the rejected fraction is the excess load.
#include "router/admission.h"

#include <cmath>
#include <deque>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/router/fake_clock.h"
#include "router/measured.h"

namespace pdserve::router {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

AdmissionOptions Options(FakeClock& c) { return OptionsOn<AdmissionOptions>(c); }

AdmissionLoad::Rate Rate(double requests_per_s, int64_t samples = 100) { return {requests_per_s, samples}; }

AdmissionLoad Load(double prefill, double handoff, double decode, double arrival) {
  return {Rate(prefill), Rate(handoff), Rate(decode), Rate(arrival)};
}

MeasuredValue TokensPerS(double value, int64_t samples = 100) { return {value, samples, absl::ZeroDuration()}; }

AdmissionRequest Request(int64_t queued, int64_t uncached, double tokens_per_s) {
  AdmissionRequest r;
  r.queued_prefill_tokens = queued;
  r.uncached_tokens = uncached;
  r.prefill_tokens_per_s = TokensPerS(tokens_per_s);
  return r;
}

TEST(AdmissionTest, QueueBoundAndTicketRelease) {
  FakeClock clock;
  AdmissionOptions o = Options(clock);
  o.max_queued = 2;
  AdmissionController a(o);
  absl::StatusOr<AdmissionTicket> t1 = a.Decide(Request(0, 100, 1000));
  absl::StatusOr<AdmissionTicket> t2 = a.Decide(Request(0, 100, 1000));
  ASSERT_TRUE(t1.ok() && t2.ok());
  const absl::StatusOr<AdmissionTicket> full = a.Decide(Request(0, 100, 1000));
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(full.status().message(), "admission queue full: 2 requests queued (max 2)");

  t1->Release();
  t1->Release();  // once only
  EXPECT_EQ(a.Stats().queued, 1);
  absl::StatusOr<AdmissionTicket> t3 = a.Decide(Request(0, 100, 1000));
  ASSERT_TRUE(t3.ok());
  {
    AdmissionTicket moved = std::move(*t3);  // the moved-from ticket holds nothing
    EXPECT_EQ(a.Stats().queued, 2);
  }
  EXPECT_EQ(a.Stats().queued, 1);
  *t2 = std::move(*t1);  // assigning releases what t2 held; t1 held nothing
  EXPECT_EQ(a.Stats().queued, 0);
  const AdmissionStats s = a.Stats();
  EXPECT_EQ(s.admitted, 3);
  EXPECT_EQ(s.rejected_queue, 1);
}

TEST(AdmissionTest, ExcessArrivalRateIsShedWithTheBottleneckNamed) {
  FakeClock clock;
  AdmissionController a(Options(clock));  // margin 5%, burst 1 s
  a.UpdateLoad(Load(20, 500, 8.1, 12.0));
  // The bucket holds 1 s of the budget, 8.1 x 1.05 = 8.5 requests.
  int admitted = 0;
  absl::Status rejected;
  std::vector<AdmissionTicket> held;
  for (int i = 0; i < 20 && rejected.ok(); ++i) {
    absl::StatusOr<AdmissionTicket> t = a.Decide(Request(0, 100, 1000));
    if (t.ok()) {
      ++admitted;
      held.push_back(std::move(*t));
    } else {
      rejected = t.status();
    }
  }
  EXPECT_EQ(admitted, 8);
  EXPECT_EQ(rejected.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(rejected.message(),
            "arrival rate 12.0 req/s exceeds the decode stage's capacity 8.1 req/s (admitting up to 8.5 req/s)");
  // Time earns admissions back at the budget rate, up to the bucket: 2 s
  // earn 17.01, of which 8.5 fit.
  clock.now += absl::Seconds(2);
  int later = 0;
  while (a.Decide(Request(0, 100, 1000)).ok()) ++later;
  EXPECT_EQ(later, 8);
  EXPECT_EQ(a.Stats().rejected_rate, 2);
}

TEST(AdmissionTest, ArrivalRateWithinTheMarginIsAdmitted) {
  FakeClock clock;
  AdmissionController a(Options(clock));
  a.UpdateLoad(Load(20, 500, 8.1, 8.5));  // under 8.1 x 1.05 = 8.505
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<AdmissionTicket> t = a.Decide(Request(0, 100, 1000));
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_THAT(t->decision().skipped, IsEmpty());
  }
  // Past it, the bucket (full) drains and then the rule refuses.
  a.UpdateLoad(Load(20, 500, 8.1, 8.6));
  int admitted = 0;
  while (a.Decide(Request(0, 100, 1000)).ok()) ++admitted;
  EXPECT_EQ(admitted, 8);
}

TEST(AdmissionTest, TooFewSamplesAdmitAndSayWhy) {
  FakeClock clock;
  AdmissionController a(Options(clock));  // min 20 samples
  AdmissionLoad load = Load(1, 1, 1, 50);
  load.arrival.samples = 5;
  a.UpdateLoad(load);
  absl::StatusOr<AdmissionTicket> t = a.Decide(Request(0, 100, 1000));
  ASSERT_TRUE(t.ok());
  EXPECT_THAT(t->decision().skipped,
              ElementsAre("rate check skipped: the arrival rate has 5 samples (need 20 samples)"));

  load = {Rate(1, 3), AdmissionLoad::Rate{}, Rate(1, 12), Rate(50)};
  a.UpdateLoad(load);
  t = a.Decide(Request(0, 100, 1000));
  ASSERT_TRUE(t.ok());
  EXPECT_THAT(t->decision().skipped,
              ElementsAre("rate check skipped: no stage capacity has 20 samples yet (prefill 3 samples, handoff no "
                          "data, decode 12 samples)"));

  // A stage with too few samples is left out of the bottleneck: decode
  // (1 req/s on 5 samples) is not trusted, prefill (8 req/s) is.
  load = {Rate(8), Rate(500), Rate(1, 5), Rate(12)};
  a.UpdateLoad(load);
  absl::Status rejected;
  for (int i = 0; i < 20 && rejected.ok(); ++i) rejected = a.Decide(Request(0, 100, 1000)).status();
  EXPECT_THAT(rejected.message(), HasSubstr("exceeds the prefill stage's capacity 8.0 req/s"));
}

TEST(AdmissionTest, PredictedTtftOverTheDeadlineOrTarget) {
  FakeClock clock;
  AdmissionOptions o = Options(clock);
  o.ttft_target = absl::Seconds(2);
  AdmissionController a(o);
  a.UpdateLoad(Load(100, 100, 100, 1));  // the rate rule applies and passes

  // 9,000 queued + 600 own tokens at 4,000 tokens/s = 2.40 s; the deadline
  // (1 s away) is sooner than the target.
  AdmissionRequest r = Request(9000, 600, 4000);
  r.deadline = clock.now + absl::Seconds(1);
  absl::StatusOr<AdmissionTicket> t = a.Decide(r);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(t.status().message(),
            "predicted TTFT 2.40 s exceeds the deadline 1.00 s (prefill queue 9,000 tokens at 4,000 tokens/s + 600 "
            "uncached tokens at 4,000 tokens/s, handoff 0.00 s)");
  // Without a deadline the target (2 s) applies.
  r.deadline.reset();
  EXPECT_EQ(a.Decide(r).status().message(),
            "predicted TTFT 2.40 s exceeds the TTFT target 2.00 s (prefill queue 9,000 tokens at 4,000 tokens/s + 600 "
            "uncached tokens at 4,000 tokens/s, handoff 0.00 s)");
  // The handoff counts: 7,800 tokens are 1.95 s, plus 0.1 s of handoff.
  r = Request(7000, 800, 4000);
  r.expected_handoff = absl::Milliseconds(100);
  EXPECT_THAT(a.Decide(r).status().message(), HasSubstr("predicted TTFT 2.05 s exceeds the TTFT target 2.00 s"));
  r.expected_handoff = absl::Milliseconds(40);
  t = a.Decide(r);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_NEAR(absl::ToDoubleSeconds(*t->decision().predicted_ttft), 1.99, 1e-9);
  EXPECT_EQ(*t->decision().ttft_limit, absl::Seconds(2));
  EXPECT_EQ(a.Stats().rejected_ttft, 3);

  // The queue drains at the worker's overall speed, this request's own
  // tokens at the speed for its size: 9,000 / 6,000 + 600 / 1,200 = 2.0 s.
  r = Request(9000, 600, 1200);
  r.queue_tokens_per_s = TokensPerS(6000);
  t = a.Decide(r);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_NEAR(absl::ToDoubleSeconds(*t->decision().predicted_ttft), 2.0, 1e-9);
  r.uncached_tokens = 660;  // 2.05 s
  EXPECT_EQ(a.Decide(r).status().message(),
            "predicted TTFT 2.05 s exceeds the TTFT target 2.00 s (prefill queue 9,000 tokens at 6,000 tokens/s + 660 "
            "uncached tokens at 1,200 tokens/s, handoff 0.00 s)");

  // No measured throughput (or too little): admitted, and the decision says why.
  r.prefill_tokens_per_s = TokensPerS(1, 3);
  r.queued_prefill_tokens = 1'000'000;
  t = a.Decide(r);
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->decision().predicted_ttft.has_value());
  EXPECT_THAT(t->decision().skipped,
              ElementsAre("TTFT check skipped: the prefill worker's tokens/s has 3 samples (need 20 samples)"));
  r.prefill_tokens_per_s = MeasuredValue{};
  EXPECT_THAT(a.Decide(r)->decision().skipped,
              ElementsAre("TTFT check skipped: the prefill worker's tokens/s has no data (need 20 samples)"));
}

TEST(AdmissionTest, LoadFromMeasuredCapacity) {
  MeasuredCapacity c;
  c.prefill.requests_per_s = 8;
  c.prefill.samples = 300;
  c.decode.requests_per_s = 16;
  c.decode.samples = 40;
  c.arrival_rate = {12.0, 120, absl::ZeroDuration()};
  const AdmissionLoad load = LoadFromCapacity(c);
  EXPECT_EQ(load.prefill.requests_per_s, 8);
  EXPECT_EQ(load.prefill.samples, 300);
  EXPECT_FALSE(load.handoff.requests_per_s.has_value());
  EXPECT_EQ(load.decode.samples, 40);
  EXPECT_EQ(load.arrival.requests_per_s, 12.0);
  EXPECT_EQ(load.arrival.samples, 120);
}

TEST(AdmissionTest, ConcurrentDecisionsKeepTheQueueCount) {
  FakeClock clock;
  AdmissionOptions o = Options(clock);
  o.max_queued = 1'000'000;
  AdmissionController a(o);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&a] {
      for (int i = 0; i < 2000; ++i) {
        absl::StatusOr<AdmissionTicket> ticket = a.Decide(Request(0, 100, 1000));
        ASSERT_TRUE(ticket.ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(a.Stats().queued, 0);
  EXPECT_EQ(a.Stats().admitted, 8000);
}

// One prefill worker at kTokensPerS serving FIFO; requests of kUncached
// tokens, so the prefill stage's capacity is 4 req/s (the bottleneck: the
// other stages are injected far above it). Poisson arrivals at `rate` for
// `seconds`; the arrival rate comes from MeasuredInputs on the same fake
// clock, the capacities are injected, the load refreshed every second.
constexpr double kTokensPerS = 4000;
constexpr int64_t kUncached = 1000;
constexpr double kCapacity = kTokensPerS / kUncached;
const absl::Duration kHandoff = absl::Milliseconds(50);

struct SimResult {
  int64_t arrivals = 0;
  int64_t rejected = 0;
  AdmissionStats stats;
  absl::Duration worst_predicted = absl::ZeroDuration();
  absl::Duration worst_actual = absl::ZeroDuration();
  double rejected_fraction() const { return static_cast<double>(rejected) / static_cast<double>(arrivals); }
};

SimResult Simulate(std::optional<absl::Duration> ttft_target, double rate, double seconds) {
  FakeClock clock;
  MeasuredOptions mo;
  mo.clock = clock.clock();
  MeasuredInputs measured(mo);
  AdmissionOptions o = Options(clock);
  o.ttft_target = ttft_target;
  o.max_queued = 100'000;
  AdmissionController admission(o);

  std::mt19937 rng(2024);
  std::exponential_distribution<double> gap(rate);
  const absl::Time start = clock.now;
  const absl::Time end = start + absl::Seconds(seconds);
  absl::Time worker_free = start;  // when the worker finishes its backlog
  absl::Time next_update = start;
  std::deque<std::pair<absl::Time, AdmissionTicket>> in_prefill;  // by prefill end
  SimResult r;
  for (clock.now = start + absl::Seconds(gap(rng)); clock.now < end; clock.now += absl::Seconds(gap(rng))) {
    while (!in_prefill.empty() && in_prefill.front().first <= clock.now) in_prefill.pop_front();
    if (clock.now >= next_update) {
      AdmissionLoad load = LoadFromCapacity(ComputeMeasuredCapacity(measured.Snapshot(), PoolFacts{1, 1, 1, {}}));
      load.prefill = Rate(kCapacity);
      load.handoff = Rate(100);
      load.decode = Rate(50);
      admission.UpdateLoad(load);
      next_update += absl::Seconds(1);
    }
    measured.RecordArrival();
    ++r.arrivals;
    const double backlog_s = std::max(0.0, absl::ToDoubleSeconds(worker_free - clock.now));
    AdmissionRequest req = Request(static_cast<int64_t>(std::ceil(backlog_s * kTokensPerS)), kUncached, kTokensPerS);
    req.expected_handoff = kHandoff;
    absl::StatusOr<AdmissionTicket> t = admission.Decide(req);
    if (!t.ok()) {
      EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted);
      ++r.rejected;
      continue;
    }
    worker_free = std::max(worker_free, clock.now) + absl::Seconds(kUncached / kTokensPerS);
    if (t->decision().predicted_ttft.has_value()) {
      r.worst_predicted = std::max(r.worst_predicted, *t->decision().predicted_ttft);
    }
    r.worst_actual = std::max(r.worst_actual, worker_free + kHandoff - clock.now);
    in_prefill.emplace_back(worker_free, std::move(*t));
  }
  in_prefill.clear();
  r.stats = admission.Stats();
  return r;
}

TEST(AdmissionSimulationTest, OverloadAdmitsTheCapacityWithinTheTtftTarget) {
  // Twice the capacity for 10 minutes: half is shed, and every admitted
  // request's predicted (and, FIFO at the injected rate, actual) TTFT is
  // within the 1 s target.
  const absl::Duration target = absl::Seconds(1);
  const double rate = 2 * kCapacity;
  const SimResult r = Simulate(target, rate, 600);
  EXPECT_GT(r.arrivals, 4500);
  EXPECT_LE(r.worst_predicted, target);
  EXPECT_LE(r.worst_actual, target + absl::Microseconds(1));
  EXPECT_NEAR(r.rejected_fraction(), 1 - kCapacity / rate, 0.02);
  // The rate rule sheds most of the excess; the TTFT rule the margin above it.
  EXPECT_GT(r.stats.rejected_rate, r.stats.rejected_ttft);
  EXPECT_GT(r.stats.rejected_ttft, 0);
  EXPECT_EQ(r.stats.queued, 0);
}

TEST(AdmissionSimulationTest, RateRuleAloneAdmitsCapacityPlusMargin) {
  // No TTFT bound: admissions run at the budget, capacity x 1.05.
  const double rate = 3 * kCapacity;
  const SimResult r = Simulate(std::nullopt, rate, 600);
  EXPECT_NEAR(r.rejected_fraction(), 1 - kCapacity * 1.05 / rate, 0.02);
  EXPECT_EQ(r.stats.rejected_ttft, 0);
}

TEST(AdmissionSimulationTest, UnderCapacityAlmostNothingIsRejected) {
  const SimResult r = Simulate(absl::Seconds(2), 0.5 * kCapacity, 600);
  EXPECT_LT(r.rejected_fraction(), 0.01);
  EXPECT_EQ(r.stats.rejected_rate, 0);
  EXPECT_LE(r.worst_predicted, absl::Seconds(2));
}

}  // namespace
}  // namespace pdserve::router
