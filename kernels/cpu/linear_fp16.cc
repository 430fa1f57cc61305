// Compiled with -mavx512fp16 (see linear_fp16.h): call only after
// F16PathSupported().
#include "kernels/cpu/linear_fp16.h"

#include <immintrin.h>

#include "kernels/cpu/matrix_probes.h"

namespace pdserve::kernels::cpu {
namespace {

constexpr int kMaxRows = 12;  // 12 rows x 2 panels: 24 half accumulators.
// Panels handled per pass over x: their weights stay in L2 while every row
// tile streams past.
constexpr int64_t kChunkBytes = 256 * 1024;

// x's halves k and k+1 in every pair of lanes: a 32-bit broadcast, one
// load-port µop (a 16-bit VPBROADCASTW would need port 5, the FMAs' port).
inline __m512h BroadcastPair(const uint16_t* p) {
  int32_t pair;
  __builtin_memcpy(&pair, p, sizeof pair);
  return _mm512_castsi512_ph(_mm512_set1_epi32(pair));
}

#include "kernels/cpu/pair_panel_store.inc"

// y[0:MR, 0:valid) (+)= x[0:MR, :] * panels^T for NP consecutive panels
// (valid counts columns from the first). A row's sums are formed in the
// same order whatever MR and NP, so its bits do not depend on the tile.
template <int MR, int NP>
void MicroKernel(const LinearF16Args& a, const uint16_t* x, const uint16_t* panel, int64_t panel_elems, float* y,
                 const float* bias, const float* row_scale, int valid) {
  // F32 sums of each lane (column j, k parity h at lane 2j + h).
  alignas(64) float sum[MR][NP][32];
  for (int r = 0; r < MR; ++r) {
    for (int p = 0; p < NP; ++p) {
      _mm512_store_ps(sum[r][p], _mm512_setzero_ps());
      _mm512_store_ps(sum[r][p] + 16, _mm512_setzero_ps());
    }
  }
  const int64_t pairs = (a.k + 1) / 2;
  for (int64_t q0 = 0; q0 < pairs; q0 += kF16Block) {
    const int64_t q1 = q0 + kF16Block < pairs ? q0 + kF16Block : pairs;
    __m512h acc[MR][NP];
    for (int r = 0; r < MR; ++r) {
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ph();
    }
    for (int64_t q = q0; q < q1; ++q) {
      __m512h b[NP];
      for (int p = 0; p < NP; ++p) {
        const uint16_t* w = panel + p * panel_elems + q * 2 * kF16PanelWidth;
        // Few rows: the loop streams the weights from DRAM; prefetch ahead.
        if constexpr (MR <= 2) __builtin_prefetch(w + 16 * 2 * kF16PanelWidth);
        b[p] = _mm512_castsi512_ph(_mm512_load_si512(w));
      }
      for (int r = 0; r < MR; ++r) {
        const __m512h xr = BroadcastPair(x + r * a.ldx + 2 * q);
        for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_fmadd_ph(xr, b[p], acc[r][p]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int p = 0; p < NP; ++p) {
        const __m512i bits = _mm512_castph_si512(acc[r][p]);
        const __m512 lo = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_castsi512_si256(bits)));
        const __m512 hi = _mm512_cvtxph_ps(_mm256_castsi256_ph(_mm512_extracti64x4_epi64(bits, 1)));
        _mm512_store_ps(sum[r][p], _mm512_add_ps(_mm512_load_ps(sum[r][p]), lo));
        _mm512_store_ps(sum[r][p] + 16, _mm512_add_ps(_mm512_load_ps(sum[r][p] + 16), hi));
      }
    }
  }
  // Column j = its even-k lane + its odd-k lane.
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int r = 0; r < MR; ++r) {
    float* yr = y + r * a.ldy;
    for (int p = 0; p < NP; ++p) {
      const __m512 v0 = _mm512_load_ps(sum[r][p]), v1 = _mm512_load_ps(sum[r][p] + 16);
      __m512 cols = _mm512_add_ps(_mm512_permutex2var_ps(v0, even, v1), _mm512_permutex2var_ps(v0, odd, v1));
      if (row_scale != nullptr) cols = _mm512_mul_ps(cols, _mm512_set1_ps(row_scale[r]));
      const int c = p * kF16PanelWidth;
      StoreCols(yr + c, bias != nullptr ? bias + c : nullptr, a.accumulate, cols, valid - c);
    }
  }
}

template <int MR, int NP>
void DispatchRows(int rows, const LinearF16Args& a, const uint16_t* x, const uint16_t* panel, int64_t panel_elems,
                  float* y, const float* bias, const float* row_scale, int valid) {
  if (rows == MR) {
    MicroKernel<MR, NP>(a, x, panel, panel_elems, y, bias, row_scale, valid);
  } else if constexpr (MR > 1) {
    DispatchRows<MR - 1, NP>(rows, a, x, panel, panel_elems, y, bias, row_scale, valid);
  }
}

}  // namespace

bool F16PathSupported() {
  // HasAvx512Fp16 (matrix_probes.cc): clang 14, which the thread-safety
  // check compiles this file with, does not know the "avx512fp16" feature.
  return HasAvx512Fp16() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
}

void LinearF16(const LinearF16Args& a, int64_t panel_begin, int64_t panel_end) {
  const int64_t panel_elems = F16PanelElems(a.k);
  int64_t chunk = kChunkBytes / (panel_elems * 2);
  if (chunk < 2) chunk = 2;
  // One row tile: each weight is read once anyway; no chunks.
  if (a.m <= kMaxRows) chunk = panel_end - panel_begin;
  for (int64_t c0 = panel_begin; c0 < panel_end; c0 += chunk) {
    const int64_t c1 = c0 + chunk < panel_end ? c0 + chunk : panel_end;
    for (int64_t m0 = 0; m0 < a.m; m0 += kMaxRows) {
      const int rows = static_cast<int>(a.m - m0 < kMaxRows ? a.m - m0 : kMaxRows);
      for (int64_t p = c0; p < c1;) {
        const int64_t col0 = p * kF16PanelWidth;
        const int64_t left = a.n - col0;
        const uint16_t* x = a.x + m0 * a.ldx;
        float* y = a.y + m0 * a.ldy + col0;
        const float* bias = a.bias != nullptr ? a.bias + col0 : nullptr;
        const uint16_t* panel = a.panels + p * panel_elems;
        const float* row_scale = a.row_scale != nullptr ? a.row_scale + m0 : nullptr;
        // One or two rows (decode): four panels at once, four weight
        // streams in flight; more rows: two panels, up to twelve rows.
        const int np = rows <= 2 ? (c1 - p >= 4 ? 4 : 1) : (c1 - p >= 2 ? 2 : 1);
        const int valid = static_cast<int>(left < np * kF16PanelWidth ? left : np * kF16PanelWidth);
        if (np == 4) {
          DispatchRows<2, 4>(rows, a, x, panel, panel_elems, y, bias, row_scale, valid);
        } else if (np == 2) {
          DispatchRows<kMaxRows, 2>(rows, a, x, panel, panel_elems, y, bias, row_scale, valid);
        } else {
          DispatchRows<kMaxRows, 1>(rows, a, x, panel, panel_elems, y, bias, row_scale, valid);
        }
        p += np;
      }
    }
  }
}

float ConvertF32ToF16(const float* x, int64_t n, uint16_t* out) {
  // The largest |x| as bits: for non-negative floats the integer order is
  // the float order, and a NaN's bits are above every number's.
  __m512i amax = _mm512_setzero_si512();
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    amax = _mm512_max_epu32(amax, _mm512_and_si512(_mm512_castps_si512(v), abs_mask));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  if (i < n) {
    const __mmask16 m = TailMask(static_cast<int>(n - i));
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    amax = _mm512_max_epu32(amax, _mm512_and_si512(_mm512_castps_si512(v), abs_mask));
    _mm256_mask_storeu_epi16(out + i, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  const uint32_t bits = _mm512_reduce_max_epu32(amax);
  float result;
  __builtin_memcpy(&result, &bits, sizeof result);
  return result;
}

}  // namespace pdserve::kernels::cpu
