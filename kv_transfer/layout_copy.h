// Where each byte of a sequence's KV goes when it moves between two block
// pools (kv/kv_cache.h layout), per layer.
//
// Same block size on both sides: a layer-block is copied as is (K, V and the
// int8 scales travel together), and runs of blocks that are consecutive in
// both pools are merged into one copy, so a fresh pool moves a layer in one
// put.
//
// Different block sizes or tensor-parallel layouts: the K block is
// transposed per slot, so a position is scattered over the block, and a
// receiver rank's heads may sit on one or several sender ranks; the sender
// packs the receiver's blocks, rank by rank, into a staging buffer
// (PackLayer), taking each model head from the first sender rank that
// holds it, and puts those whole. Only these may differ
// (kv_transfer/descriptor.h); everything else is refused earlier.
//
// Pools with several ranks (KvCacheSpec::num_ranks) copy every rank's
// blocks; same-layout copies go rank to rank.
//
// Positions below `first_position` are not copied (the receiver already
// holds them). REQUIRES: first_position is a multiple of the receiver's
// block size (the receiver only reports whole held blocks).
//
// Thread safety: pure functions over memory the caller owns.
#ifndef PDSERVE_KV_TRANSFER_LAYOUT_COPY_H_
#define PDSERVE_KV_TRANSFER_LAYOUT_COPY_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "kv/kv_cache.h"

namespace pdserve::kv {

// One contiguous copy, offsets from the start of each region.
struct CopyRun {
  int64_t src_offset = 0;
  int64_t dst_offset = 0;
  int64_t bytes = 0;
};

// Byte offset of (layer, block) of `rank` in a region laid out by `spec`.
inline int64_t LayerBlockOffset(const KvCacheSpec& spec, int32_t layer, int32_t block, int32_t rank = 0) {
  return rank * spec.RankBytes() + (static_cast<int64_t>(layer) * spec.num_blocks + block) * spec.LayerBlockBytes();
}

// Same block size and tensor-parallel layout: the merged copies of `layer`
// for positions [first_position, num_positions), every rank. Tables hold
// enough blocks for num_positions.
// REQUIRES: src and dst have the same block size, ranks and heads per rank.
std::vector<CopyRun> PlanSameLayout(const KvCacheSpec& src, absl::Span<const int32_t> src_table,
                                    const KvCacheSpec& dst, absl::Span<const int32_t> dst_table,
                                    int32_t layer, int32_t first_position, int32_t num_positions);

// Other layouts: writes receiver blocks first_position / B_dst ..
// ceil(num_positions / B_dst) - 1 of `layer`, in the receiver's layout,
// rank after rank, contiguously into `out` (size PackedLayerBytes); unused
// tail slots are zero. `src_base` is the sender's region.
int64_t PackedLayerBytes(const KvCacheSpec& dst, int32_t first_position, int32_t num_positions);
void PackLayer(const KvCacheSpec& src, const char* src_base, absl::Span<const int32_t> src_table,
               const KvCacheSpec& dst, int32_t layer, int32_t first_position, int32_t num_positions,
               char* out);
// The copies from a packed layer (offset `packed_offset` in the sender's
// staging region) to the receiver's blocks, merged where consecutive.
std::vector<CopyRun> PlanPacked(const KvCacheSpec& dst, absl::Span<const int32_t> dst_table,
                                int32_t layer, int32_t first_position, int32_t num_positions,
                                int64_t packed_offset);

// XXH3-64 of each group of `group` positions of each layer, over the
// positions' bytes in a layout-independent order (per position: K
// [head][dim], V [head][dim], then the int8 scales K [head], V [head]);
// element [layer * groups + g]. Equal checksums on both sides mean the same
// KV whatever the block sizes. For tests and the benchmark's verification.
std::vector<uint64_t> PositionChecksums(const KvCacheSpec& spec, const char* base,
                                        absl::Span<const int32_t> table, int32_t first_position,
                                        int32_t num_positions, int32_t group);

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_LAYOUT_COPY_H_
