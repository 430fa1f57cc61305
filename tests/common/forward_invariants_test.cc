// The invariants of DESIGN.md facts 1, 2, 5 and 7, on every CPU kernel path,
// each with a negative control: a deliberately wrong variant shown to fail
// the same comparison.
#include <algorithm>
#include <cstring>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "model/model.h"
#include "kv/prefix_cache.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/isa_printer.h"
#include "model/synthetic_model.h"
#include "tests/support/reference_forward.h"

namespace pdserve {
namespace {

using kernels::cpu::Isa;
using Logits = std::vector<std::vector<float>>;

double MaxAbs(const Logits& a) {
  double m = 0;
  for (const auto& r : a) {
    for (float v : r) m = std::max(m, static_cast<double>(std::abs(v)));
  }
  return m;
}

double MaxDiff(const Logits& a, const Logits& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    for (size_t j = 0; j < a[i].size(); ++j) {
      m = std::max(m, static_cast<double>(std::abs(a[i][j] - b[i][j])));
    }
  }
  return m;
}

double MaxDiff(const Logits& a, const std::vector<std::vector<double>>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t j = 0; j < a[i].size(); ++j) m = std::max(m, std::abs(a[i][j] - b[i][j]));
  }
  return m;
}

void AppendRows(const ForwardResult& r, size_t seq, Logits& out) {
  for (int32_t i = 0; i < r.num_rows[seq]; ++i) {
    absl::Span<const float> row = r.Row(r.first_row[seq] + i);
    out.emplace_back(row.begin(), row.end());
  }
}

class InvariantsTest : public ::testing::TestWithParam<Isa> {
 protected:
  void Load(const RandomModelSpec& spec, DType kv = DType::kF32, int block_size = 16) {
    dir_ = MakeTempDir("inv");
    ASSERT_TRUE(WriteRandomModel(dir_, spec).ok());
    // The model frees its buffers through its backend: it goes first.
    kv_.reset();
    model_.reset();
    auto backend = kernels::cpu::CpuBackend::Create({.num_threads = 2, .isa = GetParam()});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    auto model = Model::Load(dir_, {}, backend_.get());
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = *std::move(model);
    auto manager = KvManager::Create(model_->MakeKvSpec(kv, block_size, 256));
    ASSERT_TRUE(manager.ok()) << manager.status();
    kv_ = *std::move(manager);
  }

  // Logits of every position, feeding `tokens` in chunks of `chunk`.
  Logits Chunked(const std::vector<int32_t>& tokens, size_t chunk, SequenceKv* keep = nullptr) {
    SequenceKv local = kv_->NewSequence();
    SequenceKv& seq = keep != nullptr ? *keep : local;
    Logits out;
    for (size_t b = 0; b < tokens.size(); b += chunk) {
      const size_t n = std::min(chunk, tokens.size() - b);
      ForwardSequence fs{&seq, absl::MakeConstSpan(tokens.data() + b, n), LogitsMode::kAll};
      auto r = ForwardGrowing(*model_, *kv_, {&fs, 1});
      EXPECT_TRUE(r.ok()) << r.status();
      if (!r.ok()) break;
      AppendRows(*r, 0, out);
    }
    local.Release();
    return out;
  }

  std::vector<int32_t> Tokens(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<int32_t> t(n);
    for (auto& x : t) x = static_cast<int32_t>(rng() % model_->config().vocab_size);
    return t;
  }

  std::string dir_;
  std::unique_ptr<kernels::cpu::CpuBackend> backend_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<KvManager> kv_;
};

// Fact 1: full prefill == any chunking == token-by-token decode.
TEST_P(InvariantsTest, ChunkedPrefillEqualsFullPrefillEqualsDecode) {
  Load({});
  const std::vector<int32_t> tokens = Tokens(70, 7);
  const Logits full = Chunked(tokens, tokens.size());
  const double tol = 1e-5 * MaxAbs(full);
  for (size_t chunk : {1, 7, 16, 33}) {
    EXPECT_LE(MaxDiff(Chunked(tokens, chunk), full), tol) << "chunk " << chunk;
  }
  EXPECT_EQ(kv_->Counts().used, 0);
}

// Fact 2, negative control: a chunk run without the KV of earlier chunks
// (as if chunks could be computed independently and glued) is wrong.
TEST_P(InvariantsTest, NegativeControlChunkWithoutHistoryDiffers) {
  Load({});
  const std::vector<int32_t> tokens = Tokens(40, 8);
  const Logits full = Chunked(tokens, tokens.size());
  Logits glued = Chunked({tokens.begin(), tokens.begin() + 20}, 20);
  const Logits second = Chunked({tokens.begin() + 20, tokens.end()}, 20);
  glued.insert(glued.end(), second.begin(), second.end());
  EXPECT_GT(MaxDiff(glued, full), 1e-2 * MaxAbs(full));
}

// RoPE uses absolute positions: the engine matches the naive reference, and
// the reference with positions restarted per chunk does not.
TEST_P(InvariantsTest, AbsoluteRopePositionsAndNegativeControl) {
  Load({});
  const std::vector<int32_t> tokens = Tokens(48, 9);
  const Logits chunked = Chunked(tokens, 16);
  auto ref = testing::ReferenceLogits(dir_, tokens);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_LE(MaxDiff(chunked, *ref), 1e-4 * MaxAbs(chunked));
  auto restarted = testing::ReferenceLogits(dir_, tokens, {.rope_restart_every = 16});
  ASSERT_TRUE(restarted.ok());
  EXPECT_GT(MaxDiff(chunked, *restarted), 1e-2 * MaxAbs(chunked));
}

// Fact 7: KV in scattered physical blocks == contiguous blocks; negative
// control: a block table with two entries swapped changes the result.
TEST_P(InvariantsTest, ScatteredBlocksEqualContiguous) {
  Load({}, DType::kF32, 4);
  const std::vector<int32_t> tokens = Tokens(37, 10);
  const Logits contiguous = Chunked(tokens, 37);
  // Scatter the free list: take every block (one owner each), give them
  // back shuffled.
  {
    std::vector<SequenceKv> all;
    const int32_t blocks = kv_->Counts().free;
    for (int32_t b = 0; b < blocks; ++b) {
      all.push_back(kv_->NewSequence());
      ASSERT_TRUE(kv_->Grow(all.back(), 1).ok());
    }
    ASSERT_EQ(kv_->Counts().free, 0);
    std::shuffle(all.begin(), all.end(), std::mt19937(3));
    for (SequenceKv& s : all) s.Release();
  }
  SequenceKv seq = kv_->NewSequence();
  const Logits scattered = Chunked(tokens, 5, &seq);
  bool monotone = std::is_sorted(seq.block_table().begin(), seq.block_table().end());
  EXPECT_FALSE(monotone) << "blocks were not scattered";
  EXPECT_LE(MaxDiff(scattered, contiguous), 1e-5 * MaxAbs(contiguous));

  // Decode one more token with the right table, then with a corrupted one
  // (a history block read twice and another never: attention is invariant
  // to the order of keys, so a mere swap would go unnoticed).
  const int32_t next = 5;
  ForwardSequence good{&seq, absl::MakeConstSpan(&next, 1), LogitsMode::kLast};
  auto g = ForwardGrowing(*model_, *kv_, {&good, 1});
  ASSERT_TRUE(g.ok());
  const std::vector<float> right(g->Last(0).begin(), g->Last(0).end());
  // The corrupted table, through the manager's sharing path: seq's 9 full
  // history blocks published under a chain of hashes, then attached with
  // block 1's hash in place of block 3's, plus a byte copy of seq's partial
  // tail block (position 36). It differs from seq's table in entry 3 only
  // (and the tail's block id, not its bytes).
  constexpr int32_t kFull = 37 / 4;
  ASSERT_EQ(seq.block_table().size(), static_cast<size_t>(kFull + 1));
  std::vector<BlockHash> chain;
  for (int32_t b = 0; b < kFull; ++b) chain.push_back(BlockHash{1000 + static_cast<uint64_t>(b), 1});
  kv_->Publish(seq, chain);
  std::vector<BlockHash> corrupted_chain = chain;
  corrupted_chain[3] = chain[1];
  SequenceKv corrupted = kv_->NewSequence();
  ASSERT_EQ(kv_->AttachCachedPrefix(corrupted, corrupted_chain), kFull);
  ASSERT_TRUE(kv_->Grow(corrupted, 37 + 1).ok());
  const KvStorage& storage = kv_->storage();
  for (int32_t l = 0; l < kv_->spec().num_layers; ++l) {
    std::memcpy(storage.BlockData(l, BlockId{corrupted.block_table()[kFull]}),
                storage.BlockData(l, BlockId{seq.block_table()[kFull]}), kv_->spec().LayerBlockBytes());
  }
  corrupted.SetNumPositions(37);
  std::vector<int32_t> want_table = seq.block_table();
  want_table[3] = want_table[1];
  want_table[kFull] = corrupted.block_table()[kFull];
  ASSERT_EQ(corrupted.block_table(), want_table);
  ASSERT_NE(corrupted.block_table()[kFull], seq.block_table()[kFull]);
  ForwardSequence bad{&corrupted, absl::MakeConstSpan(&next, 1), LogitsMode::kLast};
  auto b = ForwardGrowing(*model_, *kv_, {&bad, 1});
  ASSERT_TRUE(b.ok());
  const std::vector<float> wrong(b->Last(0).begin(), b->Last(0).end());
  EXPECT_GT(MaxDiff({wrong}, {right}), 1e-2 * MaxAbs({right}));
}

// A batch of sequences with different cached and new lengths == each alone;
// negative control: the same batch with two sequences' KV swapped differs.
TEST_P(InvariantsTest, BatchEqualsEachAlone) {
  Load({});
  const std::vector<std::vector<int32_t>> prompts = {Tokens(5, 1), Tokens(23, 2), Tokens(40, 3)};
  const std::vector<std::vector<int32_t>> next = {Tokens(1, 4), Tokens(9, 5), Tokens(17, 6)};
  std::vector<Logits> alone(3);
  for (int i = 0; i < 3; ++i) {
    std::vector<int32_t> all = prompts[i];
    all.insert(all.end(), next[i].begin(), next[i].end());
    Logits l = Chunked(all, all.size());
    alone[i].assign(l.begin() + prompts[i].size(), l.end());
  }
  for (bool swap : {false, true}) {
    std::vector<SequenceKv> kv;
    for (int i = 0; i < 3; ++i) kv.push_back(kv_->NewSequence());
    for (int i = 0; i < 3; ++i) {
      ForwardSequence fs{&kv[i], prompts[i], LogitsMode::kNone};
      ASSERT_TRUE(ForwardGrowing(*model_, *kv_, {&fs, 1}).ok());
    }
    std::vector<ForwardSequence> batch;
    for (int i = 0; i < 3; ++i) batch.push_back({&kv[i], next[i], LogitsMode::kAll});
    if (swap) std::swap(batch[1].kv, batch[2].kv);
    auto r = ForwardGrowing(*model_, *kv_, batch);
    ASSERT_TRUE(r.ok()) << r.status();
    double worst = 0, scale = 0;
    for (int i = 0; i < 3; ++i) {
      Logits got;
      AppendRows(*r, i, got);
      worst = std::max(worst, MaxDiff(got, alone[i]));
      scale = std::max(scale, MaxAbs(alone[i]));
    }
    if (swap) {
      EXPECT_GT(worst, 1e-2 * scale);
    } else {
      EXPECT_LE(worst, 1e-5 * scale);
    }
    for (auto& s : kv) s.Release();
  }
  EXPECT_EQ(kv_->Counts().used, 0);
}

// Fact 5: GQA with g = 1, 2, 4, 8 matches the naive reference (which expands
// nothing either); negative control: mapping query head h to KV head h % N_kv
// instead of h / g is detected (only meaningful for 1 < g < heads).
TEST_P(InvariantsTest, GroupedQueryAttention) {
  for (int64_t kv_heads : {8, 4, 2, 1}) {
    SCOPED_TRACE(::testing::Message() << "kv heads " << kv_heads);
    RandomModelSpec spec;
    spec.num_heads = 8;
    spec.num_kv_heads = kv_heads;
    spec.seed = 100 + kv_heads;
    Load(spec);
    const std::vector<int32_t> tokens = Tokens(30, 11);
    const Logits got = Chunked(tokens, 11);
    auto ref = testing::ReferenceLogits(dir_, tokens);
    ASSERT_TRUE(ref.ok());
    EXPECT_LE(MaxDiff(got, *ref), 1e-4 * MaxAbs(got));
    if (kv_heads == 2 || kv_heads == 4) {
      auto wrong = testing::ReferenceLogits(dir_, tokens, {.wrong_gqa_mapping = true});
      ASSERT_TRUE(wrong.ok());
      EXPECT_GT(MaxDiff(got, *wrong), 1e-2 * MaxAbs(got));
    }
  }
}

// BF16 and int8 KV: the chunking invariant still holds (a position's bytes
// do not depend on how it was written: int8 scales are per position and KV
// head), and the KV bytes themselves are identical however the prompt was cut.
TEST_P(InvariantsTest, ChunkingInvariantWithReducedPrecisionKv) {
  for (DType kv : {DType::kBF16, DType::kI8}) {
    SCOPED_TRACE(DTypeName(kv));
    Load({}, kv, 16);
    const std::vector<int32_t> tokens = Tokens(50, 12);
    SequenceKv whole = kv_->NewSequence();
    const Logits full = Chunked(tokens, tokens.size(), &whole);
    for (size_t chunk : {1, 7, 16, 33}) {
      SequenceKv cut = kv_->NewSequence();
      EXPECT_LE(MaxDiff(Chunked(tokens, chunk, &cut), full), 1e-5 * MaxAbs(full)) << "chunk " << chunk;
      const int64_t bytes = kv_->spec().LayerBlockBytes();
      const KvStorage& storage = kv_->storage();
      for (int32_t l = 0; l < kv_->spec().num_layers; ++l) {
        for (size_t b = 0; b + 1 < whole.block_table().size(); ++b) {  // Full blocks.
          EXPECT_EQ(std::memcmp(storage.BlockData(l, BlockId{whole.block_table()[b]}),
                                storage.BlockData(l, BlockId{cut.block_table()[b]}), bytes),
                    0)
              << "layer " << l << " block " << b << " chunk " << chunk;
        }
      }
      cut.Release();
    }
    whole.Release();
  }
}

// Fact 8: decode requests sharing prefix blocks read them once per step
// (cascade attention), with the same logits as reading them per request.
TEST_P(InvariantsTest, SharedPrefixDecodeReadsSharedBlocksOnce) {
  Load({}, DType::kBF16, 16);
  const BlockHasher hasher(model_->identity(), DType::kBF16, 16);
  const std::vector<int32_t> prefix = Tokens(96, 20);  // 6 full shared blocks.
  {
    SequenceKv warm = kv_->NewSequence();
    ForwardSequence fs{&warm, prefix, LogitsMode::kNone};
    ASSERT_TRUE(ForwardGrowing(*model_, *kv_, {&fs, 1}).ok());
    PublishFullBlocks(*kv_, hasher, prefix, warm);
    warm.Release();
  }
  constexpr int kRequests = 8;
  std::vector<SequenceKv> seqs;
  for (int r = 0; r < kRequests; ++r) seqs.push_back(kv_->NewSequence());
  std::vector<std::vector<int32_t>> prompts;
  int64_t unique_positions = 96;
  for (int r = 0; r < kRequests; ++r) {
    std::vector<int32_t> p = prefix;
    const std::vector<int32_t> own = Tokens(10 + r, 30 + r);
    p.insert(p.end(), own.begin(), own.end());
    ASSERT_EQ(AttachCachedPrefix(*kv_, hasher, p, seqs[r]), 96);
    ForwardSequence fs{&seqs[r], absl::MakeConstSpan(p).subspan(96), LogitsMode::kNone};
    ASSERT_TRUE(ForwardGrowing(*model_, *kv_, {&fs, 1}).ok());
    unique_positions += static_cast<int64_t>(own.size()) + 1;  // + the decoded token.
    prompts.push_back(std::move(p));
  }
  const int32_t next[kRequests] = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<ForwardResult> results;
  for (bool group : {true, false}) {
    std::vector<ForwardSequence> batch;
    for (int r = 0; r < kRequests; ++r) batch.push_back({&seqs[r], absl::MakeConstSpan(&next[r], 1), LogitsMode::kLast});
    auto res = ForwardGrowing(*model_, *kv_, batch, {.group_shared_kv = group});
    ASSERT_TRUE(res.ok()) << res.status();
    results.push_back(*std::move(res));
    for (auto& s : seqs) s.SetNumPositions(s.num_positions() - 1);  // Same step again.
  }
  // Same keys, same softmax runs, same arithmetic: bitwise equal, so a
  // recompute by prefill continues a cascade-decoded sequence exactly.
  ASSERT_EQ(results[0].logits.size(), results[1].logits.size());
  EXPECT_EQ(std::memcmp(results[0].logits.data(), results[1].logits.data(),
                        results[0].logits.size() * sizeof(float)),
            0);
  const int64_t unique_bytes = unique_positions * kv_->spec().BytesPerPosition();
  // Grouped: every position once. Per request: the shared 96 once per request.
  EXPECT_LE(results[0].kv_bytes_read, 1.2 * unique_bytes);
  EXPECT_EQ(results[0].kv_bytes_read, unique_bytes);
  EXPECT_EQ(results[1].kv_bytes_read,
            unique_bytes + (kRequests - 1) * 96 * kv_->spec().BytesPerPosition());
  std::printf("KV bytes per step: grouped %lld, per request %lld, unique %lld\n",
              static_cast<long long>(results[0].kv_bytes_read),
              static_cast<long long>(results[1].kv_bytes_read), static_cast<long long>(unique_bytes));
  for (auto& s : seqs) s.Release();
}

// Running out of blocks is a status, and leaves the pool as it was.
TEST_P(InvariantsTest, PoolExhaustionIsAStatus) {
  Load({}, DType::kF32, 16);
  SequenceKv seq = kv_->NewSequence();
  const std::vector<int32_t> tokens = Tokens(256 * 16 + 1, 13);
  ForwardSequence fs{&seq, tokens, LogitsMode::kLast};
  auto r = ForwardGrowing(*model_, *kv_, {&fs, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();  // Past max positions.
  EXPECT_TRUE(seq.block_table().empty());
  EXPECT_EQ(kv_->Counts().used, 0);
  const std::vector<int32_t> fits = Tokens(300, 14);
  std::vector<SequenceKv> seqs;
  for (int i = 0; i < 20; ++i) seqs.push_back(kv_->NewSequence());
  int ok = 0;
  absl::Status last;
  for (auto& s : seqs) {
    ForwardSequence f{&s, fits, LogitsMode::kNone};
    auto res = ForwardGrowing(*model_, *kv_, {&f, 1});
    if (res.ok()) {
      ++ok;
    } else {
      last = res.status();
      EXPECT_TRUE(s.block_table().empty());
      break;
    }
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  EXPECT_EQ(ok, 256 / 19);
  for (auto& s : seqs) s.Release();
  EXPECT_EQ(kv_->Counts().used, 0);
}

// A request the caller must fix is INVALID_ARGUMENT before any block is
// taken, even when the pool could hold it: its blocks would otherwise stay
// with a sequence that can never run.
TEST_P(InvariantsTest, InvalidRequestsAllocateNothing) {
  Load({}, DType::kF32, 16);
  SequenceKv seq = kv_->NewSequence();
  const std::vector<int32_t> past_max = Tokens(model_->config().max_position_embeddings + 1, 15);
  ForwardSequence fs{&seq, past_max, LogitsMode::kLast};
  auto r = ForwardGrowing(*model_, *kv_, {&fs, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE(seq.block_table().empty());
  EXPECT_EQ(kv_->Counts().used, 0);
  const std::vector<int32_t> outside_vocab = {1, 2, static_cast<int32_t>(model_->config().vocab_size)};
  fs.tokens = outside_vocab;
  r = ForwardGrowing(*model_, *kv_, {&fs, 1});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE(seq.block_table().empty());
  EXPECT_EQ(kv_->Counts().used, 0);
}

INSTANTIATE_TEST_SUITE_P(AllIsas, InvariantsTest,
                         ::testing::ValuesIn(kernels::cpu::SupportedIsas()),
                         [](const auto& info) { return std::string(kernels::cpu::IsaName(info.param)); });

}  // namespace
}  // namespace pdserve
