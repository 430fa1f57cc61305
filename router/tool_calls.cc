#include "router/tool_calls.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "grammar/json_schema.h"
#include "nlohmann/json.hpp"

namespace pdserve::router {
namespace {

constexpr char kOpen[] = "<tool_call>";
constexpr char kClose[] = "</tool_call>";
constexpr size_t kOpenSize = sizeof(kOpen) - 1;
constexpr size_t kCloseSize = sizeof(kClose) - 1;

bool IsSpace(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

bool AllSpace(absl::string_view s) {
  for (char c : s) {
    if (!IsSpace(c)) return false;
  }
  return true;
}

bool IsNameChar(char c) { return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; }

// The longest end of `s` that begins `tag` (and is shorter than it).
size_t HeldBack(absl::string_view s, absl::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n) {
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

enum class Header { kMore, kNo, kYes };

// `{"name": "NAME", "arguments": ` (any whitespace), then at least one
// more byte; on kYes, `end` is where the arguments value begins.
Header MatchHeader(absl::string_view s, std::string* name, size_t* end) {
  size_t p = 0;
  auto ws = [&] {
    while (p < s.size() && IsSpace(s[p])) ++p;
  };
  auto lit = [&](absl::string_view l) {
    for (char c : l) {
      if (p >= s.size()) return Header::kMore;
      if (s[p] != c) return Header::kNo;
      ++p;
    }
    return Header::kYes;
  };
  for (absl::string_view part : {"{", "\"name\"", ":", "\""}) {
    ws();
    if (Header h = lit(part); h != Header::kYes) return h;
  }
  const size_t name_begin = p;
  while (p < s.size() && IsNameChar(s[p])) ++p;
  if (p >= s.size()) return Header::kMore;
  if (s[p] != '"' || p == name_begin || p - name_begin > 64) return Header::kNo;
  *name = std::string(s.substr(name_begin, p - name_begin));
  ++p;
  ws();
  if (Header h = lit(","); h != Header::kYes) return h;
  ws();
  const size_t key = p;
  if (Header h = lit("\"arguments\""); h != Header::kYes) {
    p = key;
    const Header h2 = lit("\"parameters\"");
    if (h2 != Header::kYes) return h == Header::kMore || h2 == Header::kMore ? Header::kMore : Header::kNo;
  }
  ws();
  if (Header h = lit(":"); h != Header::kYes) return h;
  ws();
  if (p >= s.size()) return Header::kMore;
  *end = p;
  return Header::kYes;
}

}  // namespace

bool ParsesToolCalls(const v1::GenerateRequest& request) {
  if (request.tools_size() == 0) return false;
  return !(request.tool_choice().choice_case() == v1::ToolChoice::kMode &&
           request.tool_choice().mode() == v1::ToolChoice::MODE_NONE);
}

ToolCallParser::ToolCallParser(std::string id_base, ToolSyntax syntax)
    : id_base_(std::move(id_base)), syntax_(syntax), mode_(syntax == ToolSyntax::kLlama31 ? Mode::kStart : Mode::kText) {}

bool ToolCallParser::WholeCall(Delta& d, const std::string& body) {
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || j.size() != 2 || !j.contains("name") || !j["name"].is_string()) return false;
  const char* key = j.contains("arguments") ? "arguments" : "parameters";
  if (!j.contains(key)) return false;
  const std::string name = j["name"].get<std::string>();
  if (!grammar::IsToolName(name)) return false;
  std::string args;
  if (j[key].is_object()) {
    args = j[key].dump();
  } else if (j[key].is_string()) {
    // Some models write the arguments as a JSON string holding them.
    const nlohmann::ordered_json inner =
        nlohmann::ordered_json::parse(j[key].get<std::string>(), nullptr, /*allow_exceptions=*/false);
    if (!inner.is_object()) return false;
    args = inner.dump();
  } else {
    return false;
  }
  Begin(d, name);
  Arguments(d, args);
  return true;
}

ToolCallParser::Delta ToolCallParser::Feed(absl::string_view text) {
  Delta d;
  pending_.append(text.data(), text.size());
  Run(d);
  return d;
}

void ToolCallParser::Content(Delta& d, absl::string_view text) {
  if (!after_call_) {
    d.content.append(text.data(), text.size());
    return;
  }
  // held_ws_ is whitespace alone until this text: only the new text is looked at.
  held_ws_.append(text.data(), text.size());
  if (!AllSpace(text)) {
    d.content += held_ws_;
    held_ws_.clear();
    after_call_ = false;
  }
}

void ToolCallParser::Begin(Delta& d, std::string name) {
  v1::ToolCall& call = calls_.emplace_back();
  call.set_id(absl::StrCat(id_base_, "_", calls_.size() - 1));
  call.set_name(name);
  CallPiece piece;
  piece.index = static_cast<int>(calls_.size()) - 1;
  piece.begins = true;
  piece.id = call.id();
  piece.name = std::move(name);
  d.calls.push_back(std::move(piece));
  held_ws_.clear();
  after_call_ = true;
}

void ToolCallParser::Arguments(Delta& d, absl::string_view text) {
  if (text.empty()) return;
  calls_.back().mutable_arguments()->append(text.data(), text.size());
  const int index = static_cast<int>(calls_.size()) - 1;
  if (!d.calls.empty() && d.calls.back().index == index) {
    d.calls.back().arguments.append(text.data(), text.size());
    return;
  }
  CallPiece piece;
  piece.index = index;
  piece.arguments = std::string(text);
  d.calls.push_back(std::move(piece));
}

void ToolCallParser::Run(Delta& d) {
  const bool llama = syntax_ == ToolSyntax::kLlama31;
  while (true) {
    switch (mode_) {
      case Mode::kStart: {
        // Llama 3.1: a call is the whole message, so its first byte tells.
        size_t first = 0;
        while (first < pending_.size() && IsSpace(pending_[first])) ++first;
        if (first == pending_.size()) return;
        if (pending_[first] == '{') {
          pending_.erase(0, first);
          call_text_.clear();
          mode_ = Mode::kHeader;
        } else {
          mode_ = Mode::kText;
        }
        break;
      }
      case Mode::kText: {
        if (llama) {
          Content(d, pending_);
          pending_.clear();
          return;
        }
        const size_t at = pending_.find(kOpen);
        if (at == std::string::npos) {
          const size_t hold = HeldBack(pending_, kOpen);
          Content(d, absl::string_view(pending_).substr(0, pending_.size() - hold));
          pending_.erase(0, pending_.size() - hold);
          return;
        }
        Content(d, absl::string_view(pending_).substr(0, at));
        pending_.erase(0, at + kOpenSize);
        call_text_.clear();
        mode_ = Mode::kHeader;
        break;
      }
      case Mode::kHeader: {
        call_text_ += pending_;
        pending_.clear();
        std::string name;
        size_t end = 0;
        const Header h = MatchHeader(call_text_, &name, &end);
        if (h == Header::kYes) {
          Begin(d, std::move(name));
          pending_ = call_text_.substr(end);
          call_text_.clear();
          depth_ = 0;
          in_string_ = escaped_ = started_ = false;
          mode_ = Mode::kArguments;
          break;
        }
        if (h == Header::kMore && (llama || call_text_.find(kClose) == std::string::npos)) return;
        mode_ = Mode::kWhole;
        break;
      }
      case Mode::kArguments: {
        size_t i = 0;
        bool done = false;
        for (; i < pending_.size() && !done; ++i) {
          const char c = pending_[i];
          if (in_string_) {
            if (escaped_) {
              escaped_ = false;
            } else if (c == '\\') {
              escaped_ = true;
            } else if (c == '"') {
              in_string_ = false;
              done = depth_ == 0;
            }
            continue;
          }
          if ((c == '}' || c == ']' || c == ',') && depth_ == 0) {
            // The call's own object goes on: a scalar value ended here.
            done = true;
            break;
          }
          started_ = true;
          if (c == '"') {
            in_string_ = true;
          } else if (c == '{' || c == '[') {
            ++depth_;
          } else if (c == '}' || c == ']') {
            done = --depth_ == 0;
          }
        }
        const size_t used = i;
        Arguments(d, absl::string_view(pending_).substr(0, used));
        pending_.erase(0, used);
        if (!done) return;
        mode_ = Mode::kAfterArguments;
        break;
      }
      case Mode::kAfterArguments: {
        call_text_ += pending_;
        pending_.clear();
        // The call's own closing brace (Llama), or its closing tag.
        const size_t at = llama ? call_text_.find('}') : call_text_.find(kClose);
        if (at == std::string::npos) return;
        pending_ = call_text_.substr(at + (llama ? 1 : kCloseSize));
        call_text_.clear();
        mode_ = Mode::kText;
        break;
      }
      case Mode::kWhole: {
        call_text_ += pending_;
        pending_.clear();
        if (llama) return;  // read at the end (Finish)
        const size_t at = call_text_.find(kClose);
        if (at == std::string::npos) return;
        const std::string body = call_text_.substr(0, at);
        pending_ = call_text_.substr(at + kCloseSize);
        call_text_.clear();
        mode_ = Mode::kText;
        if (!WholeCall(d, body)) Content(d, absl::StrCat(kOpen, body, kClose));
        break;
      }
    }
  }
}

ToolCallParser::Delta ToolCallParser::Finish() {
  Delta d;
  Run(d);
  const bool llama = syntax_ == ToolSyntax::kLlama31;
  switch (mode_) {
    case Mode::kStart:
    case Mode::kText:
      Content(d, pending_);
      break;
    case Mode::kHeader:
    case Mode::kWhole: {
      const std::string body = call_text_ + pending_;
      if (llama) {
        if (!WholeCall(d, body)) Content(d, body);
      } else {
        Content(d, absl::StrCat(kOpen, body));
      }
      break;
    }
    case Mode::kArguments:
    case Mode::kAfterArguments:
      break;
  }
  pending_.clear();
  call_text_.clear();
  held_ws_.clear();
  mode_ = llama ? Mode::kStart : Mode::kText;
  return d;
}

}  // namespace pdserve::router
