// Compiled with -mavx512bf16 (see linear_bf16.h): call only after
// Bf16PathSupported().
#include "kernels/cpu/linear_bf16.h"

#include <immintrin.h>

#include "kernels/cpu/linear_fp16.h"
#include "kernels/cpu/matrix_probes.h"

namespace pdserve::kernels::cpu {
namespace {

constexpr int kMaxRows = kBf16TileRows;  // 12 rows x 2 panels: 24 F32 accumulators.
// Panels handled per pass over x: their weights stay in L2 while every row
// tile streams past.
constexpr int64_t kChunkBytes = 256 * 1024;

// x's BF16 pair (k, k+1) in every lane: a 32-bit broadcast (a pure load).
inline __m512bh BroadcastPair(const uint16_t* p) {
  int32_t pair;
  __builtin_memcpy(&pair, p, sizeof pair);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

#include "kernels/cpu/pair_panel_store.inc"

// y[0:MR, 0:valid) (+)= x[0:MR, :] * panels^T for NP consecutive panels.
// A row's sums are formed in the same order whatever MR and NP.
template <int MR, int NP>
void MicroKernel(const LinearBf16Args& a, const uint16_t* x, const uint16_t* panel, int64_t panel_elems, float* y,
                 const float* bias, int valid) {
  __m512 acc[MR][NP];
  for (int r = 0; r < MR; ++r) {
    for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_setzero_ps();
  }
  const int64_t pairs = (a.k + 1) / 2;
  // The weights stream from DRAM on the first row tile: prefetch ahead,
  // further with more rows (more work per byte). Measured on the Zen 5
  // class (one thread, 24 MiB of weights): 16 pairs for one or two rows,
  // 64 for 8-64 rows (1.15-1.4x over none, a one-off harness); an
  // L2-resident pass pays one extra load slot per panel.
  constexpr int64_t kAhead = MR <= 2 ? 16 : 64;
  for (int64_t q = 0; q < pairs; ++q) {
    // Near its end, each panel's prefetch goes on into the panel that
    // follows this call's NP (the same stream of the next call), not into
    // this call's next panel, which is already being read: otherwise every
    // call starts its NP streams cold. Measured on the Zen 5 class (2
    // threads, 192 MiB of weights, one-off harness, medians of 21
    // alternations): 8 and 12 rows at k = 768 (24 KiB panels) 0.79-0.80x
    // the time, 8 rows at k = 2048 0.93x; 1-2 and 32-64 rows unchanged.
    const int64_t next_call = q + kAhead >= pairs ? (NP - 1) * panel_elems : 0;
    __m512bh b[NP];
    for (int p = 0; p < NP; ++p) {
      const uint16_t* w = panel + p * panel_elems + q * 2 * kF16PanelWidth;
      __builtin_prefetch(w + kAhead * 2 * kF16PanelWidth + next_call);
      b[p] = reinterpret_cast<__m512bh>(_mm512_load_si512(w));
    }
    for (int r = 0; r < MR; ++r) {
      const __m512bh xr = BroadcastPair(x + r * a.ldx + 2 * q);
      for (int p = 0; p < NP; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xr, b[p]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* yr = y + r * a.ldy;
    for (int p = 0; p < NP; ++p) {
      const int c = p * kF16PanelWidth;
      StoreCols(yr + c, bias != nullptr ? bias + c : nullptr, a.accumulate, acc[r][p], valid - c);
    }
  }
}

template <int MR, int NP>
void DispatchRows(int rows, const LinearBf16Args& a, const uint16_t* x, const uint16_t* panel, int64_t panel_elems,
                  float* y, const float* bias, int valid) {
  if (rows == MR) {
    MicroKernel<MR, NP>(a, x, panel, panel_elems, y, bias, valid);
  } else if constexpr (MR > 1) {
    DispatchRows<MR - 1, NP>(rows, a, x, panel, panel_elems, y, bias, valid);
  }
}

}  // namespace

bool Bf16PathSupported() {
  return HasAvx512Bf16() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

int64_t Bf16PanelsPerCall(int64_t m) { return m <= 2 ? 4 : 2; }

void LinearBf16(const LinearBf16Args& a, int64_t panel_begin, int64_t panel_end) {
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
        // One or two rows (decode): four panels at once, four weight
        // streams in flight; more rows: two panels, up to twelve rows.
        // Fewer left: one at a time.
        const int64_t want = Bf16PanelsPerCall(rows);
        const int np = static_cast<int>(c1 - p >= want ? want : 1);
        const int valid = static_cast<int>(left < np * kF16PanelWidth ? left : np * kF16PanelWidth);
        if (np == 4) {
          DispatchRows<2, 4>(rows, a, x, panel, panel_elems, y, bias, valid);
        } else if (np == 2) {
          DispatchRows<kMaxRows, 2>(rows, a, x, panel, panel_elems, y, bias, valid);
        } else {
          DispatchRows<kMaxRows, 1>(rows, a, x, panel, panel_elems, y, bias, valid);
        }
        p += np;
      }
    }
  }
}

void ConvertF32ToBf16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), reinterpret_cast<__m256i>(h));
  }
  if (i < n) {
    const __mmask16 m = TailMask(static_cast<int>(n - i));
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i));
    _mm256_mask_storeu_epi16(out + i, m, reinterpret_cast<__m256i>(h));
  }
}

}  // namespace pdserve::kernels::cpu
