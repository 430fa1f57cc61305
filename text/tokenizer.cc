#include "text/tokenizer.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "model/model_config.h"
#include "text/unicode_util.h"
#include "nlohmann/json.hpp"
#include <utf8proc.h>

namespace pdserve::tok {
namespace {

using nlohmann::json;

bool IsWordChar(uint32_t c) {
  if (c == '_') return true;
  const utf8proc_category_t cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
         (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
}

// Code point ending right before byte offset `end` (0 if none).
uint32_t CodePointBefore(absl::string_view s, size_t end) {
  if (end == 0) return 0;
  size_t start = PrevCharStart(s, end);
  return NextCodePoint(s, start);
}

// The token text of a tokenizer_config.json entry (a string or {"content": ...}).
std::optional<std::string> ConfigToken(const json& cfg, const char* key) {
  auto it = cfg.find(key);
  if (it == cfg.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return std::nullopt;
}

// Whether [begin, end) overlaps one of `ranges` (sorted, disjoint).
bool Overlaps(absl::Span<const TextRange> ranges, size_t begin, size_t end) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), begin,
                             [](size_t b, const TextRange& r) { return b < r.end; });
  return it != ranges.end() && it->begin < end;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& dir) {
  absl::StatusOr<std::string> tj = ReadFileToString(dir + "/tokenizer.json");
  if (!tj.ok()) return tj.status();
  absl::StatusOr<std::string> cfg = ReadFileToString(dir + "/tokenizer_config.json");
  if (!cfg.ok() && !absl::IsNotFound(cfg.status())) return cfg.status();
  auto tok = FromJson(*tj, cfg.ok() ? *cfg : "", dir);
  if (!tok.ok()) return tok.status();
  // special_tokens_map.json fills in BOS/EOS that tokenizer_config.json lacks.
  absl::StatusOr<std::string> map = ReadFileToString(dir + "/special_tokens_map.json");
  if (map.ok()) {
    const json m = json::parse(*map, nullptr, false);
    if (m.is_discarded() || !m.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(dir, "/special_tokens_map.json: not a valid JSON object"));
    }
    if ((*tok)->bos_token_.empty()) {
      if (auto b = ConfigToken(m, "bos_token")) {
        (*tok)->bos_token_ = *b;
        (*tok)->bos_id_ = (*tok)->TokenToId(*b);
      }
    }
    if ((*tok)->eos_token_.empty()) {
      if (auto e = ConfigToken(m, "eos_token")) {
        (*tok)->eos_token_ = *e;
        (*tok)->eos_id_ = (*tok)->TokenToId(*e);
      }
    }
  } else if (!absl::IsNotFound(map.status())) {
    return map.status();
  }
  return tok;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(absl::string_view tokenizer_json,
                                                                absl::string_view config_json,
                                                                const std::string& source) {
  auto fail = [&](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(source, ": ", s.message()));
  };
  const json j = json::parse(tokenizer_json.begin(), tokenizer_json.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return fail(absl::InvalidArgumentError("tokenizer.json is not a valid JSON object"));
  }
  auto tok = std::unique_ptr<Tokenizer>(new Tokenizer());
  if (!j.contains("model")) return fail(absl::InvalidArgumentError("tokenizer.json: missing 'model'"));
  auto model = Bpe::FromJson(j["model"]);
  if (!model.ok()) return fail(model.status());
  tok->model_ = *std::move(model);

  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    auto n = NormalizerFromJson(j["normalizer"], "normalizer");
    if (!n.ok()) return fail(n.status());
    tok->normalizer_ = *std::move(n);
  }
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
    auto p = PreTokenizerFromJson(j["pre_tokenizer"], "pre_tokenizer");
    if (!p.ok()) return fail(p.status());
    tok->pre_tokenizer_ = *std::move(p);
  }
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    auto d = DecoderFromJson(j["decoder"], "decoder");
    if (!d.ok()) return fail(d.status());
    tok->decoder_ = *std::move(d);
  }
  if (j.contains("post_processor")) {
    auto p = PostProcessorFromJson(j["post_processor"], "post_processor");
    if (!p.ok()) return fail(p.status());
    tok->post_ = *std::move(p);
  }
  if (j.contains("truncation") && !j["truncation"].is_null()) {
    return fail(absl::InvalidArgumentError("tokenizer.json: 'truncation' is not supported"));
  }
  if (j.contains("padding") && !j["padding"].is_null()) {
    return fail(absl::InvalidArgumentError("tokenizer.json: 'padding' is not supported"));
  }
  if (auto at = j.find("added_tokens"); at != j.end() && !at->is_null()) {
    if (!at->is_array()) return fail(absl::InvalidArgumentError("tokenizer.json: 'added_tokens' must be a list"));
    for (const json& a : *at) {
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() ||
          !a.contains("content") || !a["content"].is_string() || a["content"].get<std::string>().empty()) {
        return fail(absl::InvalidArgumentError("tokenizer.json: added_tokens entries need an id and content"));
      }
      AddedToken t;
      t.id = a["id"].get<int32_t>();
      if (t.id < 0) return fail(absl::InvalidArgumentError("tokenizer.json: negative added token id"));
      t.content = a["content"].get<std::string>();
      for (auto [key, field] : {std::pair{"single_word", &t.single_word}, std::pair{"lstrip", &t.lstrip},
                                std::pair{"rstrip", &t.rstrip}, std::pair{"normalized", &t.normalized},
                                std::pair{"special", &t.special}}) {
        auto it = a.find(key);
        if (it == a.end() || it->is_null()) continue;
        if (!it->is_boolean()) {
          return fail(absl::InvalidArgumentError(absl::StrCat(
              "tokenizer.json: added token '", t.content, "': '", key, "' must be true or false")));
        }
        *field = it->get<bool>();
      }
      tok->added_by_id_[t.id] = tok->added_.size();
      tok->added_by_content_[t.content] = tok->added_.size();
      tok->added_.push_back(std::move(t));
    }
  }

  for (auto& index : tok->by_first_byte_) index.resize(256);
  for (const AddedToken& t : tok->added_) {
    tok->by_first_byte_[t.normalized ? 1 : 0][static_cast<unsigned char>(t.content[0])].push_back(&t);
  }
  for (auto& index : tok->by_first_byte_) {
    for (auto& list : index) {
      std::stable_sort(list.begin(), list.end(), [](const AddedToken* a, const AddedToken* b) {
        return a->content.size() > b->content.size();
      });
    }
  }

  if (!config_json.empty()) {
    const json cfg = json::parse(config_json.begin(), config_json.end(), nullptr, false);
    if (cfg.is_discarded() || !cfg.is_object()) {
      return fail(absl::InvalidArgumentError("tokenizer_config.json is not a valid JSON object"));
    }
    if (auto b = ConfigToken(cfg, "bos_token")) {
      tok->bos_token_ = *b;
      tok->bos_id_ = tok->TokenToId(*b);
    }
    if (auto e = ConfigToken(cfg, "eos_token")) {
      tok->eos_token_ = *e;
      tok->eos_id_ = tok->TokenToId(*e);
    }
    if (auto ct = cfg.find("chat_template"); ct != cfg.end()) {
      if (ct->is_string()) {
        tok->chat_template_ = ct->get<std::string>();
      } else if (ct->is_array()) {
        for (const json& t : *ct) {
          if (t.is_object() && t.contains("name") && t["name"].is_string() &&
              t["name"].get<std::string>() == "default" && t.contains("template") &&
              t["template"].is_string()) {
            tok->chat_template_ = t["template"].get<std::string>();
          }
        }
      }
    }
  }
  return tok;
}

std::vector<Tokenizer::Segment> Tokenizer::SplitAdded(std::vector<Segment> segments, bool normalized,
                                                      absl::Span<const TextRange> literal) const {
  const std::vector<std::vector<const AddedToken*>>& index = by_first_byte_[normalized ? 1 : 0];
  if (std::none_of(added_.begin(), added_.end(),
                   [&](const AddedToken& t) { return t.normalized == normalized; })) {
    return segments;
  }
  std::vector<Segment> out;
  for (Segment& seg : segments) {
    if (seg.token >= 0) {
      out.push_back(std::move(seg));
      continue;
    }
    const absl::string_view s = seg.text;
    size_t emitted = 0;  // Start of the text not yet emitted.
    size_t i = 0;
    while (i < s.size()) {
      const AddedToken* hit = nullptr;
      for (const AddedToken* t : index[static_cast<unsigned char>(s[i])]) {
        if (s.compare(i, t->content.size(), t->content) != 0) continue;
        // After normalization offsets no longer map to the input, so a
        // segment touching a literal range gets no special token at all.
        if (t->special && (normalized ? seg.literal
                                      : Overlaps(literal, seg.offset + i, seg.offset + i + t->content.size()))) {
          continue;
        }
        if (t->single_word) {
          if (IsWordChar(CodePointBefore(s, i))) continue;
          const size_t end = i + t->content.size();
          size_t k = end;
          if (end < s.size() && IsWordChar(NextCodePoint(s, k))) continue;
        }
        hit = t;
        break;
      }
      if (hit == nullptr) {
        i += Utf8CharLen(s, i);
        continue;
      }
      size_t begin = i, end = i + hit->content.size();
      if (hit->lstrip) {
        while (begin > emitted) {
          const size_t start = PrevCharStart(s, begin, emitted);
          size_t k = start;
          if (!IsUnicodeWhitespace(NextCodePoint(s, k))) break;
          begin = start;
        }
      }
      if (hit->rstrip) {
        while (end < s.size()) {
          size_t k = end;
          if (!IsUnicodeWhitespace(NextCodePoint(s, k))) break;
          end = k;
        }
      }
      if (begin > emitted) {
        out.push_back({std::string(s.substr(emitted, begin - emitted)), -1, seg.at_start && emitted == 0,
                       seg.offset + emitted, seg.literal});
      }
      out.push_back({"", hit->id, false, seg.offset + begin, false});
      emitted = i = end;
    }
    if (emitted < s.size()) {
      out.push_back({std::string(s.substr(emitted)), -1, seg.at_start && emitted == 0, seg.offset + emitted,
                     seg.literal});
    }
  }
  return out;
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(absl::string_view text,
                                                       bool add_special_tokens) const {
  return EncodeImpl(text, add_special_tokens, {});
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::EncodeWithLiteralRanges(absl::string_view text,
                                                                        absl::Span<const TextRange> literal) const {
  for (size_t i = 0; i < literal.size(); ++i) {
    if (literal[i].begin > literal[i].end || literal[i].end > text.size() ||
        (i > 0 && literal[i].begin < literal[i - 1].end)) {
      return absl::InvalidArgumentError(absl::StrCat("literal range ", i, " is out of order or outside the text"));
    }
  }
  return EncodeImpl(text, /*add_special_tokens=*/false, literal);
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::EncodeImpl(absl::string_view text, bool add_special_tokens,
                                                           absl::Span<const TextRange> literal) const {
  if (!IsValidUtf8(text)) return absl::InvalidArgumentError("text is not valid UTF-8");
  std::vector<Segment> segments = SplitAdded({{std::string(text), -1, true, 0, false}}, false, literal);
  for (Segment& s : segments) {
    if (s.token < 0) s.literal = Overlaps(literal, s.offset, s.offset + s.text.size());
  }
  if (normalizer_ != nullptr) {
    for (Segment& s : segments) {
      if (s.token >= 0) continue;
      absl::StatusOr<std::string> n = normalizer_->Apply(std::move(s.text));
      if (!n.ok()) return n.status();
      s.text = *std::move(n);
    }
  }
  segments = SplitAdded(std::move(segments), true, literal);

  std::vector<int32_t> ids;
  if (add_special_tokens) ids = post_.prefix_ids;
  for (Segment& s : segments) {
    if (s.token >= 0) {
      ids.push_back(s.token);
      continue;
    }
    if (s.text.empty()) continue;
    std::vector<Piece> pieces = {{std::move(s.text), s.at_start}};
    if (pre_tokenizer_ != nullptr) pieces = pre_tokenizer_->Apply(std::move(pieces));
    for (const Piece& p : pieces) model_->Tokenize(p.text, ids);
  }
  if (add_special_tokens) ids.insert(ids.end(), post_.suffix_ids.begin(), post_.suffix_ids.end());
  return ids;
}

const std::string* Tokenizer::IdToToken(int32_t id) const {
  if (auto it = added_by_id_.find(id); it != added_by_id_.end()) return &added_[it->second].content;
  return model_->IdToToken(id);
}

std::optional<int32_t> Tokenizer::TokenToId(const std::string& token) const {
  if (auto it = added_by_content_.find(token); it != added_by_content_.end()) {
    return added_[it->second].id;
  }
  return model_->TokenToId(token);
}

bool Tokenizer::IsSpecial(int32_t id) const {
  auto it = added_by_id_.find(id);
  return it != added_by_id_.end() && added_[it->second].special;
}

int32_t Tokenizer::vocab_size() const {
  int32_t n = model_->vocab_size();
  for (const AddedToken& t : added_) n = std::max(n, t.id + 1);
  return n;
}

absl::StatusOr<std::string> Tokenizer::Decode(absl::Span<const int32_t> ids,
                                              bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string* t = IdToToken(id);
    if (t == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is outside the vocabulary [0, ", vocab_size(), ")"));
    }
    if (skip_special_tokens && IsSpecial(id)) continue;
    tokens.push_back(*t);
  }
  return DecodeTokenStrings(std::move(tokens));
}

std::string Tokenizer::DecodeTokenStrings(std::vector<std::string> tokens) const {
  if (decoder_ == nullptr) return absl::StrJoin(tokens, " ");
  return absl::StrJoin(decoder_->Apply(std::move(tokens)), "");
}

std::optional<uint8_t> Tokenizer::FallbackByte(int32_t id) const {
  if (!HasByteFallback()) return std::nullopt;
  const std::string* t = IdToToken(id);
  if (t == nullptr) return std::nullopt;
  return ParseByteToken(*t);
}

std::vector<std::optional<std::string>> Tokenizer::AllTokenBytes() const {
  const int32_t n = vocab_size();
  std::vector<std::optional<std::string>> out(n);
  const bool byte_level = decoder_ != nullptr && decoder_->IsByteLevel();
  // Other decoders (Metaspace, Replace, Strip) may treat a stream's first
  // token apart: a token's bytes are what it adds after an anchor token.
  std::optional<std::string> anchor;
  for (int32_t id = 0; id < n && !anchor.has_value() && !byte_level; ++id) {
    const std::string* t = IdToToken(id);
    if (t != nullptr && !added_by_id_.contains(id) && !FallbackByte(id).has_value()) anchor = *t;
  }
  const std::string anchor_text = anchor.has_value() ? DecodeTokenStrings({*anchor}) : "";
  for (int32_t id = 0; id < n; ++id) {
    const std::string* t = IdToToken(id);
    if (t == nullptr || IsSpecial(id)) continue;
    if (auto it = added_by_id_.find(id); it != added_by_id_.end()) {
      out[id] = added_[it->second].content;
    } else if (std::optional<uint8_t> b = FallbackByte(id); b.has_value()) {
      out[id] = std::string(1, static_cast<char>(*b));
    } else if (byte_level) {
      out[id] = ByteLevelAlphabet::Get().Decode(*t);
    } else if (anchor.has_value()) {
      std::string both = DecodeTokenStrings({*anchor, *t});
      if (absl::StartsWith(both, anchor_text)) out[id] = both.substr(anchor_text.size());
    } else {
      out[id] = *t;
    }
  }
  return out;
}

}  // namespace pdserve::tok
