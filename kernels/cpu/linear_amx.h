// The AMX matrix path: y = x W^T on Intel AMX tiles (TDPBF16PS): the BF16
// weights as they are, the activations rounded to BF16, F32 sums in the
// tile accumulators. One core's tile unit multiplies a 16x32 by a 32x16
// BF16 tile in 16 cycles, about 6x the AVX512-FP16 FMA rate here (the
// Sapphire Rapids class), so prefill and batched decode stop being bound by
// the multiply-adds.
//
// Layout: the BF16 path's k-pair panels (linear_fp16.h: 16 output columns x
// k pairs, interleaved), with K padded to a whole tile depth (kAmxDepth,
// zeros): 16 consecutive pairs of a panel are one B tile, 1 KiB contiguous.
// x is BF16 in A tiles: for each tile of 16 rows (the row count padded to
// whole tiles), its tile depths in order, each 16 rows x 32 elements, 1 KiB
// contiguous (AmxTileOffset); K is padded with zeros to a whole depth. An A
// tile is then one contiguous load, not 16 rows a padded K apart (measured
// 1.4-1.6x the products' speed at 32 rows with the weights in L2).
// A row's sums are formed by the same tile instructions in the same order
// whatever M and whichever tile the row falls in (rows are independent in a
// tile product), so its bits do not depend on the batch.
//
// Compiled with -mamx-tile -mamx-bf16; call only when AmxPathSupported().
#ifndef PDSERVE_KERNELS_CPU_LINEAR_AMX_H_
#define PDSERVE_KERNELS_CPU_LINEAR_AMX_H_

#include <cstdint>

namespace pdserve::kernels::cpu {

// K elements per tile product (16 pairs: 64 bytes of BF16 per tile row).
inline constexpr int64_t kAmxDepth = 32;
// Rows of x per tile.
inline constexpr int64_t kAmxRows = 16;

inline int64_t AmxPaddedK(int64_t k) { return (k + kAmxDepth - 1) / kAmxDepth * kAmxDepth; }
// Elements of one panel: padded K x 16 columns.
inline int64_t AmxPanelElems(int64_t k) { return AmxPaddedK(k) * 16; }
// Where row `row`, column `col` of x lies in the tiled layout (elements).
inline int64_t AmxTileOffset(int64_t k, int64_t row, int64_t col) {
  const int64_t depths = AmxPaddedK(k) / kAmxDepth;
  return (((row / kAmxRows) * depths + col / kAmxDepth) * kAmxRows + row % kAmxRows) * kAmxDepth + col % kAmxDepth;
}

struct LinearAmxArgs {
  const uint16_t* x;       // [ceil(M/16)][AmxPaddedK(K)/32][16][32] BF16 (AmxTileOffset; pads 0)
  int64_t m;
  int64_t k;
  int64_t n;               // Valid output columns.
  const uint16_t* panels;  // [ceil(N/16)] panels (AmxPanelElems(k) each), 64-byte aligned
  const float* bias;       // [N] or nullptr
  float* y;                // [M, N] F32, row stride ldy
  int64_t ldy;
  bool accumulate;         // y += x W^T (+ bias) instead of y = ...
};

// AMX-TILE and AMX-BF16 on this CPU, AVX-512 (F, BW, VL, DQ, BF16) beside
// them, and the kernel's permission to use the tile data (asked for once,
// process-wide, on the first call).
bool AmxPathSupported();

// Panels [panel_begin, panel_end) of the product, on the calling thread
// (which configures its tiles and keeps them configured for the next call).
void LinearAmx(const LinearAmxArgs& args, int64_t panel_begin, int64_t panel_end);

// Multiply-add rate probe: FLOPs of `iters` rounds of four independent tile
// products on this thread (0 when AMX is not usable).
double AmxPeakLoop(int64_t iters);

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_LINEAR_AMX_H_
