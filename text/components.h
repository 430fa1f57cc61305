// The pipeline stages of a Hugging Face tokenizer.json, each built from its
// JSON description: normalizers, pre-tokenizers, decoders and the
// post-processor. Every component type that is not implemented is refused by
// name (FromJson returns INVALID_ARGUMENT naming the JSON path and type);
// nothing is silently ignored.
//
// Thread safety: components are immutable after construction.
#ifndef PDSERVE_TEXT_COMPONENTS_H_
#define PDSERVE_TEXT_COMPONENTS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json_fwd.hpp"

namespace pdserve::tok {

// A compiled PCRE2 regex (UTF + UCP, JIT when available) or a literal
// string, as tokenizer.json's {"Regex": ...} / {"String": ...} patterns.
class Pattern {
 public:
  static absl::StatusOr<std::unique_ptr<Pattern>> FromJson(const nlohmann::json& j,
                                                          const std::string& path);
  static absl::StatusOr<std::unique_ptr<Pattern>> Regex(const std::string& regex,
                                                        const std::string& path);
  virtual ~Pattern() = default;
  // Non-overlapping matches [begin, end) in order, empty matches skipped.
  virtual std::vector<std::pair<size_t, size_t>> FindAll(absl::string_view s) const = 0;
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual absl::StatusOr<std::string> Apply(std::string s) const = 0;
};
// `path` names the component in errors ("normalizer", "normalizer.normalizers[1]").
absl::StatusOr<std::unique_ptr<Normalizer>> NormalizerFromJson(const nlohmann::json& j,
                                                               const std::string& path);

// A piece of text between pre-tokenization steps. `at_start`: the piece
// begins at offset 0 of the caller's input (Metaspace's "first" scheme).
struct Piece {
  std::string text;
  bool at_start = false;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  virtual std::vector<Piece> Apply(std::vector<Piece> pieces) const = 0;
};
absl::StatusOr<std::unique_ptr<PreTokenizer>> PreTokenizerFromJson(const nlohmann::json& j,
                                                                   const std::string& path);

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Transforms the token strings (HF's decode_chain); the result is joined.
  virtual std::vector<std::string> Apply(std::vector<std::string> tokens) const = 0;
  // Whether `<0xXX>` tokens decode to raw bytes (a ByteFallback step).
  virtual bool HasByteFallback() const { return false; }
  // Whether token strings are GPT-2 byte-level text (a ByteLevel step):
  // a token's raw bytes are then its string decoded from that alphabet.
  virtual bool IsByteLevel() const { return false; }
};

// The byte a ByteFallback token string `<0xXX>` stands for, if it is one.
std::optional<uint8_t> ParseByteToken(absl::string_view token);
absl::StatusOr<std::unique_ptr<Decoder>> DecoderFromJson(const nlohmann::json& j,
                                                         const std::string& path);

// Special tokens added around a single sequence when add_special_tokens is
// set (TemplateProcessing; ByteLevel and null add none).
struct PostProcessor {
  std::vector<int32_t> prefix_ids;  // Before the sequence.
  std::vector<int32_t> suffix_ids;  // After it.
};
absl::StatusOr<PostProcessor> PostProcessorFromJson(const nlohmann::json& j,
                                                    const std::string& path);

}  // namespace pdserve::tok

#endif  // PDSERVE_TEXT_COMPONENTS_H_
