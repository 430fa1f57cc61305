#include "tests/chaos/verdict.h"

#include <vector>

#include "gtest/gtest.h"

namespace pdserve::chaos {
namespace {

Reference Want() { return {{10, 11, 12, 13, 14, 15, 16, 17}, "abcdefgh", v1::FINISH_REASON_LENGTH}; }

Observed Got(std::vector<int32_t> tokens, std::string text = "abcdefgh",
             v1::FinishReason finish = v1::FINISH_REASON_LENGTH) {
  Observed o;
  o.tokens = std::move(tokens);
  o.text = std::move(text);
  o.has_final = true;
  o.final.set_finish_reason(finish);
  return o;
}

TEST(VerdictTest, TheReferenceStreamIsCompleted) {
  const Verdict v = Judge(Got({10, 11, 12, 13, 14, 15, 16, 17}), Want());
  EXPECT_TRUE(v.completed()) << v.detail;
}

TEST(VerdictTest, ErrorStatusIsLost) {
  Observed o = Got({10, 11});
  o.status = grpc::Status(grpc::StatusCode::UNAVAILABLE, "no healthy decode worker");
  const Verdict v = Judge(o, Want());
  EXPECT_TRUE(v.lost);
  EXPECT_FALSE(v.mismatched);
  EXPECT_NE(v.detail.find("no healthy decode worker"), std::string::npos);
}

TEST(VerdictTest, ErrorOrCancelledFinishOrNoFinalIsLost) {
  EXPECT_TRUE(Judge(Got({10}, "a", v1::FINISH_REASON_ERROR), Want()).lost);
  EXPECT_TRUE(Judge(Got({10}, "a", v1::FINISH_REASON_CANCELLED), Want()).lost);
  Observed o = Got({10});
  o.has_final = false;
  EXPECT_TRUE(Judge(o, Want()).lost);
}

TEST(VerdictTest, AReplayedWindowCountsItsTokens) {
  // Positions 2 and 3 sent again after a migration, then the rest.
  const Verdict v = Judge(Got({10, 11, 12, 13, 12, 13, 14, 15, 16, 17}, "abcdcdefgh"), Want());
  EXPECT_EQ(v.duplicated_tokens, 2);
  EXPECT_FALSE(v.mismatched) << v.detail;
  EXPECT_FALSE(v.completed());
}

TEST(VerdictTest, TwoReplaysAndALostTailAreAllSeen) {
  std::vector<int32_t> rest;
  EXPECT_EQ(DuplicatedTokens({10, 11, 10, 11, 12, 13, 14, 13, 14, 15}, Want().tokens, &rest), 4);
  EXPECT_EQ(rest, (std::vector<int32_t>{10, 11, 12, 13, 14, 15}));
  // The stream ended inside a replay: what was repeated still counts.
  EXPECT_EQ(DuplicatedTokens({10, 11, 12, 13, 11}, Want().tokens), 1);
}

TEST(VerdictTest, SurplusPastTheEndCounts) {
  const Verdict v = Judge(Got({10, 11, 12, 13, 14, 15, 16, 17, 99, 98}, "abcdefghxy"), Want());
  EXPECT_EQ(v.duplicated_tokens, 2);
  EXPECT_FALSE(v.mismatched) << v.detail;
}

TEST(VerdictTest, ADifferentTokenIsAMismatchNotARepeat) {
  // 11 equals an earlier token, but the stream does not go on as the reference.
  const Verdict v = Judge(Got({10, 11, 12, 11, 40, 41, 42, 43}), Want());
  EXPECT_EQ(v.duplicated_tokens, 0);
  EXPECT_TRUE(v.mismatched);
  EXPECT_NE(v.detail.find("token 3"), std::string::npos) << v.detail;
}

TEST(VerdictTest, ShortStreamWrongTextOrFinishIsAMismatch) {
  EXPECT_TRUE(Judge(Got({10, 11, 12}), Want()).mismatched);
  EXPECT_TRUE(Judge(Got(Want().tokens, "abcdefgX"), Want()).mismatched);
  EXPECT_TRUE(Judge(Got(Want().tokens, "abcdefgh", v1::FINISH_REASON_STOP), Want()).mismatched);
}

TEST(VerdictTest, ALostStreamIsJudgedOnItsPrefix) {
  Observed ok_prefix = Got({10, 11, 12});
  ok_prefix.status = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline");
  EXPECT_FALSE(Judge(ok_prefix, Want()).mismatched);
  Observed bad_prefix = Got({10, 77});
  bad_prefix.status = grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "deadline");
  EXPECT_TRUE(Judge(bad_prefix, Want()).mismatched);
}

}  // namespace
}  // namespace pdserve::chaos
