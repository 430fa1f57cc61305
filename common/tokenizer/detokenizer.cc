#include "common/tokenizer/detokenizer.h"

namespace pdserve::tok {
namespace {
// A decoded text ending in U+FFFD may still be waiting for the rest of a
// multi-byte character.
bool EndsWithReplacement(const std::string& s) {
  return s.size() >= 3 && s.compare(s.size() - 3, 3, "\xef\xbf\xbd") == 0;
}
}  // namespace

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer,
                                               absl::Span<const int32_t> context,
                                               bool skip_special_tokens)
    : tokenizer_(tokenizer),
      skip_special_(skip_special_tokens),
      ids_(context.begin(), context.end()),
      prefix_offset_(0),
      read_offset_(context.size()) {}

absl::Status IncrementalDetokenizer::DecodeWindow(std::string& prefix, std::string& text) {
  const absl::Span<const int32_t> all(ids_);
  if (!prefix_text_.has_value()) {
    absl::StatusOr<std::string> p =
        tokenizer_.Decode(all.subspan(prefix_offset_, read_offset_ - prefix_offset_), skip_special_);
    if (!p.ok()) return p.status();
    prefix_text_ = *std::move(p);
  }
  absl::StatusOr<std::string> t = tokenizer_.Decode(all.subspan(prefix_offset_), skip_special_);
  if (!t.ok()) return t.status();
  prefix = *prefix_text_;
  text = *std::move(t);
  return absl::OkStatus();
}

absl::StatusOr<std::string> IncrementalDetokenizer::Add(int32_t id) {
  ids_.push_back(id);
  std::string prefix, text;
  if (absl::Status s = DecodeWindow(prefix, text); !s.ok()) return s;
  if (text.size() > prefix.size() && !EndsWithReplacement(text) &&
      text.compare(0, prefix.size(), prefix) == 0) {
    prefix_offset_ = read_offset_;
    read_offset_ = ids_.size();
    prefix_text_.reset();
    return text.substr(prefix.size());
  }
  return std::string();
}

absl::StatusOr<std::string> IncrementalDetokenizer::Finish() {
  std::string prefix, text;
  if (absl::Status s = DecodeWindow(prefix, text); !s.ok()) return s;
  prefix_offset_ = read_offset_ = ids_.size();
  prefix_text_.reset();
  if (text.size() <= prefix.size()) return std::string();
  return text.substr(prefix.size());
}

}  // namespace pdserve::tok
