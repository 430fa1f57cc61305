// MeasuredInputs and ComputeMeasuredCapacity on a fake clock: "no data"
// before the first sample, exact early means, convergence of noisy samples
// to the injected truth, sample counts and ages, and each stage's capacity.
#include "router/measured.h"

#include <cmath>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/metrics.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/router/fake_clock.h"

namespace pdserve::router {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

MeasuredOptions Options(FakeClock& c) { return OptionsOn<MeasuredOptions>(c); }

// Uniform in [1 - spread, 1 + spread], seeded.
class Noise {
 public:
  explicit Noise(double spread, uint32_t seed = 7) : rng_(seed), dist_(1 - spread, 1 + spread) {}
  double operator()() { return dist_(rng_); }

 private:
  std::mt19937 rng_;
  std::uniform_real_distribution<double> dist_;
};

PoolFacts Facts(int64_t prefill_workers, int64_t decode_workers, int64_t decode_batch) {
  PoolFacts f;
  f.prefill_workers = prefill_workers;
  f.decode_workers = decode_workers;
  f.decode_batch = decode_batch;
  return f;
}

void ExpectWithin(double got, double want, double fraction) {
  EXPECT_NEAR(got, want, fraction * std::abs(want)) << "want " << want << " within " << fraction * 100 << "%";
}

TEST(MeasuredInputsTest, NoDataBeforeTheFirstSample) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));
  const MeasuredSnapshot s = m.Snapshot();
  EXPECT_TRUE(s.prefill.empty());
  EXPECT_TRUE(s.decode.empty());
  EXPECT_TRUE(s.links.empty());
  for (const MeasuredValue* v : {&s.prompt_tokens, &s.uncached_prompt_tokens, &s.decode_history_tokens,
                                 &s.handoff_bytes, &s.output_tokens, &s.arrival_rate}) {
    EXPECT_FALSE(v->has_data());
    EXPECT_EQ(v->samples, 0);
    EXPECT_FALSE(v->age.has_value());
  }
  EXPECT_FALSE(m.PrefillTokensPerS("p0", 100).has_data());
  EXPECT_EQ(FormatMeasuredValue(s.output_tokens, 1), "no data");
  EXPECT_THAT(FormatSnapshot(s), HasSubstr("output tokens: no data"));

  const MeasuredCapacity c = ComputeMeasuredCapacity(s, Facts(2, 2, 32));
  EXPECT_FALSE(c.prefill.requests_per_s.has_value());
  EXPECT_FALSE(c.handoff.requests_per_s.has_value());
  EXPECT_FALSE(c.decode.requests_per_s.has_value());
  EXPECT_EQ(c.prefill.basis, "no data: prefill tokens/s, uncached prompt tokens");
  EXPECT_EQ(c.handoff.basis, "no data: handoff bytes/s, KV bytes per request");
  EXPECT_EQ(c.decode.basis, "no data: decode history tokens, output length");
  EXPECT_FALSE(c.bottleneck.has_value());
  EXPECT_FALSE(c.complete);
  EXPECT_FALSE(c.prefill_workers_needed.has_value());
  EXPECT_THAT(FormatMeasuredCapacity(c), HasSubstr("bottleneck: no data"));
}

TEST(MeasuredInputsTest, APullIsMeasuredOnItsLinkAndOtherwiseEveryLinksMeanStandsIn) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));
  EXPECT_FALSE(m.LinkBytesPerS("p0", "p1").has_data());
  m.RecordHandoff("p0", "d0", 4e6, 1e-3);  // 4 GB/s
  m.RecordHandoff("p1", "d0", 2e6, 1e-3);  // 2 GB/s
  EXPECT_DOUBLE_EQ(*m.LinkBytesPerS("p0", "p1").value, 3e9) << "no pull measured: the links' mean";
  m.RecordLink("p0", "p1", 1e6, 1e-3);
  EXPECT_DOUBLE_EQ(*m.LinkBytesPerS("p0", "p1").value, 1e9);
  EXPECT_DOUBLE_EQ(*m.LinkBytesPerS("p0", "d0").value, 4e9);
  // A pull is not a handoff: the mean handoff size is the handoffs' alone.
  EXPECT_DOUBLE_EQ(*m.Snapshot().handoff_bytes.value, 3e6);
}

TEST(MeasuredInputsTest, ThePrefixCacheIsMeasuredByTierAsSharesOfThePrompt) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));
  EXPECT_EQ(FormatSnapshot(m.Snapshot()).find("prefix cache by tier"), std::string::npos) << "no data: no line";
  m.RecordPrefill("p0", 400, 100, 0.1);
  m.RecordPrefixTiers(100, 200);
  const MeasuredSnapshot s = m.Snapshot();
  EXPECT_DOUBLE_EQ(*s.pool_cached_tokens.value, 100);
  EXPECT_DOUBLE_EQ(*s.tier2_cached_tokens.value, 200);
  EXPECT_NE(FormatSnapshot(s).find("prefix cache by tier: 25.0% of prompt tokens from the pools, 50.0% read back "
                                   "from second tiers (1 samples)"),
            std::string::npos)
      << FormatSnapshot(s);
}

TEST(MeasuredInputsTest, EarlySamplesArePlainMeansThenWeighted) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));  // alpha 0.1: the first 10 samples are a plain mean
  m.RecordFinished(100);
  EXPECT_DOUBLE_EQ(*m.Snapshot().output_tokens.value, 100);  // the first sample is the value
  m.RecordFinished(200);
  EXPECT_DOUBLE_EQ(*m.Snapshot().output_tokens.value, 150);
  for (int i = 0; i < 8; ++i) m.RecordFinished(150);
  EXPECT_DOUBLE_EQ(*m.Snapshot().output_tokens.value, 150);
  m.RecordFinished(250);  // the 11th sample has weight 0.1
  EXPECT_DOUBLE_EQ(*m.Snapshot().output_tokens.value, 160);
  EXPECT_EQ(m.Snapshot().output_tokens.samples, 11);

  // A rate is a ratio of means: 1,000 tokens in 1 s and 3,000 in 0.5 s is
  // 4,000 tokens in 1.5 s, not the mean of 1,000/s and 6,000/s.
  m.RecordPrefill("p0", 1000, 1000, 1.0);
  m.RecordPrefill("p0", 3000, 3000, 0.5);
  EXPECT_DOUBLE_EQ(*m.Snapshot().prefill[0].tokens_per_s.value, 4000 / 1.5);
  // Meaningless samples are ignored.
  m.RecordPrefill("p0", 1000, 0, 1.0);   // a full cache hit
  m.RecordPrefill("p0", 1000, 10, 0.0);  // no time
  m.RecordDecodeStep("d0", 0, 100, 0.01);
  m.RecordHandoff("p0", "d0", 0, 0.01);
  const MeasuredSnapshot s = m.Snapshot();
  EXPECT_EQ(s.prefill[0].tokens_per_s.samples, 2);
  EXPECT_TRUE(s.decode.empty());
  EXPECT_TRUE(s.links.empty());
}

TEST(MeasuredInputsTest, AgesFollowTheClock) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));
  m.RecordPrefill("p0", 500, 400, 0.1);
  clock.now += absl::Seconds(3);
  m.RecordFinished(10);
  clock.now += absl::Milliseconds(1500);
  const MeasuredSnapshot s = m.Snapshot();
  EXPECT_EQ(s.taken, clock.now);
  EXPECT_EQ(*s.prefill[0].tokens_per_s.age, absl::Milliseconds(4500));
  EXPECT_EQ(*s.prefill[0].buckets[0].tokens_per_s.age, absl::Milliseconds(4500));
  EXPECT_EQ(*s.uncached_prompt_tokens.age, absl::Milliseconds(4500));
  EXPECT_EQ(*s.output_tokens.age, absl::Milliseconds(1500));
  EXPECT_EQ(FormatMeasuredValue(s.output_tokens, 1), "10.0 (1 samples, 1.5 s ago)");
}

// Prefix-cache hits and misses of the same prompt length cost very
// different times: the speed for a prediction comes from prefills that
// computed about as many tokens, not from the prompt length.
TEST(MeasuredInputsTest, HitsAndMissesOfOnePromptLengthAreMeasuredApart) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));
  // Truth: 4 ms per prefill plus 8,000 tokens/s; 416-token prompts, half
  // of them with 384 tokens cached.
  auto seconds = [](int64_t computed) { return 0.004 + static_cast<double>(computed) / 8000; };
  for (int i = 0; i < 100; ++i) {
    const int64_t uncached = i % 2 == 0 ? 416 : 32;
    m.RecordPrefill("p0", 416, uncached, seconds(uncached));
    clock.now += absl::Milliseconds(10);
  }
  ExpectWithin(*m.PrefillTokensPerS("p0", 416).value, 416 / seconds(416), 0.01);
  ExpectWithin(*m.PrefillTokensPerS("p0", 32).value, 32 / seconds(32), 0.01);
  // So the predicted prefill time of each is right, where one figure for
  // 416-token prompts would be off by 2x for one kind or the other.
  ExpectWithin(416 / *m.PrefillTokensPerS("p0", 416).value, seconds(416), 0.01);
  ExpectWithin(32 / *m.PrefillTokensPerS("p0", 32).value, seconds(32), 0.01);
}

TEST(MeasuredInputsTest, PrefillThroughputConvergesPerWorkerAndBucket) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));
  Noise noise(0.1);
  std::mt19937 rng(11);
  std::uniform_int_distribution<int64_t> prompt(64, 4095);
  // Truth: p0 4,000 tokens/s, p1 6,000 tokens/s; a third of each prompt cached.
  const std::pair<std::string, double> workers[] = {{"10.0.0.1:7000", 4000}, {"10.0.0.2:7000", 6000}};
  for (int i = 0; i < 400; ++i) {
    for (const auto& [worker, tps] : workers) {
      const int64_t p = prompt(rng);
      const int64_t uncached = p - p / 3;
      m.RecordPrefill(worker, p, uncached, static_cast<double>(uncached) / tps * noise());
      clock.now += absl::Milliseconds(50);
    }
  }
  const MeasuredSnapshot s = m.Snapshot();
  ASSERT_EQ(s.prefill.size(), 2u);
  for (size_t w = 0; w < 2; ++w) {
    const PrefillWorkerReading& r = s.prefill[w];
    EXPECT_EQ(r.worker, workers[w].first);
    ExpectWithin(*r.tokens_per_s.value, workers[w].second, 0.05);
    EXPECT_EQ(r.tokens_per_s.samples, 400);
    int64_t bucket_samples = 0;
    for (const PrefillBucketReading& b : r.buckets) {
      bucket_samples += b.tokens_per_s.samples;
      EXPECT_EQ(b.uncached_tokens.max + 1, 2 * b.uncached_tokens.min);  // power-of-two buckets
      ExpectWithin(*b.tokens_per_s.value, workers[w].second, 0.1);
    }
    EXPECT_EQ(bucket_samples, 400);
    // Bucketed by the tokens computed: 43 (64 - 21 cached) to 2,730.
    EXPECT_EQ(r.buckets.front().uncached_tokens.min, 32);
    EXPECT_EQ(r.buckets.back().uncached_tokens.max, 4095);
  }
  EXPECT_EQ(*s.prefill[0].tokens_per_s.age, absl::Milliseconds(100));  // p1 came after it
  EXPECT_EQ(*s.prefill[1].tokens_per_s.age, absl::Milliseconds(50));
  EXPECT_EQ(s.uncached_prompt_tokens.samples, 800);
  EXPECT_EQ(s.prompt_tokens.samples, 800);
  EXPECT_GT(*s.prompt_tokens.value, *s.uncached_prompt_tokens.value);
  // A bucket when sampled, else the worker's overall figure.
  ExpectWithin(*m.PrefillTokensPerS("10.0.0.2:7000", 3000).value, 6000, 0.1);
  EXPECT_EQ(m.PrefillTokensPerS("10.0.0.2:7000", 3000).samples, s.prefill[1].buckets.back().tokens_per_s.samples);
  EXPECT_EQ(m.PrefillTokensPerS("10.0.0.2:7000", 100'000).samples, 400);
  EXPECT_EQ(m.PrefillTokensPerS("10.0.0.2:7000", 3000, 1000).samples, 400);  // the bucket has too few
}

// Truth for the decode tests: t(B) = 10 ms + 0.3 ms * B at ~800 history.
double TrueStep(int64_t batch) { return 0.010 + 0.0003 * static_cast<double>(batch); }

void FeedDecode(MeasuredInputs& m, FakeClock& clock, const std::string& worker, const std::vector<int64_t>& batches,
                int rounds, Noise& noise) {
  for (int i = 0; i < rounds; ++i) {
    for (int64_t b : batches) {
      m.RecordDecodeStep(worker, b, 800 * noise(), TrueStep(b) * noise());
      clock.now += absl::Milliseconds(20);
    }
  }
}

TEST(MeasuredInputsTest, DecodeStepConvergesPerBucketAndCapacityFollows) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));
  Noise noise(0.1);
  FeedDecode(m, clock, "d0", {8, 32}, 300, noise);
  for (int i = 0; i < 200; ++i) m.RecordFinished(static_cast<int64_t>(std::llround(200 * noise())));
  const MeasuredSnapshot s = m.Snapshot();
  ASSERT_EQ(s.decode.size(), 1u);
  ASSERT_EQ(s.decode[0].buckets.size(), 2u);  // history 512-1023, batches 8-15 and 32-63
  for (const DecodeBucketReading& b : s.decode[0].buckets) {
    EXPECT_EQ(b.history_tokens.min, 512);
    EXPECT_EQ(b.step_s.samples, 300);
    ExpectWithin(*b.step_s.value, TrueStep(b.batch.min), 0.05);
    EXPECT_DOUBLE_EQ(b.mean_batch, static_cast<double>(b.batch.min));
  }
  ExpectWithin(*s.decode_history_tokens.value, 800, 0.05);
  EXPECT_EQ(s.decode_history_tokens.samples, 600);
  ExpectWithin(*s.output_tokens.value, 200, 0.05);

  // At a measured batch: 3 workers x 32 / (19.6 ms x 200) = 24.5 req/s.
  const PoolFacts facts = Facts(1, 3, 32);
  const MeasuredCapacity at32 = ComputeMeasuredCapacity(s, facts);
  ExpectWithin(*at32.decode.requests_per_s, 3 * 32 / (TrueStep(32) * 200), 0.06);
  EXPECT_EQ(at32.decode.samples, 200);  // the output lengths are the scarcest input
  EXPECT_THAT(at32.decode.basis, Not(HasSubstr("fitted")));
  // Beyond the measured batches, from the affine fit: t(64) = 29.2 ms.
  PoolFacts big = facts;
  big.decode_batch = 64;
  const MeasuredCapacity at64 = ComputeMeasuredCapacity(s, big);
  ExpectWithin(*at64.decode.requests_per_s_per_unit, 64 / (TrueStep(64) * 200), 0.06);
  EXPECT_THAT(at64.decode.basis, HasSubstr("fitted"));
  // One measured batch cannot be extrapolated.
  MeasuredInputs one(Options(clock));
  FeedDecode(one, clock, "d0", {8}, 50, noise);
  one.RecordFinished(200);
  const MeasuredCapacity none = ComputeMeasuredCapacity(one.Snapshot(), big);
  EXPECT_FALSE(none.decode.requests_per_s.has_value());
  EXPECT_EQ(none.decode.basis, "no data: decode step time at batch 64, history 512-1023 tokens");
}

TEST(MeasuredInputsTest, HandoffBandwidthConvergesPerLink) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));
  Noise noise(0.1);
  // 1 GB/s on p0->d0, 2 GB/s on p0->d1; 2 MB of KV per request.
  for (int i = 0; i < 300; ++i) {
    const double bytes = 2e6 * noise();
    m.RecordHandoff("p0", "d0", bytes, bytes / 1e9 * noise());
    m.RecordHandoff("p0", "d1", bytes, bytes / 2e9 * noise());
    clock.now += absl::Milliseconds(10);
  }
  const MeasuredSnapshot s = m.Snapshot();
  ASSERT_EQ(s.links.size(), 2u);
  EXPECT_EQ(s.links[0].decode_worker, "d0");
  ExpectWithin(*s.links[0].bytes_per_s.value, 1e9, 0.05);
  ExpectWithin(*s.links[1].bytes_per_s.value, 2e9, 0.05);
  EXPECT_EQ(s.links[1].bytes_per_s.samples, 300);
  ExpectWithin(*s.handoff_bytes.value, 2e6, 0.05);

  // min(2, 3) links x 1.5 GB/s / 2 MB = 1,500 req/s; a given KV size wins.
  const MeasuredCapacity c = ComputeMeasuredCapacity(s, Facts(2, 3, 8));
  ExpectWithin(*c.handoff.requests_per_s, 1500, 0.06);
  PoolFacts given_kv = Facts(2, 3, 8);
  given_kv.kv_bytes_per_request = 3e6;
  const MeasuredCapacity given = ComputeMeasuredCapacity(s, given_kv);
  ExpectWithin(*given.handoff.requests_per_s, 1000, 0.06);
  EXPECT_THAT(given.handoff.basis, HasSubstr("(given)"));
}

TEST(MeasuredInputsTest, ArrivalRateOverTheSlidingWindow) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));  // 10 s window
  Noise jitter(0.5);
  // 12 req/s on average: gaps of 1/12 s +-50%.
  const absl::Time start = clock.now;
  m.RecordArrival();
  int64_t arrivals = 1;
  while (clock.now - start < absl::Seconds(4)) {
    clock.now += absl::Seconds(1.0 / 12 * jitter());
    m.RecordArrival();
    ++arrivals;
  }
  // Before one window has passed: counted over the time since the first.
  MeasuredValue early = m.Snapshot().arrival_rate;
  EXPECT_EQ(early.samples, arrivals);
  ExpectWithin(*early.value, 12, 0.1);
  while (clock.now - start < absl::Seconds(60)) {
    clock.now += absl::Seconds(1.0 / 12 * jitter());
    m.RecordArrival();
  }
  MeasuredValue full = m.Snapshot().arrival_rate;
  ExpectWithin(*full.value, 12, 0.1);
  EXPECT_NEAR(full.samples, 120, 12);
  EXPECT_DOUBLE_EQ(*full.value, static_cast<double>(full.samples) / 10);
  EXPECT_EQ(*full.age, absl::ZeroDuration());
  // The load doubles: within one window the rate shows it.
  for (int i = 0; i < 240; ++i) {
    clock.now += absl::Seconds(1.0 / 24);
    m.RecordArrival();
  }
  ExpectWithin(*m.Snapshot().arrival_rate.value, 24, 0.02);
  // Quiet for 20 s: nothing in the window, and the age says since when.
  clock.now += absl::Seconds(20);
  const MeasuredValue quiet = m.Snapshot().arrival_rate;
  EXPECT_EQ(*quiet.value, 0);
  EXPECT_EQ(quiet.samples, 0);
  EXPECT_EQ(*quiet.age, absl::Seconds(20));
}

TEST(MeasuredInputsTest, StageCapacitiesBottleneckAndPoolSizing) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));
  Noise noise(0.1);
  // Truth: prefill 4,000 tokens/s per worker over 1,000 uncached tokens =
  // 4 req/s per worker; decode 32 / (19.6 ms x 200) = 8.16 req/s per worker;
  // handoff 1 GB/s / 2 MB = 500 req/s per link. Arrivals at 10 req/s.
  for (int i = 0; i < 300; ++i) {
    for (const char* p : {"p0", "p1"}) m.RecordPrefill(p, 1500, 1000, 1000 / 4000.0 * noise());
    m.RecordHandoff("p0", "d0", 2e6, 2e6 / 1e9 * noise());
    m.RecordDecodeStep("d0", 32, 800 * noise(), TrueStep(32) * noise());
    m.RecordFinished(200);
    m.RecordArrival();
    clock.now += absl::Milliseconds(100);
  }
  const MeasuredSnapshot s = m.Snapshot();
  const MeasuredCapacity c = ComputeMeasuredCapacity(s, Facts(2, 2, 32));
  ExpectWithin(*c.prefill.requests_per_s, 8, 0.05);
  ExpectWithin(*c.prefill.requests_per_s_per_unit, 4, 0.05);
  ExpectWithin(*c.decode.requests_per_s, 2 * 32 / (TrueStep(32) * 200), 0.05);
  ExpectWithin(*c.handoff.requests_per_s, 1000, 0.05);
  EXPECT_EQ(c.prefill.samples, 600);  // both workers' samples
  EXPECT_THAT(c.prefill.basis, HasSubstr("2 workers x"));
  ASSERT_TRUE(c.bottleneck.has_value());
  EXPECT_EQ(*c.bottleneck, capacity::Stage::kPrefill);
  EXPECT_TRUE(c.complete);
  EXPECT_DOUBLE_EQ(*c.system_requests_per_s, *c.prefill.requests_per_s);
  ExpectWithin(*c.arrival_rate.value, 10, 0.05);
  // 10 req/s takes 3 prefill workers (2.5), 2 decode workers (1.2) and 1 link.
  EXPECT_EQ(c.prefill_workers_needed, 3);
  EXPECT_EQ(c.decode_workers_needed, 2);
  EXPECT_EQ(c.handoff_links_needed, 1);
  const std::string text = FormatMeasuredCapacity(c);
  EXPECT_THAT(text, HasSubstr("bottleneck: prefill at"));
  EXPECT_THAT(text, HasSubstr("3 prefill workers, 2 decode workers, 1 concurrent handoff links"));
  EXPECT_THAT(FormatSnapshot(s), HasSubstr("handoff p0 -> d0 bytes/s: "));

  // With the decode stage unknown the known minimum is still reported, as
  // an upper bound.
  const MeasuredCapacity partial = ComputeMeasuredCapacity(s, Facts(2, 2, 1024));
  EXPECT_FALSE(partial.decode.requests_per_s.has_value());
  EXPECT_EQ(*partial.bottleneck, capacity::Stage::kPrefill);
  EXPECT_FALSE(partial.complete);
  EXPECT_THAT(FormatMeasuredCapacity(partial), HasSubstr("an upper bound"));
}

TEST(MeasuredInputsTest, ForgetWorkerDropsItsReadingsAndLinks) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));
  m.RecordPrefill("p0", 100, 100, 0.1);
  m.RecordPrefill("p1", 100, 100, 0.1);
  m.RecordDecodeStep("d0", 4, 100, 0.01);
  m.RecordHandoff("p0", "d0", 1e6, 0.001);
  m.RecordHandoff("p1", "d0", 1e6, 0.001);
  m.ForgetWorker("p0");
  const MeasuredSnapshot s = m.Snapshot();
  ASSERT_EQ(s.prefill.size(), 1u);
  EXPECT_EQ(s.prefill[0].worker, "p1");
  ASSERT_EQ(s.links.size(), 1u);
  EXPECT_EQ(s.links[0].prefill_worker, "p1");
  EXPECT_EQ(s.decode.size(), 1u);
}

TEST(MeasuredInputsTest, ConcurrentRecordersLoseNoSamples) {
  FakeClock clock;
  MeasuredInputs m(Options(clock));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&m, t] {
      const std::string worker = "p" + std::to_string(t % 2);
      for (int i = 0; i < 1000; ++i) {
        m.RecordPrefill(worker, 1000, 1000, 0.25);
        m.RecordFinished(100);
        if (i % 100 == 0) m.Snapshot();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const MeasuredSnapshot s = m.Snapshot();
  EXPECT_EQ(s.output_tokens.samples, 4000);
  EXPECT_EQ(s.prefill[0].tokens_per_s.samples + s.prefill[1].tokens_per_s.samples, 4000);
  EXPECT_DOUBLE_EQ(*s.prefill[0].tokens_per_s.value, 4000);
}

TEST(MeasuredFormatTest, NumbersHaveThousandsSeparators) {
  EXPECT_EQ(FormatNumber(9000, 0), "9,000");
  EXPECT_EQ(FormatNumber(4000.5, 1), "4,000.5");
  EXPECT_EQ(FormatNumber(1234567, 0), "1,234,567");
  EXPECT_EQ(FormatNumber(-1234.25, 2), "-1,234.25");
  EXPECT_EQ(FormatNumber(999, 0), "999");
  EXPECT_EQ(FormatNumber(-0.001, 1), "0.0");
  EXPECT_EQ(PowerOfTwoBucket(1000).min, 512);
  EXPECT_EQ(PowerOfTwoBucket(1000).max, 1023);
  EXPECT_EQ(PowerOfTwoBucket(1).min, 0);
}

// What the autoscalers read: a pool size only once both the stage and the
// arrival rate rest on enough samples; the metric is then present, before
// that absent (not NaN).
TEST(RecommendedWorkersTest, AbsentUntilTheInputsHaveEnoughSamples) {
  MeasuredCapacity c;
  EXPECT_EQ(RecommendedWorkers(c, capacity::Stage::kPrefill, 20), std::nullopt);
  c.prefill_workers_needed = 3;
  c.decode_workers_needed = 5;
  c.prefill.samples = 25;
  c.decode.samples = 19;
  c.arrival_rate.samples = 40;
  EXPECT_EQ(RecommendedWorkers(c, capacity::Stage::kPrefill, 20), 3);
  EXPECT_EQ(RecommendedWorkers(c, capacity::Stage::kDecode, 20), std::nullopt);  // 19 < 20
  EXPECT_EQ(RecommendedWorkers(c, capacity::Stage::kDecode, 19), 5);
  c.arrival_rate.samples = 10;
  EXPECT_EQ(RecommendedWorkers(c, capacity::Stage::kPrefill, 20), std::nullopt);

  MetricsRegistry m;
  std::optional<double> v;
  m.AddOptionalGauge("pdserve_recommended_workers", "h", [&v] { return v; }, "pool=\"prefill\"");
  EXPECT_EQ(m.Render().find("pdserve_recommended_workers{"), std::string::npos) << m.Render();
  v = 3;
  EXPECT_NE(m.Render().find("pdserve_recommended_workers{pool=\"prefill\"} 3\n"), std::string::npos) << m.Render();
}

}  // namespace
}  // namespace pdserve::router
