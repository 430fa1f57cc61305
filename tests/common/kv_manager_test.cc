// The KV manager: owners grow all or nothing, reservations are a cached
// prefix plus fresh blocks, the prefix cache shares and evicts through it,
// owners give their blocks back, programmer errors abort, and its lock is
// never held across a forward.
#include "kv/kv_manager.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "model/model.h"
#include "model/synthetic_model.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace pdserve {
namespace {

KvCacheSpec Spec(int32_t blocks, int32_t block_size = 4) {
  return {.num_layers = 3, .num_kv_heads = 2, .head_dim = 8, .block_size = block_size, .dtype = DType::kF32,
          .num_blocks = blocks};
}

std::unique_ptr<KvManager> Manager(int32_t blocks, int32_t block_size = 4) {
  absl::StatusOr<std::unique_ptr<KvManager>> kv = KvManager::Create(Spec(blocks, block_size));
  EXPECT_TRUE(kv.ok()) << kv.status();
  return kv.ok() ? *std::move(kv) : nullptr;
}

BlockHash H(uint64_t v) { return BlockHash{v, v * 7}; }

TEST(KvManagerTest, CountsDescribeThePool) {
  auto kv = Manager(5);
  const KvCounts c = kv->Counts();
  EXPECT_EQ(c.total, 5);
  EXPECT_EQ(c.used, 0);
  EXPECT_EQ(c.free, 5);
  EXPECT_EQ(c.cached, 0);
  EXPECT_EQ(c.block_size, 4);
  EXPECT_EQ(kv->spec().num_blocks, 5);
  EXPECT_EQ(kv->storage().base, static_cast<char*>(kv->region().data()));
}

TEST(KvManagerTest, InvalidSpecsAreRefused) {
  EXPECT_EQ(KvManager::Create(Spec(0)).status().code(), absl::StatusCode::kInvalidArgument);
}

// Moved from kv_cache_test (SequenceKv belongs to the manager now).
TEST(KvManagerTest, LogicalAndPhysicalBytes) {
  auto kv = Manager(16);
  SequenceKv a = kv->NewSequence(), b = kv->NewSequence();
  ASSERT_TRUE(kv->Grow(a, 5).ok());  // 2 blocks, 3 tail slots unused
  a.SetNumPositions(5);
  ASSERT_TRUE(kv->Grow(b, 8).ok());  // 2 full blocks
  b.SetNumPositions(8);
  const SequenceKv* seqs[] = {&a, &b};
  const KvMemoryReport r = kv->ReportMemory(seqs);
  const KvCacheSpec& s = kv->spec();
  EXPECT_EQ(r.logical_bytes, 13 * s.BytesPerPosition());
  EXPECT_EQ(r.physical_bytes, 4 * s.block_size * s.BytesPerPosition());
  EXPECT_EQ(r.blocks_used, 4);
  EXPECT_EQ(r.blocks_free, 12);
  a.Release();
  b.Release();
  EXPECT_EQ(kv->Counts().free, 16);
}

TEST(KvManagerTest, GrowIsAllOrNothingAndExhaustionLeavesTheSequenceUnchanged) {
  auto kv = Manager(3);
  SequenceKv a = kv->NewSequence();
  EXPECT_TRUE(a.empty());
  ASSERT_TRUE(kv->Grow(a, 4).ok());
  a.SetNumPositions(3);
  const std::vector<int32_t> before = a.block_table();
  ASSERT_EQ(before.size(), 1u);
  // Room already there: nothing allocated.
  ASSERT_TRUE(kv->Grow(a, 4).ok());
  EXPECT_EQ(a.block_table(), before);

  const absl::Status s = kv->Grow(a, 20);  // 5 blocks: 4 more, 2 free.
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("4 blocks requested, 2 free of 3"), absl::string_view::npos) << s;
  EXPECT_EQ(a.block_table(), before);
  EXPECT_EQ(a.num_positions(), 3);
  EXPECT_EQ(kv->Counts().free, 2);
  EXPECT_EQ(kv->Counts().used, 1);
  EXPECT_EQ(kv->RefCount(BlockId{before[0]}), 1);

  // Exactly what is left still fits.
  ASSERT_TRUE(kv->Grow(a, 12).ok());
  EXPECT_EQ(a.block_table().size(), 3u);
  EXPECT_EQ(a.block_table()[0], before[0]);
  EXPECT_EQ(kv->Counts().free, 0);
}

TEST(KvManagerTest, GrowAllRollsBackEverySequenceOnFailure) {
  auto kv = Manager(6);
  SequenceKv a = kv->NewSequence(), b = kv->NewSequence(), c = kv->NewSequence();
  ASSERT_TRUE(kv->Grow(a, 4).ok());
  ASSERT_TRUE(kv->Grow(b, 4).ok());
  const std::vector<int32_t> a_before = a.block_table(), b_before = b.block_table();
  // a and b would grow (2 + 1 blocks of the 4 free) before c fails (2 more).
  const absl::Status s = kv->GrowAll({{&a, 12}, {&b, 8}, {&c, 8}});
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(a.block_table(), a_before);
  EXPECT_EQ(b.block_table(), b_before);
  EXPECT_TRUE(c.empty());
  EXPECT_EQ(kv->Counts().used, 2);
  EXPECT_EQ(kv->Counts().free, 4);

  // The same batch when it fits: every sequence grows.
  ASSERT_TRUE(kv->GrowAll({{&a, 8}, {&b, 8}, {&c, 8}}).ok());
  EXPECT_EQ(a.block_table().size(), 2u);
  EXPECT_EQ(b.block_table().size(), 2u);
  EXPECT_EQ(c.block_table().size(), 2u);
  EXPECT_EQ(a.block_table()[0], a_before[0]);
  EXPECT_EQ(b.block_table()[0], b_before[0]);
  EXPECT_EQ(kv->Counts().used, 6);
}

TEST(KvManagerTest, ReserveIsTheCachedPrefixThenFreshBlocksInAscendingOrder) {
  auto kv = Manager(10);
  // Two published blocks, then unreferenced (cached, evictable).
  std::vector<int32_t> cached;
  {
    SequenceKv w = kv->NewSequence();
    ASSERT_TRUE(kv->Grow(w, 8).ok());
    w.SetNumPositions(8);
    kv->Publish(w, {H(1), H(2)});
    cached = w.block_table();
  }
  // One-block owners released in ascending order: the LIFO free list now
  // hands those blocks out in descending order.
  {
    std::vector<SequenceKv> singles;
    for (int i = 0; i < 4; ++i) {
      singles.push_back(kv->NewSequence());
      ASSERT_TRUE(kv->Grow(singles.back(), 1).ok());
    }
    for (SequenceKv& single : singles) single.Release();
  }
  std::vector<int32_t> plain;  // What a plain Grow takes from this state.
  {
    SequenceKv probe = kv->NewSequence();
    ASSERT_TRUE(kv->Grow(probe, 12).ok());
    plain = probe.block_table();
  }  // Given back: the same blocks are on top of the free list again.
  ASSERT_FALSE(std::is_sorted(plain.begin(), plain.end())) << "the free list was not scattered";
  const KvCounts before = kv->Counts();
  EXPECT_EQ(before.used, 0);
  EXPECT_EQ(before.cached, 2);

  absl::StatusOr<SequenceKv> r = kv->Reserve({H(1), H(2), H(3)}, 18);  // 5 blocks: 2 cached + 3.
  ASSERT_TRUE(r.ok()) << r.status();
  const std::vector<int32_t>& table = r->block_table();
  ASSERT_EQ(table.size(), 5u);
  EXPECT_EQ(r->num_positions(), 8);  // The cached prefix.
  EXPECT_EQ(table[0], cached[0]);
  EXPECT_EQ(table[1], cached[1]);
  std::sort(plain.begin(), plain.end());
  EXPECT_EQ(std::vector<int32_t>(table.begin() + 2, table.end()), plain);  // The same blocks, ascending.
  EXPECT_EQ(std::adjacent_find(table.begin() + 2, table.end()), table.end());
  for (int32_t b : table) EXPECT_EQ(kv->RefCount(BlockId{b}), 1) << "block " << b;
  for (size_t i = 2; i < table.size(); ++i) {
    EXPECT_FALSE(kv->IsCached(BlockId{table[i]}));
    EXPECT_EQ(std::count(table.begin(), table.end(), table[i]), 1);
  }
  EXPECT_EQ(kv->Counts().used, 5);
  EXPECT_EQ(kv->Counts().prefix.hit_blocks, before.prefix.hit_blocks + 2);

  // All or nothing: 5 left, 6 fresh needed after the cached prefix. The
  // prefix's references are dropped again and nothing is taken.
  const KvCounts mid = kv->Counts();
  SequenceKv prefix_holder = kv->NewSequence();
  ASSERT_EQ(kv->AttachCachedPrefix(prefix_holder, {H(1)}), 1);  // Block 0 referenced twice now.
  EXPECT_EQ(kv->RefCount(BlockId{cached[0]}), 2);
  absl::StatusOr<SequenceKv> too_big = kv->Reserve({H(1), H(2)}, 32);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted) << too_big.status();
  EXPECT_EQ(kv->RefCount(BlockId{cached[0]}), 2);
  EXPECT_EQ(kv->RefCount(BlockId{cached[1]}), 1);
  EXPECT_EQ(kv->Counts().used, mid.used);
  EXPECT_EQ(kv->Counts().free, mid.free);
  EXPECT_TRUE(kv->IsCached(BlockId{cached[0]}));
  EXPECT_TRUE(kv->IsCached(BlockId{cached[1]}));

  // No cached prefix at all: fresh blocks only, still ascending.
  r->Release();
  prefix_holder.Release();
  absl::StatusOr<SequenceKv> fresh = kv->Reserve({H(99)}, 30);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_EQ(fresh->num_positions(), 0);
  EXPECT_EQ(fresh->block_table().size(), 8u);
  EXPECT_TRUE(std::is_sorted(fresh->block_table().begin(), fresh->block_table().end()));
}

TEST(KvManagerTest, AttachedPrefixesShareBlocksAndEvictionTakesOnlyUnreferencedOnes) {
  auto kv = Manager(4, 2);
  // Four one-block owners, each published under its own hash.
  std::vector<SequenceKv> s;
  std::vector<int32_t> block;
  for (int i = 0; i < 4; ++i) {
    s.push_back(kv->NewSequence());
    ASSERT_TRUE(kv->Grow(s[i], 2).ok());
    s[i].SetNumPositions(2);
    kv->Publish(s[i], {H(i)});
    block.push_back(s[i].block_table()[0]);
    EXPECT_TRUE(kv->IsCached(BlockId{block[i]}));
  }
  EXPECT_EQ(kv->Counts().cached, 4);
  s[2].Release();  // Released first: least recently used.
  s[0].Release();
  s[1].Release();  // Block 3 stays referenced.
  EXPECT_EQ(kv->Counts().free, 3);
  EXPECT_EQ(kv->Counts().used, 1);
  EXPECT_EQ(kv->Counts().cached, 4);

  // A lookup revives blocks 0 and 1, and shares block 3 with its owner.
  SequenceKv hit = kv->NewSequence();
  ASSERT_EQ(kv->AttachCachedPrefix(hit, {H(0), H(1), H(3)}), 3);
  EXPECT_EQ(hit.block_table(), (std::vector<int32_t>{block[0], block[1], block[3]}));
  EXPECT_EQ(hit.num_positions(), 6);
  EXPECT_EQ(kv->RefCount(BlockId{block[3]}), 2);
  EXPECT_EQ(kv->Counts().free, 1);

  SequenceKv one = kv->NewSequence();
  ASSERT_TRUE(kv->Grow(one, 1).ok());  // Must evict block 2, the only evictable one.
  EXPECT_EQ(one.block_table(), std::vector<int32_t>{block[2]});
  EXPECT_EQ(kv->Counts().prefix.evictions, 1);
  EXPECT_FALSE(kv->IsCached(BlockId{block[2]}));
  EXPECT_EQ(kv->Counts().cached, 3);
  SequenceKv miss = kv->NewSequence();
  EXPECT_EQ(kv->AttachCachedPrefix(miss, {H(2)}), 0);
  EXPECT_TRUE(miss.empty());
  // Everything else is referenced: nothing can be taken.
  SequenceKv none = kv->NewSequence();
  EXPECT_EQ(kv->Grow(none, 1).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(none.empty());
  EXPECT_EQ(kv->Counts().prefix.hit_blocks, 3);
  EXPECT_EQ(kv->Counts().prefix.miss_blocks, 1);

  // Two owners of block 3: each gives back its own reference.
  s[3].Release();
  EXPECT_EQ(kv->RefCount(BlockId{block[3]}), 1);
  hit.Release();
  EXPECT_EQ(kv->RefCount(BlockId{block[3]}), 0);
  EXPECT_TRUE(kv->IsCached(BlockId{block[3]}));
  one.Release();
  EXPECT_EQ(kv->Counts().used, 0);
  EXPECT_EQ(kv->Counts().free, 4);
}

TEST(KvManagerTest, PublishingAHashAlreadyCachedKeepsTheFirstBlock) {
  auto kv = Manager(4);
  SequenceKv a = kv->NewSequence(), b = kv->NewSequence();
  ASSERT_TRUE(kv->Grow(a, 4).ok());
  ASSERT_TRUE(kv->Grow(b, 4).ok());
  kv->Publish(a, {H(5)});
  kv->Publish(b, {H(5)});
  EXPECT_TRUE(kv->IsCached(BlockId{a.block_table()[0]}));
  EXPECT_FALSE(kv->IsCached(BlockId{b.block_table()[0]}));
  EXPECT_EQ(kv->Counts().cached, 1);
  SequenceKv c = kv->NewSequence();
  ASSERT_EQ(kv->AttachCachedPrefix(c, {H(5)}), 1);
  EXPECT_EQ(c.block_table(), a.block_table());
}

TEST(KvManagerTest, FreeListenersHearEveryGiveBackOutsideTheLockUntilRemoved) {
  auto kv = Manager(8);
  int heard = 0;
  int32_t free_seen = -1;
  // The manager's own lock is not held: the listener may read its counts.
  const int handle = kv->AddFreeListener([&] {
    ++heard;
    free_seen = kv->Counts().free;
  });
  {
    SequenceKv a = kv->NewSequence();
    ASSERT_TRUE(kv->Grow(a, 8).ok());  // 2 blocks
    EXPECT_EQ(heard, 0) << "allocating is not a give-back";
    SequenceKv b = kv->NewSequence();
    ASSERT_TRUE(kv->Grow(b, 4).ok());
    b = kv->NewSequence();  // move-assigning gives b's block back
    EXPECT_EQ(heard, 1);
    EXPECT_EQ(free_seen, 6);
  }  // a destroyed
  EXPECT_EQ(heard, 2);
  EXPECT_EQ(free_seen, 8);
  kv->RemoveFreeListener(handle);
  {
    SequenceKv c = kv->NewSequence();
    ASSERT_TRUE(kv->Grow(c, 4).ok());
  }
  EXPECT_EQ(heard, 2);
}

TEST(KvManagerTest, DestructionAndMoveAssignmentGiveBlocksBack) {
  auto kv = Manager(8);
  {
    SequenceKv s = kv->NewSequence();
    ASSERT_TRUE(kv->Grow(s, 10).ok());
    EXPECT_EQ(kv->Counts().used, 3);
  }
  EXPECT_EQ(kv->Counts().used, 0);
  EXPECT_EQ(kv->Counts().free, 8);

  SequenceKv a = kv->NewSequence(), b = kv->NewSequence();
  ASSERT_TRUE(kv->Grow(a, 8).ok());   // 2 blocks
  ASSERT_TRUE(kv->Grow(b, 12).ok());  // 3 blocks
  b.SetNumPositions(11);
  const std::vector<int32_t> b_table = b.block_table();
  EXPECT_EQ(kv->Counts().used, 5);
  a = std::move(b);  // a's two blocks go back; b's three move.
  EXPECT_EQ(kv->Counts().used, 3);
  EXPECT_EQ(a.block_table(), b_table);
  EXPECT_EQ(a.num_positions(), 11);
  EXPECT_TRUE(b.empty());  // NOLINT(bugprone-use-after-move): moved-from state is specified.
  EXPECT_EQ(b.num_positions(), 0);
  for (int32_t blk : b_table) EXPECT_EQ(kv->RefCount(BlockId{blk}), 1);

  SequenceKv c(std::move(a));  // Moving an owner moves its blocks: nothing freed.
  EXPECT_EQ(kv->Counts().used, 3);
  EXPECT_EQ(c.block_table(), b_table);
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move)

  // A growable owner again after being assigned a fresh one.
  a = kv->NewSequence();
  ASSERT_TRUE(kv->Grow(a, 4).ok());
  EXPECT_EQ(kv->Counts().used, 4);

  c.Release();
  EXPECT_EQ(kv->Counts().used, 1);
  EXPECT_TRUE(c.empty());
  EXPECT_EQ(c.num_positions(), 0);
  c.Release();  // Releasing an empty owner gives back nothing twice.
  EXPECT_EQ(kv->Counts().used, 1);
  a.Release();
  EXPECT_EQ(kv->Counts().used, 0);
  EXPECT_EQ(kv->Counts().free, 8);
  SequenceKv unowned;  // Belongs to no manager: destroying it is a no-op.
  EXPECT_TRUE(unowned.empty());
}

class KvManagerDeathTest : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

// No owner path releases a block twice (Release empties the owner, a move
// empties the source), so the pool's own check is exercised directly.
TEST_F(KvManagerDeathTest, ABlockReleasedTwiceAborts) {
  EXPECT_DEATH(
      {
        auto pool = BlockPool::Create(Spec(2));
        auto blocks = (*pool)->Allocate(1);
        (*pool)->Release((*blocks)[0]);
        (*pool)->Release((*blocks)[0]);
      },
      "released while not held");
  EXPECT_DEATH(
      {
        auto pool = BlockPool::Create(Spec(2));
        (*pool)->Release(BlockId{1});  // Never allocated.
      },
      "released while not held");
}

TEST_F(KvManagerDeathTest, AManagerDestroyedWhileASequenceHoldsBlocksAborts) {
  EXPECT_DEATH(
      {
        std::unique_ptr<KvManager> kv = Manager(4);
        SequenceKv seq = kv->NewSequence();
        (void)kv->Grow(seq, 5);
        kv.reset();
      },
      "KV manager destroyed while 2 blocks are still held");
}

TEST_F(KvManagerDeathTest, GrowingAnotherManagersSequenceAborts) {
  EXPECT_DEATH(
      {
        std::unique_ptr<KvManager> a = Manager(4);
        std::unique_ptr<KvManager> b = Manager(4);
        SequenceKv seq = a->NewSequence();
        (void)b->Grow(seq, 1);
      },
      "does not belong to");
}

// ForwardGrowing on thread A pauses inside the forward (after layer 0's KV
// is written); meanwhile the manager must serve reservations, counts,
// growth and new owners. If its lock were held across the forward, those
// calls would block until the forward resumes: the bounded wait below then
// fails the test instead of hanging it.
TEST(KvManagerConcurrencyTest, TheLockIsNeverHeldAcrossAForward) {
  const std::string dir = MakeTempDir("kv_manager");
  ASSERT_TRUE(WriteRandomModel(dir, {}).ok());
  auto backend = kernels::cpu::CpuBackend::Create(kernels::cpu::CpuBackendOptions{});  // One thread.
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto model = Model::Load(dir, {}, backend->get());
  ASSERT_TRUE(model.ok()) << model.status();
  auto created = KvManager::Create((*model)->MakeKvSpec(DType::kF32, 16, 32));
  ASSERT_TRUE(created.ok()) << created.status();
  KvManager& kv = **created;

  std::mt19937 rng(17);
  std::vector<int32_t> tokens(20);
  for (auto& t : tokens) t = static_cast<int32_t>(rng() % (*model)->config().vocab_size);

  // The same forward, uninterrupted, for the result check.
  std::vector<float> want;
  {
    SequenceKv ref = kv.NewSequence();
    ForwardSequence fs{&ref, tokens, LogitsMode::kAll};
    auto r = ForwardGrowing(**model, kv, {&fs, 1});
    ASSERT_TRUE(r.ok()) << r.status();
    want = r->logits;
  }

  SequenceKv seq = kv.NewSequence(), other = kv.NewSequence();
  absl::Notification entered, resume;
  ForwardOptions options;
  options.on_layer_kv_written = [&](int32_t layer) {
    if (layer != 0) return;
    entered.Notify();
    resume.WaitForNotification();
  };
  absl::StatusOr<ForwardResult> result;
  std::thread forward([&] {
    ForwardSequence fs{&seq, tokens, LogitsMode::kAll};
    result = ForwardGrowing(**model, kv, {&fs, 1}, options);
    if (!entered.HasBeenNotified()) entered.Notify();  // Failed before layer 0.
  });
  const bool paused = entered.WaitForNotificationWithTimeout(absl::Seconds(60));

  absl::StatusOr<SequenceKv> reserved = absl::UnknownError("not called");
  KvCounts counts;
  absl::Status grown = absl::UnknownError("not called");
  SequenceKv fresh;
  absl::Notification calls_done;
  std::thread calls([&] {
    reserved = kv.Reserve({}, 40);
    counts = kv.Counts();
    grown = kv.Grow(other, 33);
    fresh = kv.NewSequence();
    calls_done.Notify();
  });
  const bool returned = calls_done.WaitForNotificationWithTimeout(absl::Seconds(30));
  const bool forward_still_paused = !resume.HasBeenNotified();
  resume.Notify();
  forward.join();
  calls.join();

  ASSERT_TRUE(paused) << "the forward never reached layer 0";
  EXPECT_TRUE(returned) << "the manager's calls waited for the forward: its lock is held across it";
  EXPECT_TRUE(forward_still_paused);
  ASSERT_TRUE(reserved.ok()) << reserved.status();
  EXPECT_EQ(reserved->block_table().size(), 3u);
  // The forward's 2 blocks were taken before it started, the reservation's 3 since.
  EXPECT_EQ(counts.used, 2 + 3);
  ASSERT_TRUE(grown.ok()) << grown;
  EXPECT_EQ(other.block_table().size(), 3u);
  ASSERT_TRUE(fresh.empty());
  ASSERT_TRUE(kv.Grow(fresh, 1).ok());  // A real owner of this manager.

  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(seq.num_positions(), static_cast<int32_t>(tokens.size()));
  ASSERT_EQ(result->logits.size(), want.size());
  EXPECT_EQ(std::memcmp(result->logits.data(), want.data(), want.size() * sizeof(float)), 0);
  // No block is held twice.
  std::vector<int32_t> all = seq.block_table();
  for (const SequenceKv* s : {&*reserved, &other, &fresh}) {
    all.insert(all.end(), s->block_table().begin(), s->block_table().end());
  }
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::adjacent_find(all.begin(), all.end()), all.end());
  EXPECT_EQ(kv.Counts().used, static_cast<int32_t>(all.size()));
}

}  // namespace
}  // namespace pdserve
