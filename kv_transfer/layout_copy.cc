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

}  // namespace

std::vector<CopyRun> PlanSameLayout(const KvCacheSpec& src, absl::Span<const int32_t> src_table,
                                    const KvCacheSpec& dst, absl::Span<const int32_t> dst_table,
                                    int32_t layer, int32_t first_position, int32_t num_positions) {
  std::vector<CopyRun> runs;
  const int32_t bs = src.block_size;
  const int64_t bytes = src.LayerBlockBytes();
  for (int32_t b = first_position / bs; b * bs < num_positions; ++b) {
    Append(runs, {LayerBlockOffset(src, layer, src_table[b]), LayerBlockOffset(dst, layer, dst_table[b]), bytes});
  }
  return runs;
}

int64_t PackedLayerBytes(const KvCacheSpec& dst, int32_t first_position, int32_t num_positions) {
  const int32_t bs = dst.block_size;
  const int64_t blocks = (num_positions + bs - 1) / bs - first_position / bs;
  return std::max<int64_t>(0, blocks) * dst.LayerBlockBytes();
}

void PackLayer(const KvCacheSpec& src, const char* src_base, absl::Span<const int32_t> src_table,
               const KvCacheSpec& dst, int32_t layer, int32_t first_position, int32_t num_positions,
               char* out) {
  const BlockGeometry sg = Geometry(src), dg = Geometry(dst);
  const bool int8 = src.dtype == DType::kI8;
  const int32_t first_block = first_position / dst.block_size;
  std::memset(out, 0, PackedLayerBytes(dst, first_position, num_positions));
  // Runs of positions contiguous in both the source block and the packed
  // destination block.
  for (int32_t p = first_block * dst.block_size; p < num_positions;) {
    const int32_t ss = p % src.block_size, ds = p % dst.block_size;
    const int32_t len = std::min({src.block_size - ss, dst.block_size - ds, num_positions - p});
    const char* s = src_base + LayerBlockOffset(src, layer, src_table[p / src.block_size]);
    char* d = out + static_cast<int64_t>(p / dst.block_size - first_block) * dst.LayerBlockBytes();
    for (int64_t h = 0; h < sg.heads; ++h) {
      for (int64_t k = 0; k < sg.dim; ++k) {
        std::memcpy(d + dg.KOffset(h, k, ds), s + sg.KOffset(h, k, ss), len * sg.elem);
      }
      std::memcpy(d + dg.VOffset(h, ds), s + sg.VOffset(h, ss), len * sg.dim * sg.elem);
      if (int8) {
        for (int64_t which = 0; which < 2; ++which) {
          std::memcpy(d + dg.ScaleOffset(which, h, ds), s + sg.ScaleOffset(which, h, ss), len * 4);
        }
      }
    }
    p += len;
  }
}

std::vector<CopyRun> PlanPacked(const KvCacheSpec& dst, absl::Span<const int32_t> dst_table,
                                int32_t layer, int32_t first_position, int32_t num_positions,
                                int64_t packed_offset) {
  std::vector<CopyRun> runs;
  const int32_t bs = dst.block_size;
  const int64_t bytes = dst.LayerBlockBytes();
  int64_t at = packed_offset;
  for (int32_t b = first_position / bs; b * bs < num_positions; ++b, at += bytes) {
    Append(runs, {at, LayerBlockOffset(dst, layer, dst_table[b]), bytes});
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
      for (int32_t p = first_position + gi * group; p < p_end; ++p) {
        const char* blk = base + LayerBlockOffset(spec, layer, table[p / spec.block_size]);
        const int64_t s = p % spec.block_size;
        for (int64_t h = 0; h < g.heads; ++h) {
          for (int64_t d = 0; d < g.dim; ++d) bytes.append(blk + g.KOffset(h, d, s), g.elem);
        }
        for (int64_t h = 0; h < g.heads; ++h) bytes.append(blk + g.VOffset(h, s), g.dim * g.elem);
        if (int8) {
          for (int64_t which = 0; which < 2; ++which) {
            for (int64_t h = 0; h < g.heads; ++h) bytes.append(blk + g.ScaleOffset(which, h, s), 4);
          }
        }
      }
      out.push_back(XXH3_64bits(bytes.data(), bytes.size()));
    }
  }
  return out;
}

}  // namespace pdserve::kv
