// Prefix caching on top of the KV manager's content-addressed blocks
// (DESIGN.md fact 6): attach the longest cached full-block prefix of a
// prompt to a new sequence, and publish a sequence's full blocks once
// written. A hit skips computing those positions; the new queries still
// attend to them (the forward runs with S0 = the cached length).
#ifndef PDSERVE_KV_PREFIX_CACHE_H_
#define PDSERVE_KV_PREFIX_CACHE_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "kv/block_hash.h"
#include "kv/kv_manager.h"

namespace pdserve {

// Attaches to the empty `seq` the cached blocks of the longest cached prefix
// of `prompt`, leaving at least one prompt position to compute (its logits
// are needed). Returns the number of positions reused (a multiple of the
// block size). Only blocks published under `salt` are found.
// REQUIRES: seq is empty; hasher.block_size() == the pool's.
int32_t AttachCachedPrefix(KvManager& kv, const BlockHasher& hasher,
                           absl::Span<const int32_t> prompt, SequenceKv& seq, const CacheSalt& salt = {});

// Publishes every full block of `seq` whose KV is written, given the token
// ids of its positions so far (tokens.size() >= seq.num_positions()),
// under the request's `salt`. Returns their hashes, in order (a chain).
std::vector<BlockHash> PublishFullBlocks(KvManager& kv, const BlockHasher& hasher,
                       absl::Span<const int32_t> tokens, const SequenceKv& seq, const CacheSalt& salt = {});

}  // namespace pdserve

#endif  // PDSERVE_KV_PREFIX_CACHE_H_
