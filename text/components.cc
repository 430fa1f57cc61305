#include "text/components.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "text/unicode_util.h"
#include "nlohmann/json.hpp"

namespace pdserve::tok {
namespace {

using nlohmann::json;

absl::Status Unsupported(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", path, ": ", what));
}

absl::StatusOr<std::string> TypeOf(const json& j, const std::string& path) {
  if (!j.is_object()) return Unsupported(path, "must be an object");
  auto t = j.find("type");
  if (t == j.end() || !t->is_string()) return Unsupported(path, "missing 'type'");
  return t->get<std::string>();
}

absl::StatusOr<std::string> StringField(const json& j, const char* key, const std::string& path) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_string()) {
    return Unsupported(path, absl::StrCat("missing string field '", key, "'"));
  }
  return it->get<std::string>();
}

bool BoolField(const json& j, const char* key, bool def) {
  auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : def;
}

// ---- Patterns ----

class RegexPattern final : public Pattern {
 public:
  explicit RegexPattern(pcre2_code* code) : code_(code) {}
  ~RegexPattern() override { pcre2_code_free(code_); }

  std::vector<std::pair<size_t, size_t>> FindAll(absl::string_view s) const override {
    std::vector<std::pair<size_t, size_t>> out;
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t offset = 0;
    while (offset <= s.size()) {
      const int rc = pcre2_match(code_, subject, s.size(), offset, PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc < 0) break;
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const size_t b = ov[0], e = ov[1];
      if (e > b) {
        out.emplace_back(b, e);
        offset = e;
      } else {
        // Empty match: step over one character.
        if (b >= s.size()) break;
        offset = b + Utf8CharLen(s, b);
      }
    }
    pcre2_match_data_free(md);
    return out;
  }

 private:
  pcre2_code* code_;
};

class StringPattern final : public Pattern {
 public:
  explicit StringPattern(std::string needle) : needle_(std::move(needle)) {}
  std::vector<std::pair<size_t, size_t>> FindAll(absl::string_view s) const override {
    std::vector<std::pair<size_t, size_t>> out;
    if (needle_.empty()) return out;
    size_t pos = 0;
    while ((pos = s.find(needle_, pos)) != absl::string_view::npos) {
      out.emplace_back(pos, pos + needle_.size());
      pos += needle_.size();
    }
    return out;
  }

 private:
  std::string needle_;
};

// ---- Normalizers ----

class NfNormalizer final : public Normalizer {
 public:
  explicit NfNormalizer(NormalForm f) : form_(f) {}
  absl::StatusOr<std::string> Apply(std::string s) const override { return Normalize(s, form_); }

 private:
  NormalForm form_;
};

class LowercaseNormalizer final : public Normalizer {
 public:
  absl::StatusOr<std::string> Apply(std::string s) const override { return Lowercase(s); }
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string p) : prepend_(std::move(p)) {}
  absl::StatusOr<std::string> Apply(std::string s) const override {
    return s.empty() ? s : prepend_ + s;
  }

 private:
  std::string prepend_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(std::unique_ptr<Pattern> p, std::string content)
      : pattern_(std::move(p)), content_(std::move(content)) {}
  absl::StatusOr<std::string> Apply(std::string s) const override {
    std::string out;
    size_t last = 0;
    for (auto [b, e] : pattern_->FindAll(s)) {
      out.append(s, last, b - last);
      out += content_;
      last = e;
    }
    out.append(s, last, std::string::npos);
    return out;
  }

 private:
  std::unique_ptr<Pattern> pattern_;
  std::string content_;
};

class StripNormalizer final : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  absl::StatusOr<std::string> Apply(std::string s) const override {
    size_t b = 0, e = s.size();
    if (left_) {
      while (b < e) {
        size_t i = b;
        if (!IsUnicodeWhitespace(NextCodePoint(s, i))) break;
        b = i;
      }
    }
    if (right_) {
      while (e > b) {
        const size_t start = PrevCharStart(s, e, b);
        size_t i = start;
        if (!IsUnicodeWhitespace(NextCodePoint(s, i))) break;
        e = start;
      }
    }
    return s.substr(b, e - b);
  }

 private:
  bool left_, right_;
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> n) : parts_(std::move(n)) {}
  absl::StatusOr<std::string> Apply(std::string s) const override {
    for (const auto& p : parts_) {
      absl::StatusOr<std::string> r = p->Apply(std::move(s));
      if (!r.ok()) return r.status();
      s = *std::move(r);
    }
    return s;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

// ---- Pre-tokenizers ----

enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

absl::StatusOr<SplitBehavior> ParseBehavior(const json& j, const std::string& path) {
  absl::StatusOr<std::string> b = StringField(j, "behavior", path);
  if (!b.ok()) return b.status();
  if (*b == "Isolated") return SplitBehavior::kIsolated;
  if (*b == "Removed") return SplitBehavior::kRemoved;
  if (*b == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (*b == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (*b == "Contiguous") return SplitBehavior::kContiguous;
  return Unsupported(path, absl::StrCat("unsupported split behavior '", *b, "'"));
}

// Splits `piece` at the matches of `pattern` with HF's delimiter behaviors.
void SplitPiece(const Piece& piece, const Pattern& pattern, SplitBehavior behavior, bool invert,
                std::vector<Piece>& out) {
  const absl::string_view s = piece.text;
  // (begin, end, is_match) spans covering s.
  std::vector<std::tuple<size_t, size_t, bool>> spans;
  size_t last = 0;
  for (auto [b, e] : pattern.FindAll(s)) {
    if (b > last) spans.emplace_back(last, b, invert);
    spans.emplace_back(b, e, !invert);
    last = e;
  }
  if (last < s.size()) spans.emplace_back(last, s.size(), invert);

  std::vector<std::pair<size_t, size_t>> parts;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (auto [b, e, m] : spans) parts.emplace_back(b, e);
      break;
    case SplitBehavior::kRemoved:
      for (auto [b, e, m] : spans) {
        if (!m) parts.emplace_back(b, e);
      }
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool prev_match = false;
      for (auto [b, e, m] : spans) {
        if (m && !parts.empty() && !prev_match) {
          parts.back().second = e;
        } else {
          parts.emplace_back(b, e);
        }
        prev_match = m;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool prev_match = false;
      for (auto [b, e, m] : spans) {
        if (!m && prev_match && !parts.empty()) {
          parts.back().second = e;
        } else {
          parts.emplace_back(b, e);
        }
        prev_match = m;
      }
      break;
    }
    case SplitBehavior::kContiguous: {
      bool prev_match = false;
      for (auto [b, e, m] : spans) {
        if (m && prev_match && !parts.empty()) {
          parts.back().second = e;
        } else {
          parts.emplace_back(b, e);
        }
        prev_match = m;
      }
      break;
    }
  }
  for (auto [b, e] : parts) {
    if (e > b) out.push_back({std::string(s.substr(b, e - b)), piece.at_start && b == 0});
  }
}

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(std::unique_ptr<Pattern> p, SplitBehavior b, bool invert)
      : pattern_(std::move(p)), behavior_(b), invert_(invert) {}
  std::vector<Piece> Apply(std::vector<Piece> pieces) const override {
    std::vector<Piece> out;
    for (const Piece& p : pieces) SplitPiece(p, *pattern_, behavior_, invert_, out);
    return out;
  }

 private:
  std::unique_ptr<Pattern> pattern_;
  SplitBehavior behavior_;
  bool invert_;
};

constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::unique_ptr<Pattern> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}
  std::vector<Piece> Apply(std::vector<Piece> pieces) const override {
    std::vector<Piece> split;
    for (Piece& p : pieces) {
      if (add_prefix_space_ && (p.text.empty() || p.text[0] != ' ')) p.text.insert(0, " ");
      if (regex_ != nullptr) {
        SplitPiece(p, *regex_, SplitBehavior::kIsolated, false, split);
      } else {
        split.push_back(std::move(p));
      }
    }
    const ByteLevelAlphabet& a = ByteLevelAlphabet::Get();
    for (Piece& p : split) p.text = a.Encode(p.text);
    return split;
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<Pattern> regex_;
};

enum class PrependScheme { kAlways, kFirst, kNever };

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  std::vector<Piece> Apply(std::vector<Piece> pieces) const override {
    std::vector<Piece> out;
    StringPattern sep(replacement_);
    for (Piece& p : pieces) {
      p.text = absl::StrReplaceAll(p.text, {{" ", replacement_}});
      const bool prepend = scheme_ == PrependScheme::kAlways ||
                           (scheme_ == PrependScheme::kFirst && p.at_start);
      if (prepend && p.text.rfind(replacement_, 0) != 0) p.text.insert(0, replacement_);
      if (split_) {
        SplitPiece(p, sep, SplitBehavior::kMergedWithNext, false, out);
      } else {
        out.push_back(std::move(p));
      }
    }
    return out;
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> p) : parts_(std::move(p)) {}
  std::vector<Piece> Apply(std::vector<Piece> pieces) const override {
    for (const auto& p : parts_) pieces = p->Apply(std::move(pieces));
    return pieces;
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

absl::StatusOr<PrependScheme> ParsePrependScheme(const json& j, const std::string& path) {
  auto it = j.find("prepend_scheme");
  if (it != j.end() && it->is_string()) {
    const std::string s = it->get<std::string>();
    if (s == "always") return PrependScheme::kAlways;
    if (s == "first") return PrependScheme::kFirst;
    if (s == "never") return PrependScheme::kNever;
    return Unsupported(path, absl::StrCat("unknown prepend_scheme '", s, "'"));
  }
  return BoolField(j, "add_prefix_space", true) ? PrependScheme::kAlways : PrependScheme::kNever;
}

// ---- Decoders ----

class ByteLevelDecoder final : public Decoder {
 public:
  std::vector<std::string> Apply(std::vector<std::string> tokens) const override {
    std::string bytes;
    const ByteLevelAlphabet& a = ByteLevelAlphabet::Get();
    for (const std::string& t : tokens) bytes += a.Decode(t);
    return {Utf8Lossy(bytes)};
  }
  bool IsByteLevel() const override { return true; }
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(std::unique_ptr<Pattern> p, std::string content)
      : normalizer_(std::move(p), std::move(content)) {}
  std::vector<std::string> Apply(std::vector<std::string> tokens) const override {
    for (std::string& t : tokens) t = *normalizer_.Apply(std::move(t));
    return tokens;
  }

 private:
  ReplaceNormalizer normalizer_;
};

class ByteFallbackDecoder final : public Decoder {
 public:
  std::vector<std::string> Apply(std::vector<std::string> tokens) const override {
    std::vector<std::string> out;
    std::string pending;  // Consecutive <0xXX> bytes.
    size_t pending_count = 0;
    auto flush = [&] {
      if (pending_count == 0) return;
      if (IsValidUtf8(pending)) {
        out.push_back(pending);
      } else {
        for (size_t i = 0; i < pending_count; ++i) out.push_back("\xef\xbf\xbd");
      }
      pending.clear();
      pending_count = 0;
    };
    for (std::string& t : tokens) {
      if (std::optional<uint8_t> b = ParseByteToken(t); b.has_value()) {
        pending.push_back(static_cast<char>(*b));
        ++pending_count;
      } else {
        flush();
        out.push_back(std::move(t));
      }
    }
    flush();
    return out;
  }
  bool HasByteFallback() const override { return true; }
};

class FuseDecoder final : public Decoder {
 public:
  std::vector<std::string> Apply(std::vector<std::string> tokens) const override {
    std::string all;
    for (const std::string& t : tokens) all += t;
    return {all};
  }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(std::string content, int start, int stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  std::vector<std::string> Apply(std::vector<std::string> tokens) const override {
    for (std::string& t : tokens) {
      for (int i = 0; i < start_ && t.rfind(content_, 0) == 0; ++i) t.erase(0, content_.size());
      for (int i = 0; i < stop_ && t.size() >= content_.size() &&
                      t.compare(t.size() - content_.size(), content_.size(), content_) == 0;
           ++i) {
        t.erase(t.size() - content_.size());
      }
    }
    return tokens;
  }

 private:
  std::string content_;
  int start_, stop_;
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, PrependScheme scheme)
      : replacement_(std::move(replacement)), scheme_(scheme) {}
  std::vector<std::string> Apply(std::vector<std::string> tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string t = absl::StrReplaceAll(tokens[i], {{replacement_, " "}});
      if (i == 0 && scheme_ != PrependScheme::kNever && !t.empty() && t[0] == ' ') t.erase(0, 1);
      tokens[i] = std::move(t);
    }
    return tokens;
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
};

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> d) : parts_(std::move(d)) {}
  std::vector<std::string> Apply(std::vector<std::string> tokens) const override {
    for (const auto& d : parts_) tokens = d->Apply(std::move(tokens));
    return tokens;
  }
  bool HasByteFallback() const override {
    return std::any_of(parts_.begin(), parts_.end(), [](const auto& d) { return d->HasByteFallback(); });
  }
  bool IsByteLevel() const override {
    return std::any_of(parts_.begin(), parts_.end(), [](const auto& d) { return d->IsByteLevel(); });
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

template <typename T, typename F>
absl::StatusOr<std::vector<std::unique_ptr<T>>> ParseList(const json& j, const char* key,
                                                          const std::string& path, F parse) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_array()) {
    return Unsupported(path, absl::StrCat("missing list '", key, "'"));
  }
  std::vector<std::unique_ptr<T>> out;
  for (size_t i = 0; i < it->size(); ++i) {
    auto part = parse((*it)[i], absl::StrCat(path, ".", key, "[", i, "]"));
    if (!part.ok()) return part.status();
    out.push_back(*std::move(part));
  }
  return out;
}

}  // namespace

std::optional<uint8_t> ParseByteToken(absl::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return std::nullopt;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  const int hi = hex(token[3]), lo = hex(token[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<uint8_t>(hi * 16 + lo);
}

absl::StatusOr<std::unique_ptr<Pattern>> Pattern::Regex(const std::string& regex,
                                                        const std::string& path) {
  int err = 0;
  PCRE2_SIZE err_off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(regex.data()), regex.size(),
                                   PCRE2_UTF | PCRE2_UCP, &err, &err_off, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return Unsupported(path, absl::StrCat("regex does not compile at offset ", err_off, ": ",
                                          reinterpret_cast<const char*>(msg)));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // Falls back to the interpreter if JIT is absent.
  return std::unique_ptr<Pattern>(new RegexPattern(code));
}

absl::StatusOr<std::unique_ptr<Pattern>> Pattern::FromJson(const json& j, const std::string& path) {
  if (j.is_object()) {
    if (auto it = j.find("Regex"); it != j.end() && it->is_string()) {
      return Regex(it->get<std::string>(), path + ".pattern");
    }
    if (auto it = j.find("String"); it != j.end() && it->is_string()) {
      return std::unique_ptr<Pattern>(new StringPattern(it->get<std::string>()));
    }
  }
  return Unsupported(path, "'pattern' must be {\"Regex\": ...} or {\"String\": ...}");
}

absl::StatusOr<std::unique_ptr<Normalizer>> NormalizerFromJson(const json& j,
                                                               const std::string& path) {
  absl::StatusOr<std::string> type = TypeOf(j, path);
  if (!type.ok()) return type.status();
  if (*type == "NFC") return std::unique_ptr<Normalizer>(new NfNormalizer(NormalForm::kNFC));
  if (*type == "NFD") return std::unique_ptr<Normalizer>(new NfNormalizer(NormalForm::kNFD));
  if (*type == "NFKC") return std::unique_ptr<Normalizer>(new NfNormalizer(NormalForm::kNFKC));
  if (*type == "NFKD") return std::unique_ptr<Normalizer>(new NfNormalizer(NormalForm::kNFKD));
  if (*type == "Lowercase") return std::unique_ptr<Normalizer>(new LowercaseNormalizer());
  if (*type == "Prepend") {
    absl::StatusOr<std::string> p = StringField(j, "prepend", path);
    if (!p.ok()) return p.status();
    return std::unique_ptr<Normalizer>(new PrependNormalizer(*p));
  }
  if (*type == "Replace") {
    auto pattern = Pattern::FromJson(j.value("pattern", json()), path);
    if (!pattern.ok()) return pattern.status();
    absl::StatusOr<std::string> content = StringField(j, "content", path);
    if (!content.ok()) return content.status();
    return std::unique_ptr<Normalizer>(new ReplaceNormalizer(*std::move(pattern), *content));
  }
  if (*type == "Strip") {
    return std::unique_ptr<Normalizer>(
        new StripNormalizer(BoolField(j, "strip_left", false), BoolField(j, "strip_right", false)));
  }
  if (*type == "Sequence") {
    auto parts = ParseList<Normalizer>(j, "normalizers", path, NormalizerFromJson);
    if (!parts.ok()) return parts.status();
    return std::unique_ptr<Normalizer>(new SequenceNormalizer(*std::move(parts)));
  }
  return Unsupported(path, absl::StrCat("normalizer type '", *type, "' is not supported"));
}

absl::StatusOr<std::unique_ptr<PreTokenizer>> PreTokenizerFromJson(const json& j,
                                                                   const std::string& path) {
  absl::StatusOr<std::string> type = TypeOf(j, path);
  if (!type.ok()) return type.status();
  if (*type == "Split") {
    auto pattern = Pattern::FromJson(j.value("pattern", json()), path);
    if (!pattern.ok()) return pattern.status();
    absl::StatusOr<SplitBehavior> b = ParseBehavior(j, path);
    if (!b.ok()) return b.status();
    return std::unique_ptr<PreTokenizer>(
        new SplitPreTokenizer(*std::move(pattern), *b, BoolField(j, "invert", false)));
  }
  if (*type == "ByteLevel") {
    std::unique_ptr<Pattern> regex;
    if (BoolField(j, "use_regex", true)) {
      auto r = Pattern::Regex(kGpt2Pattern, path);
      if (!r.ok()) return r.status();
      regex = *std::move(r);
    }
    return std::unique_ptr<PreTokenizer>(
        new ByteLevelPreTokenizer(BoolField(j, "add_prefix_space", true), std::move(regex)));
  }
  if (*type == "Metaspace") {
    absl::StatusOr<std::string> rep = StringField(j, "replacement", path);
    if (!rep.ok()) return rep.status();
    absl::StatusOr<PrependScheme> scheme = ParsePrependScheme(j, path);
    if (!scheme.ok()) return scheme.status();
    return std::unique_ptr<PreTokenizer>(
        new MetaspacePreTokenizer(*rep, *scheme, BoolField(j, "split", true)));
  }
  if (*type == "Digits") {
    auto r = Pattern::Regex(BoolField(j, "individual_digits", false) ? "\\p{N}" : "\\p{N}+", path);
    if (!r.ok()) return r.status();
    return std::unique_ptr<PreTokenizer>(
        new SplitPreTokenizer(*std::move(r), SplitBehavior::kIsolated, false));
  }
  if (*type == "Sequence") {
    auto parts = ParseList<PreTokenizer>(j, "pretokenizers", path, PreTokenizerFromJson);
    if (!parts.ok()) return parts.status();
    return std::unique_ptr<PreTokenizer>(new SequencePreTokenizer(*std::move(parts)));
  }
  return Unsupported(path, absl::StrCat("pre-tokenizer type '", *type, "' is not supported"));
}

absl::StatusOr<std::unique_ptr<Decoder>> DecoderFromJson(const json& j, const std::string& path) {
  absl::StatusOr<std::string> type = TypeOf(j, path);
  if (!type.ok()) return type.status();
  if (*type == "ByteLevel") return std::unique_ptr<Decoder>(new ByteLevelDecoder());
  if (*type == "ByteFallback") return std::unique_ptr<Decoder>(new ByteFallbackDecoder());
  if (*type == "Fuse") return std::unique_ptr<Decoder>(new FuseDecoder());
  if (*type == "Replace") {
    auto pattern = Pattern::FromJson(j.value("pattern", json()), path);
    if (!pattern.ok()) return pattern.status();
    absl::StatusOr<std::string> content = StringField(j, "content", path);
    if (!content.ok()) return content.status();
    return std::unique_ptr<Decoder>(new ReplaceDecoder(*std::move(pattern), *content));
  }
  if (*type == "Strip") {
    absl::StatusOr<std::string> content = StringField(j, "content", path);
    if (!content.ok()) return content.status();
    auto num = [&](const char* k) {
      auto it = j.find(k);
      return it != j.end() && it->is_number_unsigned() ? static_cast<int>(it->get<uint64_t>()) : 0;
    };
    return std::unique_ptr<Decoder>(new StripDecoder(*content, num("start"), num("stop")));
  }
  if (*type == "Metaspace") {
    absl::StatusOr<std::string> rep = StringField(j, "replacement", path);
    if (!rep.ok()) return rep.status();
    absl::StatusOr<PrependScheme> scheme = ParsePrependScheme(j, path);
    if (!scheme.ok()) return scheme.status();
    return std::unique_ptr<Decoder>(new MetaspaceDecoder(*rep, *scheme));
  }
  if (*type == "Sequence") {
    auto parts = ParseList<Decoder>(j, "decoders", path, DecoderFromJson);
    if (!parts.ok()) return parts.status();
    return std::unique_ptr<Decoder>(new SequenceDecoder(*std::move(parts)));
  }
  return Unsupported(path, absl::StrCat("decoder type '", *type, "' is not supported"));
}

absl::StatusOr<PostProcessor> PostProcessorFromJson(const json& j, const std::string& path) {
  PostProcessor out;
  if (j.is_null()) return out;
  absl::StatusOr<std::string> type = TypeOf(j, path);
  if (!type.ok()) return type.status();
  if (*type == "ByteLevel") return out;  // Offsets only; adds no tokens.
  if (*type == "Sequence") {
    auto it = j.find("processors");
    if (it == j.end() || !it->is_array()) return Unsupported(path, "missing list 'processors'");
    for (size_t i = 0; i < it->size(); ++i) {
      auto p = PostProcessorFromJson((*it)[i], absl::StrCat(path, ".processors[", i, "]"));
      if (!p.ok()) return p.status();
      out.prefix_ids.insert(out.prefix_ids.end(), p->prefix_ids.begin(), p->prefix_ids.end());
      out.suffix_ids.insert(out.suffix_ids.end(), p->suffix_ids.begin(), p->suffix_ids.end());
    }
    return out;
  }
  if (*type != "TemplateProcessing") {
    return Unsupported(path, absl::StrCat("post-processor type '", *type, "' is not supported"));
  }
  auto single = j.find("single");
  auto specials = j.find("special_tokens");
  if (single == j.end() || !single->is_array()) return Unsupported(path, "missing 'single'");
  bool seen_sequence = false;
  for (const json& item : *single) {
    if (item.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    auto st = item.find("SpecialToken");
    if (st == item.end() || !st->contains("id") || !(*st)["id"].is_string()) {
      return Unsupported(path, "'single' entries must be Sequence or SpecialToken");
    }
    const std::string name = (*st)["id"].get<std::string>();
    if (specials == j.end() || !specials->contains(name) || !(*specials)[name].contains("ids") ||
        !(*specials)[name]["ids"].is_array()) {
      return Unsupported(path, absl::StrCat("special token '", name, "' has no ids"));
    }
    for (const json& id : (*specials)[name]["ids"]) {
      if (!id.is_number_integer()) return Unsupported(path, "special token ids must be integers");
      (seen_sequence ? out.suffix_ids : out.prefix_ids).push_back(id.get<int32_t>());
    }
  }
  return out;
}

}  // namespace pdserve::tok
