// The CPU backend: per-ISA SIMD kernels (chosen at run time, see isa.h) run on
// a persistent thread pool.
#ifndef PDSERVE_KERNELS_CPU_CPU_BACKEND_H_
#define PDSERVE_KERNELS_CPU_CPU_BACKEND_H_

#include <atomic>
#include <cstddef>
#include <memory>
#include <new>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/thread_pool.h"

namespace pdserve::kernels::cpu {

// The matrix path of the linear layers (prefill and batched-decode GEMMs,
// decode GEMVs) for BF16 weights:
// - kF32: the ISA's F32 FMA kernels, exact to F32 arithmetic;
// - kF16: linear_fp16.h, the weights held as FP16 and the activations
//   rounded to FP16 (AVX512-FP16 only);
// - kBf16: linear_bf16.h, the BF16 weights as they are and the activations
//   rounded to BF16, pairs of products summed in F32 (AVX512-BF16 only);
// - kAmx: linear_amx.h, the same BF16 operands on AMX tiles (AMX-BF16 only).
// The KV format, the model identity and the other weight formats are the
// same on every path.
enum class MatrixPath { kF32, kF16, kBf16, kAmx };
absl::string_view MatrixPathName(MatrixPath path);
// "f32", "fp16", "bf16" or "amx".
absl::StatusOr<MatrixPath> ParseMatrixPath(absl::string_view name);

struct CpuBackendOptions {
  int num_threads = 1;
  // Unset: SelectIsa() (PDSERVE_ISA or the best supported).
  std::optional<Isa> isa;
  // Unset: kF32, unless choose_matrix_path.
  std::optional<MatrixPath> matrix_path;
  // With matrix_path unset: $PDSERVE_MATRIX_PATH when set, else the faster
  // of the paths this CPU supports, by a short probe of their multiply-add
  // rates (what the servers and pdctl do; tests that compare against F32
  // references leave it off).
  bool choose_matrix_path = false;
  // Whether products prefetch a hinted KV (PrefetchKv). Unset:
  // $PDSERVE_KV_PREFETCH ("0" or "1") when set, else KvPrefetchByDefault().
  std::optional<bool> kv_prefetch;
  // Whether attention over BF16 KV uses BF16 dot products (queries and
  // softmax weights rounded to BF16) where the bf16 matrix path is taken
  // and the block size is even. Unset: $PDSERVE_BF16_ATTENTION ("0" or
  // "1") when set, else on.
  std::optional<bool> bf16_attention;
};

// The KV prefetch's default on this CPU: on for AMD, where it is faster
// (a Zen 3 pair, AVX2 F32 products, b=8: 0.94-0.97x the step time in
// 13 of 15 runs), off elsewhere (a Sapphire Rapids-class pair, the same
// products forced with --isa avx2 --matrix_path f32: b=8 1.00-1.02x, b=12
// 1.03-1.05x, b=16 1.04-1.05x, 3 alternations each).
bool KvPrefetchByDefault();

class CpuBackend final : public Backend {
 public:
  // Errors: the requested ISA is not supported by this CPU.
  static absl::StatusOr<std::unique_ptr<CpuBackend>> Create(const CpuBackendOptions& options);

  // "cpu/ISA" plus "+fp16", "+bf16" or "+amx" on those matrix paths.
  std::string Name() const override;
  Isa isa() const { return isa_; }
  MatrixPath matrix_path() const { return matrix_path_; }
  // How the matrix path was chosen ("forced", or the probe's rates), for
  // logs and benchmarks.
  const std::string& matrix_path_reason() const { return matrix_path_reason_; }
  int num_threads() const { return pool_.num_threads(); }
  // Bytes of hinted KV (PrefetchKv) handed to products to prefetch, since
  // the backend was made; for benchmarks and tests.
  int64_t kv_prefetched_bytes() const { return kv_prefetched_bytes_; }
  bool kv_prefetch() const { return kv_prefetch_on_; }
  // Whether attention over BF16 KV of an even block size takes BF16 dot
  // products on this backend (the bf16 matrix path, unless turned off).
  bool bf16_attention() const { return bf16_attention_; }
  // Whether attention over KV of this type and block size takes them.
  bool Bf16DotAttention(DType kv, int32_t block_size) const {
    return bf16_attention_ && kv == DType::kBF16 && block_size % 2 == 0;
  }
  // The batch rows [first, last] whose products take the KV prefetch on
  // this kernel path (first > last: none; KernelTable::linear_side_rows
  // from kKvPrefetchMinRows rows).
  std::pair<int64_t, int64_t> kv_prefetch_rows() const;

  absl::StatusOr<std::unique_ptr<LinearWeight>> PackLinear(absl::Span<const MatrixPart> parts,
                                                           int64_t k, DType storage) override;
  void Linear(const LinearWeight& w, const float* x, int64_t m, const float* bias, float* y,
              bool accumulate) override;
  void RmsNorm(const float* x, const float* weight, int64_t m, int64_t d, float eps,
               float* y) override;
  void Rope(float* x, int64_t rows, int32_t heads, int32_t head_dim, const int32_t* positions,
            const float* cos, const float* sin) override;
  void SiluMul(const float* gate_up, int64_t m, int64_t f, float* out) override;
  void WriteKv(const KvLayerView& kv, int32_t num_kv_heads, int32_t head_dim, const float* k,
               const float* v, int64_t rows, const int32_t* blocks, const int32_t* slots) override;
  void Attention(const AttentionBatch& batch) override;
  // Batches of kKvPrefetchMinRows rows up to the last the kernels take the
  // prefetch at (KernelTable::linear_side_rows; 8-18 on AVX2, none on the
  // others): the F32 products between the hint and the Attention prefetch
  // the hinted KV's cached positions (up to kKvPrefetchMaxBytes), each
  // product a share in proportion to its weight bytes.
  void PrefetchKv(const KvLayerView& kv, absl::Span<const AttentionSequence> sequences) override;

  // Machine limits on this backend's instruction path and threads, for
  // benchmarks. One sample of the multiply-add rate in FLOP/s of the
  // matrix path's instruction (F32 FMA, or FP16 FMA on the FP16 path; 16
  // independent chains per thread, all threads):
  double SamplePeakFlops();
  // The same, all threads, on each matrix instruction (0 where the CPU
  // lacks it): VDPBF16PS, FP16 FMA, and the ISA's F32 FMA.
  struct MatrixPeaks {
    double bf16_dot = 0;
    double fp16_fma = 0;
    double f32_fma = 0;
    double amx_bf16 = 0;
  };
  MatrixPeaks SampleMatrixPeaks();

  // Reads `bytes` at base + each of `offsets` (as floats, summed: no
  // other arithmetic), every thread a contiguous share of the list walked
  // front to back: the rate that a placement of KV blocks allows a reader,
  // for benchmarks to set beside the attention's over the same blocks.
  // Returns the sum, so that nothing is elided. REQUIRES: bytes a multiple
  // of 256 and the data finite floats.
  float ReadBlocks(const char* base, absl::Span<const int64_t> offsets, int64_t bytes);

  // Read bandwidth over a buffer of a given size (so a working set that fits
  // in cache is judged against cache, not DRAM). Benchmarks interleave its
  // samples with the work they judge, so both see the same machine noise.
  class ReadProbe {
   public:
    ReadProbe(CpuBackend* backend, size_t bytes);
    ~ReadProbe();
    ReadProbe(const ReadProbe&) = delete;
    ReadProbe& operator=(const ReadProbe&) = delete;
    // One sample in bytes/s (about 20 ms of reading).
    double Sample();

   private:
    CpuBackend* backend_;
    float* buf_;
    int64_t n_;
    int passes_;
    float sink_ = 0;
  };

 private:
  CpuBackend(Isa isa, MatrixPath path, std::string path_reason, int num_threads, bool kv_prefetch,
             bool bf16_attention);
  // How the attention of one batch is cut into work: the per-sequence
  // items (and their chunk bounds), or the cascade plan when the batch is a
  // decode batch whose sequences share blocks. Built once per forward (the
  // first layer) and reused by the others.
  struct AttentionPlan {
    std::vector<AttentionSeq> seqs;
    bool grouped = false;
    std::vector<AttentionItem> items;
    std::vector<int64_t> bounds;
    std::vector<AttentionGroupStep> steps;
    std::vector<AttentionGroupQuery> queries;
    std::vector<int64_t> rows;
    std::vector<float> state;  // Cascade softmax state, [kv_head][rows][...].
    int64_t state_per_head = 0;
    // Decode rows split by segment over the threads: their items' states
    // and how they merge.
    std::vector<float> partials;
    std::vector<AttentionCombine> combines;
  };
  void BuildAttentionPlan(const AttentionBatch& batch);

  const Isa isa_;
  const MatrixPath matrix_path_;
  const std::string matrix_path_reason_;
  const KernelTable& table_;
  // Storage on whole cache lines: an AMX tile row (64 bytes) or a vector
  // load that straddles two lines costs two. Measured on a Sapphire
  // Rapids-class core, a 2x2 block of tile products from 16-byte aligned
  // buffers takes 8.9 ns a product with both operands in L1 and 17 ns with
  // one in L2; from 64-byte aligned ones, 6.6-7.1 and 7.0-8.7. A 512-token
  // prefill on the amx path runs 1.03-1.16x faster with x16_ aligned (5
  // alternated pairs; std::vector's large blocks sit 16 bytes into a page).
  template <typename T>
  struct LineAllocator {
    using value_type = T;
    LineAllocator() = default;
    template <typename U>
    LineAllocator(const LineAllocator<U>&) {}
    T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
    void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
    bool operator==(const LineAllocator&) const = default;
  };
  // The activations of a product on the FP16, BF16 or AMX path, rounded to
  // 16 bits (AMX: in A tiles, linear_amx.h); the scales of FP16 rows
  // divided to fit (linear_fp16.h, kF16RowMax).
  std::vector<uint16_t, LineAllocator<uint16_t>> x16_;
  std::vector<float> row_scale_, x_scaled_;
  ThreadPool pool_;
  AttentionPlan plan_;
  // The hinted KV (PrefetchKv) until the next Attention (none when `lines`
  // is 0): its blocks (each block_lines 64-byte lines, `lines` in all), the
  // lines handed to products so far (`next`), and
  // the weight bytes of the products since the hint. `expected` is the
  // weight bytes between the last hint and its Attention (the previous
  // layer's), by which each product's share is judged.
  struct KvPrefetch {
    std::vector<const char*> blocks;
    int64_t block_lines = 0;
    int64_t lines = 0;
    int64_t next = 0;
    int64_t weight_bytes = 0;
    int64_t expected = 0;
  };
  const bool kv_prefetch_on_;
  const bool bf16_attention_;
  KvPrefetch kv_prefetch_;
  int64_t kv_prefetched_bytes_ = 0;
};

}  // namespace pdserve::kernels::cpu

#endif  // PDSERVE_KERNELS_CPU_CPU_BACKEND_H_
