#include "kv/prefix_cache.h"

#include <vector>

namespace pdserve {

int32_t AttachCachedPrefix(KvManager& kv, const BlockHasher& hasher,
                           absl::Span<const int32_t> prompt, SequenceKv& seq, const CacheSalt& salt) {
  if (prompt.size() <= 1) return 0;
  const std::vector<BlockHash> hashes = hasher.FullBlockHashes(prompt.first(prompt.size() - 1), salt);
  return kv.AttachCachedPrefix(seq, hashes) * hasher.block_size();
}

std::vector<BlockHash> PublishFullBlocks(KvManager& kv, const BlockHasher& hasher,
                                         absl::Span<const int32_t> tokens, const SequenceKv& seq,
                                         const CacheSalt& salt) {
  std::vector<BlockHash> hashes = hasher.FullBlockHashes(tokens.first(static_cast<size_t>(seq.num_positions())), salt);
  kv.Publish(seq, hashes);
  return hashes;
}

}  // namespace pdserve
