#include "engine/scheduler.h"

#include <random>

#include "gtest/gtest.h"

namespace pdserve::engine {
namespace {

SchedulerInput Pool(int64_t allocatable, int64_t total = 1000) {
  SchedulerInput in;
  in.allocatable_blocks = allocatable;
  in.total_blocks = total;
  in.block_size = 16;
  return in;
}

TEST(SchedulerTest, EveryRunningSequenceGetsARowAndOnlyBlockBoundariesCostBlocks) {
  SchedulerInput in = Pool(10);
  in.running = {{.positions = 5, .blocks = 1}, {.positions = 16, .blocks = 1}, {.positions = 31, .blocks = 2}};
  const StepPlan p = PlanStep(in, {});
  EXPECT_EQ(p.preempt, 0);
  EXPECT_EQ(p.decode_rows, 3);
  EXPECT_EQ(p.blocks_needed, 1);  // Only the 17th position needs a new block.
  EXPECT_TRUE(p.chunks.empty());
  EXPECT_FALSE(p.reject_head);
}

TEST(SchedulerTest, AShortPoolPreemptsTheNewestAndStartsNoChunk) {
  SchedulerInput in = Pool(1);
  // Every row is at a block boundary: 3 blocks needed, 1 free.
  in.running = {{16, 1}, {32, 2}, {48, 3}};
  in.waiting = {{.context = 10}};
  const StepPlan p = PlanStep(in, {});
  // Row 0 takes the free block; row 1 fails and the newest (row 2, 3
  // blocks) gives its blocks back; row 1 then fits.
  EXPECT_EQ(p.preempt, 1);
  EXPECT_EQ(p.decode_rows, 2);
  EXPECT_EQ(p.blocks_needed, 2);
  EXPECT_TRUE(p.chunks.empty());
}

TEST(SchedulerTest, TheNewestRowCanPreemptItself) {
  SchedulerInput in = Pool(0);
  in.running = {{5, 1}, {16, 1}};
  const StepPlan p = PlanStep(in, {});
  EXPECT_EQ(p.preempt, 1);
  EXPECT_EQ(p.decode_rows, 1);
  EXPECT_EQ(p.blocks_needed, 0);
}

TEST(SchedulerTest, ChunksShareTheBudgetInQueueOrder) {
  SchedulerInput in = Pool(100);
  in.running = {{5, 1}};
  in.waiting = {{.context = 100}, {.context = 300}, {.context = 50}};
  const StepPlan p = PlanStep(in, {.max_batch = 64, .chunk_tokens = 256});
  ASSERT_EQ(p.chunks.size(), 2u);
  EXPECT_EQ(p.chunks[0].waiting, 0);
  EXPECT_EQ(p.chunks[0].tokens, 100);
  EXPECT_TRUE(p.chunks[0].ends_context);
  EXPECT_EQ(p.chunks[1].waiting, 1);
  EXPECT_EQ(p.chunks[1].tokens, 156);
  EXPECT_FALSE(p.chunks[1].ends_context);
  EXPECT_EQ(p.blocks_needed, BlocksFor(100, 16) + BlocksFor(156, 16));
}

TEST(SchedulerTest, AStartedPrefillContinuesWhereItsKvEnds) {
  SchedulerInput in = Pool(100);
  in.waiting = {{.context = 300, .fed = 256, .blocks = 16}};
  const StepPlan p = PlanStep(in, {});
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].tokens, 44);
  EXPECT_TRUE(p.chunks[0].ends_context);
  EXPECT_EQ(p.blocks_needed, BlocksFor(300, 16) - 16);
}

TEST(SchedulerTest, TheBatchCapCountsRowsAndChunks) {
  SchedulerInput in = Pool(100);
  in.running = {{5, 1}, {5, 1}};
  in.waiting = {{.context = 4}, {.context = 4}, {.context = 4}};
  const StepPlan p = PlanStep(in, {.max_batch = 3, .chunk_tokens = 256});
  EXPECT_EQ(p.decode_rows, 2);
  EXPECT_EQ(p.chunks.size(), 1u);
}

TEST(SchedulerTest, OverTheLatencyTargetOnlyStartedPrefillsGoOn) {
  SchedulerInput in = Pool(100);
  in.running = {{5, 1}};
  in.admit_new = false;
  in.waiting = {{.context = 40, .fed = 16, .blocks = 1}, {.context = 8}};
  const StepPlan p = PlanStep(in, {});
  ASSERT_EQ(p.chunks.size(), 1u);
  EXPECT_EQ(p.chunks[0].waiting, 0);
}

TEST(SchedulerTest, AChunkThatDoesNotFitStopsTheQueue) {
  SchedulerInput in = Pool(3);
  in.waiting = {{.context = 16}, {.context = 64}, {.context = 8}};
  const StepPlan p = PlanStep(in, {});
  ASSERT_EQ(p.chunks.size(), 1u);  // The third would fit, but order is kept.
  EXPECT_EQ(p.chunks[0].waiting, 0);
}

TEST(SchedulerTest, WhenNothingFitsPartialPrefillsBehindTheHeadGiveWay) {
  SchedulerInput in = Pool(0, 8);
  in.waiting = {{.context = 40}, {.context = 60, .fed = 32, .blocks = 2}, {.context = 10}, {.context = 50, .fed = 16, .blocks = 1}};
  const StepPlan p = PlanStep(in, {});
  EXPECT_FALSE(p.has_forward());
  EXPECT_EQ(p.release, (std::vector<int32_t>{1, 3}));
  EXPECT_FALSE(p.reject_head);
}

TEST(SchedulerTest, AHeadLargerThanThePoolIsRejectedOneThatFitsLaterWaits) {
  SchedulerInput in = Pool(0, 2);  // 32 positions.
  in.waiting = {{.context = 40}};
  EXPECT_TRUE(PlanStep(in, {}).reject_head);
  in.waiting = {{.context = 31}};  // Fits with its first generated token, once blocks are free.
  const StepPlan p = PlanStep(in, {});
  EXPECT_FALSE(p.reject_head);
  EXPECT_FALSE(p.has_forward());
  EXPECT_TRUE(p.release.empty());
}

TEST(SchedulerTest, EmptyInputPlansNothing) {
  const StepPlan p = PlanStep(Pool(10), {});
  EXPECT_FALSE(p.has_forward());
  EXPECT_EQ(p.preempt, 0);
  EXPECT_FALSE(p.reject_head);
}

// Invariants over random inputs: the plan never asks for more blocks than
// the pool can give after its preemptions, never exceeds the budget or
// the cap, keeps queue order, and marks exactly the chunks that end their
// context.
TEST(SchedulerTest, RandomInputsKeepTheInvariants) {
  std::mt19937 rng(5);
  for (int round = 0; round < 20000; ++round) {
    SchedulerInput in;
    in.block_size = 1 + static_cast<int32_t>(rng() % 32);
    in.total_blocks = 1 + rng() % 200;
    in.allocatable_blocks = static_cast<int64_t>(rng() % (in.total_blocks + 1));
    in.admit_new = rng() % 4 != 0;
    const int nr = static_cast<int>(rng() % 6), nw = static_cast<int>(rng() % 6);
    for (int i = 0; i < nr; ++i) {
      const int32_t pos = 1 + static_cast<int32_t>(rng() % 300);
      in.running.push_back({pos, static_cast<int32_t>(BlocksFor(pos, in.block_size))});
    }
    for (int i = 0; i < nw; ++i) {
      const int32_t ctx = 1 + static_cast<int32_t>(rng() % 400);
      const int32_t fed = rng() % 2 ? 0 : static_cast<int32_t>(rng() % ctx);
      in.waiting.push_back({ctx, fed, static_cast<int32_t>(BlocksFor(fed, in.block_size))});
    }
    SchedulerOptions o{.max_batch = 1 + static_cast<int32_t>(rng() % 8), .chunk_tokens = 1 + static_cast<int32_t>(rng() % 300)};
    const StepPlan p = PlanStep(in, o);
    SCOPED_TRACE(round);
    ASSERT_EQ(p.decode_rows + p.preempt, nr);
    int64_t freed = 0;
    for (int i = p.decode_rows; i < nr; ++i) freed += in.running[i].blocks;
    ASSERT_LE(p.blocks_needed, in.allocatable_blocks + freed);
    if (p.preempt > 0) ASSERT_TRUE(p.chunks.empty());
    if (!p.chunks.empty() || p.decode_rows > 0) {
      ASSERT_LE(p.decode_rows + static_cast<int>(p.chunks.size()), std::max(o.max_batch, p.decode_rows));
    }
    int32_t tokens = 0, last = -1;
    for (const StepPlan::Chunk& c : p.chunks) {
      ASSERT_GT(c.waiting, last);
      last = c.waiting;
      const WaitingSeq& w = in.waiting[c.waiting];
      ASSERT_GT(c.tokens, 0);
      ASSERT_LE(c.tokens, w.context - w.fed);
      ASSERT_EQ(c.ends_context, c.tokens == w.context - w.fed);
      if (!in.admit_new) ASSERT_TRUE(w.fed > 0 || w.blocks > 0);
      tokens += c.tokens;
    }
    ASSERT_LE(tokens, o.chunk_tokens);
    if (p.reject_head || !p.release.empty()) ASSERT_FALSE(p.has_forward());
    for (int32_t j : p.release) ASSERT_GT(j, 0);
  }
}

}  // namespace
}  // namespace pdserve::engine
