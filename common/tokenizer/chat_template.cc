#include "common/tokenizer/chat_template.h"

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/tokenizer/unicode_util.h"
#include "nlohmann/json.hpp"

namespace pdserve::tok {
namespace {

// Python's str.isspace() (what Jinja's trim filter strips).
bool PyIsSpace(uint32_t c) {
  return (c >= 0x9 && c <= 0xd) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

// Jinja's `| trim` (Python str.strip()).
std::string Trim(absl::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e) {
    size_t i = b;
    if (!PyIsSpace(NextCodePoint(s, i))) break;
    b = i;
  }
  while (e > b) {
    const size_t start = PrevCharStart(s, e, b);
    size_t i = start;
    if (!PyIsSpace(NextCodePoint(s, i))) break;
    e = start;
  }
  return std::string(s.substr(b, e - b));
}

std::string StripChar(absl::string_view s, char c, bool left, bool right) {
  size_t b = 0, e = s.size();
  if (left) {
    while (b < e && s[b] == c) ++b;
  }
  if (right) {
    while (e > b && s[e - 1] == c) --e;
  }
  return std::string(s.substr(b, e - b));
}

absl::Status BadMessage(size_t i, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("messages[", i, "]: ", what));
}

constexpr char kQwen25System[] = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";

absl::StatusOr<std::string> RenderChatML(const ChatFormat& f, absl::Span<const ChatMessage> m,
                                         bool gen) {
  std::string out;
  auto block = [&](absl::string_view role, absl::string_view content) {
    absl::StrAppend(&out, "<|im_start|>", role, "\n", content, "<|im_end|>\n");
  };
  for (size_t i = 0; i < m.size(); ++i) {
    if (m[i].role != "system" && m[i].role != "user" && m[i].role != "assistant" &&
        m[i].role != "tool") {
      return BadMessage(i, absl::StrCat("unknown role '", m[i].role, "'"));
    }
  }
  if (f.family != ChatFamily::kQwen3) {
    if (f.family == ChatFamily::kQwen25 && (m.empty() || m[0].role != "system")) {
      block("system", kQwen25System);
    }
    for (size_t i = 0; i < m.size(); ++i) {
      if (m[i].role == "tool") {
        if (i == 0 || m[i - 1].role != "tool") out += "<|im_start|>user";
        absl::StrAppend(&out, "\n<tool_response>\n", m[i].content, "\n</tool_response>");
        if (i + 1 == m.size() || m[i + 1].role != "tool") out += "<|im_end|>\n";
      } else {
        block(m[i].role, m[i].content);
      }
    }
    if (gen) out += "<|im_start|>assistant\n";
    return out;
  }
  // Qwen3: reasoning shown only for assistant turns after the last user query.
  if (!m.empty() && m[0].role == "system") block("system", m[0].content);
  size_t last_query = m.empty() ? 0 : m.size() - 1;
  for (size_t k = m.size(); k-- > 0;) {
    const std::string& c = m[k].content;
    if (m[k].role == "user" &&
        !(absl::StartsWith(c, "<tool_response>") && absl::EndsWith(c, "</tool_response>"))) {
      last_query = k;
      break;
    }
  }
  for (size_t i = 0; i < m.size(); ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "user" || (msg.role == "system" && i != 0)) {
      block(msg.role, msg.content);
    } else if (msg.role == "assistant") {
      std::string content = msg.content;
      std::string reasoning;
      const size_t close = msg.content.rfind("</think>");
      if (close != std::string::npos) {
        content = StripChar(absl::string_view(msg.content).substr(close + 8), '\n', true, false);
        std::string before = StripChar(msg.content.substr(0, msg.content.find("</think>")), '\n', false, true);
        const size_t open = before.rfind("<think>");
        if (open != std::string::npos) before = before.substr(open + 7);
        reasoning = StripChar(before, '\n', true, false);
      }
      if (i > last_query && (i + 1 == m.size() || !reasoning.empty())) {
        absl::StrAppend(&out, "<|im_start|>assistant\n<think>\n", StripChar(reasoning, '\n', true, true),
                        "\n</think>\n\n", StripChar(content, '\n', true, false));
      } else {
        absl::StrAppend(&out, "<|im_start|>assistant\n", content);
      }
      out += "<|im_end|>\n";
    } else if (msg.role == "tool") {
      if (i == 0 || m[i - 1].role != "tool") out += "<|im_start|>user";
      absl::StrAppend(&out, "\n<tool_response>\n", msg.content, "\n</tool_response>");
      if (i + 1 == m.size() || m[i + 1].role != "tool") out += "<|im_end|>\n";
    }
  }
  if (gen) out += "<|im_start|>assistant\n";
  return out;
}

absl::StatusOr<std::string> RenderLlama3(const ChatFormat& f, absl::Span<const ChatMessage> m,
                                         bool gen, absl::string_view bos) {
  std::string out;
  for (size_t i = 0; i < m.size(); ++i) {
    if (i == 0) absl::StrAppend(&out, bos);
    absl::StrAppend(&out, "<|start_header_id|>", m[i].role, "<|end_header_id|>\n\n",
                    Trim(m[i].content), "<|eot_id|>");
  }
  if (gen || f.always_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
  return out;
}

absl::StatusOr<std::string> RenderLlama2(absl::Span<const ChatMessage> m, absl::string_view bos,
                                         absl::string_view eos) {
  std::string out;
  size_t start = 0;
  const std::string* system = nullptr;
  if (!m.empty() && m[0].role == "system") {
    system = &m[0].content;
    start = 1;
  }
  for (size_t i = start; i < m.size(); ++i) {
    const bool want_user = (i - start) % 2 == 0;
    if ((m[i].role == "user") != want_user) {
      return BadMessage(i, "conversation roles must alternate user/assistant/user/assistant/...");
    }
    if (m[i].role == "user") {
      std::string content = m[i].content;
      if (i == start && system != nullptr) {
        content = absl::StrCat("<<SYS>>\n", *system, "\n<</SYS>>\n\n", content);
      }
      absl::StrAppend(&out, bos, "[INST] ", Trim(content), " [/INST]");
    } else if (m[i].role == "assistant") {
      absl::StrAppend(&out, " ", Trim(m[i].content), " ", eos);
    }
  }
  return out;
}

absl::StatusOr<std::string> RenderZephyr(absl::Span<const ChatMessage> m, bool gen,
                                         absl::string_view eos) {
  std::string out;
  for (size_t i = 0; i < m.size(); ++i) {
    if (m[i].role != "system" && m[i].role != "user" && m[i].role != "assistant") {
      return BadMessage(i, absl::StrCat("unknown role '", m[i].role, "'"));
    }
    absl::StrAppend(&out, "<|", m[i].role, "|>\n", m[i].content, eos, "\n");
    if (i + 1 == m.size() && gen) out += "<|assistant|>\n";
  }
  return out;
}

}  // namespace

absl::StatusOr<ChatFamily> ParseChatFamily(absl::string_view name) {
  if (name == "chatml") return ChatFamily::kChatML;
  if (name == "qwen3") return ChatFamily::kQwen3;
  if (name == "qwen2.5") return ChatFamily::kQwen25;
  if (name == "llama3") return ChatFamily::kLlama3;
  if (name == "llama2") return ChatFamily::kLlama2;
  if (name == "zephyr") return ChatFamily::kZephyr;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown chat template family '", name, "' (chatml, qwen3, qwen2.5, llama3, llama2, zephyr)"));
}

absl::StatusOr<ChatFormat> DetectChatFormat(absl::string_view t) {
  ChatFormat f;
  const char* override_hint = "; pass an explicit family (chatml, qwen3, qwen2.5, llama3, llama2, zephyr)";
  if (t.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("the tokenizer has no chat_template", override_hint));
  }
  if (absl::StrContains(t, "<|im_start|>")) {
    if (absl::StrContains(t, "<think>")) {
      f.family = ChatFamily::kQwen3;
    } else if (absl::StrContains(t, kQwen25System)) {
      f.family = ChatFamily::kQwen25;
    } else {
      f.family = ChatFamily::kChatML;
    }
    return f;
  }
  if (absl::StrContains(t, "<|start_header_id|>")) {
    if (absl::StrContains(t, "Cutting Knowledge Date") || absl::StrContains(t, "tools")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unrecognised Llama 3 chat template variant (dates/tools)", override_hint));
    }
    f.family = ChatFamily::kLlama3;
    f.always_generation_prompt = !absl::StrContains(t, "add_generation_prompt");
    return f;
  }
  if (absl::StrContains(t, "[INST]") && absl::StrContains(t, "<<SYS>>")) {
    f.family = ChatFamily::kLlama2;
    return f;
  }
  if (absl::StrContains(t, "<|user|>") && absl::StrContains(t, "<|assistant|>")) {
    f.family = ChatFamily::kZephyr;
    return f;
  }
  return absl::InvalidArgumentError(absl::StrCat("unrecognised chat template", override_hint));
}

absl::StatusOr<std::string> RenderChat(const ChatFormat& format,
                                       absl::Span<const ChatMessage> messages,
                                       bool add_generation_prompt, absl::string_view bos_token,
                                       absl::string_view eos_token) {
  switch (format.family) {
    case ChatFamily::kChatML:
    case ChatFamily::kQwen3:
    case ChatFamily::kQwen25:
      return RenderChatML(format, messages, add_generation_prompt);
    case ChatFamily::kLlama3:
      return RenderLlama3(format, messages, add_generation_prompt, bos_token);
    case ChatFamily::kLlama2:
      return RenderLlama2(messages, bos_token, eos_token);
    case ChatFamily::kZephyr:
      return RenderZephyr(messages, add_generation_prompt, eos_token);
  }
  return absl::InternalError("unknown chat family");
}

absl::StatusOr<std::vector<ChatMessage>> ParseChatMessages(absl::string_view json_text) {
  const nlohmann::json j = nlohmann::json::parse(json_text.begin(), json_text.end(), nullptr, false);
  if (j.is_discarded()) return absl::InvalidArgumentError("messages: not valid JSON");
  if (!j.is_array()) return absl::InvalidArgumentError("messages: must be a JSON list");
  if (j.empty()) return absl::InvalidArgumentError("messages: the list is empty");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < j.size(); ++i) {
    const auto& m = j[i];
    if (!m.is_object()) return BadMessage(i, "must be an object");
    auto role = m.find("role");
    auto content = m.find("content");
    if (role == m.end() || !role->is_string()) return BadMessage(i, "'role' must be a string");
    if (content == m.end() || !content->is_string()) return BadMessage(i, "'content' must be a string");
    for (auto it = m.begin(); it != m.end(); ++it) {
      if (it.key() != "role" && it.key() != "content") {
        return BadMessage(i, absl::StrCat("unknown field '", it.key(), "'"));
      }
    }
    out.push_back({role->get<std::string>(), content->get<std::string>()});
    if (!IsValidUtf8(out.back().content)) {
      return BadMessage(i, "'content' is not valid UTF-8");
    }
  }
  return out;
}

}  // namespace pdserve::tok
