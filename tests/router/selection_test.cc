#include "router/selection.h"

#include <vector>

#include "gtest/gtest.h"

namespace pdserve::router {
namespace {

std::vector<SelectionCandidate> Candidates(std::vector<int64_t> loads) {
  static const char* kNames[] = {"a:1", "b:1", "c:1", "d:1"};
  std::vector<SelectionCandidate> out;
  for (size_t i = 0; i < loads.size(); ++i) out.push_back({kNames[i], loads[i]});
  return out;
}

TEST(SelectionTest, LeastLoadedTakesTheSmallestLoadTiesToTheFirst) {
  LeastLoadedSelector s;
  EXPECT_EQ(s.Select(Candidates({5, 2, 9})), 1u);
  EXPECT_EQ(s.Select(Candidates({3, 3, 3})), 0u);
  EXPECT_EQ(s.Select(Candidates({4, 1, 1})), 1u);
  EXPECT_EQ(s.Select(Candidates({7})), 0u);
}

TEST(SelectionTest, RoundRobinCyclesWhateverTheLoads) {
  RoundRobinSelector s;
  const std::vector<SelectionCandidate> c = Candidates({0, 100, 5});
  std::vector<size_t> got;
  for (int i = 0; i < 6; ++i) got.push_back(s.Select(c));
  EXPECT_EQ(got, (std::vector<size_t>{0, 1, 2, 0, 1, 2}));
  // A smaller pool (one worker ejected) stays in range.
  EXPECT_LT(s.Select(Candidates({1, 1})), 2u);
}

TEST(SelectionTest, MakeSelectorNamesTheChoices) {
  for (const char* p : {"prefix_aware", "least_loaded", "round_robin"}) {
    absl::StatusOr<std::unique_ptr<Selector>> s = MakeSelector(p);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ((*s)->name(), p);
  }
  absl::StatusOr<std::unique_ptr<Selector>> bad = MakeSelector("random");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("prefix_aware, least_loaded or round_robin"), std::string::npos);
}

SelectionCandidate Prefill(const char* name, int64_t queued, int64_t cached, int64_t uncached, double speed) {
  SelectionCandidate c;
  c.address = name;
  c.load = queued;
  c.cached_tokens = cached;
  c.uncached_tokens = uncached;
  c.tokens_per_s = speed;
  return c;
}

TEST(SelectionTest, PrefixAwarePrefillPicksTheLowestEstimatedTimeToFirstToken) {
  PrefixAwareSelector s(Pool::kPrefill);
  // b holds 960 of the 1,024-token prompt: 64 to compute against 1,024.
  EXPECT_EQ(s.Select({Prefill("a", 0, 0, 1024, 2000), Prefill("b", 0, 960, 64, 2000)}), 1u);
  // ... unless b's queue outweighs the saving: a: 1,024 / 2,000 = 0.51 s,
  // b: (2,000 + 64) / 2,000 = 1.03 s.
  EXPECT_EQ(s.Select({Prefill("a", 0, 0, 1024, 2000), Prefill("b", 2000, 960, 64, 2000)}), 0u);
  // Speed counts: the same work on a worker twice as fast.
  EXPECT_EQ(s.Select({Prefill("a", 500, 0, 500, 1000), Prefill("b", 900, 0, 500, 2000)}), 1u);
  // An unmeasured worker is costed at the mean measured speed: b (900 +
  // 500) / 1,000 against a's 1,000 / 1,000.
  EXPECT_EQ(s.Select({Prefill("a", 500, 0, 500, 1000), Prefill("b", 900, 0, 500, 0)}), 0u);
  // Equal cost: the one with more cached goes first.
  EXPECT_EQ(s.Select({Prefill("a", 64, 0, 64, 1000), Prefill("b", 0, 64, 128, 1000)}), 1u);
}

TEST(SelectionTest, PrefixAwareCostTermsAreTheDocumentedOnes) {
  SelectionCandidate c = Prefill("a", 300, 700, 200, 1000);
  EXPECT_DOUBLE_EQ(EstimatedPrefillSeconds(c, 123), 0.5);
  // The queue drains at the worker's overall speed: 300 / 3,000 + 200 / 1,000.
  c.queue_tokens_per_s = 3000;
  EXPECT_DOUBLE_EQ(EstimatedPrefillSeconds(c, 123), 0.3);
  EXPECT_DOUBLE_EQ(EstimatedPrefillSeconds(Prefill("a", 300, 0, 200, 0), 250), 2.0);
  EXPECT_DOUBLE_EQ(FallbackTokensPerS({Prefill("a", 0, 0, 0, 1000), Prefill("b", 0, 0, 0, 3000),
                                       Prefill("c", 0, 0, 0, 0)}),
                   2000);
  EXPECT_DOUBLE_EQ(FallbackTokensPerS({Prefill("a", 0, 0, 0, 0)}), 1.0);
}

SelectionCandidate Decode(const char* name, int64_t in_flight, int64_t cached, bool headroom) {
  SelectionCandidate c = Prefill(name, in_flight, cached, 0, 0);
  c.headroom = headroom;
  return c;
}

TEST(SelectionTest, PrefixAwareDecodePrefersHeadroomThenTheCachedContextWithinTheSlackThenLoad) {
  PrefixAwareSelector s(Pool::kDecode);
  static_assert(PrefixAwareSelector::kDecodeAffinitySlack == 2);
  // b holds the context and is within 2 sequences of the least loaded.
  EXPECT_EQ(s.Select({Decode("a", 1, 0, true), Decode("b", 3, 512, true)}), 1u);
  // ... but not 4 more: load wins.
  EXPECT_EQ(s.Select({Decode("a", 1, 0, true), Decode("b", 5, 512, true)}), 0u);
  // Headroom first.
  EXPECT_EQ(s.Select({Decode("a", 1, 0, true), Decode("b", 0, 512, false)}), 0u);
  // Same cached context: the fewer in flight.
  EXPECT_EQ(s.Select({Decode("a", 3, 64, true), Decode("b", 2, 64, true)}), 1u);
  // Nobody has headroom: the same rules among all.
  EXPECT_EQ(s.Select({Decode("a", 9, 512, false), Decode("b", 4, 0, false)}), 1u);
  EXPECT_EQ(s.Select({Decode("a", 5, 512, false), Decode("b", 4, 0, false)}), 0u);
}

}  // namespace
}  // namespace pdserve::router
