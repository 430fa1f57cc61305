// The prefix cache: hash chain stability, pool eviction rules, and a hit
// giving exactly the logits of a cold prefill.
#include "kv/prefix_cache.h"

#include <random>
#include <string>
#include <vector>

#include "model/model.h"
#include "model/synthetic_model.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace pdserve {
namespace {

TEST(BlockHashTest, KnownSequenceHasACommittedHash) {
  // Any change to the documented byte encoding changes this value, and with
  // it the hashes other processes and machines compute: update deliberately.
  // Block 0 was cross-checked with xxhash's own CLI (`xxhsum -H2`) on the
  // encoding built by hand (block_hash.h), identity = XXH3-128 of the string.
  const BlockHasher hasher(HashBytes("pdserve-test-model"), DType::kBF16, 4);
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<BlockHash> h = hasher.FullBlockHashes(tokens);
  ASSERT_EQ(h.size(), 2u);
  EXPECT_EQ(h[0].ToHex(), "d188822b2ea5aebc7269a7359ba031b4");
  EXPECT_EQ(h[1].ToHex(), "0134b148a14cc6e86d958108a4e10878");
}

TEST(BlockHashTest, ChainDependsOnPrefixModelAndDtype) {
  const BlockHasher a(HashBytes("m1"), DType::kBF16, 2);
  const std::vector<BlockHash> base = a.FullBlockHashes({1, 2, 3, 4});
  EXPECT_EQ(a.FullBlockHashes({1, 2, 3, 4, 5})[1], base[1]);  // Partial tail ignored.
  EXPECT_NE(a.FullBlockHashes({9, 2, 3, 4})[1], base[1]);     // Same block, other prefix.
  EXPECT_NE(BlockHasher(HashBytes("m2"), DType::kBF16, 2).FullBlockHashes({1, 2})[0], base[0]);
  EXPECT_NE(BlockHasher(HashBytes("m1"), DType::kI8, 2).FullBlockHashes({1, 2})[0], base[0]);
}

// A scoped cache: chains under different salts share no block (not even
// the first, nor any later one), and the zero salt is the unsalted chain
// whose committed hashes are pinned above.
TEST(BlockHashTest, SaltedChainsShareNoBlockAndTheZeroSaltIsTheSharedChain) {
  const BlockHasher hasher(HashBytes("pdserve-test-model"), DType::kBF16, 4);
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  const std::vector<BlockHash> shared = hasher.FullBlockHashes(tokens);
  EXPECT_EQ(hasher.FullBlockHashes(tokens, CacheSalt{}), shared);
  EXPECT_EQ(hasher.FullBlockHashes(tokens, CacheSaltForKey("")), shared);  // no keys: one tenant
  const std::vector<BlockHash> alice = hasher.FullBlockHashes(tokens, CacheSaltForKey("alice"));
  const std::vector<BlockHash> bob = hasher.FullBlockHashes(tokens, CacheSaltForKey("bob"));
  ASSERT_EQ(alice.size(), 2u);
  ASSERT_EQ(bob.size(), 2u);
  for (const auto* other : {&shared, &bob}) {
    for (const BlockHash& a : alice) {
      for (const BlockHash& o : *other) EXPECT_NE(a, o);
    }
  }
  // The same key's salt is the same everywhere, as its chains must be.
  EXPECT_EQ(hasher.FullBlockHashes(tokens, CacheSaltForKey("alice")), alice);
  EXPECT_NE(CacheSaltForKey("alice"), CacheSalt{});
  // XXH3-128 of the label, a NUL and the id: other processes compute it alike.
  EXPECT_EQ(CacheSaltForKey("alice"),
            HashBytes(std::string("pdserve.prefix_cache_scope.key\0alice", 36)));
}

KvCacheSpec SmallSpec(int32_t blocks) {
  return {.num_layers = 1, .num_kv_heads = 1, .head_dim = 4, .block_size = 2,
          .dtype = DType::kF32, .num_blocks = blocks};
}

TEST(PrefixPoolTest, EvictsLeastRecentlyReleasedNeverReferenced) {
  auto pool = BlockPool::Create(SmallSpec(4));
  ASSERT_TRUE(pool.ok());
  BlockPool& p = **pool;
  auto blocks = p.Allocate(4);
  ASSERT_TRUE(blocks.ok());
  const BlockHash h[4] = {{1, 0}, {2, 0}, {3, 0}, {4, 0}};
  for (int i = 0; i < 4; ++i) p.MarkCached((*blocks)[i], h[i]);
  p.Release((*blocks)[2]);  // Released first: least recently used.
  p.Release((*blocks)[0]);
  p.Release((*blocks)[1]);  // Block 3 stays referenced.
  EXPECT_EQ(p.num_free(), 3);
  EXPECT_EQ(p.num_evictable(), 3);
  // A lookup revives block 0 (and block 1 after it).
  std::vector<BlockId> hit = p.AcquireCachedPrefix({h[0], h[1], h[3]});
  ASSERT_EQ(hit.size(), 3u);
  EXPECT_EQ(p.num_evictable(), 1);
  auto one = p.Allocate(1);  // Must evict block 2, the only evictable one.
  ASSERT_TRUE(one.ok());
  EXPECT_EQ((*one)[0], (*blocks)[2]);
  EXPECT_EQ(p.prefix_stats().evictions, 1);
  EXPECT_FALSE(p.IsCached((*blocks)[2]));
  EXPECT_TRUE(p.AcquireCachedPrefix({h[2]}).empty());
  // Everything else is referenced: nothing can be taken.
  EXPECT_EQ(p.Allocate(1).status().code(), absl::StatusCode::kResourceExhausted);
  for (BlockId b : hit) EXPECT_GE(p.RefCount(b), 1);
  EXPECT_EQ(p.prefix_stats().hit_blocks, 3);
  EXPECT_EQ(p.prefix_stats().miss_blocks, 1);
}

class PrefixHitTest : public ::testing::TestWithParam<DType> {};

TEST_P(PrefixHitTest, HitEqualsColdPrefill) {
  const std::string dir = MakeTempDir("prefix");
  ASSERT_TRUE(WriteRandomModel(dir, {}).ok());
  auto backend = kernels::cpu::CpuBackend::Create({.num_threads = 2});
  ASSERT_TRUE(backend.ok());
  auto model = Model::Load(dir, {}, backend->get());
  ASSERT_TRUE(model.ok()) << model.status();
  auto kv = KvManager::Create((*model)->MakeKvSpec(GetParam(), 16, 64));
  ASSERT_TRUE(kv.ok());
  const BlockHasher hasher((*model)->identity(), GetParam(), 16);

  std::mt19937 rng(5);
  std::vector<int32_t> shared(70), a, b;
  for (auto& t : shared) t = static_cast<int32_t>(rng() % 96);
  a = shared;
  a.insert(a.end(), {1, 2, 3});
  b = shared;
  b.insert(b.end(), {9, 8, 7, 6, 5});

  // Request A, cold; its full blocks are published.
  SequenceKv sa = (*kv)->NewSequence();
  EXPECT_EQ(AttachCachedPrefix(**kv, hasher, a, sa), 0);
  ForwardSequence fa{&sa, a, LogitsMode::kLast};
  ASSERT_TRUE(ForwardGrowing(**model, **kv, {&fa, 1}).ok());
  PublishFullBlocks(**kv, hasher, a, sa);
  sa.Release();

  // Request B reuses the shared full blocks (64 positions) ...
  SequenceKv sb = (*kv)->NewSequence();
  const int32_t reused = AttachCachedPrefix(**kv, hasher, b, sb);
  EXPECT_EQ(reused, 64);
  ForwardSequence fb{&sb, absl::MakeConstSpan(b).subspan(reused), LogitsMode::kAll};
  auto hit = ForwardGrowing(**model, **kv, {&fb, 1});
  ASSERT_TRUE(hit.ok());
  // ... and equals a cold prefill of B in a pool without the cache.
  auto cold_kv = KvManager::Create((*model)->MakeKvSpec(GetParam(), 16, 64));
  ASSERT_TRUE(cold_kv.ok());
  SequenceKv sc = (*cold_kv)->NewSequence();
  ForwardSequence fc{&sc, b, LogitsMode::kAll};
  auto cold = ForwardGrowing(**model, **cold_kv, {&fc, 1});
  ASSERT_TRUE(cold.ok());
  ASSERT_EQ(hit->num_rows[0], static_cast<int32_t>(b.size()) - reused);
  for (int32_t r = 0; r < hit->num_rows[0]; ++r) {
    absl::Span<const float> h = hit->Row(r), c = cold->Row(reused + r);
    for (size_t v = 0; v < h.size(); ++v) ASSERT_NEAR(h[v], c[v], 1e-5f) << r << "," << v;
  }
  EXPECT_EQ((*kv)->Counts().prefix.hit_blocks, 4);
  sb.Release();
  sc.Release();
  EXPECT_EQ((*kv)->Counts().used, 0);
  EXPECT_GT((*kv)->Counts().cached, 0);
}

INSTANTIATE_TEST_SUITE_P(KvTypes, PrefixHitTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kI8),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace pdserve
