// The engine's logits against an independent reference: PyTorch float64
// logits committed by tests/fixtures/reference_logits.py for small random
// models (tests/fixtures/make_models.py), on every CPU kernel path.
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "model/model.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/linear_amx.h"
#include "kernels/cpu/linear_bf16.h"
#include "kernels/cpu/linear_fp16.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

using kernels::cpu::Isa;

struct GoldenCase {
  std::string model;
  Isa isa;
  DType weights;
  DType kv;
  int block_size;
  kernels::cpu::MatrixPath path = kernels::cpu::MatrixPath::kF32;
};

std::string Name(const ::testing::TestParamInfo<GoldenCase>& info) {
  const GoldenCase& c = info.param;
  return c.model + "_" + std::string(kernels::cpu::IsaName(c.isa)) + "_w" +
         std::string(DTypeName(c.weights)) + "_kv" + std::string(DTypeName(c.kv)) + "_bs" +
         std::to_string(c.block_size) +
         (c.path == kernels::cpu::MatrixPath::kF32 ? "" : "_" + std::string(kernels::cpu::MatrixPathName(c.path)));
}

std::vector<GoldenCase> Cases() {
  const std::vector<std::string> models = {
      "llama_tied_f32",    "llama_untied_bf16", "qwen2_bias_f16",     "mistral_f32",
      "llama3_rope_f32",   "llama_headdim_f32", "llama_sharded_bf16", "llama_gqa1_f32"};
  std::vector<GoldenCase> out;
  for (Isa isa : kernels::cpu::SupportedIsas()) {
    for (const std::string& m : models) {
      out.push_back({m, isa, DType::kF32, DType::kF32, 16});
    }
    // BF16 checkpoints held as BF16 are exact, so the F32 tolerance applies.
    out.push_back({"llama_untied_bf16", isa, DType::kBF16, DType::kF32, 16});
    out.push_back({"llama_sharded_bf16", isa, DType::kBF16, DType::kF32, 5});
    // BF16 KV rounds K and V; int8 weights or KV quantize: looser tolerances.
    out.push_back({"llama_tied_f32", isa, DType::kF32, DType::kBF16, 16});
    out.push_back({"mistral_f32", isa, DType::kF32, DType::kBF16, 7});
    out.push_back({"llama_tied_f32", isa, DType::kF32, DType::kI8, 16});
    out.push_back({"qwen2_bias_f16", isa, DType::kF32, DType::kI8, 5});
    out.push_back({"llama_untied_bf16", isa, DType::kI8, DType::kF32, 16});
    out.push_back({"mistral_f32", isa, DType::kI8, DType::kI8, 16});
    out.push_back({"llama_headdim_f32", isa, DType::kI8, DType::kBF16, 16});
  }
  // The FP16 matrix path (BF16 weights only), where the CPU has it.
  if (kernels::cpu::F16PathSupported()) {
    constexpr auto kF16 = kernels::cpu::MatrixPath::kF16;
    out.push_back({"llama_untied_bf16", Isa::kAvx512, DType::kBF16, DType::kF32, 16, kF16});
    out.push_back({"llama_sharded_bf16", Isa::kAvx512, DType::kBF16, DType::kF32, 5, kF16});
    out.push_back({"qwen2_bias_f16", Isa::kAvx512, DType::kBF16, DType::kF32, 16, kF16});
    out.push_back({"mistral_f32", Isa::kAvx512, DType::kBF16, DType::kBF16, 7, kF16});
  }
  // The BF16 matrix path (BF16 weights only), where the CPU has it.
  if (kernels::cpu::Bf16PathSupported()) {
    constexpr auto kBf16 = kernels::cpu::MatrixPath::kBf16;
    out.push_back({"llama_untied_bf16", Isa::kAvx512, DType::kBF16, DType::kF32, 16, kBf16});
    out.push_back({"llama_sharded_bf16", Isa::kAvx512, DType::kBF16, DType::kF32, 5, kBf16});
    out.push_back({"qwen2_bias_f16", Isa::kAvx512, DType::kBF16, DType::kF32, 16, kBf16});
    out.push_back({"mistral_f32", Isa::kAvx512, DType::kBF16, DType::kBF16, 7, kBf16});
    // BF16 KV at an even block size: attention in BF16 dot products too.
    out.push_back({"mistral_f32", Isa::kAvx512, DType::kBF16, DType::kBF16, 16, kBf16});
    out.push_back({"llama_untied_bf16", Isa::kAvx512, DType::kBF16, DType::kBF16, 16, kBf16});
    out.push_back({"qwen2_bias_f16", Isa::kAvx512, DType::kBF16, DType::kBF16, 2, kBf16});
    out.push_back({"llama_headdim_f32", Isa::kAvx512, DType::kBF16, DType::kBF16, 16, kBf16});
  }
  // The AMX matrix path (BF16 weights only), where the CPU and kernel offer it.
  if (kernels::cpu::AmxPathSupported()) {
    constexpr auto kAmx = kernels::cpu::MatrixPath::kAmx;
    out.push_back({"llama_untied_bf16", Isa::kAvx512, DType::kBF16, DType::kF32, 16, kAmx});
    out.push_back({"llama_sharded_bf16", Isa::kAvx512, DType::kBF16, DType::kF32, 5, kAmx});
    out.push_back({"qwen2_bias_f16", Isa::kAvx512, DType::kBF16, DType::kF32, 16, kAmx});
    out.push_back({"mistral_f32", Isa::kAvx512, DType::kBF16, DType::kBF16, 7, kAmx});
  }
  return out;
}

void PrintTo(const GoldenCase& c, std::ostream* os) {
  *os << c.model << " " << kernels::cpu::IsaName(c.isa) << " weights " << DTypeName(c.weights)
      << " kv " << DTypeName(c.kv) << " block " << c.block_size
      << (c.path == kernels::cpu::MatrixPath::kF32 ? "" : " " + std::string(kernels::cpu::MatrixPathName(c.path)) + " path");
}

class GoldenLogitsTest : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(GoldenLogitsTest, MatchesReference) {
  const GoldenCase& gc = GetParam();
  const std::string dir = std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/models/" + gc.model;
  auto backend = kernels::cpu::CpuBackend::Create({.num_threads = 2, .isa = gc.isa, .matrix_path = gc.path});
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto model = Model::Load(dir, {.weight_dtype = gc.weights}, backend->get());
  ASSERT_TRUE(model.ok()) << model.status();
  auto kv = KvManager::Create((*model)->MakeKvSpec(gc.kv, gc.block_size, 64));
  ASSERT_TRUE(kv.ok()) << kv.status();

  std::ifstream f(dir + "/reference_logits.json");
  ASSERT_TRUE(f) << dir;
  const nlohmann::json ref = nlohmann::json::parse(f);
  const bool exact_storage =
      gc.kv == DType::kF32 && gc.weights != DType::kI8 && gc.path == kernels::cpu::MatrixPath::kF32;
  // Stated tolerances, relative to max|logit|: exact storage 1e-4; BF16 KV
  // 3e-2; int8 weights or int8 KV 3e-2 (measured worst cases are printed:
  // about 1e-2 with both int8); the FP16 matrix path (activations rounded
  // to FP16) and the BF16 and AMX ones (activations rounded to BF16) 1e-2.
  const double rel_tol = exact_storage                                                  ? 1e-4
                         : gc.path != kernels::cpu::MatrixPath::kF32 && gc.kv == DType::kF32 ? 1e-2
                                                                                         : 3e-2;
  for (const auto& c : ref["cases"]) {
    const std::vector<int32_t> ids = c["token_ids"].get<std::vector<int32_t>>();
    const auto expected = c["logits"].get<std::vector<std::vector<double>>>();
    SequenceKv seq = (*kv)->NewSequence();
    ForwardSequence fs{&seq, ids, LogitsMode::kAll};
    auto r = ForwardGrowing(**model, **kv, {&fs, 1});
    ASSERT_TRUE(r.ok()) << r.status();
    ASSERT_EQ(r->num_rows[0], static_cast<int32_t>(ids.size()));
    double max_abs = 0;
    for (const auto& row : expected) {
      for (double v : row) max_abs = std::max(max_abs, std::abs(v));
    }
    const double tol = rel_tol * max_abs;
    double case_worst = 0;
    for (size_t p = 0; p < ids.size(); ++p) {
      absl::Span<const float> got = r->Row(r->first_row[0] + static_cast<int64_t>(p));
      ASSERT_EQ(got.size(), expected[p].size());
      double worst = 0;
      size_t arg_got = 0, arg_want = 0;
      for (size_t v = 0; v < got.size(); ++v) {
        worst = std::max(worst, std::abs(got[v] - expected[p][v]));
        if (got[v] > got[arg_got]) arg_got = v;
        if (expected[p][v] > expected[p][arg_want]) arg_want = v;
      }
      EXPECT_LE(worst, tol) << "position " << p << " of " << ids.size();
      case_worst = std::max(case_worst, worst);
      if (exact_storage) EXPECT_EQ(arg_got, arg_want) << "argmax at position " << p;
    }
    seq.Release();
    std::printf("%s: worst |delta| / max|logit| = %.2e over %zu positions\n", ::testing::PrintToString(gc).c_str(),
                case_worst / max_abs, ids.size());
  }
  EXPECT_EQ((*kv)->Counts().used, 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GoldenLogitsTest, ::testing::ValuesIn(Cases()), Name);

}  // namespace
}  // namespace pdserve
