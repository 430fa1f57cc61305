// Compiled with -mamx-tile -mamx-bf16 (see linear_amx.h): call only after
// AmxPathSupported().
#include "kernels/cpu/linear_amx.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace pdserve::kernels::cpu {
namespace {

// Linux's arch_prctl requests for the AMX tile data state (asm/prctl.h).
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// Panels handled per pass over x: their weights stay in L2 while every row
// block streams past.
constexpr int64_t kChunkBytes = 512 * 1024;
// Tile depths (1 KiB of a panel each) fetched ahead of the tile loads.
constexpr int64_t kPrefetchSteps = 4;

// The tile configuration (palette 1): tiles 0-3 are C (16 rows x 16 F32),
// 4-5 are A (16 rows x 32 BF16), 6-7 are B (16 pair-rows x 16 columns x 2).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// `first_rows`: rows of the first row tile (A tile 4, C tiles 0 and 1),
// fewer than 16 when the whole product has fewer rows (a decode step of a
// small batch), so its tile loads, products and stores skip the rows that do
// not exist. Each row's sums are the same either way: rows are independent
// in a tile product.
void ConfigureTiles(int first_rows) {
  // The configuration stays loaded on this thread between calls (the tiles
  // are not released: a decode step makes dozens of calls, and loading a
  // configuration costs more than a small product).
  thread_local int loaded_rows = -1;
  if (loaded_rows == first_rows) return;
  loaded_rows = first_rows;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = static_cast<uint8_t>(first_rows);
  _tile_loadconfig(&cfg);
}

bool CpuHasAmx() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
  return amx_bf16 && amx_tile && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512bf16");
}

// Asked once: the kernel grants the tile data state per process.
bool PermissionGranted() {
  static const bool granted = CpuHasAmx() && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// Adds one stored C tile (16 x 16 F32, row stride 64 bytes) into y: rows
// [0, rows), columns [0, cols), with bias and the old y as asked.
inline void StoreTile(const float* c, float* y, int64_t ldy, const float* bias, bool accumulate, int rows, int cols) {
  if (cols <= 0 || rows <= 0) return;
  const __mmask16 mask = cols >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << cols) - 1u);
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    __m512 v = _mm512_load_ps(c + r * 16);
    if (bias != nullptr) v = _mm512_add_ps(v, b);
    float* yr = y + r * ldy;
    if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, yr));
    _mm512_mask_storeu_ps(yr, mask, v);
  }
}

// One row block (up to 32 rows: A tiles 4 and 5) by one or two panels (B
// tiles 6 and 7): C tiles 0 (rows 0-15, panel 0), 1 (rows 0-15, panel 1),
// 2 (rows 16-31, panel 0), 3 (rows 16-31, panel 1).
template <bool kTwoRowTiles, bool kTwoPanels>
void Block(const LinearAmxArgs& a, int64_t m0, int64_t p) {
  const int64_t depth = AmxPaddedK(a.k);
  const int64_t panel_elems = AmxPanelElems(a.k);
  // A tiles of row tile m0 / 16 (and the next), one after another by depth.
  const uint16_t* x0 = a.x + m0 * depth;
  const uint16_t* x1 = x0 + kAmxRows * depth;
  const uint16_t* w0 = a.panels + p * panel_elems;
  const uint16_t* w1 = w0 + panel_elems;
  _tile_zero(0);
  if constexpr (kTwoPanels) _tile_zero(1);
  if constexpr (kTwoRowTiles) _tile_zero(2);
  if constexpr (kTwoRowTiles && kTwoPanels) _tile_zero(3);
  for (int64_t kk = 0; kk < depth; kk += kAmxDepth) {
    // The weights stream from memory (a row block of 32 rows does 4 tile
    // products per 2 KiB of them, far less time than DRAM takes to bring
    // them): fetch kPrefetchSteps tile depths ahead in each panel's stream.
    const char* ahead0 = reinterpret_cast<const char*>(w0 + (kk + kPrefetchSteps * kAmxDepth) * 16);
    for (int line = 0; line < 16; ++line) __builtin_prefetch(ahead0 + line * 64, 0, 3);
    if constexpr (kTwoPanels) {
      const char* ahead1 = reinterpret_cast<const char*>(w1 + (kk + kPrefetchSteps * kAmxDepth) * 16);
      for (int line = 0; line < 16; ++line) __builtin_prefetch(ahead1 + line * 64, 0, 3);
    }
    // B tile: pairs [kk/2, kk/2 + 16) of the panel, 64 bytes per pair row.
    _tile_loadd(6, w0 + kk * 16, 64);
    if constexpr (kTwoPanels) _tile_loadd(7, w1 + kk * 16, 64);
    _tile_loadd(4, x0 + kk * kAmxRows, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kTwoPanels) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoRowTiles) {
      _tile_loadd(5, x1 + kk * kAmxRows, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kTwoPanels) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[16 * 16];
  const int64_t col0 = p * 16;
  const int rows0 = static_cast<int>(a.m - m0 < kAmxRows ? a.m - m0 : kAmxRows);
  const int rows1 = static_cast<int>(a.m - m0 - kAmxRows < kAmxRows ? a.m - m0 - kAmxRows : kAmxRows);
  const int cols0 = static_cast<int>(a.n - col0 < 16 ? a.n - col0 : 16);
  const int cols1 = static_cast<int>(a.n - col0 - 16 < 16 ? a.n - col0 - 16 : 16);
  const float* bias0 = a.bias != nullptr ? a.bias + col0 : nullptr;
  const float* bias1 = a.bias != nullptr ? a.bias + col0 + 16 : nullptr;
  float* y0 = a.y + m0 * a.ldy + col0;
  float* y1 = y0 + kAmxRows * a.ldy;
  // Whole tiles with nothing to add go straight from the accumulators to y,
  // not through `c` (the same F32 values: the same bits). A 512-row product
  // on one thread, K 768, N 2304 or 6144, takes 0.92-0.97x the time (3
  // alternated pairs, Sapphire Rapids class).
  if (a.bias == nullptr && !a.accumulate && rows0 == kAmxRows && cols0 == 16 &&
      (!kTwoPanels || cols1 == 16) && (!kTwoRowTiles || rows1 == kAmxRows)) {
    const size_t stride = static_cast<size_t>(a.ldy) * sizeof(float);
    _tile_stored(0, y0, stride);
    if constexpr (kTwoPanels) _tile_stored(1, y0 + 16, stride);
    if constexpr (kTwoRowTiles) _tile_stored(2, y1, stride);
    if constexpr (kTwoRowTiles && kTwoPanels) _tile_stored(3, y1 + 16, stride);
    return;
  }
  _tile_stored(0, c, 64);
  StoreTile(c, y0, a.ldy, bias0, a.accumulate, rows0, cols0);
  if constexpr (kTwoPanels) {
    _tile_stored(1, c, 64);
    StoreTile(c, y0 + 16, a.ldy, bias1, a.accumulate, rows0, cols1);
  }
  if constexpr (kTwoRowTiles) {
    _tile_stored(2, c, 64);
    StoreTile(c, y1, a.ldy, bias0, a.accumulate, rows1, cols0);
    if constexpr (kTwoPanels) {
      _tile_stored(3, c, 64);
      StoreTile(c, y1 + 16, a.ldy, bias1, a.accumulate, rows1, cols1);
    }
  }
}

// Block for the rows left from m0 (one or two row tiles) and one or two panels.
void AnyBlock(const LinearAmxArgs& a, int64_t m0, int64_t p, bool two_panels) {
  const bool two_rows = a.m - m0 > kAmxRows;
  if (two_rows) {
    if (two_panels) {
      Block<true, true>(a, m0, p);
    } else {
      Block<true, false>(a, m0, p);
    }
  } else if (two_panels) {
    Block<false, true>(a, m0, p);
  } else {
    Block<false, false>(a, m0, p);
  }
}

}  // namespace

bool AmxPathSupported() { return PermissionGranted(); }

void LinearAmx(const LinearAmxArgs& a, int64_t panel_begin, int64_t panel_end) {
  if (a.m <= 0 || panel_begin >= panel_end) return;
  ConfigureTiles(static_cast<int>(a.m < kAmxRows ? a.m : kAmxRows));
  const int64_t panel_bytes = AmxPanelElems(a.k) * 2;
  int64_t chunk = kChunkBytes / panel_bytes;
  if (chunk < 2) chunk = 2;
  // Up to four row blocks: every row block of a pair of panels right after
  // the other, so the weights stream from memory once, in one pass, and the
  // later blocks find them in L1/L2 (a pass per row block over chunks of
  // panels left the memory idle while the later passes ran).
  if (a.m <= 8 * kAmxRows) {
    for (int64_t p = panel_begin; p < panel_end; p += 2) {
      for (int64_t m0 = 0; m0 < a.m; m0 += 2 * kAmxRows) AnyBlock(a, m0, p, p + 1 < panel_end);
    }
    return;
  }
  for (int64_t c0 = panel_begin; c0 < panel_end; c0 += chunk) {
    const int64_t c1 = c0 + chunk < panel_end ? c0 + chunk : panel_end;
    for (int64_t m0 = 0; m0 < a.m; m0 += 2 * kAmxRows) {
      for (int64_t p = c0; p < c1; p += 2) AnyBlock(a, m0, p, p + 1 < c1);
    }
  }
}

double AmxPeakLoop(int64_t iters) {
  if (!PermissionGranted()) return 0;
  ConfigureTiles(16);
  alignas(64) uint16_t ab[16 * 32];
  for (uint16_t& v : ab) v = 0x3380;  // ~6e-8: the sums stay finite.
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ab, 64);
  _tile_loadd(5, ab, 64);
  _tile_loadd(6, ab, 64);
  _tile_loadd(7, ab, 64);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[16 * 16];
  _tile_stored(0, c, 64);
  static volatile float sink;
  sink = c[0];
  return static_cast<double>(iters) * 4 * 16 * 16 * 32 * 2;
}

}  // namespace pdserve::kernels::cpu
