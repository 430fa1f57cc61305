// Tensor parallelism on the CPU (DESIGN.md fact 12): the shard rules, and
// a model split over 2, 4 and 8 ranks (threads meeting in the in-process
// collective) giving the unsharded model's logits within 1e-5 of the
// largest logit in F32, and the same greedy streams, for prompts of
// several lengths batched together and then decoded, including 8 ranks
// over 2 KV heads (each KV head on 4 ranks).
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kv/kv_manager.h"
#include "model/model.h"
#include "model/synthetic_model.h"
#include "model/tensor_parallel.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace pdserve {
namespace {

ModelConfig Config(int64_t heads, int64_t kv_heads, int64_t ffn, int64_t vocab) {
  ModelConfig c;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.intermediate_size = ffn;
  c.vocab_size = vocab;
  c.head_dim = 8;
  c.hidden_size = heads * 8;
  c.num_layers = 1;
  return c;
}

TEST(ShardRangesTest, HeadsSplitWithTheirGroupsAndReplicateWhenRanksOutnumberKvHeads) {
  const ModelConfig c = Config(8, 2, 80, 97);
  auto two = ComputeShardRanges(c, {1, 2});
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->q_heads, (IndexRange{4, 8}));
  EXPECT_EQ(two->kv_heads, (IndexRange{1, 2}));
  EXPECT_EQ(two->kv_copies, 1);
  EXPECT_EQ(two->ffn, (IndexRange{40, 80}));
  EXPECT_EQ(two->vocab, (IndexRange{49, 97}));

  // 8 ranks over 2 KV heads: ranks 0-3 hold head 0, ranks 4-7 head 1, and
  // each rank's query head reads the KV head it holds (h / g, g = 4).
  for (int r = 0; r < 8; ++r) {
    auto s = ComputeShardRanges(c, {r, 8});
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->q_heads, (IndexRange{r, r + 1}));
    EXPECT_EQ(s->kv_heads, (IndexRange{r / 4, r / 4 + 1}));
    EXPECT_EQ(s->kv_copies, 4);
    EXPECT_EQ(s->q_heads.begin / c.GroupSize(), s->kv_heads.begin);
    EXPECT_EQ(s->vocab_chunk, 13);
    EXPECT_EQ(s->vocab, (IndexRange{13 * r, std::min<int64_t>(97, 13 * (r + 1))}));
  }
}

TEST(ShardRangesTest, ShapesThatCannotBeCutAreRefusedNamingWhy) {
  auto three = ComputeShardRanges(Config(8, 2, 80, 97), {0, 3});
  EXPECT_EQ(three.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(three.status().message().find("8 query heads"), std::string::npos) << three.status();
  // 12 query heads over 4 KV heads on 6 ranks: 6 neither divides 4 nor is divided by it.
  auto six = ComputeShardRanges(Config(12, 4, 96, 97), {0, 6});
  EXPECT_EQ(six.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(six.status().message().find("4 KV heads"), std::string::npos) << six.status();
  EXPECT_EQ(ComputeShardRanges(Config(8, 2, 80, 97), {2, 2}).status().code(), absl::StatusCode::kInvalidArgument);
  // 9 vocabulary entries over 8 ranks: chunks of 2 leave ranks 5-7 nothing.
  EXPECT_EQ(ComputeShardRanges(Config(8, 2, 80, 9), {0, 8}).status().code(), absl::StatusCode::kInvalidArgument);
}

constexpr int32_t kTestBlockSize = 4;

// One model, unsharded and sharded, each with its own KV.
class ShardedForwardTest : public testing::TestWithParam<int> {
 protected:
  static constexpr int32_t kBlockSize = kTestBlockSize;

  void SetUp() override {
    dir_ = MakeTempDir("tp");
    RandomModelSpec spec;  // 8 query heads over 2 KV heads, FFN 80.
    spec.vocab_size = 97;  // Not a multiple of any rank count.
    spec.num_layers = 3;
    spec.seed = 7;
    ASSERT_TRUE(WriteRandomModel(dir_, spec).ok());
  }

  std::unique_ptr<kernels::cpu::CpuBackend> Backend() {
    auto b = kernels::cpu::CpuBackend::Create({.num_threads = 1, .isa = std::nullopt, .matrix_path = std::nullopt});
    EXPECT_TRUE(b.ok()) << b.status();
    return b.ok() ? *std::move(b) : nullptr;
  }

  // A model over `tp` ranks, one single-threaded backend each (null on
  // failure, with load_error_ set).
  std::unique_ptr<Model> LoadSharded(int tp, ModelOptions options) {
    options.tp = tp;
    options.rank_backends.clear();
    // Every model's backends live as long as the fixture (a model frees
    // its buffers through them), so earlier models stay usable.
    const size_t first = backends_.size();
    for (int r = 0; r < tp; ++r) backends_.push_back(Backend());
    for (int r = 1; r < tp; ++r) options.rank_backends.push_back(backends_[first + r].get());
    auto m = Model::Load(dir_, options, backends_[first].get());
    if (!m.ok()) {
      load_error_ = m.status();
      return nullptr;
    }
    return *std::move(m);
  }

  std::string dir_;
  std::vector<std::unique_ptr<kernels::cpu::CpuBackend>> backends_;
  absl::Status load_error_;
};

// A greedy run: the logits of every prompt row, then of each decode step.
struct GreedyRun {
  std::vector<std::vector<float>> logits;  // One row per step and sequence.
  std::vector<std::vector<int32_t>> streams;
};

std::vector<std::vector<int32_t>> Prompts() {
  std::mt19937_64 rng(3);
  std::vector<std::vector<int32_t>> prompts;
  for (int len : {1, 7, 13}) {
    std::vector<int32_t> p(len);
    for (auto& t : p) t = static_cast<int32_t>(rng() % 97);
    prompts.push_back(p);
  }
  return prompts;
}

int32_t Argmax(absl::Span<const float> row) {
  return static_cast<int32_t>(std::max_element(row.begin(), row.end()) - row.begin());
}

// Runs prompts then `steps` greedy decode steps through `forward`.
// Sequence s lives on rank rank_of(s) (request-sharded pools).
template <typename ForwardFn>
GreedyRun Generate(KvManager& kv, ForwardFn forward, int steps, int (*rank_of)(size_t) = nullptr) {
  const auto prompts = Prompts();
  std::vector<SequenceKv> seqs;
  for (size_t s = 0; s < prompts.size(); ++s) seqs.push_back(kv.NewSequence(rank_of ? rank_of(s) : 0));
  GreedyRun run;
  run.streams.resize(prompts.size());
  std::vector<std::vector<int32_t>> next = prompts;
  for (int step = 0; step <= steps; ++step) {
    std::vector<ForwardSequence> batch;
    for (size_t s = 0; s < seqs.size(); ++s) {
      EXPECT_TRUE(kv.Grow(seqs[s], seqs[s].num_positions() + static_cast<int32_t>(next[s].size())).ok());
      batch.push_back({&seqs[s], next[s], step == 0 ? LogitsMode::kAll : LogitsMode::kLast});
    }
    absl::StatusOr<ForwardResult> r = forward(batch);
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return run;
    for (int64_t row = 0; row * r->vocab_size < static_cast<int64_t>(r->logits.size()); ++row) {
      const auto v = r->Row(row);
      run.logits.emplace_back(v.begin(), v.end());
    }
    for (size_t s = 0; s < seqs.size(); ++s) {
      const int32_t t = Argmax(r->Last(s));
      run.streams[s].push_back(t);
      next[s] = {t};
    }
  }
  return run;
}

// The unsharded model's run, on a pool of its own.
GreedyRun Unsharded(Model& model, int steps) {
  auto kv = KvManager::Create(model.MakeKvSpec(DType::kF32, kTestBlockSize, 64));
  EXPECT_TRUE(kv.ok()) << kv.status();
  return Generate(**kv, [&](absl::Span<const ForwardSequence> b) { return ForwardGrowing(model, **kv, b); }, steps);
}

// Every logit within 1e-5 of its row's largest, and the same greedy streams.
void ExpectSameWithinF32Rounding(const GreedyRun& got, const GreedyRun& want, int tp) {
  ASSERT_EQ(got.logits.size(), want.logits.size());
  for (size_t i = 0; i < want.logits.size(); ++i) {
    float largest = 0;
    for (float v : want.logits[i]) largest = std::max(largest, std::abs(v));
    for (size_t j = 0; j < want.logits[i].size(); ++j) {
      ASSERT_LE(std::abs(got.logits[i][j] - want.logits[i][j]), 1e-5f * largest)
          << "tp " << tp << " row " << i << " logit " << j;
    }
  }
  EXPECT_EQ(got.streams, want.streams);
}

TEST_P(ShardedForwardTest, LogitsMatchTheUnshardedModelAndGreedyStreamsAreIdentical) {
  const int tp = GetParam();
  constexpr int kSteps = 12;
  ModelOptions options;
  options.weight_dtype = DType::kF32;

  auto single_backend = Backend();
  auto single = Model::Load(dir_, options, single_backend.get());
  ASSERT_TRUE(single.ok()) << single.status();
  const GreedyRun want = Unsharded(**single, kSteps);

  auto sharded = LoadSharded(tp, options);
  ASSERT_NE(sharded, nullptr);
  ASSERT_EQ(sharded->tp(), tp);
  // Each rank holds its share of the KV heads: c_kv / min(N, N_kv).
  const KvCacheSpec spec = sharded->MakeKvSpec(DType::kF32, kBlockSize, 64);
  const KvCacheSpec full_spec = (*single)->MakeKvSpec(DType::kF32, kBlockSize, 64);
  EXPECT_EQ(spec.num_ranks, tp);
  EXPECT_EQ(spec.BytesPerPosition(), full_spec.BytesPerPosition() / std::min(tp, 2));
  EXPECT_EQ(spec.TotalBytes(), full_spec.TotalBytes() * tp / std::min(tp, 2));
  // And a share of the weights: every projection and the vocabulary
  // split, the norms (a few hundred floats) on every rank. Past 2 ranks
  // the K/V projections replicate with their heads and the narrow slices
  // pad to the kernels' panels, but no rank holds a full copy (that would
  // be tp times the weights).
  const size_t norms = (2 * 3 + 1) * 64 * sizeof(float);
  if (tp == 2) EXPECT_EQ(sharded->WeightBytes(), (*single)->WeightBytes() + norms);
  EXPECT_LT(sharded->WeightBytes(), 2 * (*single)->WeightBytes());

  auto kv = KvManager::Create(spec);
  ASSERT_TRUE(kv.ok()) << kv.status();
  const GreedyRun got = Generate(**kv, [&](absl::Span<const ForwardSequence> b) {
    return ForwardGrowing(*sharded, **kv, b);
  }, kSteps);

  ExpectSameWithinF32Rounding(got, want, tp);
  const auto stats = sharded->tp_group()->stats(tp - 1);
  // Per layer two all-reduces, plus the embedding's and the logits' gather.
  EXPECT_EQ(stats.calls, (kSteps + 1) * (2 * 3 + 2));
}

TEST_P(ShardedForwardTest, AFailedCollectiveFailsTheForwardOnEveryRank) {
  const int tp = GetParam();
  ModelOptions options;
  options.weight_dtype = DType::kF32;
  auto sharded = LoadSharded(tp, options);
  ASSERT_NE(sharded, nullptr);
  auto kv = KvManager::Create(sharded->MakeKvSpec(DType::kF32, kBlockSize, 64));
  ASSERT_TRUE(kv.ok());

  // A bad batch is refused before any rank computes: the group stays whole.
  SequenceKv bad = (*kv)->NewSequence();
  const std::vector<int32_t> outside = {500};
  const ForwardSequence bad_batch[] = {{&bad, outside}};
  EXPECT_EQ(ForwardGrowing(*sharded, **kv, bad_batch).status().code(), absl::StatusCode::kInvalidArgument);
  SequenceKv short_of_blocks = (*kv)->NewSequence();
  const std::vector<int32_t> five = {1, 2, 3, 4, 5};
  const ForwardSequence ungrown[] = {{&short_of_blocks, five}};
  EXPECT_EQ(sharded->Forward((*kv)->storage(), ungrown).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(sharded->tp_group()->broken().ok());

  SequenceKv seq = (*kv)->NewSequence();
  ASSERT_TRUE((*kv)->Grow(seq, 5).ok());
  const ForwardSequence batch[] = {{&seq, five}};
  sharded->tp_group()->InjectFailure(4, absl::UnavailableError("injected: rank link down"));
  absl::StatusOr<ForwardResult> r = sharded->Forward((*kv)->storage(), batch);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "injected: rank link down");
  EXPECT_EQ(seq.num_positions(), 0);  // Nothing advanced.
  // The group stays broken: the worker must stop serving, not retry.
  EXPECT_EQ(sharded->Forward((*kv)->storage(), batch).status().message(), "injected: rank link down");
}

TEST_P(ShardedForwardTest, RequestShardedDecodeMatchesTheUnshardedModel) {
  // Each rank holds whole requests (every KV head) in its block range and
  // attends for them; the ranks exchange the new rows' q/k/v and the
  // attention outputs. The three sequences sit on ranks 0, 1, 0 (TP 2),
  // or 1, 3, 2 (TP 4 and 8: some ranks attend for nobody).
  const int tp = GetParam();
  constexpr int kSteps = 12;
  ModelOptions options;
  options.weight_dtype = DType::kF32;
  auto single_backend = Backend();
  auto single = Model::Load(dir_, options, single_backend.get());
  ASSERT_TRUE(single.ok()) << single.status();
  const GreedyRun want = Unsharded(**single, kSteps);

  auto sharded = LoadSharded(tp, options);
  ASSERT_NE(sharded, nullptr);
  const KvCacheSpec spec = sharded->MakeKvSpec(DType::kF32, kBlockSize, 64, TpKvLayout::kRequestSharded);
  EXPECT_EQ(spec.request_ranks, tp);
  EXPECT_EQ(spec.num_kv_heads, 2);  // Every head: a rank holds whole requests.
  EXPECT_EQ(spec.BytesPerPosition(), (*single)->MakeKvSpec(DType::kF32, kBlockSize, 64).BytesPerPosition());
  auto kv = KvManager::Create(spec);
  ASSERT_TRUE(kv.ok()) << kv.status();
  int (*rank_of)(size_t) = tp == 2 ? +[](size_t s) { return static_cast<int>(s % 2); }
                                   : +[](size_t s) { return static_cast<int>(1 + (s * 2) % 3); };
  const GreedyRun got = Generate(**kv, [&](absl::Span<const ForwardSequence> b) {
    for (const ForwardSequence& f : b) {
      for (int32_t block : f.kv->block_table()) EXPECT_EQ(spec.RankOfBlock(block), f.kv->rank());
    }
    return ForwardGrowing(*sharded, **kv, b);
  }, kSteps, rank_of);

  ExpectSameWithinF32Rounding(got, want, tp);

  // Each rank allocates only from its own range: filling rank 0's leaves rank 1's free.
  const int32_t per_rank = spec.num_blocks / tp;
  SequenceKv fill = (*kv)->NewSequence(0);
  ASSERT_TRUE((*kv)->Grow(fill, per_rank * kBlockSize).ok());
  SequenceKv more = (*kv)->NewSequence(0);
  const absl::Status full = (*kv)->Grow(more, 1);
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.message().find("on rank 0"), std::string::npos) << full;
  SequenceKv elsewhere = (*kv)->NewSequence(1);
  EXPECT_TRUE((*kv)->Grow(elsewhere, kBlockSize).ok());
  EXPECT_EQ(spec.RankOfBlock(elsewhere.block_table()[0]), 1);
  // New requests go to the rank with the most room: never full rank 0.
  for (int i = 0; i < 2 * tp; ++i) EXPECT_NE((*kv)->PickRank(), 0);
}

TEST_P(ShardedForwardTest, NewRequestsSpreadOverTheRanksOfARequestShardedPool) {
  const int tp = GetParam();
  auto sharded = LoadSharded(tp, ModelOptions{});
  ASSERT_NE(sharded, nullptr);
  auto kv = KvManager::Create(sharded->MakeKvSpec(DType::kF32, kBlockSize, 64, TpKvLayout::kRequestSharded));
  ASSERT_TRUE(kv.ok()) << kv.status();
  // On an idle pool (every rank as free), back-to-back requests take the
  // ranks in turn.
  for (int i = 0; i < 2 * tp; ++i) EXPECT_EQ((*kv)->PickRank(), i % tp) << i;
  // A running request's rank has less room: the next one goes elsewhere.
  SequenceKv running = (*kv)->NewSequence(1);
  ASSERT_TRUE((*kv)->Grow(running, kBlockSize).ok());
  for (int i = 0; i < 2 * tp; ++i) EXPECT_NE((*kv)->PickRank(), 1) << i;
}

TEST_F(ShardedForwardTest, AShapeThatCannotBeCutIsRefusedAtLoad) {
  ModelOptions options;
  auto sharded = LoadSharded(3, options);  // 8 query heads over 3 ranks.
  EXPECT_EQ(sharded, nullptr);
  EXPECT_NE(load_error_.message().find("8 query heads do not split evenly"), std::string::npos) << load_error_;
  options.tp = 2;  // Without the second rank's backend.
  auto backend = Backend();
  EXPECT_EQ(Model::Load(dir_, options, backend.get()).status().code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShardedForwardTest, testing::Values(2, 4, 8),
                         [](const testing::TestParamInfo<int>& p) { return "Tp" + std::to_string(p.param); });

}  // namespace
}  // namespace pdserve
