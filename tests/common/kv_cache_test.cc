#include "kv/kv_cache.h"

#include "gtest/gtest.h"

namespace pdserve {
namespace {

KvCacheSpec Spec(int32_t blocks, DType dtype = DType::kF32) {
  return {.num_layers = 3, .num_kv_heads = 2, .head_dim = 8, .block_size = 4, .dtype = dtype,
          .num_blocks = blocks};
}

TEST(KvCacheTest, SizesFollowTheFormula) {
  const KvCacheSpec s = Spec(10, DType::kBF16);
  EXPECT_EQ(s.BytesPerPosition(), 2 * 3 * 2 * 8 * 2);  // c_kv = 2 L N_kv H p
  EXPECT_EQ(s.LayerBlockBytes(), 2 * 2 * 4 * 8 * 2);
  EXPECT_EQ(s.TotalBytes(), s.LayerBlockBytes() * 10 * 3);
}

TEST(KvCacheTest, AllocateReleaseAndRefCounts) {
  auto pool = BlockPool::Create(Spec(4));
  ASSERT_TRUE(pool.ok());
  BlockPool& p = **pool;
  auto a = p.Allocate(3);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(p.num_free(), 1);
  p.AddRef((*a)[0]);
  EXPECT_EQ(p.RefCount((*a)[0]), 2);
  p.Release((*a)[0]);
  EXPECT_EQ(p.num_free(), 1);
  p.Release((*a)[0]);
  EXPECT_EQ(p.num_free(), 2);
  auto too_many = p.Allocate(3);
  EXPECT_EQ(too_many.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(too_many.status().message().find("3 blocks requested, 2 free of 4"),
            absl::string_view::npos)
      << too_many.status();
  EXPECT_EQ(p.num_free(), 2);  // All or nothing.
  p.Release((*a)[1]);
  p.Release((*a)[2]);
  EXPECT_EQ(p.num_free(), 4);
}

TEST(KvCacheTest, LayersAreContiguousAndDisjoint) {
  auto pool = BlockPool::Create(Spec(5));
  ASSERT_TRUE(pool.ok());
  BlockPool& p = **pool;
  const int64_t lb = p.spec().LayerBlockBytes();
  char* base = static_cast<char*>(p.region().data());
  const KvStorage storage = p.storage();
  EXPECT_EQ(storage.base, base);
  EXPECT_EQ(static_cast<char*>(storage.BlockData(0, BlockId{0})), base);
  EXPECT_EQ(static_cast<char*>(storage.BlockData(0, BlockId{4})), base + 4 * lb);
  EXPECT_EQ(static_cast<char*>(storage.BlockData(2, BlockId{1})), base + (2 * 5 + 1) * lb);
  const kernels::KvLayerView v = storage.LayerView(1);
  EXPECT_EQ(static_cast<char*>(v.base), base + 5 * lb);
  EXPECT_EQ(v.v_offset * 4, lb / 2);
}

TEST(KvCacheTest, InvalidSpecsAreRefused) {
  EXPECT_FALSE(BlockPool::Create(Spec(0)).ok());
  KvCacheSpec s = Spec(4);
  s.block_size = 0;
  EXPECT_EQ(BlockPool::Create(s).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve
