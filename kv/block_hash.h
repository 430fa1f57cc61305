// Content hashes of full KV blocks, chained over the token ids (DESIGN.md
// fact 6), identical in every process and on every machine: the router and
// all workers compare them.
//
// Block i of a sequence (block size B) hashes, with XXH3-128 (seed 0), the
// bytes
//   parent   16 bytes: hash of block i-1 (low 64 bits LE, then high 64 bits
//            LE); for block 0 the chain's salt (CacheSalt), 16 zero bytes
//            unless the router scopes the cache
//   model    16 bytes: the ModelIdentity, same encoding
//   kv dtype 1 byte:   0 f32, 2 bf16, 3 int8 (the DType enum value)
//   count    4 bytes:  B, little-endian
//   tokens   4 * B bytes: the block's token ids, int32 little-endian
// so equal hashes mean the same tokens after the same prefix, under the same
// model and KV format: exact-prefix reuse only (cached abcdef + request
// abcxefg reuses abc alone, at block granularity). Chains under different
// salts share no block: the router gives each API key its own salt when the
// cache is scoped per key, so one tenant's requests can never hit (or
// detect, through cached_tokens) another's blocks.
//
// Thread safety: immutable after construction.
#ifndef PDSERVE_KV_BLOCK_HASH_H_
#define PDSERVE_KV_BLOCK_HASH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/dtype.h"

namespace pdserve {

struct BlockHash {
  uint64_t lo = 0;
  uint64_t hi = 0;
  friend bool operator==(const BlockHash& a, const BlockHash& b) { return a.lo == b.lo && a.hi == b.hi; }
  template <typename H>
  friend H AbslHashValue(H h, const BlockHash& b) {  // In-process maps only.
    return H::combine(std::move(h), b.lo, b.hi);
  }
  std::string ToHex() const;  // 32 hex digits, high word first.
};

// Identifies the weights that produced a KV: models with different weights
// (or the same checkpoint held in a different in-memory format) must never
// share cached blocks.
using ModelIdentity = BlockHash;

// Seeds a request's hash chain (its block 0's parent). Zero: the shared
// cache, the hashes every request had before salts.
using CacheSalt = BlockHash;

// XXH3-128 of arbitrary bytes (used to build identities).
BlockHash HashBytes(absl::string_view bytes);

// The salt of an API key's own cache scope: XXH3-128 of a fixed label and
// the key id, the same in every process. The id is not secret; the salt
// need not be either, since only the router sets it (clients cannot). "":
// zero (no keys: one tenant).
CacheSalt CacheSaltForKey(absl::string_view key_id);

class BlockHasher {
 public:
  BlockHasher(ModelIdentity model, DType kv_dtype, int32_t block_size);

  // Hashes of the full blocks of `tokens` (a trailing partial block has
  // none), the chain seeded with `salt`.
  std::vector<BlockHash> FullBlockHashes(absl::Span<const int32_t> tokens, const CacheSalt& salt = {}) const;
  // Hash of one block given its parent's hash.
  BlockHash HashBlock(const BlockHash& parent, absl::Span<const int32_t> block_tokens) const;

  int32_t block_size() const { return block_size_; }

 private:
  ModelIdentity model_;
  DType kv_dtype_;
  int32_t block_size_;
};

}  // namespace pdserve

#endif  // PDSERVE_KV_BLOCK_HASH_H_
