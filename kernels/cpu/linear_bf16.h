// The BF16 matrix path: y = x W^T with W held as the model's BF16 weights
// (exactly), x rounded to BF16, and each pair of products summed into F32
// by AVX512-BF16 VDPBF16PS: twice the F32 FMA rate on CPUs that run it at
// full width (the Zen 5 class; the Sapphire Rapids class
// runs it at half the F32 rate, so the probe leaves it there).
//
// Layout: the FP16 path's panels (linear_fp16.h: 16 output columns x k
// pairs, interleaved), holding BF16 bits; VDPBF16PS adds a lane's pair of
// products to its F32 sum, so a column's sum is F32 from the first pair
// and its order is fixed by k alone.
//
// Compiled with -mavx512bf16; call only when Bf16PathSupported().
#ifndef PDSERVE_KERNELS_CPU_LINEAR_BF16_H_
#define PDSERVE_KERNELS_CPU_LINEAR_BF16_H_

#include <cstdint>

namespace pdserve::kernels::cpu {

struct LinearBf16Args {
  const uint16_t* x;       // [M, ldx] BF16, ldx = K rounded up to even (the pad is 0)
  int64_t ldx;
  int64_t m;
  int64_t k;
  int64_t n;               // Valid output columns.
  const uint16_t* panels;  // [ceil(N/16)] panels (F16PanelElems(k) each), 64-byte aligned
  const float* bias;       // [N] or nullptr
  float* y;                // [M, N] F32, row stride ldy
  int64_t ldy;
  bool accumulate;         // y += x W^T (+ bias) instead of y = ...
};

// AVX512-BF16 (with F, BW, VL, DQ) on this CPU.
bool Bf16PathSupported();

// Rows of one tile: a product of at most this many rows reads each weight
// once, straight from memory.
inline constexpr int kBf16TileRows = 12;

// The panels one kernel call takes at once for m rows (a thread's unit of
// work in a decode product).
int64_t Bf16PanelsPerCall(int64_t m);

// Panels [panel_begin, panel_end) of the product. Each row's result is the
// same whatever M and whichever tile the row falls in.
void LinearBf16(const LinearBf16Args& args, int64_t panel_begin, int64_t panel_end);

// out[i] = bf16(x[i]), round to nearest even (a NaN stays a NaN).
void ConvertF32ToBf16(const float* x, int64_t n, uint16_t* out);

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_LINEAR_BF16_H_
