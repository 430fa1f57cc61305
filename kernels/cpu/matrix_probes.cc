// Compiled with -mavx512bf16 -mavx512fp16; every entry point checks CPUID
// before executing one of those instructions.
#include "kernels/cpu/matrix_probes.h"

#include <immintrin.h>

namespace pdserve::kernels::cpu {
namespace {
volatile float g_probe_sink;
}  // namespace

bool HasAvx512Bf16() { return __builtin_cpu_supports("avx512bf16"); }
bool HasAvx512Fp16() { return __builtin_cpu_supports("avx512fp16"); }

// Sixteen accumulators as named variables, so they live in registers (an
// array stays in memory, and the loop then times store forwarding instead).
#define PDSERVE_X16(m) m(0) m(1) m(2) m(3) m(4) m(5) m(6) m(7) m(8) m(9) m(10) m(11) m(12) m(13) m(14) m(15)

double Bf16DotPeakLoop(int64_t iters) {
  if (!HasAvx512Bf16()) return 0;
#define PDSERVE_INIT(i) __m512 acc##i = _mm512_set1_ps(static_cast<float>(i) * 1e-3f);
  PDSERVE_X16(PDSERVE_INIT)
#undef PDSERVE_INIT
  __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x3f803f80));        // (1.0, 1.0)
  const __m512bh y = reinterpret_cast<__m512bh>(_mm512_set1_epi32(0x33d633d6));  // ~1e-7
  for (int64_t it = 0; it < iters; ++it) {
#define PDSERVE_STEP(i) acc##i = _mm512_dpbf16_ps(acc##i, x, y);
    PDSERVE_X16(PDSERVE_STEP)
#undef PDSERVE_STEP
    __asm__ volatile("" : "+v"(x));  // Keep the loop from being folded.
  }
  float sink = 0;
#define PDSERVE_SUM(i) sink += _mm512_reduce_add_ps(acc##i);
  PDSERVE_X16(PDSERVE_SUM)
#undef PDSERVE_SUM
  g_probe_sink = sink;
  return 2.0 * 2 * 16 * 16 * static_cast<double>(iters);
}

double Fp16FmaPeakLoop(int64_t iters) {
  if (!HasAvx512Fp16()) return 0;
#define PDSERVE_INIT(i) __m512h acc##i = _mm512_set1_ph(static_cast<_Float16>(i * 1e-3f));
  PDSERVE_X16(PDSERVE_INIT)
#undef PDSERVE_INIT
  __m512h a = _mm512_set1_ph(static_cast<_Float16>(0.999f));
  const __m512h b = _mm512_set1_ph(static_cast<_Float16>(1e-4f));
  for (int64_t it = 0; it < iters; ++it) {
#define PDSERVE_STEP(i) acc##i = _mm512_fmadd_ph(acc##i, a, b);
    PDSERVE_X16(PDSERVE_STEP)
#undef PDSERVE_STEP
    __asm__ volatile("" : "+v"(a));
  }
  float sink = 0;
#define PDSERVE_SUM(i) sink += static_cast<float>(_mm512_reduce_add_ph(acc##i));
  PDSERVE_X16(PDSERVE_SUM)
#undef PDSERVE_SUM
  g_probe_sink = sink;
  return 2.0 * 32 * 16 * static_cast<double>(iters);
}
#undef PDSERVE_X16

}  // namespace pdserve::kernels::cpu
