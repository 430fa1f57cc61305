// Streaming detokenization: turns generated ids into text deltas.
//
// The contract, which every server's streamed text inherits:
// - Every delta is valid UTF-8, and text once returned is never taken back.
// - The concatenation of the deltas (Finish included) equals the tokenizer's
//   decode of the generated ids, with one exception. A byte-fallback
//   tokenizer decodes a run of consecutive `<0xXX>` tokens as its bytes when
//   they form valid UTF-8, and as one U+FFFD per byte otherwise; a stream
//   shows a run's complete characters as they arrive, so when a run turns
//   invalid after some of it was shown, the stream keeps what it showed (the
//   run's longest valid prefix) and continues with one U+FFFD per byte not
//   shown. Once a run is known to be invalid each further byte of it is one
//   U+FFFD at once, and the next token starts afresh: later text is never
//   held back.
// - Text is held back only while it cannot be known yet: the bytes of an
//   incomplete character (byte fallback), or a decode ending in U+FFFD for
//   decoders that map tokens to raw bytes (byte-level BPE), which may still
//   be waiting for the rest of a character.
// - Leading-space rules of SentencePiece decoders hold: a window of earlier
//   tokens is decoded with each new one and only the difference is emitted.
//
// The prompt (`context`) is used only for those rules; a byte run is never
// continued across the prompt's end (the generated ids are decoded as if they
// stood alone, which is what a decode of them gives).
//
// Thread safety: one instance per stream; not thread-safe. Copyable.
#ifndef PDSERVE_TEXT_DETOKENIZER_H_
#define PDSERVE_TEXT_DETOKENIZER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "text/tokenizer.h"

namespace pdserve::tok {

class IncrementalDetokenizer {
 public:
  // `context`: token ids before the stream (the prompt).
  // REQUIRES: `tokenizer` outlives this object.
  IncrementalDetokenizer(const Tokenizer& tokenizer, absl::Span<const int32_t> context,
                         bool skip_special_tokens);

  // Adds one generated token; returns the text it completes (often empty
  // while a multi-byte character is still partial).
  // Errors: an id outside the vocabulary (here or in the context).
  absl::StatusOr<std::string> Add(int32_t id);
  // End of stream: whatever is still held back (the bytes of a trailing
  // partial character each decode as U+FFFD).
  absl::StatusOr<std::string> Finish();

 private:
  // Appends `id`'s token string, or resolves it into the current byte run.
  absl::Status Append(int32_t id);
  void AppendRunByte(uint8_t byte);
  // Appends resolved, valid UTF-8 bytes as `<0xXX>` token strings, which the
  // decoder turns back into exactly these bytes.
  void AppendBytes(absl::string_view bytes);
  // Ends the current byte run: its unresolved bytes become U+FFFD each.
  void EndRun();
  // The window's new text, cut at a character boundary; moves the window.
  std::string Emit(bool final);

  const Tokenizer& tokenizer_;
  bool skip_special_;
  absl::Status status_;              // A bad id in the context.
  std::vector<std::string> pieces_;  // Token strings as the decoder sees them.
  size_t prefix_offset_ = 0;         // Window start, in pieces_.
  size_t read_offset_ = 0;           // Pieces up to here have been emitted.
  std::optional<std::string> prefix_text_;  // Decode of [prefix_offset_, read_offset_).
  // The current run of byte-fallback tokens: the bytes of an incomplete
  // character (not in pieces_ yet), and whether the run is already invalid.
  std::string run_pending_;
  bool run_invalid_ = false;
};

}  // namespace pdserve::tok

#endif  // PDSERVE_TEXT_DETOKENIZER_H_
