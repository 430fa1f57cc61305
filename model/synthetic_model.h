// Writes random-weight Hugging Face model directories (config.json +
// model.safetensors), deterministically from a seed: small ones for tests,
// full-size shapes for benchmarks (`pdctl make-model`).
#ifndef PDSERVE_MODEL_SYNTHETIC_MODEL_H_
#define PDSERVE_MODEL_SYNTHETIC_MODEL_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "base/dtype.h"

namespace pdserve {

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

// The ~125M-parameter Llama shape used by the benchmarks: 12 layers,
// hidden 768, 12 query / 4 KV heads, FFN 2048, vocab 32000, untied.
RandomModelSpec Llama125MSpec();

// A fresh, empty directory under $TEST_TMPDIR or the system temp dir,
// unique per call.
std::string MakeTempDir(const std::string& tag);

}  // namespace pdserve

#endif  // PDSERVE_MODEL_SYNTHETIC_MODEL_H_
