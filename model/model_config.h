// The architecture of a Llama-family checkpoint, read from Hugging Face's
// config.json (+ generation_config.json for the end-of-sequence ids).
//
// Accepted: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (q/k/v
// biases), tied or untied embeddings, GQA, explicit head_dim, rope_theta,
// rope_scaling of type "llama3". Refused with a message naming the field:
// anything the engine would not run exactly (sliding-window attention that
// can take effect, other rope_scaling types, other activations, biases on
// other projections, other architectures).
#ifndef PDSERVE_MODEL_MODEL_CONFIG_H_
#define PDSERVE_MODEL_MODEL_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve {

enum class Architecture : uint8_t { kLlama, kMistral, kQwen2 };

struct Llama3RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelConfig {
  Architecture architecture = Architecture::kLlama;
  std::string architecture_name;  // As written in config.json.
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  std::optional<Llama3RopeScaling> rope_scaling;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // Qwen2.
  std::optional<int32_t> bos_token_id;
  std::vector<int32_t> eos_token_ids;

  int64_t GroupSize() const { return num_heads / num_kv_heads; }
  int64_t QDim() const { return num_heads * head_dim; }
  int64_t KvDim() const { return num_kv_heads * head_dim; }
  // Parameters of the matrices and vectors (embeddings counted once if tied).
  int64_t NumParameters() const;
};

// Parses config.json text. `source` names the file in error messages.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text, absl::string_view source);

// Applies generation_config.json (eos/bos ids) on top of `config`.
absl::Status ApplyGenerationConfig(absl::string_view json_text, absl::string_view source,
                                   ModelConfig& config);

// Reads DIR/config.json and, when present, DIR/generation_config.json.
absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir);

// Reads a whole file; NOT_FOUND when absent.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

}  // namespace pdserve

#endif  // PDSERVE_MODEL_MODEL_CONFIG_H_
