// Checksums of KV as a pool holds it, for checking that a block's bytes are
// the ones its producer wrote (the KV handoff's verification).
//
// LayerChecksum is the XXH3-64 of one layer's bytes of a run of blocks,
// rank after rank, and within a rank block after block in table order,
// LayerBlockBytes() each: the order in which a handoff packs a layer into
// the receiver's layout, so a sender can hash its packed bytes or its own
// blocks (same layout) and a receiver its blocks, and the results agree
// whenever the bytes do.
//
// Thread safety: pure functions; the caller holds the blocks.
#ifndef PDSERVE_KV_KV_CHECKSUM_H_
#define PDSERVE_KV_KV_CHECKSUM_H_

#include <cstdint>

#include "absl/types/span.h"
#include "kv/kv_cache.h"

namespace pdserve {

// Of `layer` in blocks table[first_block, end_block), every rank of
// `storage`. Host storage only.
// REQUIRES: 0 <= first_block <= end_block <= table.size().
uint64_t LayerChecksum(const KvStorage& storage, int32_t layer, absl::Span<const int32_t> table, int32_t first_block,
                       int32_t end_block);

// Of `bytes` bytes at `data`: bytes already laid out in that order (a packed
// layer).
uint64_t BytesChecksum(const void* data, int64_t bytes);

}  // namespace pdserve

#endif  // PDSERVE_KV_KV_CHECKSUM_H_
