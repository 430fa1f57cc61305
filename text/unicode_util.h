// UTF-8 helpers, Unicode normalization (through utf8proc) and the GPT-2
// byte-level alphabet used by byte-level BPE tokenizers.
#ifndef PDSERVE_TEXT_UNICODE_UTIL_H_
#define PDSERVE_TEXT_UNICODE_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pdserve::tok {

// Length of the UTF-8 sequence starting at s[i] (1 for an invalid lead byte
// or a truncated sequence, so iteration always advances).
size_t Utf8CharLen(absl::string_view s, size_t i);

// Appends the UTF-8 encoding of code point `cp`.
void AppendUtf8(uint32_t cp, std::string& out);

// Decodes the code point at s[i] (U+FFFD for invalid input), advancing i.
uint32_t NextCodePoint(absl::string_view s, size_t& i);

// Start of the character that ends at byte `end` (not before `floor`).
size_t PrevCharStart(absl::string_view s, size_t end, size_t floor = 0);

// Unicode White_Space, as Rust's char::is_whitespace (what HF tokenizers use).
bool IsUnicodeWhitespace(uint32_t cp);

// Whether `s` ends in the middle of a UTF-8 sequence (an incomplete code point).
bool EndsWithIncompleteUtf8(absl::string_view s);

// Whether `s` is entirely valid UTF-8 (no allocation).
bool IsValidUtf8(absl::string_view s);

// Replaces every invalid UTF-8 sequence with U+FFFD (as Rust's
// String::from_utf8_lossy does: one replacement per maximal invalid prefix).
std::string Utf8Lossy(absl::string_view bytes);

enum class NormalForm { kNFC, kNFD, kNFKC, kNFKD };
// Errors: invalid UTF-8 input.
absl::StatusOr<std::string> Normalize(absl::string_view s, NormalForm form);

// Unicode-aware lower-casing of every code point.
std::string Lowercase(absl::string_view s);

// The GPT-2 byte-level alphabet: byte b <-> one printable code point.
class ByteLevelAlphabet {
 public:
  static const ByteLevelAlphabet& Get();
  // UTF-8 of the code point standing for each byte of `bytes`, concatenated.
  std::string Encode(absl::string_view bytes) const;
  // Inverse; code points outside the alphabet are kept as their UTF-8 bytes.
  std::string Decode(absl::string_view text) const;

 private:
  ByteLevelAlphabet();
  std::string byte_to_utf8_[256];
  std::vector<int> cp_to_byte_;  // Indexed by code point (< 512); -1 if none.
};

}  // namespace pdserve::tok

#endif  // PDSERVE_TEXT_UNICODE_UTIL_H_
