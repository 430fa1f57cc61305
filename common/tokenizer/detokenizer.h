// Streaming detokenization: turns generated ids into text deltas that are
// always complete UTF-8 and whose concatenation equals the decode of the
// whole continuation, including the leading-space rules of SentencePiece
// decoders (a window of earlier tokens is decoded with each new one and only
// the difference is emitted).
//
// Thread safety: one instance per stream; not thread-safe.
#ifndef PDSERVE_COMMON_TOKENIZER_DETOKENIZER_H_
#define PDSERVE_COMMON_TOKENIZER_DETOKENIZER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/tokenizer/tokenizer.h"

namespace pdserve::tok {

class IncrementalDetokenizer {
 public:
  // `context`: token ids before the stream (the prompt), used only so the
  // first generated tokens decode with their true leading spaces.
  // REQUIRES: `tokenizer` outlives this object.
  IncrementalDetokenizer(const Tokenizer& tokenizer, absl::Span<const int32_t> context,
                         bool skip_special_tokens);

  // Adds one generated token; returns the text it completes (often empty
  // while a multi-byte character is still partial).
  absl::StatusOr<std::string> Add(int32_t id);
  // End of stream: whatever is still held back (a trailing partial
  // character decodes as U+FFFD, as a full decode would).
  absl::StatusOr<std::string> Finish();

 private:
  // Decodes the window's already-emitted part (cached until the offsets
  // move) and the whole window.
  absl::Status DecodeWindow(std::string& prefix, std::string& text);

  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::vector<int32_t> ids_;
  size_t prefix_offset_;  // Window start.
  size_t read_offset_;    // Tokens up to here have been emitted.
  std::optional<std::string> prefix_text_;  // Decode of [prefix_offset_, read_offset_).
};

}  // namespace pdserve::tok

#endif  // PDSERVE_COMMON_TOKENIZER_DETOKENIZER_H_
