#include "kernels/cpu/thread_collective.h"

#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pdserve::kernels::cpu {
namespace {

// Runs fn(rank) on one thread per rank and returns each rank's statuses.
void RunRanks(ThreadCollectiveGroup& group, const std::function<void(Collective&)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < group.size(); ++r) threads.emplace_back([&, r] { fn(group.rank(r)); });
  for (std::thread& t : threads) t.join();
}

float Value(int rank, int64_t i) { return static_cast<float>((i * 7 + rank * 13) % 101) * 0.37f - 11.0f / (rank + 1); }

class AllReduceTest : public testing::TestWithParam<int> {};

TEST_P(AllReduceTest, EveryRankHoldsTheRankOrderedSumBitForBit) {
  const int size = GetParam();
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{17}, int64_t{1000}, int64_t{100003}}) {
    ThreadCollectiveGroup group(size);
    std::vector<std::vector<float>> data(size, std::vector<float>(n));
    for (int r = 0; r < size; ++r) {
      for (int64_t i = 0; i < n; ++i) data[r][i] = Value(r, i);
    }
    std::vector<float> want(n);
    for (int64_t i = 0; i < n; ++i) {
      float s = Value(0, i);
      for (int r = 1; r < size; ++r) s += Value(r, i);
      want[i] = s;
    }
    RunRanks(group, [&](Collective& c) { ASSERT_TRUE(c.AllReduceSum(data[c.rank()].data(), n).ok()); });
    for (int r = 0; r < size; ++r) {
      ASSERT_EQ(std::memcmp(data[r].data(), want.data(), n * sizeof(float)), 0) << "rank " << r << " n " << n;
    }
  }
}

TEST_P(AllReduceTest, GatherAndBroadcastPlaceEveryRanksBytes) {
  const int size = GetParam();
  ThreadCollectiveGroup group(size);
  const size_t bytes = 37;  // Not a multiple of anything.
  std::vector<std::vector<char>> out(size, std::vector<char>(size * bytes, 0));
  std::vector<std::vector<char>> bcast(size, std::vector<char>(bytes, 0));
  RunRanks(group, [&](Collective& c) {
    const int r = c.rank();
    std::vector<char> mine(bytes);
    for (size_t i = 0; i < bytes; ++i) mine[i] = static_cast<char>(r * 31 + i);
    ASSERT_TRUE(c.AllGather(mine.data(), bytes, out[r].data()).ok());
    // In place: this rank's part already sits in its own slot.
    std::vector<char> in_place(size * bytes, 0);
    std::memcpy(in_place.data() + r * bytes, mine.data(), bytes);
    ASSERT_TRUE(c.AllGather(in_place.data() + r * bytes, bytes, in_place.data()).ok());
    EXPECT_EQ(in_place, out[r]);
    if (r == size - 1) bcast[r] = mine;
    ASSERT_TRUE(c.Broadcast(bcast[r].data(), bytes, size - 1).ok());
  });
  for (int r = 0; r < size; ++r) {
    for (int j = 0; j < size; ++j) {
      for (size_t i = 0; i < bytes; ++i) {
        ASSERT_EQ(out[r][j * bytes + i], static_cast<char>(j * 31 + i)) << "rank " << r << " slot " << j;
      }
    }
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(bcast[r][i], static_cast<char>((size - 1) * 31 + i));
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, AllReduceTest, testing::Values(1, 2, 3, 4, 8));

TEST(ThreadCollectiveTest, EightRanksOnFewCoresKeepGoing) {
  // More ranks than this machine's cores: waits must block, not spin forever.
  ThreadCollectiveGroup group(8);
  constexpr int kRounds = 2000;
  std::vector<std::vector<float>> data(8, std::vector<float>(64));
  RunRanks(group, [&](Collective& c) {
    for (int round = 0; round < kRounds; ++round) {
      std::fill(data[c.rank()].begin(), data[c.rank()].end(), 1.0f);
      ASSERT_TRUE(c.AllReduceSum(data[c.rank()].data(), 64).ok());
      ASSERT_EQ(data[c.rank()][63], 8.0f);
      ASSERT_TRUE(c.Barrier().ok());
    }
  });
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(group.stats(r).calls, 2 * kRounds);
    EXPECT_EQ(group.stats(r).bytes, kRounds * 64 * 4);
  }
}

TEST(ThreadCollectiveTest, BreakWakesEveryWaitingRank) {
  ThreadCollectiveGroup group(4);
  std::vector<absl::Status> got(4);
  std::vector<std::thread> threads;
  // Ranks 1..3 wait for rank 0, which never comes.
  for (int r = 1; r < 4; ++r) threads.emplace_back([&, r] { got[r] = group.rank(r).Barrier(); });
  group.Break(absl::InternalError("rank 0 died"));
  for (std::thread& t : threads) t.join();
  for (int r = 1; r < 4; ++r) {
    EXPECT_EQ(got[r].code(), absl::StatusCode::kInternal) << r;
    EXPECT_EQ(got[r].message(), "rank 0 died");
  }
  // The group stays broken.
  EXPECT_EQ(group.rank(0).Barrier().message(), "rank 0 died");
  EXPECT_EQ(group.broken().message(), "rank 0 died");
}

TEST(ThreadCollectiveTest, AnInjectedFailureFailsThatCallOnEveryRank) {
  ThreadCollectiveGroup group(3);
  group.InjectFailure(3, absl::UnavailableError("injected collective failure"));
  std::vector<std::vector<absl::Status>> got(3);
  RunRanks(group, [&](Collective& c) {
    std::vector<float> v(8, 1.0f);
    for (int i = 0; i < 5; ++i) got[c.rank()].push_back(c.AllReduceSum(v.data(), 8));
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_EQ(got[r].size(), 5u);
    EXPECT_TRUE(got[r][0].ok());
    EXPECT_TRUE(got[r][1].ok());
    for (int i = 2; i < 5; ++i) {
      EXPECT_EQ(got[r][i].code(), absl::StatusCode::kUnavailable) << "rank " << r << " call " << i;
    }
  }
}

TEST(ThreadCollectiveTest, OneRankNeedsNoPartner) {
  ThreadCollectiveGroup group(1);
  std::vector<float> v = {1.5f, -2.0f};
  ASSERT_TRUE(group.rank(0).AllReduceSum(v.data(), 2).ok());
  EXPECT_EQ(v, (std::vector<float>{1.5f, -2.0f}));
  std::vector<char> out(3);
  const char in[3] = {1, 2, 3};
  ASSERT_TRUE(group.rank(0).AllGather(in, 3, out.data()).ok());
  EXPECT_EQ(out, (std::vector<char>{1, 2, 3}));
}

}  // namespace
}  // namespace pdserve::kernels::cpu
