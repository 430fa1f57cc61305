#include "kv/kv_events.h"

#include <vector>

#include "kv/block_hash.h"
#include "kv/kv_manager.h"
#include "kv/prefix_cache.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

BlockHash H(uint64_t v) { return BlockHash{v, v * 7}; }

std::vector<KvEventKind> Kinds(const KvEventBatch& b) {
  std::vector<KvEventKind> out;
  for (const KvEvent& e : b.events) out.push_back(e.kind);
  return out;
}

TEST(KvEventLogTest, StartsClearedAndNumbersEventsInOrder) {
  KvEventLog log;
  log.OnStored(H(1), BlockHash{});
  log.OnStored(H(2), H(1));
  log.OnRemoved(H(1));
  const KvEventBatch all = log.Read(0);
  EXPECT_FALSE(all.snapshot);
  ASSERT_EQ(all.events.size(), 4u);
  EXPECT_EQ(Kinds(all), (std::vector<KvEventKind>{KvEventKind::kCleared, KvEventKind::kStored, KvEventKind::kStored,
                                                  KvEventKind::kRemoved}));
  for (size_t i = 0; i < all.events.size(); ++i) EXPECT_EQ(all.events[i].id, i + 1);
  EXPECT_EQ(all.events[2].parent, H(1));  // The hash chain travels with the event.
  EXPECT_EQ(all.last_id, 4u);
  EXPECT_FALSE(all.more);
  // Only what is new.
  const KvEventBatch tail = log.Read(3);
  ASSERT_EQ(tail.events.size(), 1u);
  EXPECT_EQ(tail.events[0].id, 4u);
  EXPECT_TRUE(log.Read(4).events.empty());
  EXPECT_EQ(log.Read(4).last_id, 4u);
  EXPECT_EQ(log.num_cached(), 1u);
}

TEST(TieredListenerTest, ABlockIsHeldWhileEitherTierHoldsIt) {
  KvEventLog log;
  TieredListener tiers(&log);
  tiers.pool()->OnStored(H(1), BlockHash{});
  tiers.tier2()->OnStored(H(1), BlockHash{});  // Written to disk too: nothing new.
  tiers.tier2()->OnStored(H(2), H(1));         // Only on disk (read back at start).
  tiers.pool()->OnRemoved(H(1));               // Evicted from the pool, kept on disk.
  EXPECT_EQ(log.num_cached(), 2u);
  tiers.tier2()->OnRemoved(H(1));              // Gone from both.
  tiers.pool()->OnRemoved(H(2));               // Never in the pool: nothing.
  tiers.tier2()->OnStored(H(3), H(2));
  const KvEventBatch all = log.Read(0);
  EXPECT_EQ(Kinds(all), (std::vector<KvEventKind>{KvEventKind::kCleared, KvEventKind::kStored, KvEventKind::kStored,
                                                  KvEventKind::kRemoved, KvEventKind::kStored}));
  EXPECT_EQ(all.events[2].hash, H(2));
  EXPECT_EQ(all.events[2].parent, H(1));
  EXPECT_EQ(all.events[3].hash, H(1));
  EXPECT_EQ(all.events[4].parent, H(2));
  EXPECT_EQ(log.num_cached(), 2u);
}

TEST(KvEventLogTest, BatchesAreBoundedAndSayMoreFollows) {
  KvEventLog log;
  for (uint64_t i = 1; i <= 10; ++i) log.OnStored(H(i), H(i - 1));
  const KvEventBatch a = log.Read(0, 4);
  EXPECT_EQ(a.events.size(), 4u);
  EXPECT_TRUE(a.more);
  EXPECT_EQ(a.last_id, 4u);
  const KvEventBatch b = log.Read(a.last_id, 100);
  EXPECT_EQ(b.events.size(), 7u);
  EXPECT_FALSE(b.more);
  EXPECT_EQ(b.last_id, 11u);
}

TEST(KvEventLogTest, AReaderTooFarBehindOrFromAnotherProcessGetsASnapshot) {
  KvEventLog log(/*capacity=*/4);
  for (uint64_t i = 1; i <= 6; ++i) log.OnStored(H(i), H(i - 1));
  log.OnRemoved(H(2));
  // Events 1..3 were dropped: a reader after 1 cannot catch up.
  const KvEventBatch behind = log.Read(1);
  EXPECT_TRUE(behind.snapshot);
  ASSERT_FALSE(behind.events.empty());
  EXPECT_EQ(behind.events[0].kind, KvEventKind::kCleared);
  EXPECT_EQ(behind.events.size(), 1u + 5u);  // Cleared + the 5 cached blocks.
  EXPECT_EQ(behind.last_id, 8u);
  // Ids this log never issued (a restarted worker's reader).
  EXPECT_TRUE(log.Read(100).snapshot);
  // A reader that kept up is not affected.
  const KvEventBatch fine = log.Read(6);
  EXPECT_FALSE(fine.snapshot);
  EXPECT_EQ(fine.events.size(), 2u);
}

TEST(KvEventLogTest, ThePoolReportsPublishedAndEvictedBlocks) {
  KvEventLog log;  // Outlives the manager.
  auto manager = KvManager::Create({.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .block_size = 4,
                                    .dtype = DType::kF32, .num_blocks = 3});
  ASSERT_TRUE(manager.ok());
  KvManager& kv = **manager;
  kv.set_listener(&log);
  const BlockHasher hasher(HashBytes("model"), DType::kF32, 4);
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  SequenceKv seq = kv.NewSequence();
  ASSERT_TRUE(kv.Grow(seq, 9).ok());
  seq.SetNumPositions(9);
  PublishFullBlocks(kv, hasher, tokens, seq);
  const std::vector<BlockHash> chain = hasher.FullBlockHashes(tokens);
  KvEventBatch b = log.Read(1);
  ASSERT_EQ(b.events.size(), 2u);
  EXPECT_EQ(b.events[0].kind, KvEventKind::kStored);
  EXPECT_EQ(b.events[0].hash, chain[0]);
  EXPECT_EQ(b.events[0].parent, BlockHash{});
  EXPECT_EQ(b.events[1].hash, chain[1]);
  EXPECT_EQ(b.events[1].parent, chain[0]);
  // Publishing again changes nothing.
  PublishFullBlocks(kv, hasher, tokens, seq);
  EXPECT_EQ(log.last_id(), 3u);
  seq.Release();
  // Three new blocks: the free one, then the two cached ones, oldest first.
  SequenceKv taken = kv.NewSequence();
  ASSERT_TRUE(kv.Grow(taken, 12).ok());
  ASSERT_EQ(taken.block_table().size(), 3u);
  b = log.Read(3);
  ASSERT_EQ(b.events.size(), 2u);
  EXPECT_EQ(b.events[0].kind, KvEventKind::kRemoved);
  EXPECT_EQ(b.events[1].kind, KvEventKind::kRemoved);
  EXPECT_EQ(log.num_cached(), 0u);
  taken.Release();
  kv.set_listener(nullptr);
}

}  // namespace
}  // namespace pdserve
