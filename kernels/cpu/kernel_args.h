// Plain argument structs shared by the per-ISA CPU kernel translation units.
// This header holds data only (no inline code: its few sizes are static
// functions, one copy in each unit), so the per-ISA units, which are
// compiled with different -m flags, cannot collide on shared symbols.
#ifndef PDSERVE_KERNELS_CPU_KERNEL_ARGS_H_
#define PDSERVE_KERNELS_CPU_KERNEL_ARGS_H_

#include <cstdint>

namespace pdserve::kernels::cpu {

// Weights of a linear layer W[N, K] re-laid out in panels of kPanelWidth
// output rows: panels[p][k][j] = W[p * kPanelWidth + j, k], rows past N are
// zero. Element type F32, BF16 (bits in uint16_t) or I8 (symmetric, with one
// F32 scale per output row).
inline constexpr int kPanelWidth = 16;

enum class ElemType : int32_t { kF32 = 0, kBF16 = 1, kI8 = 2 };

struct LinearArgs {
  const float* x;      // [M, K], row stride ldx
  int64_t ldx;
  int64_t m;
  int64_t k;
  int64_t n;           // Valid output columns.
  const void* panels;  // [ceil(N/16), K, 16] of w_type
  ElemType w_type;
  const float* w_scales;  // kI8: [ceil(N/16) * 16] per output row; else nullptr
  const float* bias;   // [N] or nullptr
  float* y;            // [M, N], row stride ldy
  int64_t ldy;
  bool accumulate;     // y += x W^T (+ bias) instead of y = ...
  // Other memory to prefetch while the weights stream (the next attention's
  // KV, CpuBackend::PrefetchKv): lines [side_begin, side_end) of the blocks
  // side_blocks[0..], each side_block_lines 64-byte lines long, line i at
  // side_blocks[i / side_block_lines] + i % side_block_lines * 64. Spread
  // over the panels in proportion; none when side_begin == side_end. Taken
  // only at KernelTable::linear_side_rows.
  const char* const* side_blocks = nullptr;
  int64_t side_begin = 0;
  int64_t side_end = 0;
  int64_t side_block_lines = 0;
};

// One sequence of an attention batch: `num_new` query rows (positions
// num_cached .. num_cached + num_new - 1) attend to positions 0 .. own
// position, all of which are already in the paged cache.
struct AttentionSeq {
  const int32_t* block_table;  // Physical block of each logical block.
  int32_t num_cached;
  int32_t num_new;
  int32_t row_offset;  // First row of this sequence in q / out.
};

// Attention's softmax folds a row's keys run by run (kAttentionRunKeys
// keys, whole blocks: kAttentionRunKeys / block_size of them) and groups the
// runs in segments of kAttentionSegmentRuns runs: each segment is folded
// from an empty state, and the segments' states are merged in key order
// (kernels_impl.inc, MergeState). Every path (a prompt's tiles, a lone
// decode row, a decode row's segments on several threads, cascade) does
// exactly this, so a row's bits never depend on which of them computed it.
inline constexpr int32_t kAttentionRunKeys = 256;
inline constexpr int32_t kAttentionSegmentRuns = 2;
static constexpr int32_t AttentionSegmentBlocks(int32_t block_size) {
  return kAttentionSegmentRuns * (kAttentionRunKeys / block_size);
}

// A unit of parallel work: rows [row_begin, row_end) of one sequence, for the
// query heads of one KV head; with `segment` >= 0, one row's keys of that
// segment only, whose softmax state (not yet normalised) goes to
// AttentionArgs::partials at `partial` (AttentionPartialFloats each KV head,
// for the consecutive heads of the items that the kernel takes together)
// for AttentionCombine to merge.
struct AttentionItem {
  int32_t seq;
  int32_t kv_head;
  int32_t row_begin;
  int32_t row_end;
  int32_t segment = -1;
  int64_t partial = -1;
};

// A decode row's KV head whose segments ran as separate items: their
// `count` states at partials + first_partial, `stride` floats apart,
// merged in key order and normalised into out.
struct AttentionCombine {
  int64_t row;
  int32_t kv_head;
  int32_t count;
  int64_t first_partial;
  int64_t stride;
};

// Floats of one KV head's softmax state: its `group` query heads' sums of
// weighted V (head_dim each), maxima and sums of weights.
static constexpr int64_t AttentionPartialFloats(int32_t group, int32_t head_dim) {
  return static_cast<int64_t>(group) * (head_dim + 2);
}

struct AttentionArgs {
  const float* q;  // [T, num_heads, head_dim]
  float* out;      // [T, num_heads, head_dim]
  const AttentionSeq* seqs;
  // KV of one layer: block b's K for kv head h is [head_dim][block_size]
  // (transposed: element (d, s) at kv + b * block_stride + h * head_stride +
  // d * block_size + s); its V is [block_size][head_dim] at the same place +
  // v_offset (element (s, d) at ... + v_offset + s * head_dim + d).
  // Element type kv_type. For kI8, the
  // block's F32 scales ([K|V][num_kv_heads][block_size]) start scale_offset
  // bytes after the block's start.
  const void* kv;
  ElemType kv_type;
  int64_t block_stride;  // In elements.
  int64_t head_stride;   // In elements.
  int64_t v_offset;      // In elements.
  int64_t scale_offset;  // In bytes; kI8 only.
  int32_t block_size;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  float scale;
  // BF16 KV only, on a CPU with AVX512-BF16 and an even block_size: the
  // AVX-512 kernels score and weight with BF16 dot products (queries and
  // softmax weights rounded to BF16; kernels_impl.inc, UpdateTileDot).
  bool bf16_dot = false;
  // Segment states of the items with a segment (AttentionItem::partial).
  float* partials = nullptr;
};

// Cascade (shared-prefix) attention plan for decode batches: steps in
// logical block order, each one physical block and the queries that read it.
struct AttentionGroupStep {
  int32_t block;          // Physical block.
  int32_t query_begin;    // Range in `queries`.
  int32_t query_end;
  int32_t logical_block;  // Its index in the block tables of its queries.
};
struct AttentionGroupQuery {
  int32_t state;    // Index into `rows` and AttentionArgs::seqs (the kernel's state).
  int32_t visible;  // Keys of this block the query attends to.
};
// A cascade query's state: scaled queries, the current segment's state and
// the merged earlier segments' state.
static constexpr int64_t AttentionGroupStateFloats(int32_t group, int32_t head_dim) {
  return static_cast<int64_t>(group) * head_dim + 2 * AttentionPartialFloats(group, head_dim);
}
struct AttentionGroupPlan {
  const AttentionGroupStep* steps;
  int64_t num_steps;
  const AttentionGroupQuery* queries;
  const int64_t* rows;  // Query row (in q / out) of each state.
  int32_t num_rows;
};

// Function table of one instruction-set path.
struct KernelTable {
  const char* name;
  // Computes output panels [panel_begin, panel_end).
  void (*linear)(const LinearArgs& args, int64_t panel_begin, int64_t panel_end);
  // Both attention kernels return the KV bytes they read (K, V and int8
  // scales; a block read for several rows or queries at once counts once).
  int64_t (*attention)(const AttentionArgs& args, const AttentionItem* items, int64_t num_items);
  // One KV head of a grouped plan; `state` holds
  // num_rows * AttentionGroupStateFloats(group, head_dim) floats.
  int64_t (*attention_grouped)(const AttentionArgs& args, const AttentionGroupPlan& plan,
                               int32_t kv_head, float* state);
  // Merges and normalises the segment states of `attention` items.
  void (*attention_combine)(const AttentionArgs& args, const AttentionCombine* combines, int64_t num);
  // out[i] = silu(gate[i]) * up[i] for i < n.
  void (*silu_mul)(const float* gate, const float* up, float* out, int64_t n);
  // One row of RMS normalization: y[i] = x[i] * inv * w[i], inv =
  // 1 / sqrt(sum x^2 / n + eps) rounded to float. The sum in float64 (each
  // square exact) as 8 partial sums, element i in sum i % 8, each in
  // order, added as ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7)): the
  // same bits on every ISA. y may be x.
  void (*rms_norm_row)(const float* x, const float* w, int64_t n, float eps, float* y);
  // Machine-limit probes for benchmarks, on this path's instructions:
  // `iters` rounds of independent multiply-adds; returns the FLOPs done.
  double (*fma_peak_loop)(int64_t iters);
  // Reads n floats (n a multiple of 64) as fast as possible; returns a sum so
  // the reads cannot be elided.
  float (*read_sum)(const float* p, int64_t n);
  // The rows [first, last] at which `linear` takes LinearArgs' side stream
  // (none when first > last).
  int64_t linear_side_rows[2];
};

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_KERNEL_ARGS_H_
