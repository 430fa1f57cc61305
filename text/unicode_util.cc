#include "text/unicode_util.h"

#include <utf8proc.h>

#include <cstdlib>

#include "absl/status/status.h"

namespace pdserve::tok {

size_t Utf8CharLen(absl::string_view s, size_t i) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 1;
  if (i + n > s.size()) return 1;
  for (size_t k = 1; k < n; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return 1;
  }
  return n;
}

void AppendUtf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xc0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xe0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  } else {
    out.push_back(static_cast<char>(0xf0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
  }
}

uint32_t NextCodePoint(absl::string_view s, size_t& i) {
  utf8proc_int32_t cp = 0;
  const utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                              static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
  if (n <= 0) {
    ++i;
    return 0xfffd;
  }
  i += static_cast<size_t>(n);
  return static_cast<uint32_t>(cp);
}

size_t PrevCharStart(absl::string_view s, size_t end, size_t floor) {
  size_t start = end - 1;
  while (start > floor && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
  return start;
}

bool IsUnicodeWhitespace(uint32_t c) {
  return (c >= 0x9 && c <= 0xd) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
         c == 0x205f || c == 0x3000;
}

bool EndsWithIncompleteUtf8(absl::string_view s) {
  // Look back at most 3 bytes for a lead byte whose sequence runs past the end.
  for (size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const unsigned char c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xc0) == 0x80) continue;  // Continuation byte: keep looking.
    const size_t need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    return need > back;
  }
  return false;
}

bool IsValidUtf8(absl::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    utf8proc_int32_t cp;
    const utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                                static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
    if (n <= 0) return false;
    i += static_cast<size_t>(n);
  }
  return true;
}

std::string Utf8Lossy(absl::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    utf8proc_int32_t cp;
    const utf8proc_ssize_t n = utf8proc_iterate(
        reinterpret_cast<const utf8proc_uint8_t*>(bytes.data() + i),
        static_cast<utf8proc_ssize_t>(bytes.size() - i), &cp);
    if (n > 0) {
      out.append(bytes.data() + i, static_cast<size_t>(n));
      i += static_cast<size_t>(n);
      continue;
    }
    // Skip the maximal prefix of a valid sequence (Rust/WHATWG semantics).
    const unsigned char c = static_cast<unsigned char>(bytes[i]);
    size_t need = 0;
    unsigned char lo = 0x80, hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) {
      need = 1;
    } else if (c >= 0xe0 && c <= 0xef) {
      need = 2;
      if (c == 0xe0) lo = 0xa0;
      if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      need = 3;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;
    }
    size_t j = i + 1;
    for (size_t k = 0; k < need && j < bytes.size(); ++k, ++j) {
      const unsigned char b = static_cast<unsigned char>(bytes[j]);
      if (b < lo || b > hi) break;
      lo = 0x80;
      hi = 0xbf;
    }
    out += "\xef\xbf\xbd";
    i = j;
  }
  return out;
}

absl::StatusOr<std::string> Normalize(absl::string_view s, NormalForm form) {
  int options = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNFC:
      options |= UTF8PROC_COMPOSE;
      break;
    case NormalForm::kNFD:
      options |= UTF8PROC_DECOMPOSE;
      break;
    case NormalForm::kNFKC:
      options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
      break;
    case NormalForm::kNFKD:
      options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
      break;
  }
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                   static_cast<utf8proc_ssize_t>(s.size()), &out,
                   static_cast<utf8proc_option_t>(options));
  if (n < 0) {
    return absl::InvalidArgumentError(std::string("normalization failed: ") + utf8proc_errmsg(n));
  }
  std::string result(reinterpret_cast<char*>(out), static_cast<size_t>(n));
  std::free(out);
  return result;
}

std::string Lowercase(absl::string_view s) {
  std::string out;
  size_t i = 0;
  while (i < s.size()) AppendUtf8(static_cast<uint32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(NextCodePoint(s, i)))), out);
  return out;
}

ByteLevelAlphabet::ByteLevelAlphabet() : cp_to_byte_(512, -1) {
  // Printable Latin-1 bytes stand for themselves; the other 68 bytes map, in
  // byte order, to code points 256, 257, ...
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
    const int cp = printable ? b : next++;
    byte_to_utf8_[b].clear();
    AppendUtf8(static_cast<uint32_t>(cp), byte_to_utf8_[b]);
    cp_to_byte_[cp] = b;
  }
}

const ByteLevelAlphabet& ByteLevelAlphabet::Get() {
  static const ByteLevelAlphabet* alphabet = new ByteLevelAlphabet();
  return *alphabet;
}

std::string ByteLevelAlphabet::Encode(absl::string_view bytes) const {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) out += byte_to_utf8_[b];
  return out;
}

std::string ByteLevelAlphabet::Decode(absl::string_view text) const {
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const size_t start = i;
    const uint32_t cp = NextCodePoint(text, i);
    if (cp < cp_to_byte_.size() && cp_to_byte_[cp] >= 0) {
      out.push_back(static_cast<char>(cp_to_byte_[cp]));
    } else {
      out.append(text.data() + start, i - start);
    }
  }
  return out;
}

}  // namespace pdserve::tok
