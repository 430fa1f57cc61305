#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace pdserve::kernels::cpu {
namespace {

// Every item of [0, n) visited exactly once, by calls of at most `grain`
// items that start on a grain boundary (grain 0: calls of any size).
void ExpectEachItemOnceInGrains(const std::vector<std::pair<int64_t, int64_t>>& calls, int64_t n, int64_t grain) {
  std::vector<int> seen(static_cast<size_t>(n), 0);
  for (const auto& [b, e] : calls) {
    ASSERT_LE(0, b);
    ASSERT_LT(b, e);
    ASSERT_LE(e, n);
    if (grain > 0) {
      ASSERT_EQ(b % grain, 0) << "call [" << b << ", " << e << ")";
      ASSERT_LE(e - b, grain) << "call [" << b << ", " << e << ")";
    }
    for (int64_t i = b; i < e; ++i) ++seen[static_cast<size_t>(i)];
  }
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[static_cast<size_t>(i)], 1) << "item " << i << " of " << n;
}

class ThreadPoolTest : public testing::TestWithParam<int> {};

TEST_P(ThreadPoolTest, StealingCoversEveryItemOnceInGrainsWhateverTheSizes) {
  ThreadPool pool(GetParam());
  for (int64_t grain : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{7}}) {
    for (int64_t n : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{5}, int64_t{16}, int64_t{97}, int64_t{2000}}) {
      std::mutex mu;
      std::vector<std::pair<int64_t, int64_t>> calls;
      pool.ParallelStealing(n, grain, [&](int64_t b, int64_t e) {
        std::lock_guard<std::mutex> lock(mu);
        calls.emplace_back(b, e);
      });
      // One thread or one grain: a single call over everything.
      if (GetParam() == 1 || n <= grain) {
        ASSERT_EQ(calls.size(), 1u);
        EXPECT_EQ(calls[0], std::make_pair(int64_t{0}, n));
        continue;
      }
      ExpectEachItemOnceInGrains(calls, n, grain);
    }
  }
  // Nothing to do: no call.
  bool called = false;
  pool.ParallelStealing(0, 4, [&](int64_t, int64_t) { called = true; });
  EXPECT_FALSE(called);
}

TEST_P(ThreadPoolTest, EachThreadWalksItsShareFrontToBackAndAStalledOneIsTakenOver) {
  const int threads = GetParam();
  if (threads == 1) GTEST_SKIP() << "one thread: nothing to share";
  ThreadPool pool(threads);
  constexpr int64_t kN = 64;
  std::mutex mu;
  std::vector<std::pair<std::thread::id, int64_t>> order;
  const std::thread::id caller = std::this_thread::get_id();
  // The caller stalls on its first grain, so the workers finish their own
  // shares and take the rest of the caller's from its back.
  pool.ParallelStealing(kN, 1, [&](int64_t b, int64_t) {
    if (std::this_thread::get_id() == caller && b == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::lock_guard<std::mutex> lock(mu);
    order.emplace_back(std::this_thread::get_id(), b);
  });
  ASSERT_EQ(order.size(), static_cast<size_t>(kN));
  int64_t by_caller = 0;
  for (const auto& [id, b] : order) by_caller += id == caller;
  // The caller's share is grains [0, kN / threads); it ran grain 0 and at
  // most a few more before the others took the rest of it.
  EXPECT_LT(by_caller, kN / threads) << "the stalled caller's share was not taken over";
  // With one worker: it runs its share [kN / 2, kN) front to back (with
  // more, a descheduled worker's share may be taken before it starts, so
  // which share a worker ran is not known), then the caller's from the
  // back.
  if (threads == 2) {
    std::vector<int64_t> worker;
    for (const auto& [id, b] : order) {
      if (id != caller) worker.push_back(b);
    }
    int64_t next = kN / 2, stolen = kN / 2 - 1;
    for (const int64_t b : worker) {
      if (b >= kN / 2) {
        EXPECT_EQ(b, next) << "the worker's share not run front to back";
        next = b + 1;
      } else {
        EXPECT_EQ(b, stolen) << "the caller's share not taken from its back";
        stolen = b - 1;
      }
    }
  }
}

TEST_P(ThreadPoolTest, BackToBackLoopsOfBothKindsNeverMixTheirItems) {
  // Thousands of short loops, alternating kinds: a worker late for one loop
  // must not claim items of the next.
  ThreadPool pool(GetParam());
  std::vector<std::atomic<int>> hits(512);
  for (int round = 0; round < 3000; ++round) {
    const int64_t n = 1 + (round * 37) % 511;
    for (int64_t i = 0; i < n; ++i) hits[static_cast<size_t>(i)].store(0, std::memory_order_relaxed);
    const auto body = [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)].fetch_add(1, std::memory_order_relaxed);
    };
    if (round % 2 == 0) {
      pool.ParallelStealing(n, 1 + round % 5, body);
    } else {
      pool.ParallelFor(n, body);
    }
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << "round " << round << " item " << i << " of " << n;
    }
  }
}

TEST_P(ThreadPoolTest, ParallelForCoversEveryItemOnce) {
  ThreadPool pool(GetParam());
  for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{100}, int64_t{4097}}) {
    for (int per_thread : {1, 2, 4}) {
      std::mutex mu;
      std::vector<std::pair<int64_t, int64_t>> calls;
      pool.ParallelFor(
          n,
          [&](int64_t b, int64_t e) {
            std::lock_guard<std::mutex> lock(mu);
            calls.emplace_back(b, e);
          },
          per_thread);
      ExpectEachItemOnceInGrains(calls, n, 0);
      EXPECT_LE(calls.size(), static_cast<size_t>(GetParam() * per_thread));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Threads, ThreadPoolTest, testing::Values(1, 2, 3, 4),
                         [](const testing::TestParamInfo<int>& p) { return "t" + std::to_string(p.param); });

}  // namespace
}  // namespace pdserve::kernels::cpu
