#include "common/prefix_cache.h"

#include <vector>

namespace pdserve {

int32_t AttachCachedPrefix(BlockPool& pool, const BlockHasher& hasher,
                           absl::Span<const int32_t> prompt, SequenceKv& seq) {
  if (prompt.size() <= 1) return 0;
  const std::vector<BlockHash> hashes = hasher.FullBlockHashes(prompt.first(prompt.size() - 1));
  const std::vector<BlockId> blocks = pool.AcquireCachedPrefix(hashes);
  for (BlockId b : blocks) seq.AppendBlock(b);
  const int32_t reused = static_cast<int32_t>(blocks.size()) * hasher.block_size();
  seq.SetNumPositions(reused);
  return reused;
}

void PublishFullBlocks(BlockPool& pool, const BlockHasher& hasher,
                       absl::Span<const int32_t> tokens, const SequenceKv& seq) {
  const std::vector<BlockHash> hashes =
      hasher.FullBlockHashes(tokens.first(static_cast<size_t>(seq.num_positions())));
  for (size_t b = 0; b < hashes.size(); ++b) {
    pool.MarkCached(BlockId{seq.block_table()[b]}, hashes[b], b > 0 ? hashes[b - 1] : BlockHash{});
  }
}

}  // namespace pdserve
