#include "kernels/cpu/cpu_backend.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/cpu/linear_amx.h"
#include "kernels/cpu/linear_bf16.h"
#include "kernels/cpu/linear_fp16.h"
#include "kernels/cpu/matrix_probes.h"

namespace pdserve::kernels::cpu {
namespace {

constexpr size_t kHugePageBytes = 2 << 20;

// Panel-packed weights (see kernel_args.h), 64-byte aligned.
// `pairs` kF16 / kBf16: held as FP16 / BF16 in the k-pair panels of those
// matrix paths (linear_fp16.h, linear_bf16.h), whatever `dtype` the model
// asked for (BF16); kF32: the ISA kernels' panels of `dtype`.
class PackedLinear final : public LinearWeight {
 public:
  PackedLinear(int64_t n, int64_t k, DType dtype, MatrixPath pairs = MatrixPath::kF32)
      : n_(n),
        k_(k),
        dtype_(dtype),
        pairs_(pairs),
        width_(pairs != MatrixPath::kF32 ? kF16PanelWidth : kPanelWidth),
        num_panels_((n + width_ - 1) / width_) {
    bytes_ = pairs == MatrixPath::kAmx   ? static_cast<size_t>(num_panels_ * AmxPanelElems(k)) * 2
             : pairs != MatrixPath::kF32 ? static_cast<size_t>(num_panels_ * F16PanelElems(k)) * 2
                 : static_cast<size_t>(num_panels_ * width_ * k) * DTypeSize(dtype);
    // A matrix of 2 MiB or more in transparent huge pages: a decode step
    // streams every weight once, and with 4 KiB pages each page costs a
    // TLB miss.
    const bool huge = bytes_ >= kHugePageBytes;
    const size_t align = huge ? kHugePageBytes : 64;
    const size_t alloc = bytes_ == 0 ? 64 : (bytes_ + align - 1) / align * align;
    data_ = static_cast<char*>(std::aligned_alloc(align, alloc));
    if (huge) madvise(data_, alloc, MADV_HUGEPAGE);
    std::memset(data_, 0, alloc);
    if (dtype == DType::kI8) {
      scales_.assign(num_panels_ * kPanelWidth, 0.0f);
      bytes_ += scales_.size() * sizeof(float);
    }
  }
  ~PackedLinear() override { std::free(data_); }

  int64_t n() const override { return n_; }
  int64_t k() const override { return k_; }
  DType dtype() const override { return dtype_; }
  size_t bytes() const override { return bytes_; }
  int64_t num_panels() const { return num_panels_; }
  // The matrix path these panels are for.
  MatrixPath pairs() const { return pairs_; }
  char* data() const { return data_; }
  // kI8: one scale per output row (padded to whole panels).
  std::vector<float>& scales() { return scales_; }
  const float* scales_or_null() const { return scales_.empty() ? nullptr : scales_.data(); }

 private:
  std::vector<float> scales_;
  int64_t n_, k_;
  DType dtype_;
  MatrixPath pairs_;
  int64_t width_;
  int64_t num_panels_;
  size_t bytes_;
  char* data_;
};

ElemType ToElem(DType t) {
  return t == DType::kF32 ? ElemType::kF32 : t == DType::kI8 ? ElemType::kI8 : ElemType::kBF16;
}

// Symmetric int8 of x with one scale: q = round(x / scale), scale =
// max|x| / 127 (0 for an all-zero x). Returns the scale.
float QuantizeI8(const float* x, int64_t n, int8_t* q, int64_t q_stride) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::abs(x[i]));
  const float scale = amax / 127.0f;
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::nearbyint(x[i] * inv);
    q[i * q_stride] = static_cast<int8_t>(std::clamp(v, -127.0f, 127.0f));
  }
  return scale;
}

// FLOP/s of one thread's multiply-adds on `loop` over a few ms: a warm-up
// run (the first use of AMX tiles, or of wide units after a frequency
// change, runs slow), then the best of five short runs, so a preemption does
// not decide the path.
double ProbeRate(double (*loop)(int64_t)) {
  constexpr int64_t kIters = 20000;
  (void)loop(kIters);
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const double flops = loop(kIters);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0) best = std::max(best, flops / s);
  }
  return best;
}

// The FP16 path is taken when its FMA rate beats the F32 one by this much:
// widening the half sums every kF16Block pairs costs about 10 %.
constexpr double kF16MinAdvantage = 1.4;
// The BF16 path (no widening; the activations' rounding to BF16 costs a
// pass over x) when VDPBF16PS beats the F32 FMA rate by this much.
constexpr double kBf16MinAdvantage = 1.2;
// The AMX path when its tile rate beats F32 FMA by this much: its kernel
// reaches a smaller share of its peak (tile loads, C tile stores).
constexpr double kAmxMinAdvantage = 3.0;

// Row-wise work (norms, rotations, conversions) below this many elements
// stays on the calling thread: a pool hand-off costs more.
constexpr int64_t kParallelElems = 32 * 1024;
// PrefetchKv: products of fewer rows are bound by the weight stream (no
// bandwidth left to prefetch with); at 8 rows (a Zen 3 core pair, AVX2,
// 125M BF16 weights) an F32 product reads about 20 GB/s of weights against
// a 30-35 GB/s limit. At most this many bytes are prefetched, so that the
// KV and the weights streamed until the Attention fit the L3 together.
constexpr int64_t kKvPrefetchMinRows = 8;
constexpr int64_t kKvPrefetchMaxBytes = 8 << 20;
// BF16 products of more rows than one tile and at most this many (decode
// batches) take fewer, longer chunks (see CpuBackend::Linear).
constexpr int64_t kDecodeChunkRows = 32;
// Decode rows of at least this many attention segments (more than 1536 keys)
// may be split between the threads by segment (BuildAttentionPlan).
constexpr int32_t kSplitMinSegments = 4;

}  // namespace

absl::string_view MatrixPathName(MatrixPath path) {
  switch (path) {
    case MatrixPath::kF16:
      return "fp16";
    case MatrixPath::kBf16:
      return "bf16";
    case MatrixPath::kAmx:
      return "amx";
    case MatrixPath::kF32:
      break;
  }
  return "f32";
}

absl::StatusOr<MatrixPath> ParseMatrixPath(absl::string_view name) {
  if (name == "f32") return MatrixPath::kF32;
  if (name == "fp16") return MatrixPath::kF16;
  if (name == "bf16") return MatrixPath::kBf16;
  if (name == "amx") return MatrixPath::kAmx;
  return absl::InvalidArgumentError(absl::StrCat("unknown matrix path '", name, "' (f32, fp16, bf16 or amx)"));
}

bool KvPrefetchByDefault() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

namespace {

// A switch: the option when set, else the environment variable ("0" or
// "1"; another value is an error naming it) when set and not empty, else
// `fallback`.
absl::StatusOr<bool> OnOff(std::optional<bool> option, const char* variable, bool fallback) {
  if (option.has_value()) return *option;
  const char* env = std::getenv(variable);
  if (env == nullptr || *env == '\0') return fallback;
  const absl::string_view v = env;
  if (v != "0" && v != "1") return absl::InvalidArgumentError(absl::StrCat(variable, "=", v, ": expected 0 or 1"));
  return v == "1";
}

}  // namespace

absl::StatusOr<std::unique_ptr<CpuBackend>> CpuBackend::Create(const CpuBackendOptions& options) {
  Isa isa;
  if (options.isa.has_value()) {
    if (!IsaSupported(*options.isa)) {
      return absl::FailedPreconditionError(
          absl::StrCat("ISA ", IsaName(*options.isa), " is not supported by this CPU"));
    }
    isa = *options.isa;
  } else {
    absl::StatusOr<Isa> selected = SelectIsa();
    if (!selected.ok()) return selected.status();
    isa = *selected;
  }
  if (options.num_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("threads must be at least 1, got ", options.num_threads));
  }
  const bool f16_ok = isa == Isa::kAvx512 && F16PathSupported();
  const bool bf16_ok = isa == Isa::kAvx512 && Bf16PathSupported();
  const bool amx_ok = isa == Isa::kAvx512 && AmxPathSupported();
  std::optional<MatrixPath> path = options.matrix_path;
  std::string reason = "forced";
  if (!path.has_value() && !options.choose_matrix_path) {
    path = MatrixPath::kF32;
    reason = "default";
  }
  if (!path.has_value()) {
    if (const char* env = std::getenv("PDSERVE_MATRIX_PATH"); env != nullptr && *env != '\0') {
      absl::StatusOr<MatrixPath> p = ParseMatrixPath(env);
      if (!p.ok()) return absl::InvalidArgumentError(absl::StrCat("PDSERVE_MATRIX_PATH: ", p.status().message()));
      path = *p;
      reason = "PDSERVE_MATRIX_PATH";
    }
  }
  if (path == MatrixPath::kF16 && !f16_ok) {
    return absl::FailedPreconditionError(
        absl::StrCat("matrix path fp16 needs AVX512-FP16 and the avx512 ISA (this run: ", IsaName(isa), ", ",
                     F16PathSupported() ? "with" : "without", " AVX512-FP16)"));
  }
  if (path == MatrixPath::kBf16 && !bf16_ok) {
    return absl::FailedPreconditionError(
        absl::StrCat("matrix path bf16 needs AVX512-BF16 and the avx512 ISA (this run: ", IsaName(isa), ", ",
                     Bf16PathSupported() ? "with" : "without", " AVX512-BF16)"));
  }
  if (path == MatrixPath::kAmx && !amx_ok) {
    return absl::FailedPreconditionError(
        absl::StrCat("matrix path amx needs AMX-BF16 (and the kernel's permission for its tile data) and the avx512 "
                     "ISA (this run: ", IsaName(isa), ", ", AmxPathSupported() ? "with" : "without", " AMX)"));
  }
  if (!path.has_value()) {
    if (!f16_ok && !bf16_ok && !amx_ok) {
      path = MatrixPath::kF32;
      reason = absl::StrCat("the only path of ISA ", IsaName(isa), " on this CPU");
    } else {
      // Each candidate's probed rate, discounted by its own overhead; the
      // best wins (F32 when neither clears it).
      const double f32 = ProbeRate(GetKernelTable(isa).fma_peak_loop);
      const double f16 = f16_ok ? ProbeRate(&Fp16FmaPeakLoop) : 0.0;
      const double bf16 = bf16_ok ? ProbeRate(&Bf16DotPeakLoop) : 0.0;
      const double amx = amx_ok ? ProbeRate(&AmxPeakLoop) : 0.0;
      // A fixed order of preference, each path taken when its rate clears
      // its threshold over F32 FMA: the thresholds sit far below the rates
      // measured where each path wins (AMX 6-11x, FP16 2.0x, BF16 dot 2.0x
      // on the Zen 5 class) and far above where it loses (BF16 dot 0.5x on
      // the Sapphire Rapids class), so the noise of a short probe does not
      // split identical machines between paths (their streams would differ).
      if (amx_ok && amx >= kAmxMinAdvantage * f32) {
        path = MatrixPath::kAmx;
      } else if (f16_ok && f16 >= kF16MinAdvantage * f32) {
        path = MatrixPath::kF16;
      } else if (bf16_ok && bf16 >= kBf16MinAdvantage * f32) {
        path = MatrixPath::kBf16;
      } else {
        path = MatrixPath::kF32;
      }
      auto rate = [&](const char* name, bool ok, double r, double need) {
        return ok ? absl::StrFormat(", %s %.0f (%.2fx; needs %.1fx)", name, r * 1e-9, f32 > 0 ? r / f32 : 0.0, need)
                  : absl::StrFormat(", %s absent", name);
      };
      reason = absl::StrCat(absl::StrFormat("probe, GFLOP/s per thread: F32 FMA %.0f", f32 * 1e-9),
                            rate("FP16 FMA", f16_ok, f16, kF16MinAdvantage),
                            rate("BF16 dot", bf16_ok, bf16, kBf16MinAdvantage),
                            rate("AMX BF16", amx_ok, amx, kAmxMinAdvantage));
    }
  }
  absl::StatusOr<bool> kv_prefetch = OnOff(options.kv_prefetch, "PDSERVE_KV_PREFETCH", KvPrefetchByDefault());
  if (!kv_prefetch.ok()) return kv_prefetch.status();
  absl::StatusOr<bool> bf16_attention = OnOff(options.bf16_attention, "PDSERVE_BF16_ATTENTION", true);
  if (!bf16_attention.ok()) return bf16_attention.status();
  // The bf16 path is taken only on CPUs with AVX512-BF16, and only the
  // AVX-512 kernels hold the dot form.
  const bool dot_attention = *bf16_attention && *path == MatrixPath::kBf16 && isa == Isa::kAvx512;
  return std::unique_ptr<CpuBackend>(
      new CpuBackend(isa, *path, std::move(reason), options.num_threads, *kv_prefetch, dot_attention));
}

CpuBackend::CpuBackend(Isa isa, MatrixPath path, std::string path_reason, int num_threads, bool kv_prefetch,
                       bool bf16_attention)
    : isa_(isa),
      matrix_path_(path),
      matrix_path_reason_(std::move(path_reason)),
      table_(GetKernelTable(isa)),
      pool_(num_threads),
      kv_prefetch_on_(kv_prefetch),
      bf16_attention_(bf16_attention) {}

std::string CpuBackend::Name() const {
  if (matrix_path_ == MatrixPath::kF32) return absl::StrCat("cpu/", table_.name);
  return absl::StrCat("cpu/", table_.name, "+", MatrixPathName(matrix_path_));
}

absl::StatusOr<std::unique_ptr<LinearWeight>> CpuBackend::PackLinear(
    absl::Span<const MatrixPart> parts, int64_t k, DType storage) {
  if (storage != DType::kF32 && storage != DType::kBF16 && storage != DType::kI8) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights cannot be stored as ", DTypeName(storage)));
  }
  int64_t n = 0;
  for (const MatrixPart& p : parts) {
    if (p.dtype == DType::kI8) return absl::InvalidArgumentError("int8 sources are not supported");
    if (p.stride != 0 && p.stride < k) {
      return absl::InvalidArgumentError(absl::StrCat("matrix rows ", p.stride, " apart hold fewer than ", k, " elements"));
    }
    n += p.rows;
  }
  std::vector<float> row(static_cast<size_t>(k));
  // Every output row of the parts in order, as F32: fn(out_row, row).
  // False as soon as fn returns false.
  auto for_each_row = [&](auto fn) {
    int64_t out_row = 0;
    for (const MatrixPart& p : parts) {
      const size_t in_row_bytes = static_cast<size_t>(p.stride > 0 ? p.stride : k) * DTypeSize(p.dtype);
      for (int64_t r = 0; r < p.rows; ++r, ++out_row) {
        ConvertToF32(p.dtype, static_cast<const char*>(p.data) + r * in_row_bytes, static_cast<size_t>(k), row.data());
        if (!fn(out_row, row.data())) return false;
      }
    }
    return true;
  };
  // BF16 weights take the FP16 path when it was chosen and every weight is
  // a finite half (else this matrix stays on the F32 path).
  if (matrix_path_ == MatrixPath::kF16 && storage == DType::kBF16) {
    auto w = std::make_unique<PackedLinear>(n, k, storage, MatrixPath::kF16);
    std::vector<uint16_t> half(static_cast<size_t>(k));
    uint16_t* dst = reinterpret_cast<uint16_t*>(w->data());
    const bool fits = for_each_row([&](int64_t out_row, float* r) {
      // Through BF16 first: the FP16 copy holds the BF16 weights' values.
      for (int64_t c = 0; c < k; ++c) r[c] = Bf16ToF32(F32ToBf16(r[c]));
      if (!(ConvertF32ToF16(r, k, half.data()) <= kF16Max)) return false;
      uint16_t* panel = dst + out_row / kF16PanelWidth * F16PanelElems(k);
      const int64_t j = out_row % kF16PanelWidth;
      for (int64_t c = 0; c < k; ++c) panel[F16PanelIndex(j, c)] = half[c];
      return true;
    });
    if (fits) return std::unique_ptr<LinearWeight>(std::move(w));
  }
  // BF16 weights on the BF16 or AMX path: their bits, in k-pair panels
  // (AMX: K padded to whole tiles with zeros).
  if ((matrix_path_ == MatrixPath::kBf16 || matrix_path_ == MatrixPath::kAmx) && storage == DType::kBF16) {
    auto w = std::make_unique<PackedLinear>(n, k, storage, matrix_path_);
    uint16_t* dst = reinterpret_cast<uint16_t*>(w->data());
    const int64_t panel_elems = matrix_path_ == MatrixPath::kAmx ? AmxPanelElems(k) : F16PanelElems(k);
    for_each_row([&](int64_t out_row, const float* r) {
      uint16_t* panel = dst + out_row / kF16PanelWidth * panel_elems;
      const int64_t j = out_row % kF16PanelWidth;
      for (int64_t c = 0; c < k; ++c) panel[F16PanelIndex(j, c)] = F32ToBf16(r[c]);
      return true;
    });
    return std::unique_ptr<LinearWeight>(std::move(w));
  }
  auto w = std::make_unique<PackedLinear>(n, k, storage);
  for_each_row([&](int64_t out_row, const float* r) {
    const int64_t panel = out_row / kPanelWidth;
    const int64_t j = out_row % kPanelWidth;
    const int64_t base = panel * k * kPanelWidth + j;
    if (storage == DType::kF32) {
      float* dst = reinterpret_cast<float*>(w->data());
      for (int64_t c = 0; c < k; ++c) dst[base + c * kPanelWidth] = r[c];
    } else if (storage == DType::kI8) {
      int8_t* dst = reinterpret_cast<int8_t*>(w->data());
      w->scales()[out_row] = QuantizeI8(r, k, dst + base, kPanelWidth);
    } else {
      uint16_t* dst = reinterpret_cast<uint16_t*>(w->data());
      for (int64_t c = 0; c < k; ++c) dst[base + c * kPanelWidth] = F32ToBf16(r[c]);
    }
    return true;
  });
  return std::unique_ptr<LinearWeight>(std::move(w));
}

void CpuBackend::Linear(const LinearWeight& w, const float* x, int64_t m, const float* bias,
                        float* y, bool accumulate) {
  const auto& pw = static_cast<const PackedLinear&>(w);
  if (pw.pairs() == MatrixPath::kAmx || pw.pairs() == MatrixPath::kBf16) {
    const bool amx = pw.pairs() == MatrixPath::kAmx;
    const int64_t k = pw.k();
    // AMX: rows of whole tile depths, whole tiles of rows (the rows past m
    // are read and their sums thrown away). BF16: whole k pairs. The
    // columns past k are zeros, as the weights' pad is.
    const int64_t ldx = amx ? AmxPaddedK(k) : (k + 1) / 2 * 2;
    const int64_t rows = amx ? (m + kAmxRows - 1) / kAmxRows * kAmxRows : m;
    if (x16_.size() < static_cast<size_t>(rows * ldx)) x16_.resize(static_cast<size_t>(rows * ldx), 0);
    auto convert = [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        if (!amx) {
          uint16_t* out = x16_.data() + i * ldx;
          ConvertF32ToBf16(x + i * k, k, out);
          for (int64_t c = k; c < ldx; ++c) out[c] = 0;
          continue;
        }
        // AMX: the row's 32-element pieces go to its A tiles (linear_amx.h).
        for (int64_t c = 0; c < ldx; c += kAmxDepth) {
          uint16_t* out = x16_.data() + AmxTileOffset(k, i, c);
          const int64_t n = std::min<int64_t>(kAmxDepth, k - c);
          ConvertF32ToBf16(x + i * k + c, n, out);
          for (int64_t j = n; j < kAmxDepth; ++j) out[j] = 0;
        }
      }
    };
    if (m * k < kParallelElems) {
      convert(0, m);
    } else {
      pool_.ParallelFor(m, convert);
    }
    const uint16_t* panels = reinterpret_cast<const uint16_t*>(pw.data());
    if (amx) {
      const LinearAmxArgs a{.x = x16_.data(), .m = m, .k = k, .n = pw.n(), .panels = panels,
                            .bias = bias, .y = y, .ldy = pw.n(), .accumulate = accumulate};
      // Whole pairs of panels per thread (the kernel's two-panel blocks).
      const int64_t pairs = (pw.num_panels() + 1) / 2;
      pool_.ParallelFor(pairs, [&](int64_t b, int64_t e) { LinearAmx(a, 2 * b, std::min(2 * e, pw.num_panels())); });
    } else {
      const LinearBf16Args a{.x = x16_.data(), .ldx = ldx, .m = m, .k = k, .n = pw.n(), .panels = panels,
                             .bias = bias, .y = y, .ldy = pw.n(), .accumulate = accumulate};
      const auto body = [&](int64_t b, int64_t e) { LinearBf16(a, b, e); };
      if (m <= kBf16TileRows) {
        // One row tile (decode batches up to 12): each thread streams its
        // own share of the panels front to back, a kernel call at a time,
        // and takes calls from the back of the other's share when it runs
        // out (ParallelStealing): one cold start of the weight streams a
        // thread, and a tail of at most one call. Against 2 chunks a thread
        // (Zen 5 class, `bench-engine`, alternated runs) it is faster for
        // b=1 and b=8 at h=128 and 512 in 5 of 6 runs each (0.86-0.97x in
        // most), and at h=4096 for b=1 in 4 of 4, b=4 in 6 of 8, b=8 in 5
        // of 8, b=12 in 6 of 8. At 32 rows it is slower (1.02-1.07x in 5
        // of 6): there the kernel's own chunks keep each pass's panels in
        // L2 for the later row tiles.
        pool_.ParallelStealing(pw.num_panels(), Bf16PanelsPerCall(m), body);
      } else {
        // Up to 32 rows: 2 chunks a thread, not 4. Each chunk starts its
        // weight streams cold, and at these rows the tail a thread waits
        // for is short (b=32 faster in 8 of 10 alternated runs). Prefill
        // keeps 4: there a thread idles for the other's last chunk.
        pool_.ParallelFor(pw.num_panels(), body, m <= kDecodeChunkRows ? 2 : 4);
      }
    }
    return;
  }
  if (pw.pairs() == MatrixPath::kF16) {
    const int64_t k = pw.k();
    const int64_t ldx = (k + 1) / 2 * 2;  // Whole k pairs; an odd K's pad is 0.
    if (x16_.size() < static_cast<size_t>(m * ldx)) x16_.resize(static_cast<size_t>(m * ldx));
    // Each row on its own: a row whose values would not fit half precision
    // is divided by a power of two first (its products multiplied back).
    bool scaled = false;
    for (int64_t i = 0; i < m; ++i) {
      const float* row = x + i * k;
      uint16_t* out = x16_.data() + i * ldx;
      const float amax = ConvertF32ToF16(row, k, out);
      if (amax > kF16RowMax && std::isfinite(amax)) {
        if (!scaled) row_scale_.assign(static_cast<size_t>(m), 1.0f);
        scaled = true;
        int e = 0;
        std::frexp(amax / kF16RowMax, &e);
        row_scale_[i] = std::ldexp(1.0f, e);
        x_scaled_.resize(static_cast<size_t>(k));
        for (int64_t c = 0; c < k; ++c) x_scaled_[c] = std::ldexp(row[c], -e);
        ConvertF32ToF16(x_scaled_.data(), k, out);
      }
      if (ldx != k) out[k] = 0;
    }
    const LinearF16Args a{.x = x16_.data(),
                          .ldx = ldx,
                          .m = m,
                          .k = k,
                          .n = pw.n(),
                          .panels = reinterpret_cast<const uint16_t*>(pw.data()),
                          .bias = bias,
                          .y = y,
                          .ldy = pw.n(),
                          .accumulate = accumulate,
                          .row_scale = scaled ? row_scale_.data() : nullptr};
    pool_.ParallelFor(pw.num_panels(), [&](int64_t b, int64_t e) { LinearF16(a, b, e); });
    return;
  }
  KvPrefetch& kp = kv_prefetch_;
  int64_t side_begin = 0, side_end = 0;
  if (kp.lines > 0 && m >= table_.linear_side_rows[0] && m <= table_.linear_side_rows[1]) {
    // This product's share of the lines left: its weight bytes against
    // those expected until the Attention (all of them when none are).
    const int64_t bytes = static_cast<int64_t>(pw.bytes());
    const int64_t left = kp.lines - kp.next;
    const int64_t expected_left = std::max(kp.expected - kp.weight_bytes, bytes);
    kp.weight_bytes += bytes;
    side_begin = kp.next;
    side_end = kp.next + static_cast<int64_t>(static_cast<double>(left) * bytes / expected_left);
    kp.next = side_end;
    kv_prefetched_bytes_ += (side_end - side_begin) * 64;
  }
  LinearArgs args{.x = x,
                  .ldx = pw.k(),
                  .m = m,
                  .k = pw.k(),
                  .n = pw.n(),
                  .panels = pw.data(),
                  .w_type = ToElem(pw.dtype()),
                  .w_scales = pw.scales_or_null(),
                  .bias = bias,
                  .y = y,
                  .ldy = pw.n(),
                  .accumulate = accumulate,
                  .side_blocks = kp.blocks.data(),
                  .side_begin = side_begin,
                  .side_end = side_end,
                  .side_block_lines = kp.block_lines};
  // Split whole panels, in pairs so the two-panel micro-tile stays whole.
  const int64_t pairs = (pw.num_panels() + 1) / 2;
  pool_.ParallelFor(pairs, [&](int64_t b, int64_t e) {
    table_.linear(args, 2 * b, std::min(2 * e, pw.num_panels()));
  });
}

void CpuBackend::RmsNorm(const float* x, const float* weight, int64_t m, int64_t d, float eps,
                         float* y) {
  // Rows on their own (a prompt's rows in parallel), each the same
  // arithmetic wherever it runs (and on every ISA: KernelTable). The ISA
  // kernel, not a loop here: a loop's one chain of d dependent float64 adds
  // and scalar scaling makes the norms 3 % of a 512-token prefill's samples
  // on the amx path (perf, Sapphire Rapids class).
  auto rows = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) table_.rms_norm_row(x + i * d, weight, d, eps, y + i * d);
  };
  if (m * d < kParallelElems) {
    rows(0, m);
  } else {
    pool_.ParallelFor(m, rows);
  }
}
void CpuBackend::Rope(float* x, int64_t rows, int32_t heads, int32_t head_dim,
                      const int32_t* positions, const float* cos, const float* sin) {
  const int32_t half = head_dim / 2;
  auto some = [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* c = cos + static_cast<int64_t>(positions[r]) * half;
      const float* s = sin + static_cast<int64_t>(positions[r]) * half;
      for (int32_t h = 0; h < heads; ++h) {
        float* v = x + (r * heads + h) * head_dim;
        for (int32_t i = 0; i < half; ++i) {
          const float a = v[i];
          const float b2 = v[i + half];
          v[i] = a * c[i] - b2 * s[i];
          v[i + half] = b2 * c[i] + a * s[i];
        }
      }
    }
  };
  if (rows * heads * head_dim < kParallelElems) {
    some(0, rows);
  } else {
    pool_.ParallelFor(rows, some);
  }
}
void CpuBackend::SiluMul(const float* gate_up, int64_t m, int64_t f, float* out) {
  pool_.ParallelFor(m, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      table_.silu_mul(gate_up + i * 2 * f, gate_up + i * 2 * f + f, out + i * f, f);
    }
  });
}

void CpuBackend::WriteKv(const KvLayerView& kv, int32_t num_kv_heads, int32_t head_dim,
                         const float* k, const float* v, int64_t rows, const int32_t* blocks,
                         const int32_t* slots) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int32_t h = 0; h < num_kv_heads; ++h) {
      // K transposed ([dim][slot], stride block_size); V row-major.
      const int64_t head = blocks[r] * kv.block_stride + h * kv.head_stride;
      const int64_t k_off = head + slots[r];
      const int64_t k_step = kv.block_size;
      const int64_t v_off = head + kv.v_offset + static_cast<int64_t>(slots[r]) * head_dim;
      const float* ks = k + (r * num_kv_heads + h) * head_dim;
      const float* vs = v + (r * num_kv_heads + h) * head_dim;
      if (kv.dtype == DType::kF32) {
        float* base = static_cast<float*>(kv.base);
        for (int32_t i = 0; i < head_dim; ++i) base[k_off + i * k_step] = ks[i];
        std::memcpy(base + v_off, vs, head_dim * sizeof(float));
      } else if (kv.dtype == DType::kI8) {
        int8_t* base = static_cast<int8_t*>(kv.base);
        float* scales = reinterpret_cast<float*>(base + blocks[r] * kv.block_stride + kv.scale_offset);
        const int64_t si = static_cast<int64_t>(h) * kv.block_size + slots[r];
        scales[si] = QuantizeI8(ks, head_dim, base + k_off, k_step);
        scales[si + static_cast<int64_t>(num_kv_heads) * kv.block_size] =
            QuantizeI8(vs, head_dim, base + v_off, 1);
      } else {
        uint16_t* base = static_cast<uint16_t*>(kv.base);
        for (int32_t i = 0; i < head_dim; ++i) {
          base[k_off + i * k_step] = F32ToBf16(ks[i]);
          base[v_off + i] = F32ToBf16(vs[i]);
        }
      }
    }
  }
}

void CpuBackend::BuildAttentionPlan(const AttentionBatch& batch) {
  AttentionPlan& p = plan_;
  p.seqs.clear();
  p.items.clear();
  p.bounds.assign(1, 0);
  p.steps.clear();
  p.queries.clear();
  p.rows.clear();
  p.combines.clear();
  for (const AttentionSequence& in : batch.sequences) {
    p.seqs.push_back({in.block_table.data(), in.num_cached, in.num_new, in.row_offset});
  }
  // Cascade only for decode batches (one new row per sequence) in which some
  // physical block serves two sequences; otherwise the per-sequence kernel,
  // which parallelises over rows too, is the better choice.
  const int32_t bs = batch.kv.block_size;
  p.grouped = batch.group_shared_blocks;
  int32_t max_blocks = 0;
  if (p.grouped) {
    absl::flat_hash_map<int32_t, int32_t> uses;
    bool shared = false;
    for (const AttentionSequence& s : batch.sequences) {
      if (s.num_new != 1) {
        p.grouped = false;
        break;
      }
      const int32_t blocks = (s.num_cached + 1 + bs - 1) / bs;
      max_blocks = std::max(max_blocks, blocks);
      for (int32_t i = 0; i < blocks; ++i) shared |= ++uses[s.block_table[i]] == 2;
    }
    p.grouped = p.grouped && shared;
  }
  if (p.grouped) {
    // Steps in logical block order; the queries of a step share its block.
    for (const AttentionSequence& s : batch.sequences) p.rows.push_back(s.row_offset);
    std::vector<std::pair<int32_t, AttentionGroupQuery>> level;
    for (int32_t i = 0; i < max_blocks; ++i) {
      level.clear();
      for (size_t q = 0; q < batch.sequences.size(); ++q) {
        const AttentionSequence& s = batch.sequences[q];
        const int32_t keys = s.num_cached + 1 - i * bs;
        if (keys <= 0) continue;
        level.push_back({s.block_table[i], {static_cast<int32_t>(q), std::min(keys, bs)}});
      }
      std::stable_sort(level.begin(), level.end(),
                       [](const auto& x, const auto& y) { return x.first < y.first; });
      for (size_t k = 0; k < level.size();) {
        AttentionGroupStep step{level[k].first, static_cast<int32_t>(p.queries.size()), 0, i};
        for (; k < level.size() && level[k].first == step.block; ++k) p.queries.push_back(level[k].second);
        step.query_end = static_cast<int32_t>(p.queries.size());
        p.steps.push_back(step);
      }
    }
    const int64_t group = batch.num_heads / batch.num_kv_heads;
    p.state_per_head =
        static_cast<int64_t>(p.rows.size()) * AttentionGroupStateFloats(static_cast<int32_t>(group), batch.head_dim);
    p.state.resize(p.state_per_head * batch.num_kv_heads);
    return;
  }
  // Work items: (sequence, KV head, row range); each is costed by the keys
  // its rows read, then cut into chunks of about equal cost.
  std::vector<double> cost;
  constexpr int32_t kRowsPerItem = 16;
  const int threads = pool_.num_threads();
  bool decode = true;
  for (const AttentionSequence& s : batch.sequences) decode = decode && s.num_new == 1;
  // Fewer decode rows than threads: the segments (AttentionSegmentBlocks)
  // of a row of kSplitMinSegments or more are items of their own, all of a
  // segment's KV heads side by side, so that the threads share the row by
  // keys and each reads whole blocks (every head's K and V) in one stream,
  // not a part of every block; AttentionCombine merges them as a lone
  // thread would. One row, 2 threads, Zen 5 class, `pdctl bench-attention`,
  // 3 alternations: history 2048 29.0-29.6 GB/s against 23.9-24.5 by
  // heads, 4096 29.2-30.6 against 23.3-24.5. Rows split at 513 keys (512
  // and 1) read 0.72-0.85x as fast in `bench-engine` (3 alternations: the
  // second segment's pass and the merge for one key), so shorter rows go
  // by heads. The minimum is a history, not a count a thread:
  // with more threads than a row has KV heads, a long row split by keys
  // keeps every thread busy where its heads alone would not (unmeasured
  // beyond 2 threads, where the two rules agree).
  const bool split = decode && static_cast<int64_t>(batch.sequences.size()) < threads;
  const int32_t seg_blocks = AttentionSegmentBlocks(bs);
  const int64_t partial_floats =
      AttentionPartialFloats(batch.num_heads / batch.num_kv_heads, batch.head_dim);
  int64_t partials = 0;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const AttentionSequence& in = batch.sequences[s];
    const int32_t segments = (in.num_cached + 1 + seg_blocks * bs - 1) / (seg_blocks * bs);
    if (split && segments >= kSplitMinSegments) {
      // States [segment][KV head].
      const int64_t stride = batch.num_kv_heads * partial_floats;
      for (int32_t h = 0; h < batch.num_kv_heads; ++h) {
        p.combines.push_back({in.row_offset, h, segments, partials + h * partial_floats, stride});
      }
      for (int32_t j = 0; j < segments; ++j) {
        const int32_t keys = std::min(in.num_cached + 1 - j * seg_blocks * bs, seg_blocks * bs);
        for (int32_t h = 0; h < batch.num_kv_heads; ++h) {
          p.items.push_back({static_cast<int32_t>(s), h, 0, 1, j, partials + j * stride + h * partial_floats});
          cost.push_back(keys);
        }
      }
      partials += static_cast<int64_t>(segments) * batch.num_kv_heads * partial_floats;
      continue;
    }
    for (int32_t h = 0; h < batch.num_kv_heads; ++h) {
      for (int32_t r = 0; r < in.num_new; r += kRowsPerItem) {
        const int32_t e = std::min(in.num_new, r + kRowsPerItem);
        p.items.push_back({static_cast<int32_t>(s), h, r, e});
        cost.push_back(static_cast<double>(e - r) * (in.num_cached + (r + e) / 2.0 + 1));
      }
    }
  }
  // Chunks of about equal cost, 4 a thread to even out the threads' pace;
  // a decode batch's, as few as hold whole rows (one, two, three or four
  // a thread), or, with fewer rows than threads, one a thread with an
  // equal share of the heads. A thread then interleaves the KV heads of a
  // row in its chunk block by block (AttentionTyped), reading 8 KB or
  // more of each 16 KB block of the 125M shape's KV in one stream instead
  // of one head's 4 KB. At history 4096 on a 2-thread Zen 3 class CPU,
  // against one head a stream (4 alternations): one row 17.8-18.5 against
  // 14.6-14.7 GB/s, two
  // rows 17.7-18.3 against 14.7-14.8 with two heads a chunk (`pdctl
  // bench-attention`), whole rows another 1.03-1.04x at two rows (3
  // alternations); in `bench-engine`, b=1 steps 0.92-0.96x the time, b=2
  // 0.89x. A row's heads compute in the same order either way: the same
  // bits.
  p.partials.resize(partials);
  int per_thread = 4;
  if (decode && batch.num_kv_heads > 1) {
    const int64_t rows = static_cast<int64_t>(batch.sequences.size());
    per_thread = static_cast<int>(std::clamp<int64_t>(rows / threads, 1, 4));
  }
  const int nc = per_thread * threads;
  double total = 0;
  for (double c : cost) total += c;
  double acc = 0;
  for (size_t i = 0; i < p.items.size(); ++i) {
    acc += cost[i];
    if (acc >= total * static_cast<double>(p.bounds.size()) / nc || i + 1 == p.items.size()) {
      p.bounds.push_back(static_cast<int64_t>(i + 1));
    }
  }
}

std::pair<int64_t, int64_t> CpuBackend::kv_prefetch_rows() const {
  return {std::max(kKvPrefetchMinRows, table_.linear_side_rows[0]), table_.linear_side_rows[1]};
}

void CpuBackend::PrefetchKv(const KvLayerView& kv, absl::Span<const AttentionSequence> sequences) {
  KvPrefetch& kp = kv_prefetch_;
  kp.blocks.clear();
  kp.lines = kp.next = kp.weight_bytes = 0;
  if (!kv_prefetch_on_) return;
  int64_t rows = 0;
  for (const AttentionSequence& s : sequences) rows += s.num_new;
  const int64_t block_bytes = kv.block_stride * static_cast<int64_t>(DTypeSize(kv.dtype));
  // Only products whose rows take the side stream, and are not bound by
  // the weight stream, prefetch.
  const auto [first_rows, last_rows] = kv_prefetch_rows();
  if (rows < first_rows || rows > last_rows || block_bytes < 64) return;
  // The blocks of the cached positions (the new ones' KV is not written
  // yet), each once (shared prefixes), in address order.
  const char* base = static_cast<const char*>(kv.base);
  for (const AttentionSequence& s : sequences) {
    const int32_t n = (s.num_cached + kv.block_size - 1) / kv.block_size;
    for (int32_t i = 0; i < n && i < static_cast<int32_t>(s.block_table.size()); ++i) {
      kp.blocks.push_back(base + static_cast<int64_t>(s.block_table[i]) * block_bytes);
    }
  }
  std::sort(kp.blocks.begin(), kp.blocks.end());
  kp.blocks.erase(std::unique(kp.blocks.begin(), kp.blocks.end()), kp.blocks.end());
  kp.blocks.resize(std::min<size_t>(kp.blocks.size(), static_cast<size_t>(kKvPrefetchMaxBytes / block_bytes)));
  kp.block_lines = block_bytes / 64;
  kp.lines = static_cast<int64_t>(kp.blocks.size()) * kp.block_lines;
}

void CpuBackend::Attention(const AttentionBatch& batch) {
  if (kv_prefetch_.lines > 0) {
    // The hint ends; the next interval's expectation, when a product took
    // a share here.
    kv_prefetch_.lines = 0;
    if (kv_prefetch_.weight_bytes > 0) kv_prefetch_.expected = kv_prefetch_.weight_bytes;
  }
  if (!batch.same_sequences_as_previous) BuildAttentionPlan(batch);
  const AttentionPlan& p = plan_;
  AttentionArgs args{.q = batch.q,
                     .out = batch.out,
                     .seqs = p.seqs.data(),
                     .kv = batch.kv.base,
                     .kv_type = ToElem(batch.kv.dtype),
                     .block_stride = batch.kv.block_stride,
                     .head_stride = batch.kv.head_stride,
                     .v_offset = batch.kv.v_offset,
                     .scale_offset = batch.kv.scale_offset,
                     .block_size = batch.kv.block_size,
                     .num_heads = batch.num_heads,
                     .num_kv_heads = batch.num_kv_heads,
                     .head_dim = batch.head_dim,
                     .scale = batch.scale,
                     .bf16_dot = Bf16DotAttention(batch.kv.dtype, batch.kv.block_size),
                     .partials = plan_.partials.data()};
  std::atomic<int64_t> bytes{0};
  if (p.grouped) {
    const AttentionGroupPlan plan{p.steps.data(), static_cast<int64_t>(p.steps.size()),
                                  p.queries.data(), p.rows.data(), static_cast<int32_t>(p.rows.size())};
    pool_.ParallelFor(
        batch.num_kv_heads,
        [&](int64_t b, int64_t e) {
          for (int64_t h = b; h < e; ++h) {
            bytes.fetch_add(table_.attention_grouped(args, plan, static_cast<int32_t>(h),
                                                     plan_.state.data() + h * p.state_per_head),
                            std::memory_order_relaxed);
          }
        },
        1);
  } else {
    pool_.ParallelChunks(p.bounds, [&](int64_t b, int64_t e) {
      bytes.fetch_add(table_.attention(args, p.items.data() + b, e - b), std::memory_order_relaxed);
    });
    if (!p.combines.empty()) {
      table_.attention_combine(args, p.combines.data(), static_cast<int64_t>(p.combines.size()));
    }
  }
  if (batch.kv_bytes_read != nullptr) *batch.kv_bytes_read += bytes.load();
}

namespace {
double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
}  // namespace

double CpuBackend::SamplePeakFlops() {
  constexpr int64_t kIters = 2'000'000;
  std::vector<double> flops(pool_.num_threads(), 0.0);
  const auto t0 = std::chrono::steady_clock::now();
  pool_.ParallelFor(
      pool_.num_threads(),
      [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          flops[t] = matrix_path_ == MatrixPath::kF16    ? Fp16FmaPeakLoop(kIters)
                     : matrix_path_ == MatrixPath::kBf16 ? Bf16DotPeakLoop(kIters)
                     : matrix_path_ == MatrixPath::kAmx  ? AmxPeakLoop(kIters / 16)
                                                         : table_.fma_peak_loop(isa_ == Isa::kScalar ? kIters / 4 : kIters);
        }
      },
      1);
  const auto t1 = std::chrono::steady_clock::now();
  double total = 0;
  for (double f : flops) total += f;
  return total / Seconds(t0, t1);
}

CpuBackend::MatrixPeaks CpuBackend::SampleMatrixPeaks() {
  constexpr int64_t kIters = 2'000'000;
  MatrixPeaks peaks;
  for (int which = 0; which < 4; ++which) {
    std::vector<double> flops(pool_.num_threads(), 0.0);
    const auto t0 = std::chrono::steady_clock::now();
    pool_.ParallelFor(
        pool_.num_threads(),
        [&](int64_t b, int64_t e) {
          for (int64_t t = b; t < e; ++t) {
            flops[t] = which == 0   ? Bf16DotPeakLoop(kIters)
                       : which == 1 ? Fp16FmaPeakLoop(kIters)
                       : which == 3 ? AmxPeakLoop(kIters / 16)
                                    : table_.fma_peak_loop(isa_ == Isa::kScalar ? kIters / 4 : kIters);
          }
        },
        1);
    const auto t1 = std::chrono::steady_clock::now();
    double total = 0;
    for (double f : flops) total += f;
    (which == 0   ? peaks.bf16_dot
     : which == 1 ? peaks.fp16_fma
     : which == 3 ? peaks.amx_bf16
                  : peaks.f32_fma) = total / Seconds(t0, t1);
  }
  return peaks;
}

float CpuBackend::ReadBlocks(const char* base, absl::Span<const int64_t> offsets, int64_t bytes) {
  const int64_t n = static_cast<int64_t>(offsets.size());
  const int threads = pool_.num_threads();
  std::vector<int64_t> bounds(threads + 1);
  for (int t = 0; t <= threads; ++t) bounds[t] = n * t / threads;
  // Each share's sum in its own slot (found by its first block), added
  // after: no share's sum is lost to another's. An empty share (fewer
  // blocks than threads) has no slot of its own, so it touches none.
  std::vector<float> sums(threads, 0.0f);
  pool_.ParallelChunks(bounds, [&](int64_t b, int64_t e) {
    if (b == e) return;
    float s = 0;
    for (int64_t i = b; i < e; ++i) {
      s += table_.read_sum(reinterpret_cast<const float*>(base + offsets[i]), bytes / 4);
    }
    const auto slot = std::upper_bound(bounds.begin(), bounds.end(), b) - bounds.begin() - 1;
    sums[slot] += s;
  });
  float total = 0;
  for (float s : sums) total += s;
  return total;
}

CpuBackend::ReadProbe::ReadProbe(CpuBackend* backend, size_t bytes) : backend_(backend) {
  n_ = std::max<int64_t>(1024, static_cast<int64_t>(bytes / sizeof(float)) / 1024 * 1024);
  // In huge pages as the weights and the KV pool are, so the limit is the
  // best read the memory system gives, not one slowed by TLB misses.
  const size_t bytes_used = static_cast<size_t>(n_) * sizeof(float);
  const bool huge = bytes_used >= kHugePageBytes;
  const size_t align = huge ? kHugePageBytes : 64;
  buf_ = static_cast<float*>(std::aligned_alloc(align, (bytes_used + align - 1) / align * align));
  if (huge) madvise(buf_, (bytes_used + align - 1) / align * align, MADV_HUGEPAGE);
  for (int64_t i = 0; i < n_; ++i) buf_[i] = static_cast<float>(i & 7);
  passes_ = static_cast<int>(std::max<int64_t>(1, (int64_t{256} << 20) / (n_ * 4)));
  Sample();  // Warm-up: page faults, first touch of the cache hierarchy.
}

CpuBackend::ReadProbe::~ReadProbe() { std::free(buf_); }

double CpuBackend::ReadProbe::Sample() {
  std::atomic<float> sink{0};
  const auto t0 = std::chrono::steady_clock::now();
  for (int p = 0; p < passes_; ++p) {
    backend_->pool_.ParallelFor(n_ / 1024, [&](int64_t b, int64_t e) {
      const float s = backend_->table_.read_sum(buf_ + b * 1024, (e - b) * 1024);
      sink.store(sink.load(std::memory_order_relaxed) + s, std::memory_order_relaxed);
    });
  }
  const auto t1 = std::chrono::steady_clock::now();
  sink_ += sink.load();
  return static_cast<double>(n_) * 4 * passes_ / Seconds(t0, t1);
}

}  // namespace pdserve::kernels::cpu
