// The rebalance policy on a fake clock: a worker must stay hot for the
// sustain period before anything moves, a sequence moves at most once per
// window, what a worker received does not go straight back out, and a
// move that saves less than it costs is not made.
#include "router/rebalance.h"

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace pdserve::router {
namespace {

constexpr int64_t kBytesPerPosition = 36864;

DecodeLoad Worker(const std::string& address, double step_s, double kv_used = 0.2) {
  return {.address = address, .step_seconds = step_s, .kv_used_fraction = kv_used,
          .kv_bytes_per_position = kBytesPerPosition};
}

double NoLink(const std::string&, const std::string&) { return 0; }

class RebalanceTest : public ::testing::Test {
 protected:
  RebalancePolicy policy_{RebalanceOptions{.step_margin = 0.5,
                                           .kv_margin = 0.25,
                                           .sustain = absl::Seconds(3),
                                           .window = absl::Seconds(30),
                                           .switch_steps = 3,
                                           .default_bytes_per_s = 1e9}};
  absl::Time now_ = absl::FromUnixSeconds(1000);
  // a is hot (100 ms steps), b cool (20 ms).
  std::vector<DecodeLoad> workers_ = {Worker("a", 0.100), Worker("b", 0.020)};
  std::vector<SequenceLoad> seqs_ = {
      {.id = "s1", .worker = "a", .context = 512, .remaining = 400},
      {.id = "s2", .worker = "a", .context = 512, .remaining = 100},
      {.id = "s3", .worker = "b", .context = 512, .remaining = 400},
  };

  std::optional<MoveChoice> At(absl::Duration t) {
    return policy_.Decide(now_ + t, workers_, seqs_, NoLink);
  }
};

TEST_F(RebalanceTest, NothingMovesUntilTheWorkerHasBeenHotForTheSustainPeriod) {
  EXPECT_FALSE(At(absl::Seconds(0)).has_value());
  EXPECT_FALSE(At(absl::Seconds(2)).has_value());
  // One report below the margin restarts the count.
  workers_[0].step_seconds = 0.025;
  EXPECT_FALSE(At(absl::Seconds(2.5)).has_value());
  workers_[0].step_seconds = 0.100;
  EXPECT_FALSE(At(absl::Seconds(3)).has_value());
  EXPECT_FALSE(At(absl::Seconds(5.9)).has_value());
  const std::optional<MoveChoice> m = At(absl::Seconds(6));
  ASSERT_TRUE(m.has_value());
  // The sequence with the most left to gain, from the hot worker, towards the cool one.
  EXPECT_EQ(m->id, "s1");
  EXPECT_EQ(m->from, "a");
  EXPECT_EQ(m->to, "b");
  EXPECT_GT(m->saves_s, m->costs_s);
}

TEST_F(RebalanceTest, ASequenceMovesAtMostOncePerWindowAndEachMoveRestartsTheSustain) {
  ASSERT_FALSE(At(absl::Seconds(0)).has_value());
  ASSERT_EQ(At(absl::Seconds(3))->id, "s1");
  // The worker stays hot (its reports lag the move): the next move waits
  // a whole sustain period again.
  EXPECT_FALSE(At(absl::Seconds(4)).has_value());
  // s1 is still there in the reports (its move failed, say): it is not
  // chosen again within the window. s2 is: 100 tokens x 80 ms saved is
  // 8 s, far more than its transfer and switch cost.
  const std::optional<MoveChoice> next = At(absl::Seconds(6));
  ASSERT_TRUE(next.has_value());
  EXPECT_EQ(next->id, "s2");
  seqs_.erase(seqs_.begin() + 1);  // s2 left.
  for (int t = 9; t < 33; t += 3) EXPECT_FALSE(At(absl::Seconds(t)).has_value()) << "at " << t << " s";
  // Past the window from s1's move it may move again.
  const std::optional<MoveChoice> again = At(absl::Seconds(33));
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->id, "s1");
}

TEST_F(RebalanceTest, WhatAWorkerReceivedDoesNotGoStraightBack) {
  ASSERT_FALSE(At(absl::Seconds(0)).has_value());
  ASSERT_EQ(At(absl::Seconds(3))->to, "b");
  // The load flips: b is now the hot one, a the cool one.
  workers_ = {Worker("a", 0.020), Worker("b", 0.100)};
  for (int t = 4; t < 33; ++t) EXPECT_FALSE(At(absl::Seconds(t)).has_value()) << "ping-pong at " << t << " s";
  // After the window b may shed load like any worker.
  const std::optional<MoveChoice> later = At(absl::Seconds(34));
  ASSERT_TRUE(later.has_value());
  EXPECT_EQ(later->from, "b");
  EXPECT_EQ(later->id, "s3");
}

TEST_F(RebalanceTest, AMoveThatCostsMoreThanItSavesIsNotMade) {
  // A little left to generate, a long context over a slow link.
  seqs_ = {{.id = "short", .worker = "a", .context = 4096, .remaining = 2}};
  EXPECT_FALSE(At(absl::Seconds(0)).has_value());
  EXPECT_FALSE(At(absl::Seconds(10)).has_value());
  // Workers within the margin: nothing is hot.
  workers_ = {Worker("a", 0.029), Worker("b", 0.020)};
  seqs_ = {{.id = "long", .worker = "a", .context = 64, .remaining = 4000}};
  EXPECT_FALSE(At(absl::Seconds(20)).has_value());
  EXPECT_FALSE(At(absl::Seconds(30)).has_value());
}

TEST_F(RebalanceTest, KvPressureAloneMakesAWorkerHot) {
  workers_ = {Worker("a", 0.030, 0.95), Worker("b", 0.020, 0.30)};
  EXPECT_FALSE(At(absl::Seconds(0)).has_value());
  const std::optional<MoveChoice> m = At(absl::Seconds(3));
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->from, "a");
}

TEST_F(RebalanceTest, OneServingWorkerOrNoMeasuredStepMovesNothing) {
  workers_[1].serving = false;
  EXPECT_FALSE(At(absl::Seconds(0)).has_value());
  EXPECT_FALSE(At(absl::Seconds(10)).has_value());
  workers_[1].serving = true;
  workers_[1].step_seconds = 0;  // b has not decoded yet.
  EXPECT_FALSE(At(absl::Seconds(20)).has_value());
}

}  // namespace
}  // namespace pdserve::router
