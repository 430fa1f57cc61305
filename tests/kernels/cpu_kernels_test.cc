// Every CPU kernel path (forced through the dispatch) against naive double
// precision references, with odd sizes and unaligned tails.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/linear_amx.h"
#include "kernels/cpu/linear_bf16.h"
#include "kernels/cpu/linear_fp16.h"
#include "tests/support/isa_printer.h"

namespace pdserve::kernels::cpu {
namespace {

class CpuKernelsTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    auto b = CpuBackend::Create({.num_threads = 2, .isa = GetParam()});
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
  }
  std::vector<float> Random(size_t n, float scale = 1.0f) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  std::unique_ptr<CpuBackend> backend_;
  std::mt19937 rng_{42};
};

// The benchmarks' block reader reads exactly the blocks it is given, each
// whole, wherever they lie, once per call.
TEST_P(CpuKernelsTest, ReadBlocksReadsEveryGivenBlockOnce) {
  constexpr int64_t kBlockFloats = 64 * 5;  // 1280 bytes: a multiple of 256.
  std::vector<float> pool(kBlockFloats * 16);
  for (size_t i = 0; i < pool.size(); ++i) pool[i] = static_cast<float>(i / kBlockFloats + 1);  // block b: b + 1
  const char* base = reinterpret_cast<const char*>(pool.data());
  for (std::vector<int64_t> blocks : {std::vector<int64_t>{}, {3}, {9, 2, 15, 0, 7}, {1, 1, 4}}) {
    std::vector<int64_t> offsets;
    double want = 0;
    for (int64_t b : blocks) {
      offsets.push_back(b * kBlockFloats * 4);
      want += static_cast<double>(b + 1) * kBlockFloats;
    }
    // Small integers: every partial sum is exact in float.
    EXPECT_EQ(backend_->ReadBlocks(base, offsets, kBlockFloats * 4), want) << blocks.size() << " blocks";
  }
}

TEST_P(CpuKernelsTest, LinearMatchesReference) {
  for (DType wt : {DType::kF32, DType::kBF16, DType::kI8}) {
    // Row counts around the micro-tile heights (4, 6, 12 rows) and the
    // row tilings: one tile, a few tiles evened out (8, 13, 14 on AVX2),
    // many tiles in chunks (29), evened out there too (20: 5 5 5 5 and
    // 32: 6 6 5 5 5 5 on AVX2).
    for (int64_t m : {1, 2, 5, 8, 12, 13, 14, 20, 29, 32}) {
      for (int64_t n : {1, 15, 16, 17, 33, 50, 64}) {
        for (int64_t k : {1, 3, 17, 64}) {
          for (bool accumulate : {false, true}) {
            SCOPED_TRACE(::testing::Message() << "w=" << DTypeName(wt) << " m=" << m << " n=" << n
                                              << " k=" << k << " acc=" << accumulate);
            std::vector<float> w = Random(n * k), x = Random(m * k), bias = Random(n);
            // Split W into two parts to exercise concatenation.
            const int64_t n1 = n / 3;
            const MatrixPart parts[] = {{DType::kF32, w.data(), n1},
                                        {DType::kF32, w.data() + n1 * k, n - n1}};
            auto packed = backend_->PackLinear(parts, k, wt);
            ASSERT_TRUE(packed.ok());
            std::vector<float> y = Random(m * n);
            const std::vector<float> y0 = y;
            backend_->Linear(**packed, x.data(), m, bias.data(), y.data(), accumulate);
            // The int8 reference quantizes each output row as documented.
            std::vector<float> wq = w;
            if (wt == DType::kI8) {
              for (int64_t j = 0; j < n; ++j) {
                float amax = 0;
                for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::abs(w[j * k + c]));
                for (int64_t c = 0; c < k; ++c) {
                  wq[j * k + c] = std::nearbyint(w[j * k + c] * (127.0f / amax)) * (amax / 127.0f);
                }
              }
            }
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t j = 0; j < n; ++j) {
                double want = bias[j] + (accumulate ? y0[i * n + j] : 0.0);
                double mag = std::abs(bias[j]);
                for (int64_t c = 0; c < k; ++c) {
                  const float wv = wt == DType::kF32   ? w[j * k + c]
                                   : wt == DType::kBF16 ? Bf16ToF32(F32ToBf16(w[j * k + c]))
                                                        : wq[j * k + c];
                  want += static_cast<double>(x[i * k + c]) * wv;
                  mag += std::abs(x[i * k + c] * wv);
                }
                ASSERT_NEAR(y[i * n + j], want, (wt == DType::kI8 ? 1e-4 : 1e-5) * (mag + 1))
                    << i << "," << j;
              }
            }
            // Each row's bits are the same computed alone (whatever tile it sat in).
            for (int64_t i = 0; i < m; ++i) {
              std::vector<float> one(y0.begin() + i * n, y0.begin() + (i + 1) * n);
              backend_->Linear(**packed, x.data() + i * k, 1, bias.data(), one.data(), accumulate);
              for (int64_t j = 0; j < n; ++j) {
                ASSERT_EQ(one[j], y[i * n + j]) << "row " << i << " col " << j << " differs computed alone";
              }
            }
          }
        }
      }
    }
  }
}

// PrefetchKv: the products between the hint and the next Attention are
// handed the hinted KV's blocks (each once, at most 8 MiB) to prefetch, in
// shares by their weight bytes against the previous interval's; only
// products of the rows whose order takes the side stream, and of at least
// 8 rows; and a product's bits are the same with it as without.
TEST_P(CpuKernelsTest, KvPrefetchIsSharedByTheProductsAndChangesNoBits) {
  constexpr int32_t kBlock = 16, kHeads = 4, kDim = 64, kSeqs = 8;
  constexpr int64_t kBlockElems = 2LL * kHeads * kBlock * kDim;  // BF16 K and V: 16 KiB.
  constexpr int64_t kBlockBytes = kBlockElems * 2;
  const KernelTable& table = GetKernelTable(GetParam());
  auto takes = [&](int64_t m) { return m >= 8 && m >= table.linear_side_rows[0] && m <= table.linear_side_rows[1]; };
  if (GetParam() == Isa::kAvx2) {
    // The panel-outer order (2 or 3 tiles of 6 rows at most).
    EXPECT_TRUE(takes(8) && takes(18));
    EXPECT_FALSE(takes(6) || takes(19));
  }
  // The rest with the prefetch switched on, whatever this CPU's default
  // (KvPrefetchByDefault: on for AMD only).
  auto made = CpuBackend::Create({.num_threads = 2, .isa = GetParam(), .kv_prefetch = true});
  ASSERT_TRUE(made.ok()) << made.status();
  backend_ = *std::move(made);
  // What bench-engine reports as the rows that take it: 8-18 on AVX2 (the
  // panel-outer order), none on the others.
  const auto [first_rows, last_rows] = backend_->kv_prefetch_rows();
  if (GetParam() == Isa::kAvx2) {
    EXPECT_EQ(first_rows, 8);
    EXPECT_EQ(last_rows, 18);
  } else {
    EXPECT_GT(first_rows, last_rows);
  }
  for (int64_t m = 1; m <= 40; ++m) EXPECT_EQ(takes(m), m >= first_rows && m <= last_rows) << m;
  const int64_t k = 64;
  auto w1 = backend_->RandomLinear(96, k, DType::kBF16, 1.0f, 1);
  auto w2 = backend_->RandomLinear(320, k, DType::kBF16, 1.0f, 2);
  ASSERT_TRUE(w1.ok() && w2.ok());
  const int64_t b1 = static_cast<int64_t>((*w1)->bytes()), b2 = static_cast<int64_t>((*w2)->bytes());

  bool expecting = false;
  // kSeqs sequences of `per_seq` blocks, all sharing their first one.
  auto run = [&](int32_t per_seq, int64_t m) {
    SCOPED_TRACE(::testing::Message() << "blocks per sequence " << per_seq << ", m=" << m);
    const int32_t num_blocks = 1 + kSeqs * (per_seq - 1);
    std::vector<uint16_t> kv(static_cast<size_t>(num_blocks) * kBlockElems, 0);
    std::vector<std::vector<int32_t>> tables(kSeqs);
    std::vector<AttentionSequence> seqs;
    const int32_t cached = (per_seq - 1) * kBlock + 1;  // The last block holds one position.
    for (int32_t s = 0; s < kSeqs; ++s) {
      tables[s].push_back(0);
      for (int32_t b = 1; b < per_seq; ++b) tables[s].push_back(1 + s * (per_seq - 1) + (b - 1));
      seqs.push_back({tables[s], cached, 1, s});
    }
    const KvLayerView view{.base = kv.data(),
                           .dtype = DType::kBF16,
                           .block_stride = kBlockElems,
                           .head_stride = kBlock * kDim,
                           .v_offset = kHeads * kBlock * kDim,
                           .block_size = kBlock};
    const int64_t hinted = std::min<int64_t>(num_blocks * kBlockBytes, 8 << 20);
    std::vector<float> x = Random(m * k), y1(m * 96), y2(m * 320), ref1(m * 96), ref2(m * 320);
    backend_->Linear(**w1, x.data(), m, nullptr, ref1.data(), false);
    backend_->Linear(**w2, x.data(), m, nullptr, ref2.data(), false);
    std::vector<float> q(kSeqs * kHeads * kDim, 0.0f), out(q.size());
    const AttentionBatch attend{.q = q.data(), .out = out.data(), .sequences = seqs, .kv = view,
                                .num_heads = kHeads, .num_kv_heads = kHeads, .head_dim = kDim, .scale = 0.125f};
    // Close any earlier interval, so the first below has no expectation.
    backend_->Attention(attend);
    for (int interval = 0; interval < 2; ++interval) {
      SCOPED_TRACE(::testing::Message() << "interval " << interval);
      backend_->PrefetchKv(view, seqs);
      const int64_t before = backend_->kv_prefetched_bytes();
      backend_->Linear(**w1, x.data(), m, nullptr, y1.data(), false);
      const int64_t after1 = backend_->kv_prefetched_bytes();
      backend_->Linear(**w2, x.data(), m, nullptr, y2.data(), false);
      const int64_t after2 = backend_->kv_prefetched_bytes();
      backend_->Attention(attend);
      EXPECT_EQ(y1, ref1);
      EXPECT_EQ(y2, ref2);
      if (!takes(m)) {
        EXPECT_EQ(after2, before);
        continue;
      }
      // The backend's first interval has no expectation: the first product
      // takes all. The later ones judge by the last's weight bytes (b1 + b2).
      const int64_t lines = hinted / 64;
      const int64_t share1 = !expecting ? lines : static_cast<int64_t>(static_cast<double>(lines) * b1 / (b1 + b2));
      expecting = true;
      EXPECT_EQ(after1 - before, share1 * 64);
      EXPECT_EQ(after2 - before, hinted);
    }
  };
  run(3, 8);    // 17 blocks.
  run(3, 16);
  run(3, 4);    // Too few rows: bound by the weight stream.
  run(3, 32);   // The chunked order on AVX2.
  run(80, 8);   // 633 blocks: capped at 8 MiB.
}

TEST_P(CpuKernelsTest, SiluMulMatchesReference) {
  for (int64_t f : {1, 7, 16, 33, 100}) {
    const int64_t m = 3;
    std::vector<float> gu = Random(m * 2 * f, 4.0f), out(m * f);
    backend_->SiluMul(gu.data(), m, f, out.data());
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < f; ++j) {
        const double g = gu[i * 2 * f + j], u = gu[i * 2 * f + f + j];
        const double want = g / (1 + std::exp(-g)) * u;
        ASSERT_NEAR(out[i * f + j], want, 1e-6 * (std::abs(want) + 1e-3)) << f;
      }
    }
  }
}

// RMS normalization against float64, and bitwise against the documented
// arithmetic (KernelTable::rms_norm_row: 8 partial sums, element i in sum
// i % 8; y = (x * inv) * w), so every ISA gives the same bits; a prompt's
// rows (in parallel) and a normalization in place give them too. (The
// order inside the float64 sum shows in y only when it moves inv across a
// float rounding boundary, which random rows almost never do: summing the
// 8 partial sums in another order passes here; scaling as x * (inv * w)
// fails.)
TEST_P(CpuKernelsTest, RmsNormMatchesReferenceInTheDocumentedOrder) {
  const float eps = 1e-5f;
  for (int64_t d : {1, 7, 8, 9, 17, 64, 767, 768, 770}) {
    for (int64_t m : {3, 700}) {
      std::vector<float> x = Random(m * d, 3.0f), w = Random(d), y(m * d);
      backend_->RmsNorm(x.data(), w.data(), m, d, eps, y.data());
      for (int64_t i = 0; i < m; ++i) {
        const float* xi = x.data() + i * d;
        double part[8] = {}, exact = 0;
        for (int64_t j = 0; j < d; ++j) {
          part[j % 8] += static_cast<double>(xi[j]) * xi[j];
          exact += static_cast<double>(xi[j]) * xi[j];
        }
        const double ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
        const double inv_exact = 1.0 / std::sqrt(exact / static_cast<double>(d) + eps);
        for (int64_t j = 0; j < d; ++j) {
          const float got = y[i * d + j];
          ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(xi[j] * inv * w[j]))
              << "d " << d << " row " << i << " col " << j;
          const double want = xi[j] * inv_exact * w[j];
          ASSERT_NEAR(got, want, 1e-6 * (std::abs(want) + 1e-6)) << d;
        }
      }
      std::vector<float> in_place = x;
      backend_->RmsNorm(in_place.data(), w.data(), m, d, eps, in_place.data());
      ASSERT_EQ(std::memcmp(in_place.data(), y.data(), y.size() * sizeof(float)), 0) << d;
    }
  }
}

struct AttnShape {
  int32_t heads, kv_heads, head_dim, block_size;
  DType kv_type;
};

// The documented block layout: K transposed [head][dim][slot], V [head][slot][dim].
int64_t KOffset(const AttnShape& s, int64_t block_elems, int64_t block, int h, int64_t slot, int d) {
  return block * block_elems + (static_cast<int64_t>(h) * s.head_dim + d) * s.block_size + slot;
}
int64_t VOffset(const AttnShape& s, int64_t block_elems, int64_t half, int64_t block, int h,
                int64_t slot, int d) {
  return block * block_elems + half + (static_cast<int64_t>(h) * s.block_size + slot) * s.head_dim + d;
}

std::vector<float> RandomVector(std::mt19937& rng, size_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// How far an attention output may be from the double reference.
// exact_scores: F32 scores and weights (2e-5 absolute). Otherwise the BF16
// dot form (AttentionArgs::bf16_dot): each query element rounded to BF16
// (relative 2^-9) moves a score by at most delta = 2^-9 * scale * sum_d
// |q_d k_d|, which moves a normalized weight by a relative 2 * delta at
// most (first order); each weight rounded to BF16 and the sum of the
// rounded weights as the normalizer add 2 * 2^-9. The output, a convex
// combination of V, then moves by max_j |v_jd| times that, with half
// again for the second order, plus the F32 sums' 2e-5.
struct AttnTolerance {
  bool exact_scores = true;
};

// One query head's attention in float64 over `keys` keys whose stored
// values are k(j, d) and v(j, d), and how far the kernels may be from it
// for each output dimension (AttnTolerance).
struct HeadReference {
  std::vector<double> want, tol;
};
template <typename KAt, typename VAt>
HeadReference ReferenceHead(const float* q, int32_t keys, int32_t head_dim, float scale, KAt k, VAt v,
                            AttnTolerance tolerance) {
  std::vector<double> w(keys);
  double mx = -1e300;
  double delta = 0;  // Bound on a score's move from BF16 queries.
  for (int32_t j = 0; j < keys; ++j) {
    double dot = 0, mag = 0;
    for (int32_t d = 0; d < head_dim; ++d) {
      const double t = static_cast<double>(q[d]) * k(j, d);
      dot += t;
      mag += std::abs(t);
    }
    w[j] = dot * scale;
    delta = std::max(delta, std::ldexp(mag * scale, -9));
    mx = std::max(mx, w[j]);
  }
  double sum = 0;
  for (double& e : w) sum += (e = std::exp(e - mx));
  HeadReference r;
  for (int32_t d = 0; d < head_dim; ++d) {
    double want = 0, vmax = 0;
    for (int32_t j = 0; j < keys; ++j) {
      const double vj = v(j, d);
      want += w[j] / sum * vj;
      vmax = std::max(vmax, std::abs(vj));
    }
    r.want.push_back(want);
    r.tol.push_back(tolerance.exact_scores ? 2e-5 : 1.5 * vmax * (2 * delta + 2 * std::ldexp(1.0, -9)) + 2e-5);
  }
  return r;
}

void ExpectPagedAttentionMatchesReference(CpuBackend& backend, std::mt19937& rng, absl::Span<const AttnShape> shapes,
                                          AttnTolerance tolerance) {
  auto Random = [&](size_t n, float scale = 1.0f) { return RandomVector(rng, n, scale); };
  for (const AttnShape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "heads " << s.heads << "/" << s.kv_heads << " dim "
                                      << s.head_dim << " bs " << s.block_size);
    // Prefill chunks (S0=0, m=9) and (S0=21, m=3); decodes (S0=40, m=1) and
    // (S0=600, m=2), whose history spans several of the kernel's softmax
    // runs (256 keys) and, for odd block sizes, a partial last block.
    constexpr int kSeqs = 4;
    const int32_t cached[kSeqs] = {0, 21, 40, 600};
    const int32_t fresh[kSeqs] = {9, 3, 1, 2};
    const int32_t num_blocks = 1024;
    const int64_t half = static_cast<int64_t>(s.kv_heads) * s.block_size * s.head_dim;
    // int8 blocks carry [K|V][kv_heads][block_size] F32 scales after the data.
    const int64_t scale_offset = 2 * half;
    const int64_t block_elems =
        s.kv_type == DType::kI8 ? 2 * half + 2LL * s.kv_heads * s.block_size * 4 : 2 * half;
    std::vector<float> kvf(num_blocks * block_elems, 0.0f);
    std::vector<uint16_t> kvh(num_blocks * block_elems, 0);
    std::vector<int8_t> kvq(num_blocks * block_elems, 0);
    std::vector<std::vector<int32_t>> tables(kSeqs);
    std::vector<int32_t> perm(num_blocks);
    for (int32_t i = 0; i < num_blocks; ++i) perm[i] = (i * 37 + 11) % num_blocks;
    int32_t next_block = 0;
    int32_t rows = 0;
    std::vector<AttentionSequence> seqs;
    // Logical K/V per sequence for the reference: [pos][kv_head][dim].
    std::vector<std::vector<float>> K(kSeqs), Vv(kSeqs);
    for (int q = 0; q < kSeqs; ++q) {
      const int32_t total = cached[q] + fresh[q];
      const int32_t nb = (total + s.block_size - 1) / s.block_size;
      for (int32_t b = 0; b < nb; ++b) tables[q].push_back(perm[next_block++]);
      K[q] = Random(static_cast<size_t>(total) * s.kv_heads * s.head_dim);
      Vv[q] = Random(static_cast<size_t>(total) * s.kv_heads * s.head_dim);
      for (int32_t p = 0; p < total; ++p) {
        for (int32_t h = 0; h < s.kv_heads; ++h) {
          const int64_t block = tables[q][p / s.block_size];
          const int64_t slot = p % s.block_size;
          const int64_t src0 = (static_cast<int64_t>(p) * s.kv_heads + h) * s.head_dim;
          if (s.kv_type == DType::kI8) {
            // Quantize with one scale per (position, head), as WriteKv does.
            float* scales = reinterpret_cast<float*>(kvq.data() + block * block_elems + scale_offset);
            for (int kv = 0; kv < 2; ++kv) {
              std::vector<float>& src = kv == 0 ? K[q] : Vv[q];
              float amax = 0;
              for (int32_t d = 0; d < s.head_dim; ++d) amax = std::max(amax, std::abs(src[src0 + d]));
              const float sc = amax / 127.0f;
              scales[kv * s.kv_heads * s.block_size + h * s.block_size + slot] = sc;
              for (int32_t d = 0; d < s.head_dim; ++d) {
                const int8_t v = static_cast<int8_t>(std::nearbyint(src[src0 + d] * (127.0f / amax)));
                const int64_t at = kv == 0 ? KOffset(s, block_elems, block, h, slot, d)
                                           : VOffset(s, block_elems, half, block, h, slot, d);
                kvq[at] = v;
                src[src0 + d] = v * sc;
              }
            }
            continue;
          }
          for (int32_t d = 0; d < s.head_dim; ++d) {
            const int64_t ko = KOffset(s, block_elems, block, h, slot, d);
            const int64_t vo = VOffset(s, block_elems, half, block, h, slot, d);
            const int64_t src = src0 + d;
            if (s.kv_type == DType::kBF16) {
              kvh[ko] = F32ToBf16(K[q][src]);
              kvh[vo] = F32ToBf16(Vv[q][src]);
              K[q][src] = Bf16ToF32(kvh[ko]);
              Vv[q][src] = Bf16ToF32(kvh[vo]);
            } else {
              kvf[ko] = K[q][src];
              kvf[vo] = Vv[q][src];
            }
          }
        }
      }
      seqs.push_back({tables[q], cached[q], fresh[q], rows});
      rows += fresh[q];
    }
    std::vector<float> qv = Random(static_cast<size_t>(rows) * s.heads * s.head_dim);
    std::vector<float> out(qv.size(), -1.0f);
    const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
    void* base = s.kv_type == DType::kF32    ? static_cast<void*>(kvf.data())
                 : s.kv_type == DType::kBF16 ? static_cast<void*>(kvh.data())
                                             : static_cast<void*>(kvq.data());
    KvLayerView view{.base = base,
                     .dtype = s.kv_type,
                     .block_stride = block_elems,
                     .head_stride = static_cast<int64_t>(s.block_size) * s.head_dim,
                     .v_offset = half,
                     .block_size = s.block_size,
                     .scale_offset = s.kv_type == DType::kI8 ? scale_offset : 0};
    backend.Attention({.q = qv.data(), .out = out.data(), .sequences = seqs, .kv = view,
                       .num_heads = s.heads, .num_kv_heads = s.kv_heads,
                       .head_dim = s.head_dim, .scale = scale});
    const int32_t g = s.heads / s.kv_heads;
    for (int q = 0; q < kSeqs; ++q) {
      for (int32_t i = 0; i < fresh[q]; ++i) {
        const int32_t row = seqs[q].row_offset + i;
        const int32_t pos = cached[q] + i;
        for (int32_t h = 0; h < s.heads; ++h) {
          const int32_t kh = h / g;
          const HeadReference ref = ReferenceHead(
              qv.data() + (row * s.heads + h) * s.head_dim, pos + 1, s.head_dim, scale,
              [&](int32_t j, int32_t d) { return K[q][(static_cast<int64_t>(j) * s.kv_heads + kh) * s.head_dim + d]; },
              [&](int32_t j, int32_t d) { return Vv[q][(static_cast<int64_t>(j) * s.kv_heads + kh) * s.head_dim + d]; },
              tolerance);
          for (int32_t d = 0; d < s.head_dim; ++d) {
            ASSERT_NEAR(out[(row * s.heads + h) * s.head_dim + d], ref.want[d], ref.tol[d])
                << "seq " << q << " row " << i << " head " << h << " dim " << d;
          }
        }
      }
    }
  }
}

TEST_P(CpuKernelsTest, PagedAttentionMatchesReference) {
  const AttnShape shapes[] = {{4, 2, 8, 16, DType::kF32},  {6, 2, 12, 5, DType::kF32},
                              {8, 1, 64, 16, DType::kBF16}, {3, 3, 80, 1, DType::kF32},
                              {5, 1, 20, 7, DType::kBF16},  {12, 4, 64, 16, DType::kF32},
                              {8, 2, 64, 16, DType::kI8},   {6, 3, 20, 5, DType::kI8}};
  ExpectPagedAttentionMatchesReference(*backend_, rng_, shapes, {});
}

// Prompt rows are attended in tiles of consecutive rows that share each K
// and V load; a row's output must be bitwise what it is attended alone (as
// the decode of its position): recompute after preemption and migration
// rely on it. Prompts that start, end and cross the kernel's 256-key
// softmax runs and 512-key segments (a lone row of 4 segments or more has
// its segments split over the 2 threads), with head dims off the vector
// width, odd block sizes and every KV format.
void ExpectPromptRowsBitwiseTheRowAlone(CpuBackend& backend, std::mt19937& rng, absl::Span<const AttnShape> shapes) {
  auto Random = [&](size_t n, float scale = 1.0f) { return RandomVector(rng, n, scale); };
  struct Prompt {
    int32_t cached, fresh;
  };
  const Prompt prompts[] = {{0, 300}, {250, 13}, {7, 1}, {509, 6}, {0, 2}, {1020, 9}, {2040, 3}};
  for (const AttnShape& s : shapes) {
    for (const Prompt& pr : prompts) {
      SCOPED_TRACE(::testing::Message() << "heads " << s.heads << "/" << s.kv_heads << " dim " << s.head_dim
                                        << " bs " << s.block_size << " kv " << DTypeName(s.kv_type) << " cached "
                                        << pr.cached << " fresh " << pr.fresh);
      const int32_t total = pr.cached + pr.fresh;
      const int32_t nb = (total + s.block_size - 1) / s.block_size;
      const int64_t half = static_cast<int64_t>(s.kv_heads) * s.block_size * s.head_dim;
      const int64_t scale_offset = 2 * half;
      // Element units of the block's dtype; int8 scales (F32) after the data.
      const int64_t block_elems =
          s.kv_type == DType::kI8 ? 2 * half + 2LL * s.kv_heads * s.block_size * 4 : 2 * half;
      std::vector<int32_t> table(nb);
      for (int32_t b = 0; b < nb; ++b) table[b] = (b * 7 + 3) % nb;
      const std::vector<float> vals = Random(static_cast<size_t>(nb * block_elems));
      std::vector<float> kvf;
      std::vector<uint16_t> kvh;
      std::vector<int8_t> kvq;
      void* base = nullptr;
      if (s.kv_type == DType::kF32) {
        kvf = vals;
        base = kvf.data();
      } else if (s.kv_type == DType::kBF16) {
        for (float v : vals) kvh.push_back(F32ToBf16(v));
        base = kvh.data();
      } else {
        for (float v : vals) kvq.push_back(static_cast<int8_t>(std::clamp(v * 40.0f, -127.0f, 127.0f)));
        for (int32_t b = 0; b < nb; ++b) {
          float* scales = reinterpret_cast<float*>(kvq.data() + b * block_elems + scale_offset);
          for (int64_t i = 0; i < 2LL * s.kv_heads * s.block_size; ++i) scales[i] = 0.01f + 0.001f * (i % 13);
        }
        base = kvq.data();
      }
      const KvLayerView view{.base = base,
                             .dtype = s.kv_type,
                             .block_stride = block_elems,
                             .head_stride = static_cast<int64_t>(s.block_size) * s.head_dim,
                             .v_offset = half,
                             .block_size = s.block_size,
                             .scale_offset = s.kv_type == DType::kI8 ? scale_offset : 0};
      const int64_t row_elems = static_cast<int64_t>(s.heads) * s.head_dim;
      const std::vector<float> qv = Random(static_cast<size_t>(pr.fresh * row_elems), 2.0f);
      const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
      std::vector<float> tiled(qv.size(), -1.0f);
      const AttentionSequence prompt[] = {{table, pr.cached, pr.fresh, 0}};
      backend.Attention({.q = qv.data(), .out = tiled.data(), .sequences = prompt, .kv = view,
                           .num_heads = s.heads, .num_kv_heads = s.kv_heads, .head_dim = s.head_dim,
                           .scale = scale});
      for (int32_t i = 0; i < pr.fresh; ++i) {
        std::vector<float> alone(static_cast<size_t>(row_elems), -2.0f);
        const AttentionSequence one[] = {{table, pr.cached + i, 1, 0}};
        backend.Attention({.q = qv.data() + i * row_elems, .out = alone.data(), .sequences = one, .kv = view,
                             .num_heads = s.heads, .num_kv_heads = s.kv_heads, .head_dim = s.head_dim,
                             .scale = scale});
        for (int64_t e = 0; e < row_elems; ++e) {
          ASSERT_EQ(std::bit_cast<uint32_t>(tiled[i * row_elems + e]), std::bit_cast<uint32_t>(alone[e]))
              << "row " << i << " element " << e << ": " << tiled[i * row_elems + e] << " vs " << alone[e];
        }
      }
    }
  }
}

TEST_P(CpuKernelsTest, PromptRowsAreBitwiseTheRowAlone) {
  // Shapes with up to four query heads per KV head (three on AVX2, whose
  // chunks are 8 keys) and whole chunks (12/4, 4/1, 12/12 and 4/2 at block
  // 16, 8/4 at 32, 4/4 at 16; 4/1 pairs only on AVX-512; BF16 at block 16
  // takes AVX2's ScoreChunkPairQt for 1, 2 and 3 heads) have a lone row's
  // chunks scored in pairs (and a pair can span two blocks) while the
  // prompt's tiles score them one at a time, or on AVX-512 in pairs of
  // their own (kTilePairs: 6 heads a pass, the diagonal's partial chunks
  // alone), so the two pair a row's chunks differently. A lone row whose
  // backend work chunk holds several of its KV heads (on 2 threads a lone
  // row's chunk holds half of them: several for the shapes here with 4 or
  // more) goes over them run by run (every head's 256-key run before the
  // next run), where a prompt's tiles take one head's whole history at a
  // time.
  const AttnShape shapes[] = {{12, 4, 64, 16, DType::kBF16}, {8, 8, 20, 5, DType::kF32},
                              {6, 2, 24, 7, DType::kI8},     {16, 1, 8, 1, DType::kBF16},
                              {4, 1, 64, 16, DType::kF32},   {24, 2, 16, 16, DType::kI8},
                              {12, 12, 64, 16, DType::kBF16}, {8, 4, 32, 32, DType::kI8},
                              {6, 3, 20, 48, DType::kF32},   {4, 4, 36, 16, DType::kBF16},
                              {4, 2, 32, 16, DType::kBF16}};
  ExpectPromptRowsBitwiseTheRowAlone(*backend_, rng_, shapes);
}

// Long decode histories go segment by segment (AttentionSegmentBlocks):
// alone on one thread the segments are merged in turn; a lone row on
// several threads has its segments computed apart and merged after; a
// cascade batch (sequences sharing a prefix) merges each query's segments
// as it steps through the blocks. All three must give the same bits, and
// the merge must be right: each row against the float64 reference.
void ExpectLongDecodeRowsAgreeAcrossPaths(Isa isa, std::mt19937& rng, const AttnShape& s, bool bf16_dot) {
  SCOPED_TRACE(::testing::Message() << "heads " << s.heads << "/" << s.kv_heads << " dim " << s.head_dim << " bs "
                                    << s.block_size << " kv " << DTypeName(s.kv_type));
  // Histories of 3, 2 and 5 segments (of about 512 keys; the backend
  // splits a row of 4 or more between the threads when there are fewer
  // rows than threads); the first and the
  // last share their first 1120 keys' blocks, the second the first 640
  // keys' of those.
  constexpr int kSeqs = 3;
  const int32_t cached[kSeqs] = {1300, 900, 2100};
  const int32_t shared[kSeqs] = {1120 / s.block_size, 640 / s.block_size, 1120 / s.block_size};
  int32_t total_blocks = shared[0];
  for (int q = 0; q < kSeqs; ++q) total_blocks += (cached[q] + s.block_size) / s.block_size - shared[q];
  const int64_t half = static_cast<int64_t>(s.kv_heads) * s.block_size * s.head_dim;
  const int64_t block_elems = 2 * half;
  const std::vector<float> vals = RandomVector(rng, static_cast<size_t>(total_blocks * block_elems));
  std::vector<float> kvf(vals.size());
  std::vector<uint16_t> kvh(vals.size());
  for (size_t i = 0; i < vals.size(); ++i) {
    kvh[i] = F32ToBf16(vals[i]);
    kvf[i] = s.kv_type == DType::kBF16 ? Bf16ToF32(kvh[i]) : vals[i];  // The values the kernels read.
  }
  std::vector<int32_t> perm(total_blocks);
  for (int32_t i = 0; i < total_blocks; ++i) perm[i] = (i * 37 + 11) % total_blocks;
  std::vector<std::vector<int32_t>> tables(kSeqs);
  int32_t next = shared[0];  // Blocks [0, shared[0]) of perm are the shared prefix.
  for (int q = 0; q < kSeqs; ++q) {
    const int32_t nb = (cached[q] + 1 + s.block_size - 1) / s.block_size;
    for (int32_t b = 0; b < nb; ++b) tables[q].push_back(perm[b < shared[q] ? b : next++]);
  }
  ASSERT_EQ(next, total_blocks);
  const KvLayerView view{.base = s.kv_type == DType::kF32 ? static_cast<void*>(kvf.data()) : kvh.data(),
                         .dtype = s.kv_type,
                         .block_stride = block_elems,
                         .head_stride = static_cast<int64_t>(s.block_size) * s.head_dim,
                         .v_offset = half,
                         .block_size = s.block_size};
  const int64_t row_elems = static_cast<int64_t>(s.heads) * s.head_dim;
  const std::vector<float> qv = RandomVector(rng, static_cast<size_t>(kSeqs * row_elems), 2.0f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.head_dim));
  std::vector<AttentionSequence> batch;
  for (int q = 0; q < kSeqs; ++q) batch.push_back({tables[q], cached[q], 1, q});
  const MatrixPath path = bf16_dot ? MatrixPath::kBf16 : MatrixPath::kF32;
  auto one = CpuBackend::Create({.num_threads = 1, .isa = isa, .matrix_path = path, .bf16_attention = bf16_dot});
  auto two = CpuBackend::Create({.num_threads = 2, .isa = isa, .matrix_path = path, .bf16_attention = bf16_dot});
  // Five threads for 3 rows: every row split, chunks cutting across a
  // segment's heads.
  auto five = CpuBackend::Create({.num_threads = 5, .isa = isa, .matrix_path = path, .bf16_attention = bf16_dot});
  ASSERT_TRUE(one.ok() && two.ok() && five.ok());
  ASSERT_EQ((*one)->Bf16DotAttention(s.kv_type, s.block_size), bf16_dot);
  auto run = [&](CpuBackend& b, absl::Span<const AttentionSequence> seqs, const float* q, bool group) {
    std::vector<float> out(seqs.size() * row_elems, -1.0f);
    int64_t bytes = 0;
    b.Attention({.q = q, .out = out.data(), .sequences = seqs, .kv = view, .num_heads = s.heads,
                 .num_kv_heads = s.kv_heads, .head_dim = s.head_dim, .scale = scale, .group_shared_blocks = group,
                 .kv_bytes_read = &bytes});
    EXPECT_GT(bytes, 0);
    return out;
  };
  const std::vector<float> cascade = run(**one, batch, qv.data(), true);
  const std::vector<float> cascade2 = run(**two, batch, qv.data(), true);
  const std::vector<float> per_sequence = run(**two, batch, qv.data(), false);
  const std::vector<float> split_batch = run(**five, batch, qv.data(), false);
  auto same = [&](const float* x, const float* y, const char* what, int q) {
    for (int64_t e = 0; e < row_elems; ++e) {
      ASSERT_EQ(std::bit_cast<uint32_t>(x[e]), std::bit_cast<uint32_t>(y[e]))
          << what << ": sequence " << q << " element " << e << ": " << x[e] << " vs " << y[e];
    }
  };
  for (int q = 0; q < kSeqs; ++q) {
    const AttentionSequence alone[] = {{tables[q], cached[q], 1, 0}};
    const float* qq = qv.data() + q * row_elems;
    const std::vector<float> serial = run(**one, alone, qq, true);
    const std::vector<float> split = run(**two, alone, qq, true);
    same(serial.data(), split.data(), "one thread against two (segments apart for the longest)", q);
    same(serial.data(), cascade.data() + q * row_elems, "alone against cascade", q);
    same(serial.data(), cascade2.data() + q * row_elems, "alone against cascade on two threads", q);
    same(serial.data(), per_sequence.data() + q * row_elems, "alone against the batch", q);
    same(serial.data(), split_batch.data() + q * row_elems, "alone against the batch on five threads", q);
    const std::vector<float> split5 = run(**five, alone, qq, true);
    same(serial.data(), split5.data(), "one thread against five", q);
    // And against float64 (the merge's arithmetic, not only its order).
    const int32_t g = s.heads / s.kv_heads;
    const int32_t keys = cached[q] + 1;
    for (int32_t h = 0; h < s.heads; ++h) {
      const int32_t kh = h / g;
      auto at = [&](int32_t j) { return static_cast<int64_t>(tables[q][j / s.block_size]); };
      const HeadReference ref = ReferenceHead(
          qq + h * s.head_dim, keys, s.head_dim, scale,
          [&](int32_t j, int32_t d) { return kvf[KOffset(s, block_elems, at(j), kh, j % s.block_size, d)]; },
          [&](int32_t j, int32_t d) { return kvf[VOffset(s, block_elems, half, at(j), kh, j % s.block_size, d)]; },
          {.exact_scores = !bf16_dot});
      for (int32_t d = 0; d < s.head_dim; ++d) {
        ASSERT_NEAR(serial[h * s.head_dim + d], ref.want[d], ref.tol[d])
            << "sequence " << q << " head " << h << " dim " << d;
      }
    }
  }
}

TEST_P(CpuKernelsTest, LongDecodeRowsAgreeAcrossThreadsAndCascade) {
  for (const AttnShape& s : {AttnShape{12, 4, 64, 16, DType::kBF16}, AttnShape{8, 2, 20, 5, DType::kF32},
                             AttnShape{4, 4, 32, 32, DType::kBF16}}) {
    ExpectLongDecodeRowsAgreeAcrossPaths(GetParam(), rng_, s, false);
  }
}

TEST(Bf16AttentionTest, LongDecodeRowsAgreeAcrossThreadsAndCascade) {
  if (!Bf16PathSupported()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  std::mt19937 rng(7);
  ExpectLongDecodeRowsAgreeAcrossPaths(Isa::kAvx512, rng, {12, 4, 64, 16, DType::kBF16}, true);
}

// Row i, column j of x W^T in double on the BF16-rounded weights, and the
// first-order error bound of the FP16 path (unit roundoff u = 2^-11): x and
// each product are rounded once (2u |p|), and each addition to a lane's
// running half sum rounds it (u |partial|); a lane sums the even or the odd
// k of a block of kF16Block pairs. The F32 part adds ~1e-7 relative.
struct F16Expectation {
  double want = 0, bound = 0;
};
F16Expectation ExpectF16(const std::vector<float>& x, const std::vector<float>& w, int64_t k, int64_t i, int64_t j) {
  constexpr double u = 1.0 / 2048;
  F16Expectation e;
  double partial[2] = {0, 0};
  for (int64_t c = 0; c < k; ++c) {
    const double p = static_cast<double>(x[i * k + c]) * Bf16ToF32(F32ToBf16(w[j * k + c]));
    e.want += p;
    if (c % (2 * kF16Block) == 0) partial[0] = partial[1] = 0;
    partial[c & 1] += p;
    e.bound += 2 * u * std::abs(p) + u * std::abs(partial[c & 1]);
  }
  return e;
}

// One pair-panel path (backend) against a double reference: every (m, n,
// k, accumulate) of the lists, K up to 2048, y within `expect`'s bound (+
// `rel` of |y|); and each row's bits the same computed alone as in the
// batch. The even K have a bias and the odd ones none, so each (m, n,
// accumulate) meets both (the AMX path stores whole tiles without a bias
// or an old y straight from its accumulators).
using PathExpectation = F16Expectation (*)(const std::vector<float>&, const std::vector<float>&, int64_t, int64_t,
                                           int64_t);
void ExpectPathMatchesReference(CpuBackend& backend, uint32_t seed, std::initializer_list<int64_t> ms,
                                std::initializer_list<int64_t> ns, PathExpectation expect, double rel) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int64_t m : ms) {
    for (int64_t n : ns) {
      for (int64_t k : {1, 2, 31, 32, 33, 64, 65, 200, 2048}) {
        for (bool accumulate : {false, true}) {
          SCOPED_TRACE(::testing::Message() << "m=" << m << " n=" << n << " k=" << k << " acc=" << accumulate);
          std::vector<float> w(n * k), x(m * k), bias(n), y(m * n);
          for (float& v : w) v = 0.05f * d(rng);
          for (float& v : x) v = d(rng);
          for (float& v : bias) v = d(rng);
          for (float& v : y) v = d(rng);
          const std::vector<float> y0 = y;
          const MatrixPart parts[] = {{DType::kF32, w.data(), n}};
          auto packed = backend.PackLinear(parts, k, DType::kBF16);
          ASSERT_TRUE(packed.ok()) << packed.status();
          const bool with_bias = k % 2 == 0;
          if (!with_bias) bias.assign(bias.size(), 0.0f);
          const float* b = with_bias ? bias.data() : nullptr;
          backend.Linear(**packed, x.data(), m, b, y.data(), accumulate);
          for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < n; ++j) {
              const F16Expectation e = expect(x, w, k, i, j);
              const double want = e.want + bias[j] + (accumulate ? y0[i * n + j] : 0.0);
              ASSERT_NEAR(y[i * n + j], want, e.bound + rel * (std::abs(want) + 1)) << i << "," << j;
            }
          }
          for (int64_t i = 0; i < m; ++i) {
            std::vector<float> one(y0.begin() + i * n, y0.begin() + (i + 1) * n);
            backend.Linear(**packed, x.data() + i * k, 1, b, one.data(), accumulate);
            for (int64_t j = 0; j < n; ++j) {
              ASSERT_EQ(one[j], y[i * n + j]) << "row " << i << " col " << j << " differs computed alone";
            }
          }
        }
      }
    }
  }
}

// The FP16 matrix path (linear_fp16.h) against a double reference on the
// BF16-rounded weights: error within the half-precision rounding of x, of
// each product and of each kF16Block-long half sum; and each row's bits the
// same whether it is computed alone or in any tile of a larger batch.
TEST(F16PathTest, LinearMatchesReferenceAndRowsDoNotDependOnTheBatch) {
  if (!F16PathSupported()) GTEST_SKIP() << "this CPU has no AVX512-FP16: the fp16 matrix path cannot run here";
  auto b = CpuBackend::Create({.num_threads = 2, .isa = Isa::kAvx512, .matrix_path = MatrixPath::kF16});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->Name(), "cpu/avx512+fp16");
  ExpectPathMatchesReference(**b, 7, {1, 2, 3, 8, 9, 29}, {1, 31, 32, 33, 100, 160}, &ExpectF16, 1e-5);
}

// A row whose activations would overflow half precision (up to 2e5 here)
// is divided by a power of two before rounding and its products multiplied
// back: finite results within the same error bound, the other rows' bits
// unchanged.
TEST(F16PathTest, RowsTooLargeForHalfPrecisionAreScaledNotOverflowed) {
  if (!F16PathSupported()) GTEST_SKIP() << "this CPU has no AVX512-FP16: the fp16 matrix path cannot run here";
  auto b = CpuBackend::Create({.num_threads = 2, .isa = Isa::kAvx512, .matrix_path = MatrixPath::kF16});
  ASSERT_TRUE(b.ok()) << b.status();
  const int64_t m = 3, k = 100, n = 40;
  std::mt19937 rng(11);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> w(n * k), x(m * k), y(m * n, 0.0f);
  for (float& v : w) v = 0.05f * d(rng);
  for (float& v : x) v = d(rng);
  for (int64_t c = 0; c < k; ++c) x[1 * k + c] *= 5e4f;  // Row 1: |x| up to ~2e5.
  const MatrixPart parts[] = {{DType::kF32, w.data(), n}};
  auto packed = (*b)->PackLinear(parts, k, DType::kBF16);
  ASSERT_TRUE(packed.ok());
  (*b)->Linear(**packed, x.data(), m, nullptr, y.data(), false);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const F16Expectation e = ExpectF16(x, w, k, i, j);
      ASSERT_TRUE(std::isfinite(y[i * n + j])) << i << "," << j;
      ASSERT_NEAR(y[i * n + j], e.want, e.bound + 1e-5 * (std::abs(e.want) + 1)) << i << "," << j;
    }
  }
  // Row 0 alone: the same bits as beside the scaled row.
  std::vector<float> one(n, 0.0f);
  (*b)->Linear(**packed, x.data(), 1, nullptr, one.data(), false);
  for (int64_t j = 0; j < n; ++j) ASSERT_EQ(one[j], y[j]) << j;
}

// A matrix with a weight beyond the largest half (1e5) stays on the F32
// path: the F32 path's exact results, not infinities.
TEST(F16PathTest, WeightsBeyondHalfPrecisionStayOnTheF32Path) {
  if (!F16PathSupported()) GTEST_SKIP() << "this CPU has no AVX512-FP16: the fp16 matrix path cannot run here";
  auto f16 = CpuBackend::Create({.num_threads = 1, .isa = Isa::kAvx512, .matrix_path = MatrixPath::kF16});
  auto f32 = CpuBackend::Create({.num_threads = 1, .isa = Isa::kAvx512, .matrix_path = MatrixPath::kF32});
  ASSERT_TRUE(f16.ok() && f32.ok());
  const int64_t m = 2, k = 40, n = 20;
  std::vector<float> w(n * k, 0.01f), x(m * k, 0.5f), a(m * n), b(m * n);
  w[3 * k + 7] = 1e5f;
  const MatrixPart parts[] = {{DType::kF32, w.data(), n}};
  auto pa = (*f16)->PackLinear(parts, k, DType::kBF16);
  auto pb = (*f32)->PackLinear(parts, k, DType::kBF16);
  ASSERT_TRUE(pa.ok() && pb.ok());
  (*f16)->Linear(**pa, x.data(), m, nullptr, a.data(), false);
  (*f32)->Linear(**pb, x.data(), m, nullptr, b.data(), false);
  EXPECT_EQ(a, b);
}

// Row i, column j of x W^T in double on the BF16-rounded weights, and the
// first-order error bound of the BF16 path: x rounded to BF16 (unit
// roundoff 2^-8, each product then exact in F32), and each addition to the
// F32 lane sum rounded (2^-24 of the running |sum|).
F16Expectation ExpectBf16(const std::vector<float>& x, const std::vector<float>& w, int64_t k, int64_t i, int64_t j) {
  F16Expectation e;
  double running = 0;
  for (int64_t c = 0; c < k; ++c) {
    const double p = static_cast<double>(x[i * k + c]) * Bf16ToF32(F32ToBf16(w[j * k + c]));
    e.want += p;
    running += std::abs(p);
    e.bound += std::abs(p) / 256 + running / (1 << 24);
  }
  return e;
}

// The BF16 operands' paths (linear_bf16.h: VDPBF16PS; linear_amx.h: AMX
// tiles) against a double reference on the BF16 weights: error within the
// BF16 rounding of x and F32 sums; each row's bits the same alone or in any
// tile of a larger batch; odd K padded. (AMX: up to 128 rows go through
// each pair of panels in one pass, more in chunks of panels: 150 takes the
// chunks.)
void ExpectBf16OperandPath(MatrixPath path, const std::string& name) {
  auto b = CpuBackend::Create({.num_threads = 2, .isa = Isa::kAvx512, .matrix_path = path});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->Name(), name);
  ExpectPathMatchesReference(**b, 9, {1, 2, 3, 8, 12, 13, 16, 17, 29, 33, 70, 150}, {1, 15, 16, 17, 33, 100, 160},
                             &ExpectBf16, 1e-6);
}

TEST(Bf16PathTest, LinearMatchesReferenceAndRowsDoNotDependOnTheBatch) {
  if (!Bf16PathSupported()) GTEST_SKIP() << "this CPU has no AVX512-BF16: the bf16 matrix path cannot run here";
  ExpectBf16OperandPath(MatrixPath::kBf16, "cpu/avx512+bf16");
}

TEST(AmxPathTest, LinearMatchesReferenceAndRowsDoNotDependOnTheBatch) {
  if (!AmxPathSupported()) GTEST_SKIP() << "this CPU (or its kernel) offers no AMX-BF16: the amx matrix path cannot run here";
  ExpectBf16OperandPath(MatrixPath::kAmx, "cpu/avx512+amx");
}

// Activations far beyond half precision's range stay finite on the BF16
// path (BF16 has F32's exponent range): no scaling needed.
TEST(Bf16PathTest, LargeActivationsNeedNoScaling) {
  if (!Bf16PathSupported()) GTEST_SKIP() << "this CPU has no AVX512-BF16: the bf16 matrix path cannot run here";
  auto b = CpuBackend::Create({.num_threads = 1, .isa = Isa::kAvx512, .matrix_path = MatrixPath::kBf16});
  ASSERT_TRUE(b.ok()) << b.status();
  const int64_t m = 2, k = 70, n = 20;
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> w(n * k), x(m * k), y(m * n);
  for (float& v : w) v = 0.05f * d(rng);
  for (float& v : x) v = 1e20f * d(rng);
  const MatrixPart parts[] = {{DType::kF32, w.data(), n}};
  auto packed = (*b)->PackLinear(parts, k, DType::kBF16);
  ASSERT_TRUE(packed.ok());
  (*b)->Linear(**packed, x.data(), m, nullptr, y.data(), false);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const F16Expectation e = ExpectBf16(x, w, k, i, j);
      ASSERT_NEAR(y[i * n + j], e.want, e.bound) << i << "," << j;
    }
  }
}

TEST(F16PathTest, ChoiceIsValidatedAndReported) {
  EXPECT_EQ(ParseMatrixPath("fp16").value(), MatrixPath::kF16);
  EXPECT_EQ(ParseMatrixPath("f32").value(), MatrixPath::kF32);
  EXPECT_EQ(ParseMatrixPath("bf16").value(), MatrixPath::kBf16);
  EXPECT_EQ(ParseMatrixPath("amx").value(), MatrixPath::kAmx);
  EXPECT_EQ(ParseMatrixPath("tpu").status().code(), absl::StatusCode::kInvalidArgument);
  for (MatrixPath p : {MatrixPath::kF32, MatrixPath::kF16, MatrixPath::kBf16, MatrixPath::kAmx}) {
    EXPECT_EQ(ParseMatrixPath(MatrixPathName(p)).value(), p);
  }
  // Not on a non-AVX-512 path, whatever the CPU.
  EXPECT_EQ(CpuBackend::Create({.isa = Isa::kScalar, .matrix_path = MatrixPath::kF16}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CpuBackend::Create({.isa = Isa::kAvx2, .matrix_path = MatrixPath::kBf16}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(CpuBackend::Create({.isa = Isa::kAvx2, .matrix_path = MatrixPath::kAmx}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Default: F32; chosen: a path this CPU runs, with the probe's reason.
  auto plain = CpuBackend::Create({});
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->matrix_path(), MatrixPath::kF32);
  auto chosen = CpuBackend::Create({.choose_matrix_path = true});
  ASSERT_TRUE(chosen.ok());
  if ((*chosen)->matrix_path() == MatrixPath::kF16) EXPECT_TRUE(F16PathSupported());
  if ((*chosen)->matrix_path() == MatrixPath::kBf16) EXPECT_TRUE(Bf16PathSupported());
  if ((*chosen)->matrix_path() == MatrixPath::kAmx) EXPECT_TRUE(AmxPathSupported());
  EXPECT_FALSE((*chosen)->matrix_path_reason().empty());
  std::printf("chosen matrix path: %s (%s)\n", std::string(MatrixPathName((*chosen)->matrix_path())).c_str(),
              (*chosen)->matrix_path_reason().c_str());
}

// Attention over BF16 KV on the bf16 matrix path takes BF16 dot products
// (AttentionArgs::bf16_dot, even block sizes): within the error the BF16
// queries and weights allow (AttnTolerance), and a prompt's rows bitwise
// the rows alone, across head dims odd and off the vector width, GQA
// groups, block sizes of 2 to 64, runs of 256 keys.
TEST(Bf16AttentionTest, MatchesReferenceAndPromptRowsAreBitwiseTheRowAlone) {
  if (!Bf16PathSupported()) GTEST_SKIP() << "this CPU has no AVX512-BF16: BF16 dot attention cannot run here";
  auto b = CpuBackend::Create({.num_threads = 2, .isa = Isa::kAvx512, .matrix_path = MatrixPath::kBf16});
  ASSERT_TRUE(b.ok()) << b.status();
  ASSERT_TRUE((*b)->bf16_attention());
  std::mt19937 rng(7);
  const AttnShape shapes[] = {{8, 1, 64, 16, DType::kBF16},  {12, 12, 64, 16, DType::kBF16},
                              {6, 2, 20, 8, DType::kBF16},   {5, 1, 13, 2, DType::kBF16},
                              {4, 4, 36, 32, DType::kBF16},  {16, 1, 8, 64, DType::kBF16},
                              {24, 2, 96, 16, DType::kBF16}, {3, 3, 80, 4, DType::kBF16}};
  ExpectPagedAttentionMatchesReference(**b, rng, shapes, {.exact_scores = false});
  ExpectPromptRowsBitwiseTheRowAlone(**b, rng, shapes);
}

// The dot form is the bf16 path's only, and can be turned off.
TEST(Bf16AttentionTest, SwitchedByPathOptionOrEnvironment) {
  struct Unset {
    ~Unset() { ::unsetenv("PDSERVE_BF16_ATTENTION"); }
  } unset;
  ::unsetenv("PDSERVE_BF16_ATTENTION");
  auto f32 = CpuBackend::Create({});
  ASSERT_TRUE(f32.ok());
  EXPECT_FALSE((*f32)->bf16_attention());
  if (!Bf16PathSupported()) GTEST_SKIP() << "this CPU has no AVX512-BF16: BF16 dot attention cannot run here";
  auto on = CpuBackend::Create({.isa = Isa::kAvx512, .matrix_path = MatrixPath::kBf16});
  ASSERT_TRUE(on.ok());
  EXPECT_TRUE((*on)->bf16_attention());
  auto off = CpuBackend::Create({.isa = Isa::kAvx512, .matrix_path = MatrixPath::kBf16, .bf16_attention = false});
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE((*off)->bf16_attention());
  ::setenv("PDSERVE_BF16_ATTENTION", "0", 1);
  auto env_off = CpuBackend::Create({.isa = Isa::kAvx512, .matrix_path = MatrixPath::kBf16});
  ASSERT_TRUE(env_off.ok());
  EXPECT_FALSE((*env_off)->bf16_attention());
  ::setenv("PDSERVE_BF16_ATTENTION", "on", 1);
  auto bad = CpuBackend::Create({.isa = Isa::kAvx512, .matrix_path = MatrixPath::kBf16});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("PDSERVE_BF16_ATTENTION=on"), absl::string_view::npos) << bad.status();
}

TEST(KvPrefetchTest, SwitchedByOptionOrEnvironment) {
  // The variable is unset again however the test ends.
  struct Unset {
    ~Unset() { ::unsetenv("PDSERVE_KV_PREFETCH"); }
  } unset;
  ::unsetenv("PDSERVE_KV_PREFETCH");
  // Unset: this CPU's default (on for AMD only).
  auto by_default = CpuBackend::Create({});
  ASSERT_TRUE(by_default.ok());
  EXPECT_EQ((*by_default)->kv_prefetch(), KvPrefetchByDefault());
  EXPECT_EQ(KvPrefetchByDefault(), __builtin_cpu_is("amd") != 0);
  ::setenv("PDSERVE_KV_PREFETCH", "1", 1);
  auto on = CpuBackend::Create({});
  ASSERT_TRUE(on.ok());
  EXPECT_TRUE((*on)->kv_prefetch());
  ::setenv("PDSERVE_KV_PREFETCH", "0", 1);
  auto off = CpuBackend::Create({});
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE((*off)->kv_prefetch());
  auto forced = CpuBackend::Create({.kv_prefetch = true});  // The option wins.
  ASSERT_TRUE(forced.ok());
  EXPECT_TRUE((*forced)->kv_prefetch());
  ::setenv("PDSERVE_KV_PREFETCH", "yes", 1);
  auto bad = CpuBackend::Create({});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("PDSERVE_KV_PREFETCH=yes"), absl::string_view::npos) << bad.status();

  // Off: a hint hands nothing to the products.
  std::vector<uint16_t> kv(4 * 8192, 0);
  const std::vector<int32_t> table = {0, 1, 2, 3};
  std::vector<AttentionSequence> seqs(8, AttentionSequence{table, 64, 1, 0});
  for (int i = 0; i < 8; ++i) seqs[i].row_offset = i;
  const KvLayerView view{.base = kv.data(), .dtype = DType::kBF16, .block_stride = 8192, .head_stride = 1024,
                         .v_offset = 4096, .block_size = 16};
  auto w = (*off)->RandomLinear(64, 64, DType::kBF16, 1.0f, 1);
  ASSERT_TRUE(w.ok());
  std::vector<float> x(8 * 64, 1.0f), y(8 * 64);
  (*off)->PrefetchKv(view, seqs);
  (*off)->Linear(**w, x.data(), 8, nullptr, y.data(), false);
  EXPECT_EQ((*off)->kv_prefetched_bytes(), 0);
}

TEST(IsaTest, EnvironmentOverrideIsValidated) {
  EXPECT_TRUE(ParseIsa("avx512").ok());
  EXPECT_EQ(ParseIsa("neon").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(IsaSupported(Isa::kScalar));
  ASSERT_FALSE(SupportedIsas().empty());
  EXPECT_EQ(SupportedIsas().front(), Isa::kScalar);
}

INSTANTIATE_TEST_SUITE_P(AllIsas, CpuKernelsTest, ::testing::ValuesIn(SupportedIsas()),
                         [](const auto& info) { return std::string(IsaName(info.param)); });

}  // namespace
}  // namespace pdserve::kernels::cpu
