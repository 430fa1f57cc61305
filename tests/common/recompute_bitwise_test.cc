// Recompute after migration or preemption (DESIGN.md facts 1, 2, 7): a
// decoding sequence's KV is rebuilt by prefilling prompt + generated tokens,
// and decoding continues with Philox keyed by (seed, position). The
// continuation is exact only if the rebuilt KV and the next logits are
// bitwise those of the original run, which computed the prompt by prefill
// and every generated token by a decode step batched with other sequences.
// Checked on the shipped model, loaded as the workers load it (weights and
// KV as stored: BF16), one thread, on every kernel path of this CPU.
#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kv/block_hash.h"
#include "model/model.h"
#include "kv/prefix_cache.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/linear_amx.h"
#include "kernels/cpu/linear_bf16.h"
#include "kernels/cpu/linear_fp16.h"
#include "tests/support/isa_printer.h"

namespace pdserve {
namespace {

using kernels::cpu::Isa;

const std::string kModel = std::string(PDSERVE_SOURCE_DIR) + "/deploy/models/kjv-tiny";
constexpr int32_t kBlockSize = 16;
constexpr int32_t kPrompt = 40;
constexpr int32_t kGenerated = 30;
constexpr int32_t kTotal = kPrompt + kGenerated;

// What a path leaves behind for the target sequence: the K/V bytes of each
// layer for positions [0, kTotal) and the logits of the next token.
struct Snapshot {
  std::vector<std::vector<uint16_t>> kv;  // [layer][position, kv_head, K then V, head_dim]
  std::vector<float> logits;              // [vocab]
};

// A kernel path: the ISA and the matrix path of its linear layers.
struct KernelPath {
  Isa isa;
  kernels::cpu::MatrixPath matrix = kernels::cpu::MatrixPath::kF32;
};

std::vector<KernelPath> KernelPaths() {
  std::vector<KernelPath> out;
  for (Isa isa : kernels::cpu::SupportedIsas()) out.push_back({isa});
  if (kernels::cpu::F16PathSupported()) out.push_back({Isa::kAvx512, kernels::cpu::MatrixPath::kF16});
  if (kernels::cpu::Bf16PathSupported()) out.push_back({Isa::kAvx512, kernels::cpu::MatrixPath::kBf16});
  if (kernels::cpu::AmxPathSupported()) out.push_back({Isa::kAvx512, kernels::cpu::MatrixPath::kAmx});
  return out;
}

class RecomputeBitwiseTest : public ::testing::TestWithParam<KernelPath> {
 protected:
  void SetUp() override {
    auto backend =
        kernels::cpu::CpuBackend::Create({.num_threads = 1, .isa = GetParam().isa, .matrix_path = GetParam().matrix});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    auto model = Model::Load(kModel, {}, backend_.get());
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *std::move(model);
    ASSERT_EQ(model_->weight_dtype(), DType::kBF16);
    auto kv = KvManager::Create(model_->MakeKvSpec(DType::kBF16, kBlockSize, 256));
    ASSERT_TRUE(kv.ok()) << kv.status();
    kv_ = *std::move(kv);
    tokens_ = Tokens(kTotal, 1);
  }

  std::vector<int32_t> Tokens(size_t n, uint64_t seed) const {
    std::mt19937_64 rng(seed);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = static_cast<int32_t>(3 + rng() % (model_->config().vocab_size - 3));
    return t;
  }

  ForwardResult Run(std::vector<ForwardSequence> batch, const ForwardOptions& options = {}) {
    auto r = ForwardGrowing(*model_, *kv_, batch, options);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? *std::move(r) : ForwardResult{};
  }

  Snapshot Take(const SequenceKv& seq, const ForwardResult& last, size_t index) {
    Snapshot s;
    const KvCacheSpec& spec = kv_->spec();
    const int32_t H = spec.head_dim;
    for (int32_t l = 0; l < spec.num_layers; ++l) {
      const kernels::KvLayerView v = kv_->storage().LayerView(l);
      const auto* base = static_cast<const uint16_t*>(v.base);
      std::vector<uint16_t> out;
      for (int32_t p = 0; p < seq.num_positions(); ++p) {
        const int64_t block = seq.block_table()[p / v.block_size];
        const int32_t slot = p % v.block_size;
        for (int32_t h = 0; h < spec.num_kv_heads; ++h) {
          const int64_t head = block * v.block_stride + h * v.head_stride;
          for (int32_t d = 0; d < H; ++d) out.push_back(base[head + slot + d * v.block_size]);
          for (int32_t d = 0; d < H; ++d) out.push_back(base[head + v.v_offset + slot * H + d]);
        }
      }
      s.kv.push_back(std::move(out));
    }
    absl::Span<const float> row = last.Last(index);
    s.logits.assign(row.begin(), row.end());
    return s;
  }

  // (a) The recompute: one prefill of prompt + generated tokens.
  Snapshot OnePrefill() {
    SequenceKv seq = kv_->NewSequence();
    const ForwardResult r = Run({{&seq, tokens_}});
    Snapshot s = Take(seq, r, 0);
    seq.Release();
    return s;
  }

  // (b) The original run alone: prefill the prompt, decode token by token.
  Snapshot PrefillThenDecode() {
    SequenceKv seq = kv_->NewSequence();
    ForwardResult r = Run({{&seq, absl::MakeConstSpan(tokens_).first(kPrompt)}});
    for (int32_t i = kPrompt; i < kTotal; ++i) {
      r = Run({{&seq, absl::MakeConstSpan(&tokens_[i], 1)}});
    }
    Snapshot s = Take(seq, r, 0);
    seq.Release();
    return s;
  }

  // (c) The original run in a continuous batch: every decode step also
  // carries `others` sequences of different lengths. With `shared_prefix`,
  // the others and the target begin with the same cached 32 tokens (two
  // full blocks, as the decode side's prefix cache attaches them), so the
  // decode batch shares physical blocks and, with `cascade`, attention reads
  // them once for all sequences (DESIGN.md fact 8).
  Snapshot BatchedDecode(int others, bool shared_prefix, bool cascade = true) {
    const BlockHasher hasher(model_->identity(), DType::kBF16, kBlockSize);
    constexpr int32_t kShared = 32;
    const absl::Span<const int32_t> prompt = absl::MakeConstSpan(tokens_).first(kPrompt);
    if (shared_prefix) {
      SequenceKv warm = kv_->NewSequence();
      Run({{&warm, prompt.first(kShared), LogitsMode::kNone}});
      PublishFullBlocks(*kv_, hasher, prompt.first(kShared), warm);
      warm.Release();
    }
    std::vector<SequenceKv> seqs;
    for (int o = 0; o <= others; ++o) seqs.push_back(kv_->NewSequence());
    std::vector<std::vector<int32_t>> streams;
    for (int o = 0; o <= others; ++o) {
      std::vector<int32_t> t;
      if (o == 0) {
        t = tokens_;
      } else {
        t = Tokens(kShared + 2 + 9 * o + kGenerated, 100 + o);
        if (shared_prefix) std::copy(prompt.begin(), prompt.begin() + kShared, t.begin());
      }
      streams.push_back(std::move(t));
    }
    for (int o = 0; o <= others; ++o) {
      const int32_t len = static_cast<int32_t>(streams[o].size()) - kGenerated;
      const absl::Span<const int32_t> p = absl::MakeConstSpan(streams[o]).first(len);
      const int32_t reused = shared_prefix ? AttachCachedPrefix(*kv_, hasher, p, seqs[o]) : 0;
      EXPECT_EQ(reused, shared_prefix ? kShared : 0);
      Run({{&seqs[o], p.subspan(reused), LogitsMode::kNone}});
    }
    ForwardResult r;
    for (int32_t i = 0; i < kGenerated; ++i) {
      std::vector<ForwardSequence> batch;
      for (int o = 0; o <= others; ++o) {
        const auto& t = streams[o];
        batch.push_back({&seqs[o], absl::MakeConstSpan(&t[t.size() - kGenerated + i], 1)});
      }
      std::rotate(batch.begin(), batch.begin() + i % batch.size(), batch.end());
      r = Run(batch, {.group_shared_kv = cascade});
      const size_t target = (batch.size() - i % batch.size()) % batch.size();
      if (i + 1 == kGenerated) {
        EXPECT_EQ(batch[target].kv, &seqs[0]);
        Snapshot s = Take(seqs[0], r, target);
        for (auto& q : seqs) q.Release();
        return s;
      }
    }
    return {};
  }

  // (d) The recompute as a scheduler runs it: chunks of 32, each step
  // batched with a chunk of another request's prefill.
  Snapshot ChunkedWithNeighbour() {
    const std::vector<int32_t> other = Tokens(91, 200);
    SequenceKv seq = kv_->NewSequence(), neighbour = kv_->NewSequence();
    ForwardResult r;
    size_t done = 0, other_done = 0;
    constexpr size_t kChunk = 32;
    while (done < tokens_.size()) {
      const size_t n = std::min(kChunk, tokens_.size() - done);
      std::vector<ForwardSequence> batch;
      if (other_done < other.size()) {
        const size_t on = std::min(kChunk - 9, other.size() - other_done);
        batch.push_back({&neighbour, absl::MakeConstSpan(other).subspan(other_done, on)});
        other_done += on;
      }
      batch.push_back({&seq, absl::MakeConstSpan(tokens_).subspan(done, n)});
      done += n;
      r = Run(batch);
    }
    Snapshot s = Take(seq, r, r.first_row.size() - 1);
    seq.Release();
    neighbour.Release();
    return s;
  }

  // Bitwise equality, naming the first layer whose KV differs.
  static void ExpectSame(const Snapshot& want, const Snapshot& got, const char* path) {
    ASSERT_EQ(want.kv.size(), got.kv.size());
    for (size_t l = 0; l < want.kv.size(); ++l) {
      ASSERT_EQ(want.kv[l].size(), got.kv[l].size());
      size_t differing = 0, first = want.kv[l].size();
      for (size_t i = 0; i < want.kv[l].size(); ++i) {
        if (want.kv[l][i] != got.kv[l][i]) {
          ++differing;
          first = std::min(first, i);
        }
      }
      const size_t per_position = want.kv[l].size() / kTotal;
      EXPECT_EQ(differing, 0u) << path << ": layer " << l << " KV differs in " << differing
                               << " of " << want.kv[l].size() << " values, first at position "
                               << first / per_position;
      if (differing != 0) break;  // Later layers inherit it.
    }
    ASSERT_EQ(want.logits.size(), got.logits.size());
    EXPECT_EQ(std::memcmp(want.logits.data(), got.logits.data(), want.logits.size() * 4), 0)
        << path << ": next-token logits differ";
  }

  std::unique_ptr<kernels::cpu::CpuBackend> backend_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<KvManager> kv_;
  std::vector<int32_t> tokens_;
};

TEST_P(RecomputeBitwiseTest, PrefillThenDecodeEqualsOnePrefill) {
  ExpectSame(OnePrefill(), PrefillThenDecode(), "prefill + decode");
}

TEST_P(RecomputeBitwiseTest, BatchedDecodeEqualsOnePrefill) {
  ExpectSame(OnePrefill(), BatchedDecode(5, /*shared_prefix=*/false), "batched decode");
}

TEST_P(RecomputeBitwiseTest, BatchedDecodeSharingPrefixBlocksEqualsOnePrefill) {
  ExpectSame(OnePrefill(), BatchedDecode(5, /*shared_prefix=*/true), "cascade decode");
}

// The same batch with cascade attention off: the per-sequence kernel.
TEST_P(RecomputeBitwiseTest, BatchedDecodeSharingPrefixBlocksPerSequenceEqualsOnePrefill) {
  ExpectSame(OnePrefill(), BatchedDecode(5, /*shared_prefix=*/true, /*cascade=*/false),
             "per-sequence decode over shared blocks");
}

TEST_P(RecomputeBitwiseTest, ChunkedBatchedPrefillEqualsOnePrefill) {
  ExpectSame(OnePrefill(), ChunkedWithNeighbour(), "chunked + batched prefill");
}

INSTANTIATE_TEST_SUITE_P(Isas, RecomputeBitwiseTest, ::testing::ValuesIn(KernelPaths()),
                         [](const ::testing::TestParamInfo<KernelPath>& info) {
                           return std::string(kernels::cpu::IsaName(info.param.isa)) +
                                  (info.param.matrix == kernels::cpu::MatrixPath::kF32
                                       ? ""
                                       : "_" + std::string(kernels::cpu::MatrixPathName(info.param.matrix)));
                         });

}  // namespace
}  // namespace pdserve
