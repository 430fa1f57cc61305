// The CUDA backend against the CPU backend (the reference every other
// test trusts): each kernel on random inputs, then whole forwards of the
// test models with the KV pool in GPU memory. Skips, saying why, where no
// GPU can be used.
//
// Tolerances: F32 operands differ only in summation order (1e-5 of the
// largest value); BF16 matrices round the activations to BF16 on the GPU
// (the CPU's F32 path does not), about 2^-9 relative per operand, so
// those compare at 2e-2 of the largest value; the KV write's bytes are the
// CPU's exactly for every encoding.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kv/kv_manager.h"
#include "model/model.h"
#include "engine/philox.h"
#include "engine/sampling.h"
#include "model/synthetic_model.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/device_array.h"

namespace pdserve {
namespace {

using kernels::cuda::CudaBackend;

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

float MaxAbs(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::abs(x));
  return m;
}

float MaxDiff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto gpu = CudaBackend::Create({});
    if (!gpu.ok()) GTEST_SKIP() << "no usable GPU, CUDA backend not run: " << gpu.status();
    gpu_ = *std::move(gpu);
    auto cpu = kernels::cpu::CpuBackend::Create({.num_threads = 2, .isa = std::nullopt,
                                                 .matrix_path = kernels::cpu::MatrixPath::kF32});
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = *std::move(cpu);
  }

  // Host values on the GPU.
  kernels::DeviceArray<float> Up(const std::vector<float>& v) {
    kernels::DeviceArray<float> a(gpu_.get());
    EXPECT_TRUE(a.Assign(v).ok());
    return a;
  }
  std::vector<float> Down(const kernels::DeviceArray<float>& a, size_t n) {
    std::vector<float> v(n);
    gpu_->CopyToHost(v.data(), a.data(), n * sizeof(float));
    EXPECT_TRUE(gpu_->status().ok()) << gpu_->status();
    return v;
  }

  std::unique_ptr<CudaBackend> gpu_;
  std::unique_ptr<kernels::cpu::CpuBackend> cpu_;
};

TEST_F(CudaBackendTest, LinearMatchesTheCpuForEveryWeightFormatAndRowCount) {
  const int64_t n = 300, k = 257;
  const std::vector<float> wf = Random(n * k, 1, 0.5f);
  const std::vector<float> bias = Random(n, 2);
  for (DType storage : {DType::kF32, DType::kBF16, DType::kI8}) {
    const kernels::MatrixPart part{DType::kF32, wf.data(), n, 0};
    auto wc = cpu_->PackLinear({&part, 1}, k, storage);
    auto wg = gpu_->PackLinear({&part, 1}, k, storage);
    ASSERT_TRUE(wc.ok() && wg.ok());
    EXPECT_EQ((*wg)->bytes(), static_cast<size_t>(n * k * DTypeSize(storage) + (storage == DType::kI8 ? n * 4 : 0)));
    // 1..8 rows take the int8 GEMV, more the dequantise-then-GEMM path.
    for (int64_t m : {1, 3, 8, 9, 64}) {
      for (bool with_bias : {false, true}) {
        for (bool accumulate : {false, true}) {
          SCOPED_TRACE(testing::Message() << DTypeName(storage) << " m=" << m << " bias=" << with_bias
                                          << " accumulate=" << accumulate);
          const std::vector<float> x = Random(m * k, 3 + m);
          const std::vector<float> y0 = Random(m * n, 4 + m);
          std::vector<float> yc = y0;
          cpu_->Linear(**wc, x.data(), m, with_bias ? bias.data() : nullptr, yc.data(), accumulate);
          auto xg = Up(x), yg = Up(y0), bg = Up(bias);
          gpu_->Linear(**wg, xg.data(), m, with_bias ? bg.data() : nullptr, yg.data(), accumulate);
          const std::vector<float> got = Down(yg, m * n);
          const float tol = (storage == DType::kF32 ? 1e-5f : 2e-2f) * MaxAbs(yc);
          EXPECT_LE(MaxDiff(got, yc), tol);
        }
      }
    }
  }
}

// Prefill rows over an int8 matrix of more output rows than one
// dequantised slab (4096): every slab's columns land in place.
TEST_F(CudaBackendTest, Int8PrefillOverSeveralDequantisedSlabsMatchesTheCpu) {
  const int64_t n = 4096 * 2 + 37, k = 33, m = 12;
  const std::vector<float> wf = Random(n * k, 70, 0.5f);
  const kernels::MatrixPart part{DType::kF32, wf.data(), n, 0};
  auto wc = cpu_->PackLinear({&part, 1}, k, DType::kI8);
  auto wg = gpu_->PackLinear({&part, 1}, k, DType::kI8);
  ASSERT_TRUE(wc.ok() && wg.ok());
  const std::vector<float> x = Random(m * k, 71);
  std::vector<float> yc(m * n);
  cpu_->Linear(**wc, x.data(), m, nullptr, yc.data(), false);
  auto xg = Up(x), yg = Up(std::vector<float>(m * n, 5.0f));
  gpu_->Linear(**wg, xg.data(), m, nullptr, yg.data(), false);
  EXPECT_LE(MaxDiff(Down(yg, m * n), yc), 2e-2f * MaxAbs(yc));
}

TEST_F(CudaBackendTest, RowKernelsMatchTheCpu) {
  const int64_t m = 7, d = 96;
  const std::vector<float> x = Random(m * d, 10, 3.0f), w = Random(d, 11);
  {
    std::vector<float> yc(m * d);
    cpu_->RmsNorm(x.data(), w.data(), m, d, 1e-5f, yc.data());
    auto xg = Up(x), wg = Up(w), yg = Up(std::vector<float>(m * d));
    gpu_->RmsNorm(xg.data(), wg.data(), m, d, 1e-5f, yg.data());
    EXPECT_LE(MaxDiff(Down(yg, m * d), yc), 1e-5f * MaxAbs(yc));
    // In place, as the final norm runs.
    gpu_->RmsNorm(xg.data(), wg.data(), m, d, 1e-5f, xg.data());
    EXPECT_LE(MaxDiff(Down(xg, m * d), yc), 1e-5f * MaxAbs(yc));
  }
  {
    const int32_t heads = 3, hd = 32;
    const std::vector<int32_t> pos = {0, 5, 17, 3, 99, 100, 1};
    const std::vector<float> cos = Random(128 * hd / 2, 12), sin = Random(128 * hd / 2, 13);
    std::vector<float> q = Random(m * heads * hd, 14);
    std::vector<float> qc = q;
    cpu_->Rope(qc.data(), m, heads, hd, pos.data(), cos.data(), sin.data());
    auto qg = Up(q), cg = Up(cos), sg = Up(sin);
    gpu_->Rope(qg.data(), m, heads, hd, pos.data(), cg.data(), sg.data());
    EXPECT_LE(MaxDiff(Down(qg, q.size()), qc), 1e-6f * MaxAbs(qc));
  }
  {
    const int64_t f = 50;
    const std::vector<float> gu = Random(m * 2 * f, 15, 4.0f);
    std::vector<float> oc(m * f);
    cpu_->SiluMul(gu.data(), m, f, oc.data());
    auto gg = Up(gu), og = Up(std::vector<float>(m * f));
    gpu_->SiluMul(gg.data(), m, f, og.data());
    EXPECT_LE(MaxDiff(Down(og, m * f), oc), 1e-6f * MaxAbs(oc));
  }
  {
    // Add, Copy2D, Zero.
    auto a = Up(x), b = Up(std::vector<float>(x.rbegin(), x.rend()));
    gpu_->Add(a.data(), b.data(), m * d);
    std::vector<float> want(m * d);
    for (int64_t i = 0; i < m * d; ++i) want[i] = x[i] + x[m * d - 1 - i];
    EXPECT_EQ(Down(a, m * d), want);
    auto c = Up(std::vector<float>(m * 10, -1.0f));
    gpu_->Copy2D(c.data(), 10 * sizeof(float), b.data() + 3, d * sizeof(float), 4 * sizeof(float), m);
    gpu_->Zero(c.data() + 9, sizeof(float));
    const std::vector<float> got = Down(c, m * 10);
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t j = 0; j < 10; ++j) {
        const float expect = j < 4 ? x[m * d - 1 - (r * d + 3 + j)] : (r == 0 && j == 9 ? 0.0f : -1.0f);
        EXPECT_EQ(got[r * 10 + j], expect) << r << "," << j;
      }
    }
    // One row wider than both pitches, as the forward copies consecutive
    // logit rows (n rows of D as one row of n * D).
    auto e = Up(std::vector<float>(m * d, -1.0f));
    gpu_->Copy2D(e.data() + d, d * sizeof(float), b.data() + 2 * d, d * sizeof(float), 3 * d * sizeof(float), 1);
    const std::vector<float> wide = Down(e, m * d);
    for (int64_t i = 0; i < m * d; ++i) {
      const float expect = i >= d && i < 4 * d ? x[m * d - 1 - (i + d)] : -1.0f;
      ASSERT_EQ(wide[i], expect) << i;
    }
  }
}

TEST_F(CudaBackendTest, RandomWeightsFillEveryRowAndFollowTheSeed) {
  // Every row of random tables, read back through Embed (F32: the draws
  // themselves).
  const int64_t rows = 300, dim = 257;
  const float bound = 0.5f;
  std::vector<int32_t> ids(rows);
  for (int64_t i = 0; i < rows; ++i) ids[i] = static_cast<int32_t>(i);
  auto draw = [&](uint64_t seed) {
    std::vector<float> v;
    auto t = gpu_->RandomEmbedding(rows, dim, DType::kF32, bound, seed);
    EXPECT_TRUE(t.ok()) << t.status();
    if (!t.ok()) return v;
    auto out = Up(std::vector<float>(rows * dim, 9.0f));
    gpu_->Embed(**t, ids.data(), rows, out.data());
    return Down(out, rows * dim);
  };
  const std::vector<float> a = draw(5), b = draw(5), c = draw(6);
  ASSERT_EQ(a.size(), static_cast<size_t>(rows * dim));
  EXPECT_EQ(a, b) << "the same seed gave other weights";
  EXPECT_NE(a, c) << "another seed gave the same weights";
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = a.data() + r * dim;
    float mx = 0;
    for (int64_t i = 0; i < dim; ++i) mx = std::max(mx, std::abs(row[i]));
    EXPECT_LE(mx, bound) << "row " << r;
    EXPECT_GT(mx, bound / 2) << "row " << r;
    if (r > 0) {
      EXPECT_FALSE(std::equal(row, row + dim, row - dim)) << "rows " << r - 1 << " and " << r;
    }
  }
}

TEST_F(CudaBackendTest, EmbeddingMatchesTheCpuAndOtherRanksRowsAreZero) {
  const int64_t rows = 40, dim = 48;
  const std::vector<float> table = Random(rows * dim, 20);
  const std::vector<int32_t> ids = {0, 39, 7, -3, 40, 7};
  for (DType storage : {DType::kF32, DType::kBF16, DType::kI8}) {
    SCOPED_TRACE(DTypeName(storage));
    const kernels::MatrixPart part{DType::kF32, table.data(), rows, 0};
    auto tc = cpu_->PackEmbedding(part, dim, storage);
    auto tg = gpu_->PackEmbedding(part, dim, storage);
    ASSERT_TRUE(tc.ok() && tg.ok());
    std::vector<float> oc(ids.size() * dim);
    cpu_->Embed(**tc, ids.data(), ids.size(), oc.data());
    auto og = Up(std::vector<float>(ids.size() * dim, 9.0f));
    gpu_->Embed(**tg, ids.data(), ids.size(), og.data());
    EXPECT_EQ(Down(og, oc.size()), oc);  // Same decoding: bitwise.
  }
}

// A KV pool of `blocks` blocks laid out as the model's (kv/kv_cache.h).
struct Pool {
  KvCacheSpec spec;
  std::vector<char> host;
  kernels::DeviceArray<char> dev;
};

Pool MakePool(kernels::Backend* gpu, DType dtype, int32_t kv_heads, int32_t head_dim, int32_t block_size,
              int32_t blocks) {
  Pool p;
  p.spec.num_layers = 1;
  p.spec.num_kv_heads = kv_heads;
  p.spec.model_kv_heads = kv_heads;
  p.spec.head_dim = head_dim;
  p.spec.block_size = block_size;
  p.spec.dtype = dtype;
  p.spec.num_blocks = blocks;
  p.host.assign(p.spec.TotalBytes(), 0);
  p.dev = kernels::DeviceArray<char>(gpu);
  EXPECT_TRUE(p.dev.Assign(p.host).ok());
  return p;
}

TEST_F(CudaBackendTest, KvWriteBytesAreTheCpusForEveryEncoding) {
  const int32_t kvh = 3, hd = 40, bs = 16, blocks = 6;
  const int64_t rows = 20;
  const std::vector<float> k = Random(rows * kvh * hd, 30, 2.0f), v = Random(rows * kvh * hd, 31, 2.0f);
  std::vector<int32_t> bl(rows), sl(rows);
  for (int64_t r = 0; r < rows; ++r) {
    bl[r] = static_cast<int32_t>((r * 7) % blocks);
    sl[r] = static_cast<int32_t>((r * 5) % bs);
  }
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8}) {
    SCOPED_TRACE(DTypeName(dtype));
    Pool p = MakePool(gpu_.get(), dtype, kvh, hd, bs, blocks);
    KvStorage host{p.spec, p.host.data()}, dev{p.spec, p.dev.data()};
    cpu_->WriteKv(host.LayerView(0), kvh, hd, k.data(), v.data(), rows, bl.data(), sl.data());
    auto kg = Up(k), vg = Up(v);
    gpu_->WriteKv(dev.LayerView(0), kvh, hd, kg.data(), vg.data(), rows, bl.data(), sl.data());
    std::vector<char> got(p.host.size());
    gpu_->CopyToHost(got.data(), p.dev.data(), got.size());
    ASSERT_TRUE(gpu_->status().ok()) << gpu_->status();
    EXPECT_TRUE(got == p.host) << "the pool's bytes differ";
  }
}

// Attention over (S0, m) sequences: prefill, chunked prefill, decode over
// long histories (split across blocks and merged), GQA 1-8, a head_dim
// that is no multiple of 32, every KV
// encoding; the CPU reads the same pool bytes.
TEST_F(CudaBackendTest, PagedAttentionMatchesTheCpu) {
  struct Case {
    int32_t heads, kv_heads, head_dim;
  };
  for (const Case c :
       {Case{8, 8, 64}, Case{8, 4, 64}, Case{8, 2, 128}, Case{8, 1, 32}, Case{16, 2, 128}, Case{12, 4, 80}}) {
    for (DType dtype : {DType::kF32, DType::kBF16, DType::kI8}) {
      SCOPED_TRACE(testing::Message() << c.heads << "/" << c.kv_heads << " heads of " << c.head_dim << ", "
                                      << DTypeName(dtype));
      const int32_t bs = 16, blocks = 800;
      Pool p = MakePool(gpu_.get(), dtype, c.kv_heads, c.head_dim, bs, blocks);
      // Fill every block through the CPU's writer, then the GPU's copy.
      {
        const int64_t rows = static_cast<int64_t>(blocks) * bs;
        const std::vector<float> k = Random(rows * c.kv_heads * c.head_dim, 40, 1.5f);
        const std::vector<float> v = Random(rows * c.kv_heads * c.head_dim, 41, 1.5f);
        std::vector<int32_t> bl(rows), sl(rows);
        for (int64_t r = 0; r < rows; ++r) {
          bl[r] = static_cast<int32_t>(r / bs);
          sl[r] = static_cast<int32_t>(r % bs);
        }
        KvStorage host{p.spec, p.host.data()};
        cpu_->WriteKv(host.LayerView(0), c.kv_heads, c.head_dim, k.data(), v.data(), rows, bl.data(), sl.data());
        gpu_->CopyToDevice(p.dev.data(), p.host.data(), p.host.size());
      }
      // (S0, m): a prefill, a chunk after a prefix, decodes at 1, 700 and 4000.
      const std::vector<std::pair<int32_t, int32_t>> shapes = {{0, 37}, {48, 20}, {0, 1}, {699, 1}, {3999, 1}};
      std::vector<std::vector<int32_t>> tables;
      std::vector<kernels::AttentionSequence> seqs;
      int32_t rows = 0, next_block = 0;
      for (auto [s0, m] : shapes) {
        std::vector<int32_t> t;
        for (int32_t b = 0; b < (s0 + m + bs - 1) / bs; ++b) t.push_back((next_block + b * 13) % blocks);
        next_block += 101;
        tables.push_back(t);
      }
      for (size_t i = 0; i < shapes.size(); ++i) {
        seqs.push_back({absl::MakeConstSpan(tables[i]), shapes[i].first, shapes[i].second, rows});
        rows += shapes[i].second;
      }
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
      KvStorage host{p.spec, p.host.data()}, dev{p.spec, p.dev.data()};
      auto compare = [&](absl::Span<const kernels::AttentionSequence> batch, int32_t batch_rows) {
        const std::vector<float> q = Random(static_cast<size_t>(batch_rows) * c.heads * c.head_dim, 42);
        std::vector<float> oc(q.size());
        cpu_->Attention({.q = q.data(), .out = oc.data(), .sequences = batch, .kv = host.LayerView(0),
                         .num_heads = c.heads, .num_kv_heads = c.kv_heads, .head_dim = c.head_dim, .scale = scale});
        auto qg = Up(q), og = Up(std::vector<float>(q.size()));
        gpu_->Attention({.q = qg.data(), .out = og.data(), .sequences = batch, .kv = dev.LayerView(0),
                         .num_heads = c.heads, .num_kv_heads = c.kv_heads, .head_dim = c.head_dim, .scale = scale});
        EXPECT_LE(MaxDiff(Down(og, q.size()), oc), 2e-5f * std::max(1.0f, MaxAbs(oc)));
      };
      // The whole mix: enough (row, head) pairs to fill the GPU, one split.
      compare(seqs, rows);
      // The two long decodes alone: few (row, head) pairs, so the history
      // is split across thread blocks and merged (the 700 row's later
      // splits are empty).
      SCOPED_TRACE("decodes at 700 and 4000 alone");
      const std::vector<kernels::AttentionSequence> decodes = {{seqs[3].block_table, 699, 1, 0},
                                                               {seqs[4].block_table, 3999, 1, 1}};
      compare(decodes, 2);
    }
  }
}

// The GPU sampler picks the CPU sampler's token for the same logits over
// every pipeline step: greedy, temperature, top-k, top-p, min-p and the
// three penalties, on rows with ties and a real vocabulary size.
TEST_F(CudaBackendTest, TheSamplerPicksTheCpusToken) {
  auto sampler = kernels::cuda::CudaSampler::Create(gpu_.get());
  ASSERT_TRUE(sampler.ok()) << sampler.status();
  for (int64_t vocab : {97, 32000, 128256}) {
    SCOPED_TRACE(testing::Message() << "vocab " << vocab);
    const int rows = 48;
    std::vector<float> logits = Random(rows * vocab, 60 + vocab, 8.0f);
    // Ties (equal logits at different ids) in some rows.
    for (int r = 0; r < rows; r += 5) logits[r * vocab + 3] = logits[r * vocab + 1] = 30.0f;
    std::vector<SamplingParams> params(rows);
    std::vector<PenaltyState> states;
    std::vector<std::vector<int32_t>> seen(rows), gen(rows), counts(rows);
    std::vector<kernels::cuda::SampleRowParams> gpu_rows(rows);
    for (int r = 0; r < rows; ++r) {
      SamplingParams& p = params[r];
      switch (r % 8) {
        case 0: p.temperature = 0; break;
        case 1: p.temperature = 1; break;
        case 2: p.temperature = 0.7f; p.top_k = 40; break;
        case 3: p.temperature = 1.3f; p.top_p = 0.9f; break;
        case 4: p.temperature = 1; p.min_p = 0.05f; break;
        case 5: p.temperature = 0.8f; p.repetition_penalty = 1.3f; p.presence_penalty = 0.5f; break;
        case 6: p.temperature = 0; p.frequency_penalty = 1.5f; p.repetition_penalty = 0.7f; break;
        default: p.temperature = 2; p.top_k = 1000; p.top_p = 0.5f; p.min_p = 0.01f; p.frequency_penalty = -1; break;
      }
      std::vector<int32_t> prompt;
      for (int i = 0; i < 20; ++i) prompt.push_back(static_cast<int32_t>((r * 131 + i * 17) % vocab));
      states.emplace_back(prompt);
      for (int i = 0; i < 12; ++i) states.back().AddGenerated(static_cast<int32_t>((r * 7 + i * i) % vocab));
    }
    std::vector<int32_t> want(rows);
    for (int r = 0; r < rows; ++r) {
      const PenaltyState& st = states[r];
      for (const auto& [t, n] : st.seen()) seen[r].push_back(t);
      for (const auto& [t, n] : st.generated()) {
        gen[r].push_back(t);
        counts[r].push_back(n);
      }
      const uint64_t seed = 1000 + r;
      const int64_t position = 32 + r;
      want[r] = SampleToken(absl::MakeConstSpan(logits.data() + r * vocab, vocab), params[r], st, seed, position).token;
      const SamplingParams& p = params[r];
      gpu_rows[r] = {.temperature = p.temperature, .top_k = p.top_k, .top_p = p.top_p, .min_p = p.min_p,
                     .repetition_penalty = p.repetition_penalty, .presence_penalty = p.presence_penalty,
                     .frequency_penalty = p.frequency_penalty,
                     .uniform = PhiloxUniform(seed, static_cast<uint64_t>(position)),
                     .seen_ids = seen[r], .generated_ids = gen[r], .generated_counts = counts[r]};
    }
    auto lg = Up(logits);
    std::vector<int32_t> got(rows, -1);
    ASSERT_TRUE((*sampler)->Sample(lg.data(), vocab, gpu_rows, got.data()).ok());
    EXPECT_EQ(got, want);
  }
}

// Whole forwards: the same model on both backends, the GPU's KV pool in
// GPU memory. Teacher-forced on the CPU's greedy tokens: logits within the
// format's tolerance at every step, and the same argmax wherever the CPU's
// top two are further apart than that tolerance.
class CudaForwardTest : public CudaBackendTest {
 protected:
  void Compare(const std::string& dir, ModelOptions options, DType kv, float rel_tol) {
    auto cm = Model::Load(dir, options, cpu_.get());
    auto gm = Model::Load(dir, options, gpu_.get());
    ASSERT_TRUE(cm.ok()) << cm.status();
    ASSERT_TRUE(gm.ok()) << gm.status();
    auto ckv = KvManager::Create((*cm)->MakeKvSpec(kv, 16, 64));
    BackendKvRegionAllocator on_gpu(gpu_.get());
    auto gkv = KvManager::Create((*gm)->MakeKvSpec(kv, 16, 64), &on_gpu);
    ASSERT_TRUE(ckv.ok() && gkv.ok());
    const int64_t V = (*cm)->config().vocab_size;
    // Two sequences batched: a prompt longer than a block, and a short one.
    std::vector<std::vector<int32_t>> feed = {{}, {}};
    for (int i = 0; i < 37; ++i) feed[0].push_back(static_cast<int32_t>((i * 31 + 5) % V));
    for (int i = 0; i < 5; ++i) feed[1].push_back(static_cast<int32_t>((i * 17 + 2) % V));
    SequenceKv cs[2] = {(*ckv)->NewSequence(), (*ckv)->NewSequence()};
    SequenceKv gs[2] = {(*gkv)->NewSequence(), (*gkv)->NewSequence()};
    int checked = 0;
    for (int step = 0; step < 12; ++step) {
      ForwardSequence cb[2], gb[2];
      for (int s = 0; s < 2; ++s) {
        cb[s] = {&cs[s], feed[s], LogitsMode::kLast};
        gb[s] = {&gs[s], feed[s], LogitsMode::kLast};
      }
      auto cr = ForwardGrowing(**cm, **ckv, cb);
      auto gr = ForwardGrowing(**gm, **gkv, gb);
      ASSERT_TRUE(cr.ok()) << cr.status();
      ASSERT_TRUE(gr.ok()) << gr.status();
      for (int s = 0; s < 2; ++s) {
        SCOPED_TRACE(testing::Message() << "step " << step << " sequence " << s);
        const auto c = cr->Last(s), g = gr->Last(s);
        float mx = 0, diff = 0;
        for (int64_t i = 0; i < V; ++i) {
          mx = std::max(mx, std::abs(c[i]));
          diff = std::max(diff, std::abs(c[i] - g[i]));
        }
        ASSERT_LE(diff, rel_tol * mx);
        std::vector<float> sorted(c.begin(), c.end());
        std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
        const int32_t ca = static_cast<int32_t>(std::max_element(c.begin(), c.end()) - c.begin());
        const int32_t ga = static_cast<int32_t>(std::max_element(g.begin(), g.end()) - g.begin());
        if (sorted[0] - sorted[1] > 2 * rel_tol * mx) {
          EXPECT_EQ(ga, ca);
          ++checked;
        }
        feed[s] = {ca};
      }
    }
    EXPECT_GT(checked, 0) << "no step had a clear greedy token";
  }
};

TEST_F(CudaForwardTest, RandomModelsOfEveryGqaRatioMatchTheCpu) {
  for (int64_t kv_heads : {8, 4, 2, 1}) {
    SCOPED_TRACE(testing::Message() << kv_heads << " KV heads");
    RandomModelSpec spec;
    spec.num_heads = 8;
    spec.num_kv_heads = kv_heads;
    spec.head_dim = 16;
    spec.hidden_size = 128;
    spec.seed = 50 + kv_heads;
    const std::string dir = MakeTempDir("cuda_fwd");
    ASSERT_TRUE(WriteRandomModel(dir, spec).ok());
    Compare(dir, {}, DType::kF32, 1e-4f);
  }
}

TEST_F(CudaForwardTest, ReducedPrecisionWeightsAndKvMatchTheCpu) {
  RandomModelSpec spec;
  spec.dtype = DType::kBF16;
  spec.head_dim = 32;
  spec.hidden_size = 256;
  const std::string dir = MakeTempDir("cuda_fwd_bf16");
  ASSERT_TRUE(WriteRandomModel(dir, spec).ok());
  for (DType w : {DType::kBF16, DType::kI8}) {
    for (DType kv : {DType::kBF16, DType::kI8}) {
      SCOPED_TRACE(testing::Message() << "weights " << DTypeName(w) << " KV " << DTypeName(kv));
      ModelOptions o;
      o.weight_dtype = w;
      Compare(dir, o, kv, 3e-2f);
    }
  }
}

TEST_F(CudaForwardTest, TheShippedModelMatchesTheCpu) {
  // $PDSERVE_SOURCE_DIR: the checkout on a GPU machine the binary was carried to.
  const char* env = std::getenv("PDSERVE_SOURCE_DIR");
  const std::string root = env != nullptr ? env : PDSERVE_SOURCE_DIR;
  Compare(root + "/deploy/models/kjv-tiny", {}, DType::kBF16, 3e-2f);
}

}  // namespace
}  // namespace pdserve
