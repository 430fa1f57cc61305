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
  for (const char* p : {"least_loaded", "round_robin"}) {
    absl::StatusOr<std::unique_ptr<Selector>> s = MakeSelector(p);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ((*s)->name(), p);
  }
  absl::StatusOr<std::unique_ptr<Selector>> bad = MakeSelector("random");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("least_loaded or round_robin"), std::string::npos);
}

}  // namespace
}  // namespace pdserve::router
