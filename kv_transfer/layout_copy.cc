#include "kv_transfer/layout_copy.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "xxhash.h"

namespace pdserve::kv {
namespace {

void Append(std::vector<CopyRun>& runs, CopyRun r) {
  if (!runs.empty()) {
    CopyRun& last = runs.back();
    if (last.src_offset + last.bytes == r.src_offset && last.dst_offset + last.bytes == r.dst_offset) {
      last.bytes += r.bytes;
      return;
    }
  }
  runs.push_back(r);
}

// Element offsets inside one layer-block (bytes).
struct BlockGeometry {
  int64_t elem, heads, dim, slots;
  int64_t KOffset(int64_t h, int64_t d, int64_t s) const { return ((h * dim + d) * slots + s) * elem; }
  int64_t VOffset(int64_t h, int64_t s) const { return heads * dim * slots * elem + ((h * slots + s) * dim) * elem; }
  // which: 0 = K, 1 = V.
  int64_t ScaleOffset(int64_t which, int64_t h, int64_t s) const {
    return 2 * heads * dim * slots * elem + ((which * heads + h) * slots + s) * 4;
  }
};

BlockGeometry Geometry(const KvCacheSpec& s) {
  return {static_cast<int64_t>(DTypeSize(s.dtype)), s.num_kv_heads, s.head_dim, s.block_size};
}

// Where model KV head `head` is first held: (rank, local head).
std::pair<int32_t, int32_t> HolderOf(const KvCacheSpec& s, int32_t head) {
  if (s.num_ranks * s.num_kv_heads == s.ModelKvHeads()) return {head / s.num_kv_heads, head % s.num_kv_heads};
  return {head * (s.num_ranks / s.ModelKvHeads()), 0};  // Replicated: its first rank.
}

// Receiver blocks a packed layer holds, per rank.
int64_t PackedBlocks(const KvCacheSpec& dst, int32_t first_position, int32_t num_positions) {
  const int32_t bs = dst.block_size;
  return std::max<int64_t>(0, (num_positions + bs - 1) / bs - first_position / bs);
}

}  // namespace

std::vector<CopyRun> PlanSameLayout(const KvCacheSpec& src, absl::Span<const int32_t> src_table,
                                    const KvCacheSpec& dst, absl::Span<const int32_t> dst_table,
                                    int32_t layer, int32_t first_position, int32_t num_positions) {
  std::vector<CopyRun> runs;
  const int32_t bs = src.block_size;
  const int64_t bytes = src.LayerBlockBytes();
  for (int32_t r = 0; r < src.num_ranks; ++r) {
    for (int32_t b = first_position / bs; b * bs < num_positions; ++b) {
      Append(runs, {LayerBlockOffset(src, layer, src_table[b], r), LayerBlockOffset(dst, layer, dst_table[b], r),
                    bytes});
    }
  }
  return runs;
}

int64_t PackedLayerBytes(const KvCacheSpec& dst, int32_t first_position, int32_t num_positions) {
  return PackedBlocks(dst, first_position, num_positions) * dst.LayerBlockBytes() * dst.num_ranks;
}

void PackLayer(const KvCacheSpec& src, const char* src_base, absl::Span<const int32_t> src_table,
               const KvCacheSpec& dst, int32_t layer, int32_t first_position, int32_t num_positions,
               char* out) {
  const BlockGeometry sg = Geometry(src), dg = Geometry(dst);
  const bool int8 = src.dtype == DType::kI8;
  const int32_t first_block = first_position / dst.block_size;
  std::memset(out, 0, PackedLayerBytes(dst, first_position, num_positions));
  const int64_t rank_bytes = PackedBlocks(dst, first_position, num_positions) * dst.LayerBlockBytes();
  for (int32_t dr = 0; dr < dst.num_ranks; ++dr) {
    for (int32_t dh = 0; dh < dst.num_kv_heads; ++dh) {
      const auto [sr, sh] = HolderOf(src, dst.FirstKvHead(dr) + dh);
      // Runs of positions contiguous in both the source block and the
      // packed destination block.
      for (int32_t p = first_block * dst.block_size; p < num_positions;) {
        const int32_t ss = p % src.block_size, ds = p % dst.block_size;
        const int32_t len = std::min({src.block_size - ss, dst.block_size - ds, num_positions - p});
        const char* s = src_base + LayerBlockOffset(src, layer, src_table[p / src.block_size], sr);
        char* d = out + dr * rank_bytes + static_cast<int64_t>(p / dst.block_size - first_block) * dst.LayerBlockBytes();
        if (len == sg.slots && len == dg.slots) {
          // A whole block of the same size: the head's K is one run.
          std::memcpy(d + dg.KOffset(dh, 0, 0), s + sg.KOffset(sh, 0, 0), sg.dim * len * sg.elem);
        } else {
          for (int64_t k = 0; k < sg.dim; ++k) {
            std::memcpy(d + dg.KOffset(dh, k, ds), s + sg.KOffset(sh, k, ss), len * sg.elem);
          }
        }
        std::memcpy(d + dg.VOffset(dh, ds), s + sg.VOffset(sh, ss), len * sg.dim * sg.elem);
        if (int8) {
          for (int64_t which = 0; which < 2; ++which) {
            std::memcpy(d + dg.ScaleOffset(which, dh, ds), s + sg.ScaleOffset(which, sh, ss), len * 4);
          }
        }
        p += len;
      }
    }
  }
}

std::vector<CopyRun> PlanPacked(const KvCacheSpec& dst, absl::Span<const int32_t> dst_table,
                                int32_t layer, int32_t first_position, int32_t num_positions,
                                int64_t packed_offset) {
  std::vector<CopyRun> runs;
  const int32_t bs = dst.block_size;
  const int64_t bytes = dst.LayerBlockBytes();
  int64_t at = packed_offset;
  for (int32_t r = 0; r < dst.num_ranks; ++r) {
    for (int32_t b = first_position / bs; b * bs < num_positions; ++b, at += bytes) {
      Append(runs, {at, LayerBlockOffset(dst, layer, dst_table[b], r), bytes});
    }
  }
  return runs;
}

std::vector<uint64_t> PositionChecksums(const KvCacheSpec& spec, const char* base,
                                        absl::Span<const int32_t> table, int32_t first_position,
                                        int32_t num_positions, int32_t group) {
  const BlockGeometry g = Geometry(spec);
  const bool int8 = spec.dtype == DType::kI8;
  const int32_t groups = (num_positions - first_position + group - 1) / group;
  std::vector<uint64_t> out;
  std::string bytes;
  for (int32_t layer = 0; layer < spec.num_layers; ++layer) {
    for (int32_t gi = 0; gi < groups; ++gi) {
      bytes.clear();
      const int32_t p_end = std::min(num_positions, first_position + (gi + 1) * group);
      // Model heads in order, each from the first rank holding it.
      const int32_t heads = spec.ModelKvHeads();
      for (int32_t p = first_position + gi * group; p < p_end; ++p) {
        const int64_t s = p % spec.block_size;
        auto block_of = [&](int32_t head) {
          const auto [rank, local] = HolderOf(spec, head);
          return std::make_pair(base + LayerBlockOffset(spec, layer, table[p / spec.block_size], rank),
                                static_cast<int64_t>(local));
        };
        for (int32_t mh = 0; mh < heads; ++mh) {
          const auto [blk, h] = block_of(mh);
          for (int64_t d = 0; d < g.dim; ++d) bytes.append(blk + g.KOffset(h, d, s), g.elem);
        }
        for (int32_t mh = 0; mh < heads; ++mh) {
          const auto [blk, h] = block_of(mh);
          bytes.append(blk + g.VOffset(h, s), g.dim * g.elem);
        }
        if (int8) {
          for (int64_t which = 0; which < 2; ++which) {
            for (int32_t mh = 0; mh < heads; ++mh) {
              const auto [blk, h] = block_of(mh);
              bytes.append(blk + g.ScaleOffset(which, h, s), 4);
            }
          }
        }
      }
      out.push_back(XXH3_64bits(bytes.data(), bytes.size()));
    }
  }
  return out;
}

}  // namespace pdserve::kv
