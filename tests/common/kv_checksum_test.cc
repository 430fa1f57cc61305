// LayerChecksum hashes a layer's blocks rank after rank, block after block
// in table order, and its dispatched XXH3 (the CPU's widest vector path)
// gives the portable XXH3-64 of those bytes: machines of different CPUs
// agree on every checksum.
#include "kv/kv_checksum.h"

#include <xxhash.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kv/kv_manager.h"

namespace pdserve {
namespace {

TEST(KvChecksumTest, ALayerChecksumIsTheXxh3OfItsBlocksRankAfterRankInTableOrder) {
  const KvCacheSpec spec{.num_layers = 3, .num_kv_heads = 2, .head_dim = 8, .block_size = 4,
                         .dtype = DType::kF32, .num_blocks = 8, .num_ranks = 2, .model_kv_heads = 4};
  ASSERT_TRUE(spec.Validate().ok());
  auto kv = KvManager::Create(spec);
  ASSERT_TRUE(kv.ok()) << kv.status();
  std::mt19937_64 rng(3);
  auto* words = static_cast<uint64_t*>((*kv)->region().data());
  for (size_t i = 0; i < (*kv)->region().size() / 8; ++i) words[i] = rng();
  const KvStorage storage = (*kv)->storage();
  const std::vector<int32_t> table = {5, 2, 7, 0};
  for (int32_t layer = 0; layer < spec.num_layers; ++layer) {
    std::string bytes;
    for (int32_t r = 0; r < spec.num_ranks; ++r) {
      for (int32_t j = 1; j < 3; ++j) {
        bytes.append(static_cast<const char*>(storage.BlockData(layer, BlockId{table[j]}, r)),
                     static_cast<size_t>(spec.LayerBlockBytes()));
      }
    }
    EXPECT_EQ(LayerChecksum(storage, layer, table, 1, 3), XXH3_64bits(bytes.data(), bytes.size())) << layer;
    EXPECT_EQ(BytesChecksum(bytes.data(), static_cast<int64_t>(bytes.size())), XXH3_64bits(bytes.data(), bytes.size()));
  }
  EXPECT_EQ(LayerChecksum(storage, 0, table, 2, 2), XXH3_64bits(nullptr, 0)) << "no blocks: the empty input's hash";
}

}  // namespace
}  // namespace pdserve
