#include "base/health.h"

#include "gtest/gtest.h"

namespace pdserve {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

HealthInputs Inputs(bool idle, int32_t used, absl::Time beat) {
  HealthInputs in;
  in.idle = idle;
  in.kv_blocks_used = used;
  in.transport_beat = beat;
  return in;
}

TEST(HealthJudgeTest, BusyWorkerHoldingBlocksServes) {
  HealthJudge j({.leak_grace = absl::Seconds(2), .wedge_after = absl::Seconds(5)});
  for (int s = 0; s < 10; ++s) {
    const absl::Time now = kT0 + absl::Seconds(s);
    EXPECT_EQ(j.Judge(Inputs(false, 40, now), now), "");
  }
}

TEST(HealthJudgeTest, IdleWorkerHoldingBlocksPastTheGraceLeaks) {
  HealthJudge j({.leak_grace = absl::Seconds(2), .wedge_after = absl::Seconds(5)});
  EXPECT_EQ(j.Judge(Inputs(true, 3, kT0), kT0), "");
  EXPECT_EQ(j.Judge(Inputs(true, 3, kT0 + absl::Seconds(1)), kT0 + absl::Seconds(1)), "");
  const std::string why = j.Judge(Inputs(true, 3, kT0 + absl::Seconds(2)), kT0 + absl::Seconds(2));
  EXPECT_NE(why.find("KV pool leak: 3 blocks"), std::string::npos) << why;
}

TEST(HealthJudgeTest, WorkInBetweenRestartsTheLeakClock) {
  HealthJudge j({.leak_grace = absl::Seconds(2), .wedge_after = absl::Seconds(5)});
  EXPECT_EQ(j.Judge(Inputs(true, 3, kT0), kT0), "");
  const absl::Time t1 = kT0 + absl::Milliseconds(1500);
  EXPECT_EQ(j.Judge(Inputs(false, 3, t1), t1), "");  // A request came: the blocks may be its.
  const absl::Time t2 = kT0 + absl::Seconds(3);
  EXPECT_EQ(j.Judge(Inputs(true, 3, t2), t2), "");
  const absl::Time t3 = t2 + absl::Seconds(2);
  EXPECT_NE(j.Judge(Inputs(true, 3, t3), t3), "");
  // Once the blocks come back the worker serves again.
  EXPECT_EQ(j.Judge(Inputs(true, 0, t3), t3), "");
}

TEST(HealthJudgeTest, StaleTransportBeatIsWedged) {
  HealthJudge j({.leak_grace = absl::Seconds(2), .wedge_after = absl::Seconds(5)});
  EXPECT_EQ(j.Judge(Inputs(true, 0, kT0), kT0 + absl::Seconds(4)), "");
  const std::string why = j.Judge(Inputs(true, 0, kT0), kT0 + absl::Seconds(6));
  EXPECT_NE(why.find("wedged"), std::string::npos) << why;
}

TEST(HealthJudgeTest, DrainingIsNotServing) {
  HealthJudge j;
  HealthInputs in = Inputs(true, 0, kT0);
  in.draining = true;
  EXPECT_EQ(j.Judge(in, kT0), "draining");
}

TEST(HealthJudgeTest, TransportThatCannotHandOffIsNotServingWithItsReason) {
  HealthJudge j;
  HealthInputs in = Inputs(true, 0, kT0);
  in.transport_error = "KV handoff self-check over 127.0.0.1:5 failed: no answer within 5s";
  EXPECT_EQ(j.Judge(in, kT0), in.transport_error);
  in.transport_error.clear();  // A re-check passed.
  EXPECT_EQ(j.Judge(in, kT0), "");
}

}  // namespace
}  // namespace pdserve
