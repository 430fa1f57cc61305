// The FP16 matrix path: y = x W^T with x and W rounded to IEEE half
// precision and multiplied in AVX512-FP16, about twice the F32 FMA rate on
// CPUs whose FP16 FMA runs at full width (the Sapphire Rapids class). The backend chooses it at start-up (cpu_backend.h) and
// never on a CPU without AVX512-FP16.
//
// Layout: each 512-bit vector of weights holds 16 output columns x 2
// consecutive k (pairs interleaved), so one 32-bit broadcast of x's pair
// (a pure load) feeds every panel of a tile. Each lane sums its products
// in half precision for kF16Block pairs, then the sums are widened into
// F32 accumulators, so rounding error grows with the block, not with K;
// the two k-halves of each column are added at the end.
//
// Everything here is compiled with -mavx512fp16 and may only be called when
// F16PathSupported() is true.
#ifndef PDSERVE_KERNELS_CPU_LINEAR_FP16_H_
#define PDSERVE_KERNELS_CPU_LINEAR_FP16_H_

#include <cstdint>

namespace pdserve::kernels::cpu {

// Output columns per FP16 panel; a panel is [ceil(K/2)][16 columns][2] halves.
inline constexpr int kF16PanelWidth = 16;
// K pairs summed in half precision before the sums are widened to F32.
inline constexpr int kF16Block = 64;

// Elements of one panel (K rounded up to even).
inline int64_t F16PanelElems(int64_t k) { return (k + 1) / 2 * 2 * kF16PanelWidth; }
// Index of weight (column j of its panel, k) within the panel.
inline int64_t F16PanelIndex(int64_t j, int64_t k) { return (k / 2) * 2 * kF16PanelWidth + j * 2 + (k & 1); }

struct LinearF16Args {
  const uint16_t* x;       // [M, ldx] halves, ldx = K rounded up to even (the pad is 0)
  int64_t ldx;
  int64_t m;
  int64_t k;
  int64_t n;               // Valid output columns.
  const uint16_t* panels;  // [ceil(N/16)] panels, 64-byte aligned
  const float* bias;       // [N] or nullptr
  float* y;                // [M, N] F32, row stride ldy
  int64_t ldy;
  bool accumulate;         // y += x W^T (+ bias) instead of y = ...
  // [M] or nullptr: row r's products are multiplied by row_scale[r] (a
  // power of two) before the bias and the old y are added, for rows whose x
  // was divided by it to fit half precision.
  const float* row_scale = nullptr;
};

// Rows of x whose largest |value| exceeds this are divided by a power of two
// to come under it before they are rounded to FP16 (the sums of kF16Block
// products then stay far from the largest half, 65504), and their products
// multiplied back: no infinity, and the other rows' bits unchanged.
inline constexpr float kF16RowMax = 2048.0f;

// AVX512-FP16 (with F, BW, VL, DQ) on this CPU.
bool F16PathSupported();

// Panels [panel_begin, panel_end) of the product. Each row's result is the
// same whatever M and whichever tile the row falls in.
void LinearF16(const LinearF16Args& args, int64_t panel_begin, int64_t panel_end);

// out[i] = half(x[i]), round to nearest even (overflow: +-inf); returns
// max |x[i]| (NaN if any x[i] is NaN).
float ConvertF32ToF16(const float* x, int64_t n, uint16_t* out);

// The largest finite half, 65504: weights beyond it cannot take this path.
inline constexpr float kF16Max = 65504.0f;

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_LINEAR_FP16_H_
