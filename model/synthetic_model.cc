#include "model/synthetic_model.h"

#include <unistd.h>

#include <cstring>

#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "model/safetensors.h"
#include "nlohmann/json.hpp"

namespace pdserve {

std::string MakeTempDir(const std::string& tag) {
  static std::atomic<int> counter{0};
  const char* base = std::getenv("TEST_TMPDIR");
  std::filesystem::path root = base != nullptr ? base : std::filesystem::temp_directory_path();
  std::filesystem::path dir =
      root / absl::StrCat("pdserve_", tag, "_", ::getpid(), "_", counter.fetch_add(1));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

RandomModelSpec Llama125MSpec() {
  RandomModelSpec s;
  s.vocab_size = 32000;
  s.hidden_size = 768;
  s.intermediate_size = 2048;
  s.num_layers = 12;
  s.num_heads = 12;
  s.num_kv_heads = 4;
  s.head_dim = 64;
  s.max_position_embeddings = 8192;
  return s;
}

absl::Status WriteRandomModel(const std::string& dir, const RandomModelSpec& s) {
  std::filesystem::create_directories(dir);
  std::mt19937_64 rng(s.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::string> blobs;
  std::vector<TensorToWrite> tensors;
  blobs.reserve(64 + s.num_layers * 16);
  auto add = [&](const std::string& name, std::vector<int64_t> shape, float stddev, float mean) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::string bytes(n * DTypeSize(s.dtype), '\0');
    for (int64_t i = 0; i < n; ++i) {
      const float v = mean + stddev * normal(rng);
      if (s.dtype == DType::kF32) {
        std::memcpy(bytes.data() + 4 * i, &v, 4);
      } else {
        const uint16_t h = F32ToBf16(v);
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      }
    }
    blobs.push_back(std::move(bytes));
    tensors.push_back({name, s.dtype == DType::kF32 ? DType::kF32 : DType::kBF16, shape, blobs.back()});
  };
  const int64_t D = s.hidden_size, F = s.intermediate_size, H = s.head_dim;
  const float lin = 1.0f / std::sqrt(static_cast<float>(D));
  add("model.embed_tokens.weight", {s.vocab_size, D}, s.tie_word_embeddings ? 0.2f : 1.0f, 0.0f);
  for (int64_t l = 0; l < s.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "input_layernorm.weight", {D}, 0.1f, 1.0f);
    add(p + "self_attn.q_proj.weight", {s.num_heads * H, D}, 1.5f * lin, 0.0f);
    add(p + "self_attn.k_proj.weight", {s.num_kv_heads * H, D}, 1.5f * lin, 0.0f);
    add(p + "self_attn.v_proj.weight", {s.num_kv_heads * H, D}, lin, 0.0f);
    add(p + "self_attn.o_proj.weight", {D, s.num_heads * H},
        1.0f / std::sqrt(static_cast<float>(s.num_heads * H)), 0.0f);
    add(p + "post_attention_layernorm.weight", {D}, 0.1f, 1.0f);
    add(p + "mlp.gate_proj.weight", {F, D}, lin, 0.0f);
    add(p + "mlp.up_proj.weight", {F, D}, lin, 0.0f);
    add(p + "mlp.down_proj.weight", {D, F}, 1.0f / std::sqrt(static_cast<float>(F)), 0.0f);
  }
  add("model.norm.weight", {D}, 0.1f, 1.0f);
  if (!s.tie_word_embeddings) add("lm_head.weight", {s.vocab_size, D}, 2.0f * lin, 0.0f);
  if (absl::Status st = WriteSafetensors(dir + "/model.safetensors", tensors); !st.ok()) return st;

  nlohmann::json c = {
      {"architectures", {s.architecture}},
      {"vocab_size", s.vocab_size},
      {"hidden_size", D},
      {"intermediate_size", F},
      {"num_hidden_layers", s.num_layers},
      {"num_attention_heads", s.num_heads},
      {"num_key_value_heads", s.num_kv_heads},
      {"head_dim", H},
      {"max_position_embeddings", s.max_position_embeddings},
      {"rms_norm_eps", 1e-5},
      {"rope_theta", 10000.0},
      {"tie_word_embeddings", s.tie_word_embeddings},
      {"hidden_act", "silu"},
      {"bos_token_id", 1},
      {"eos_token_id", 2},
  };
  std::ofstream f(dir + "/config.json");
  f << c.dump(2);
  if (!f) return absl::InternalError(absl::StrCat(dir, "/config.json: write failed"));
  return absl::OkStatus();
}

}  // namespace pdserve
