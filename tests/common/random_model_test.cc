// Model::CreateRandom: a forward-ready model of any Llama shape from the
// backend's random weights (what the GPU benchmark's 8B shape is made
// of), deterministic in its seed.
#include <cmath>
#include <memory>
#include <vector>

#include "kv/kv_manager.h"
#include "model/model.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"

namespace pdserve {
namespace {

ModelConfig Shape() {
  ModelConfig c;
  c.vocab_size = 101;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_layers = 3;
  c.num_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.max_position_embeddings = 256;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000;
  return c;
}

std::vector<float> Logits(Model& model, const std::vector<int32_t>& tokens) {
  auto kv = KvManager::Create(model.MakeKvSpec(DType::kF32, 16, 8));
  EXPECT_TRUE(kv.ok()) << kv.status();
  SequenceKv seq = (*kv)->NewSequence();
  ForwardSequence fs{&seq, tokens, LogitsMode::kAll};
  auto r = ForwardGrowing(model, **kv, {&fs, 1});
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? r->logits : std::vector<float>();
}

TEST(RandomModelTest, SameSeedSameModelAndEveryLogitFinite) {
  auto backend = *kernels::cpu::CpuBackend::Create({.num_threads = 1, .isa = std::nullopt,
                                                    .matrix_path = kernels::cpu::MatrixPath::kF32});
  const std::vector<int32_t> tokens = {1, 50, 100, 7, 7, 0, 33};
  for (DType w : {DType::kF32, DType::kBF16, DType::kI8}) {
    SCOPED_TRACE(DTypeName(w));
    auto a = Model::CreateRandom(Shape(), w, 42, backend.get());
    auto b = Model::CreateRandom(Shape(), w, 42, backend.get());
    auto other = Model::CreateRandom(Shape(), w, 43, backend.get());
    ASSERT_TRUE(a.ok() && b.ok() && other.ok()) << a.status();
    const std::vector<float> la = Logits(**a, tokens), lb = Logits(**b, tokens), lo = Logits(**other, tokens);
    ASSERT_EQ(la.size(), tokens.size() * 101);
    EXPECT_EQ(la, lb);
    EXPECT_NE(la, lo);
    float spread = 0;
    for (float x : la) {
      ASSERT_TRUE(std::isfinite(x));
      spread = std::max(spread, std::abs(x - la[0]));
    }
    EXPECT_GT(spread, 1e-3f) << "all logits equal";
    EXPECT_EQ((*a)->identity(), (*b)->identity());
    EXPECT_NE((*a)->identity(), (*other)->identity());
    EXPECT_EQ((*a)->weight_dtype(), w);
    // Every matrix of the shape, held as w (int8 with a scale per row).
    const int64_t elems = 3 * (64 * (64 + 2 * 16) + 64 * 64 + 2 * 96 * 64 + 64 * 96) + 101 * 64;
    EXPECT_GE((*a)->WeightBytes(), static_cast<size_t>(elems * DTypeSize(w)));
  }
}

TEST(RandomModelTest, ABrokenShapeIsRefused) {
  auto backend = *kernels::cpu::CpuBackend::Create({});
  ModelConfig c = Shape();
  c.num_kv_heads = 3;  // 8 query heads do not group over 3.
  EXPECT_EQ(Model::CreateRandom(c, DType::kBF16, 1, backend.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Model::CreateRandom(Shape(), DType::kF16, 1, backend.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve
