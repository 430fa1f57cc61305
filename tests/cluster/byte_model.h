// A model that splits characters across tokens: random weights of a small
// shape with the llama2 tokenizer fixture's 32000-token vocabulary (byte
// fallback), whose output head favours the 256 byte tokens, so streams
// put bytes together in every way a trained model rarely does (characters
// split across tokens, runs that turn invalid part way). Tests that need
// held partial characters serve it.
#ifndef PDSERVE_TESTS_CLUSTER_BYTE_MODEL_H_
#define PDSERVE_TESTS_CLUSTER_BYTE_MODEL_H_

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "model/safetensors.h"
#include "model/synthetic_model.h"

namespace pdserve {

inline constexpr int kVocab = 32000;  // The llama2 tokenizer's.

inline constexpr int kFirstByteToken = 3;  // <0x00>; <0xFF> is 258.
// The byte tokens' lm_head rows are scaled by this: their logits spread
// wider, so a plain random head's 0.8% of samples (too few to meet the
// byte runs that broke streams in 300 requests) becomes about 15%.
inline constexpr float kByteRowScale = 1.7f;

// Rewrites the f32 model at `path` with the byte tokens' lm_head rows scaled.
inline absl::Status FavourByteTokens(const std::string& path) {
  std::vector<std::string> blobs;
  std::vector<TensorToWrite> tensors;
  {
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    if (!file.ok()) return file.status();
    blobs.reserve((*file)->tensors().size());
    for (const TensorView& t : (*file)->tensors()) {
      blobs.emplace_back(static_cast<const char*>(t.data), t.num_bytes);
      std::string& data = blobs.back();
      if (t.name == "lm_head.weight") {
        float* rows = reinterpret_cast<float*>(data.data());  // [vocab, hidden]
        const int64_t hidden = t.shape[1];
        for (int64_t i = kFirstByteToken * hidden; i < (kFirstByteToken + 256) * hidden; ++i) {
          rows[i] *= kByteRowScale;
        }
      }
      tensors.push_back({t.name, t.dtype, t.shape, data});
    }
  }
  return WriteSafetensors(path, tensors);
}

// A model directory: random weights of a small shape with the llama2
// tokenizer fixture's vocabulary (byte tokens favoured), and that tokenizer.
inline std::string MakeByteFallbackModel(const std::string& dir) {
  RandomModelSpec spec;
  spec.vocab_size = kVocab;
  spec.hidden_size = 64;
  spec.intermediate_size = 128;
  spec.num_layers = 2;
  spec.num_heads = 8;
  spec.num_kv_heads = 2;
  spec.head_dim = 8;
  spec.seed = 17;
  absl::Status s = WriteRandomModel(dir, spec);
  if (s.ok()) s = FavourByteTokens(dir + "/model.safetensors");
  EXPECT_TRUE(s.ok()) << s;
  const std::string fixture = std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/tokenizers/llama2";
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    std::filesystem::copy_file(absl::StrCat(fixture, "/", f), absl::StrCat(dir, "/", f));
  }
  return dir;
}

}  // namespace pdserve

#endif  // PDSERVE_TESTS_CLUSTER_BYTE_MODEL_H_
