// The FP16 matrix path: y = x W^T with x and W rounded to IEEE half
// precision, multiply-adds in AVX512-FP16 (32 lanes), and the half-precision
// partial sums widened into F32 accumulators every kF16Block products, so
// rounding error grows with the block, not with K. About twice the F32 FMA
// rate on CPUs whose FP16 FMA runs at full width (MACHINE_FACTS: the
// Sapphire Rapids class); the backend chooses it at start-up (cpu_backend.h)
// and never on a CPU without AVX512-FP16.
//
// Everything here is compiled with -mavx512fp16 and may only be called when
// F16PathSupported() is true.
#ifndef PDSERVE_KERNELS_CPU_LINEAR_FP16_H_
#define PDSERVE_KERNELS_CPU_LINEAR_FP16_H_

#include <cstdint>

namespace pdserve::kernels::cpu {

// Output columns per FP16 panel: one 512-bit vector of halves.
inline constexpr int kF16PanelWidth = 32;
// Products summed in half precision before they are widened to F32.
inline constexpr int kF16Block = 32;

struct LinearF16Args {
  const uint16_t* x;       // [M, K] halves, row stride ldx
  int64_t ldx;
  int64_t m;
  int64_t k;
  int64_t n;               // Valid output columns.
  const uint16_t* panels;  // [ceil(N/32), K, 32] halves, 64-byte aligned
  const float* bias;       // [N] or nullptr
  float* y;                // [M, N] F32, row stride ldy
  int64_t ldy;
  bool accumulate;         // y += x W^T (+ bias) instead of y = ...
};

// AVX512-FP16 (with F, BW, VL, DQ) on this CPU.
bool F16PathSupported();

// Panels [panel_begin, panel_end) of the product. Each row's result is the
// same whatever M and whichever tile the row falls in.
void LinearF16(const LinearF16Args& args, int64_t panel_begin, int64_t panel_end);

// out[i] = half(x[i]), round to nearest even (overflow: +-inf).
void ConvertF32ToF16(const float* x, int64_t n, uint16_t* out);

// The largest finite half, 65504: weights beyond it cannot take this path.
inline constexpr float kF16Max = 65504.0f;

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_LINEAR_FP16_H_
