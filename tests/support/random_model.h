// Writes small random Hugging Face model directories for tests (config.json +
// model.safetensors), deterministically from a seed.
#ifndef PDSERVE_TESTS_SUPPORT_RANDOM_MODEL_H_
#define PDSERVE_TESTS_SUPPORT_RANDOM_MODEL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "common/dtype.h"

namespace pdserve::testing {

struct RandomModelSpec {
  std::string architecture = "LlamaForCausalLM";
  int64_t vocab_size = 96;
  int64_t hidden_size = 64;
  int64_t intermediate_size = 80;
  int64_t num_layers = 2;
  int64_t num_heads = 8;
  int64_t num_kv_heads = 2;
  int64_t head_dim = 8;
  int64_t max_position_embeddings = 512;
  bool tie_word_embeddings = false;
  DType dtype = DType::kF32;
  uint64_t seed = 1;
};

// Creates `dir` (and parents) and writes the model into it.
absl::Status WriteRandomModel(const std::string& dir, const RandomModelSpec& spec);

// A fresh, empty directory under the test temp dir, unique per call.
std::string MakeTempDir(const std::string& tag);

}  // namespace pdserve::testing

#endif  // PDSERVE_TESTS_SUPPORT_RANDOM_MODEL_H_
