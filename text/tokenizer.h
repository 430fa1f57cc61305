// A Hugging Face tokenizer loaded from tokenizer.json (+ tokenizer_config.json
// for BOS/EOS and the chat template), producing the ids Hugging Face's own
// implementation produces.
//
// Encoding follows HF's pipeline: added tokens are matched first and never
// split (non-normalized ones on the raw text, normalized ones after the
// normalizer), the rest is normalized, pre-tokenized and run through the
// BPE model; with add_special_tokens, the post-processor's tokens are added.
// Supported components: see components.h; anything else is refused by name.
//
// Thread safety: immutable after Load; Encode/Decode may run concurrently.
#ifndef PDSERVE_TEXT_TOKENIZER_H_
#define PDSERVE_TEXT_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "text/bpe.h"
#include "text/components.h"

namespace pdserve::tok {

// A byte range [begin, end) of a text.
struct TextRange {
  size_t begin = 0;
  size_t end = 0;
};

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

class Tokenizer {
 public:
  // Reads DIR/tokenizer.json and, when present, DIR/tokenizer_config.json and
  // DIR/special_tokens_map.json (BOS/EOS the config does not name).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& dir);
  // From file contents (config may be empty). `source` names them in errors.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(absl::string_view tokenizer_json,
                                                             absl::string_view tokenizer_config_json,
                                                             const std::string& source);

  // Errors: invalid UTF-8 input (INVALID_ARGUMENT).
  absl::StatusOr<std::vector<int32_t>> Encode(absl::string_view text,
                                              bool add_special_tokens = false) const;
  // Encode (no special tokens added), except that inside the `literal`
  // ranges (sorted, disjoint, within `text`) special added tokens are not
  // matched: a special token's text there is encoded as the characters it
  // is (Hugging Face's split_special_tokens, there only). Added tokens that
  // are not special still match, as they do in Hugging Face's own. Outside
  // the ranges, and across their edges, the ids are Encode's: the text is
  // still normalized, pre-tokenized and merged as one. Chat prompts use it:
  // the template's markers are special tokens, a message's words never are.
  // A special token that is matched after normalization (no supported model
  // has one) is not matched at all in a run of text that touches a range.
  absl::StatusOr<std::vector<int32_t>> EncodeWithLiteralRanges(absl::string_view text,
                                                               absl::Span<const TextRange> literal) const;
  // Errors: an id outside the vocabulary.
  absl::StatusOr<std::string> Decode(absl::Span<const int32_t> ids,
                                     bool skip_special_tokens = false) const;

  // The decoder chain alone, on token strings (what Decode applies after
  // mapping ids to their strings). Streaming detokenization uses it to
  // decode byte-fallback runs it has already resolved.
  std::string DecodeTokenStrings(std::vector<std::string> tokens) const;
  // The byte `id` stands for when the decoder turns `<0xXX>` tokens into raw
  // bytes (SentencePiece byte fallback); nullopt for every other token.
  std::optional<uint8_t> FallbackByte(int32_t id) const;
  bool HasByteFallback() const { return decoder_ != nullptr && decoder_->HasByteFallback(); }

  // The raw bytes token `id` writes after other text (the bytes a stream
  // gains when the token is generated), for grammars that match bytes;
  // nullopt for special tokens and unknown ids. A byte-level token's bytes
  // may be part of a UTF-8 character; a `<0xXX>` token is its one byte.
  std::vector<std::optional<std::string>> AllTokenBytes() const;

  // The token string of `id` (added tokens included); nullptr if unknown.
  const std::string* IdToToken(int32_t id) const;
  std::optional<int32_t> TokenToId(const std::string& token) const;
  bool IsSpecial(int32_t id) const;
  int32_t vocab_size() const;  // Highest id + 1.

  std::optional<int32_t> bos_id() const { return bos_id_; }
  std::optional<int32_t> eos_id() const { return eos_id_; }
  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }
  // tokenizer_config.json's chat_template ("" when absent).
  const std::string& chat_template() const { return chat_template_; }
  // Ids the post-processor puts before a sequence with add_special_tokens.
  const std::vector<int32_t>& prefix_ids() const { return post_.prefix_ids; }

 private:
  struct Segment {
    std::string text;
    int32_t token = -1;  // >= 0: an added token.
    bool at_start = false;
    size_t offset = 0;     // Where `text` began in the input (before normalization).
    bool literal = false;  // Overlaps a literal range (set before normalization).
  };
  // Splits each text segment at matches of added tokens with the given
  // `normalized` flag (leftmost-longest; lstrip/rstrip/single_word applied);
  // special ones are not matched over a `literal` range.
  std::vector<Segment> SplitAdded(std::vector<Segment> segments, bool normalized,
                                  absl::Span<const TextRange> literal) const;
  absl::StatusOr<std::vector<int32_t>> EncodeImpl(absl::string_view text, bool add_special_tokens,
                                                  absl::Span<const TextRange> literal) const;

  std::unique_ptr<Bpe> model_;
  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<Decoder> decoder_;
  PostProcessor post_;
  std::vector<AddedToken> added_;
  // Added tokens by first byte, longest first; [0] non-normalized, [1] normalized.
  std::vector<std::vector<const AddedToken*>> by_first_byte_[2];
  absl::flat_hash_map<int32_t, size_t> added_by_id_;
  absl::flat_hash_map<std::string, size_t> added_by_content_;
  std::optional<int32_t> bos_id_, eos_id_;
  std::string bos_token_, eos_token_, chat_template_;
};

}  // namespace pdserve::tok

#endif  // PDSERVE_TEXT_TOKENIZER_H_
