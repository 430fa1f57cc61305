#include "text/chat_template.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "text/unicode_util.h"
#include "nlohmann/json.hpp"

namespace pdserve::tok {
namespace {

// Python's str.isspace() (what Jinja's trim filter strips).
bool PyIsSpace(uint32_t c) {
  return (c >= 0x9 && c <= 0xd) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

// The [begin, end) that Jinja's `| trim` (Python str.strip()) keeps of `s`.
std::pair<size_t, size_t> TrimBounds(absl::string_view s) {
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
  return {b, e};
}

std::string Trim(absl::string_view s) {
  const auto [b, e] = TrimBounds(s);
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

// The rendered text as it is built, with the ranges that came from the
// messages (RenderedChat::content).
class ChatText {
 public:
  void Marker(absl::string_view s) { out_.text.append(s.data(), s.size()); }
  void Content(absl::string_view s) {
    if (s.empty()) return;
    out_.content.push_back({out_.text.size(), out_.text.size() + s.size()});
    out_.text.append(s.data(), s.size());
  }
  void Append(const ChatText& other) {
    const size_t shift = out_.text.size();
    for (const TextRange& r : other.out_.content) out_.content.push_back({r.begin + shift, r.end + shift});
    out_.text += other.out_.text;
  }
  // Jinja's `| trim` over everything so far; the ranges follow the text.
  void Trim() {
    const auto [b, e] = TrimBounds(out_.text);
    std::vector<TextRange> kept;
    for (const TextRange& r : out_.content) {
      const size_t rb = std::max(r.begin, b), re = std::min(r.end, e);
      if (rb < re) kept.push_back({rb - b, re - b});
    }
    out_.content = std::move(kept);
    out_.text = out_.text.substr(b, e - b);
  }
  RenderedChat Take() { return std::move(out_); }

 private:
  RenderedChat out_;
};

absl::Status BadMessage(size_t i, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("messages[", i, "]: ", what));
}

absl::Status CheckRoles(absl::Span<const ChatMessage> m, bool tool) {
  for (size_t i = 0; i < m.size(); ++i) {
    const std::string& r = m[i].role;
    if (r != "system" && r != "user" && r != "assistant" && !(tool && r == "tool")) {
      return BadMessage(i, absl::StrCat("unknown role '", r, "'"));
    }
  }
  return absl::OkStatus();
}

constexpr char kQwen25System[] = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
constexpr char kToolsHead[] =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
constexpr char kToolsTail[] =
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n";

// Python's json.dumps(v, ensure_ascii=False, indent=indent): indent < 0 is
// one line with ", " between items, else an item a line with ",".
void PyJson(const nlohmann::ordered_json& v, int indent, int level, std::string& out) {
  const bool container = v.is_object() || v.is_array();
  if (!container || v.empty()) {
    out += container ? (v.is_object() ? "{}" : "[]") : v.dump();
    return;
  }
  const std::string inner = indent < 0 ? "" : "\n" + std::string(static_cast<size_t>(indent) * (level + 1), ' ');
  const std::string outer = indent < 0 ? "" : "\n" + std::string(static_cast<size_t>(indent) * level, ' ');
  const char* between = indent < 0 ? ", " : ",";
  out += v.is_object() ? '{' : '[';
  bool first = true;
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (!first) out += between;
    first = false;
    out += inner;
    if (v.is_object()) {
      out += nlohmann::ordered_json(it.key()).dump();
      out += ": ";
    }
    PyJson(it.value(), indent, level + 1, out);
  }
  out += outer;
  out += v.is_object() ? '}' : ']';
}

absl::StatusOr<RenderedChat> RenderChatML(const ChatFormat& f, absl::Span<const ChatMessage> m, bool gen,
                                          absl::Span<const std::string> tools) {
  ChatText out;
  // An assistant's calls, after its content (a newline between them).
  auto calls = [&](const ChatMessage& msg, bool had_content) {
    for (size_t k = 0; k < msg.tool_calls.size(); ++k) {
      if (k > 0 || had_content) out.Marker("\n");
      out.Marker("<tool_call>\n{\"name\": \"");
      out.Content(msg.tool_calls[k].name);
      out.Marker("\", \"arguments\": ");
      out.Content(msg.tool_calls[k].arguments);
      out.Marker("}\n</tool_call>");
    }
  };
  const bool first_system = !m.empty() && m[0].role == "system";
  if (!tools.empty()) {
    // The tools go into the system turn, after the client's system message.
    out.Marker("<|im_start|>system\n");
    if (first_system) {
      out.Content(m[0].content);
      out.Marker("\n\n");
    } else if (f.family == ChatFamily::kQwen25) {
      out.Marker(absl::StrCat(kQwen25System, "\n\n"));
    }
    out.Marker(kToolsHead);
    for (const std::string& t : tools) {
      out.Marker("\n");
      out.Content(t);
    }
    out.Marker(kToolsTail);
  }
  auto block = [&](absl::string_view role, absl::string_view content) {
    out.Marker(absl::StrCat("<|im_start|>", role, "\n"));
    out.Content(content);
    out.Marker("<|im_end|>\n");
  };
  auto tool_response = [&](size_t i) {
    if (i == 0 || m[i - 1].role != "tool") out.Marker("<|im_start|>user");
    out.Marker("\n<tool_response>\n");
    out.Content(m[i].content);
    out.Marker("\n</tool_response>");
    if (i + 1 == m.size() || m[i + 1].role != "tool") out.Marker("<|im_end|>\n");
  };
  if (absl::Status st = CheckRoles(m, /*tool=*/true); !st.ok()) return st;
  if (f.family != ChatFamily::kQwen3) {
    if (tools.empty() && f.family == ChatFamily::kQwen25 && !first_system) {
      out.Marker(absl::StrCat("<|im_start|>system\n", kQwen25System, "<|im_end|>\n"));
    }
    for (size_t i = 0; i < m.size(); ++i) {
      if (i == 0 && first_system && !tools.empty()) continue;  // in the tools' system turn
      if (m[i].role == "tool") {
        tool_response(i);
      } else if (m[i].role == "assistant" && !m[i].tool_calls.empty()) {
        out.Marker("<|im_start|>assistant\n");
        out.Content(m[i].content);
        calls(m[i], !m[i].content.empty());
        out.Marker("<|im_end|>\n");
      } else {
        block(m[i].role, m[i].content);
      }
    }
    if (gen) out.Marker("<|im_start|>assistant\n");
    return out.Take();
  }
  // Qwen3: reasoning shown only for assistant turns after the last user query.
  if (first_system && tools.empty()) block("system", m[0].content);
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
        out.Marker("<|im_start|>assistant\n<think>\n");
        out.Content(StripChar(reasoning, '\n', true, true));
        out.Marker("\n</think>\n\n");
        out.Content(StripChar(content, '\n', true, false));
      } else {
        out.Marker("<|im_start|>assistant\n");
        out.Content(content);
      }
      calls(msg, !content.empty());
      out.Marker("<|im_end|>\n");
    } else if (msg.role == "tool") {
      tool_response(i);
    }
  }
  if (gen) out.Marker("<|im_start|>assistant\n");
  return out.Take();
}

absl::StatusOr<RenderedChat> RenderLlama3(const ChatFormat& f, absl::Span<const ChatMessage> m, bool gen,
                                          absl::string_view bos) {
  // The role goes between the header markers: anything but a known name
  // there would let a client write its own markers.
  if (absl::Status st = CheckRoles(m, /*tool=*/false); !st.ok()) return st;
  ChatText out;
  for (size_t i = 0; i < m.size(); ++i) {
    if (i == 0) out.Marker(bos);
    out.Marker(absl::StrCat("<|start_header_id|>", m[i].role, "<|end_header_id|>\n\n"));
    out.Content(Trim(m[i].content));
    out.Marker("<|eot_id|>");
  }
  if (gen || f.always_generation_prompt) out.Marker("<|start_header_id|>assistant<|end_header_id|>\n\n");
  return out.Take();
}

constexpr char kLlamaToolsHead[] =
    "Given the following functions, please respond with a JSON for a function call with its proper arguments "
    "that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": "
    "dictionary of argument name and its value}.Do not use variables.\n\n";

absl::StatusOr<RenderedChat> RenderLlama31(const ChatFormat& f, absl::Span<const ChatMessage> m, bool gen,
                                           absl::string_view bos, absl::Span<const std::string> tools) {
  if (absl::Status st = CheckRoles(m, /*tool=*/true); !st.ok()) return st;
  ChatText out;
  out.Marker(bos);
  size_t next = 0;
  std::string system;
  if (!m.empty() && m[0].role == "system") {
    system = Trim(m[0].content);
    next = 1;
  }
  out.Marker("<|start_header_id|>system<|end_header_id|>\n\n");
  if (!tools.empty()) out.Marker("Environment: ipython\n");
  const std::string date = f.date_from_clock ? absl::FormatTime("%d %b %Y", absl::Now(), absl::UTCTimeZone())
                                             : std::string("26 Jul 2024");
  out.Marker(absl::StrCat("Cutting Knowledge Date: December 2023\nToday Date: ", date, "\n\n"));
  out.Content(system);
  out.Marker("<|eot_id|>");
  if (!tools.empty()) {
    // The tools go into the first message after the system one, whatever
    // its role, as the template puts them.
    if (next >= m.size()) return BadMessage(next, "the llama3.1 chat template puts the tools in a first user message");
    out.Marker(absl::StrCat("<|start_header_id|>user<|end_header_id|>\n\n", kLlamaToolsHead));
    for (const std::string& t : tools) {
      absl::StatusOr<std::string> pretty = JinjaJson(t, 4);
      if (!pretty.ok()) return absl::InvalidArgumentError(absl::StrCat("tools: ", pretty.status().message()));
      out.Content(*pretty);
      out.Marker("\n\n");
    }
    out.Content(Trim(m[next].content));
    out.Marker("<|eot_id|>");
    ++next;
  }
  for (size_t i = next; i < m.size(); ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "tool") {
      // The template prints a result with tojson (a string is iterable to
      // Jinja), so it arrives quoted.
      out.Marker("<|start_header_id|>ipython<|end_header_id|>\n\n");
      out.Content(nlohmann::ordered_json(msg.content).dump());
      out.Marker("<|eot_id|>");
    } else if (!msg.tool_calls.empty()) {
      if (msg.tool_calls.size() != 1) {
        return BadMessage(i, "tool_calls: the llama3.1 chat template takes one call per message");
      }
      out.Marker("<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"");
      out.Content(msg.tool_calls[0].name);
      out.Marker("\", \"parameters\": ");
      out.Content(msg.tool_calls[0].arguments);
      out.Marker("}<|eot_id|>");
    } else {
      out.Marker(absl::StrCat("<|start_header_id|>", msg.role, "<|end_header_id|>\n\n"));
      out.Content(Trim(msg.content));
      out.Marker("<|eot_id|>");
    }
  }
  if (gen) out.Marker("<|start_header_id|>assistant<|end_header_id|>\n\n");
  return out.Take();
}

absl::StatusOr<RenderedChat> RenderLlama2(absl::Span<const ChatMessage> m, absl::string_view bos,
                                          absl::string_view eos) {
  if (absl::Status st = CheckRoles(m, /*tool=*/false); !st.ok()) return st;
  ChatText out;
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
      ChatText turn;
      if (i == start && system != nullptr) {
        turn.Marker("<<SYS>>\n");
        turn.Content(*system);
        turn.Marker("\n<</SYS>>\n\n");
      }
      turn.Content(m[i].content);
      turn.Trim();
      out.Marker(absl::StrCat(bos, "[INST] "));
      out.Append(turn);
      out.Marker(" [/INST]");
    } else if (m[i].role == "assistant") {
      out.Marker(" ");
      out.Content(Trim(m[i].content));
      out.Marker(absl::StrCat(" ", eos));
    }
  }
  return out.Take();
}

absl::StatusOr<RenderedChat> RenderZephyr(absl::Span<const ChatMessage> m, bool gen, absl::string_view eos) {
  if (absl::Status st = CheckRoles(m, /*tool=*/false); !st.ok()) return st;
  ChatText out;
  for (size_t i = 0; i < m.size(); ++i) {
    out.Marker(absl::StrCat("<|", m[i].role, "|>\n"));
    out.Content(m[i].content);
    out.Marker(absl::StrCat(eos, "\n"));
    if (i + 1 == m.size() && gen) out.Marker("<|assistant|>\n");
  }
  return out.Take();
}

}  // namespace

bool FamilyHasTools(ChatFamily family) {
  return family == ChatFamily::kChatML || family == ChatFamily::kQwen3 || family == ChatFamily::kQwen25 ||
         family == ChatFamily::kLlama31;
}

const char* ChatFamilyName(ChatFamily family) {
  switch (family) {
    case ChatFamily::kChatML:
      return "chatml";
    case ChatFamily::kQwen3:
      return "qwen3";
    case ChatFamily::kQwen25:
      return "qwen2.5";
    case ChatFamily::kLlama3:
      return "llama3";
    case ChatFamily::kLlama31:
      return "llama3.1";
    case ChatFamily::kLlama2:
      return "llama2";
    case ChatFamily::kZephyr:
      return "zephyr";
  }
  return "unknown";
}

absl::StatusOr<std::string> JinjaJson(absl::string_view json_text, int indent) {
  const nlohmann::ordered_json v =
      nlohmann::ordered_json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded()) return absl::InvalidArgumentError("not valid JSON");
  std::string out;
  PyJson(v, indent, 0, out);
  return out;
}

absl::StatusOr<ChatFamily> ParseChatFamily(absl::string_view name) {
  if (name == "chatml") return ChatFamily::kChatML;
  if (name == "qwen3") return ChatFamily::kQwen3;
  if (name == "qwen2.5") return ChatFamily::kQwen25;
  if (name == "llama3") return ChatFamily::kLlama3;
  if (name == "llama3.1") return ChatFamily::kLlama31;
  if (name == "llama2") return ChatFamily::kLlama2;
  if (name == "zephyr") return ChatFamily::kZephyr;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown chat template family '", name, "' (chatml, qwen3, qwen2.5, llama3, llama3.1, llama2, zephyr)"));
}

absl::StatusOr<ChatFormat> DetectChatFormat(absl::string_view t) {
  ChatFormat f;
  const char* override_hint = "; pass an explicit family (chatml, qwen3, qwen2.5, llama3, llama3.1, llama2, zephyr)";
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
    if (absl::StrContains(t, "Cutting Knowledge Date") && absl::StrContains(t, "tools_in_user_message") &&
        absl::StrContains(t, "\"parameters\": ")) {
      f.family = ChatFamily::kLlama31;
      f.date_from_clock = absl::StrContains(t, "strftime_now");
      return f;
    }
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

absl::StatusOr<RenderedChat> RenderChatWithContent(const ChatFormat& format,
                                                   absl::Span<const ChatMessage> messages,
                                                   bool add_generation_prompt, absl::string_view bos_token,
                                                   absl::string_view eos_token, absl::Span<const std::string> tools) {
  if (!FamilyHasTools(format.family)) {
    const char* why = " has no tool syntax that pdserve renders (the ChatML, Qwen and Llama 3.1 templates do)";
    if (!tools.empty()) return absl::InvalidArgumentError(absl::StrCat("tools: the ", ChatFamilyName(format.family),
                                                                        " chat template", why));
    for (size_t i = 0; i < messages.size(); ++i) {
      if (!messages[i].tool_calls.empty()) {
        return BadMessage(i, absl::StrCat("tool_calls: the ", ChatFamilyName(format.family), " chat template", why));
      }
    }
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    if (!messages[i].tool_calls.empty() && messages[i].role != "assistant") {
      return BadMessage(i, "tool_calls: only an assistant message holds tool calls");
    }
  }
  switch (format.family) {
    case ChatFamily::kChatML:
    case ChatFamily::kQwen3:
    case ChatFamily::kQwen25:
      return RenderChatML(format, messages, add_generation_prompt, tools);
    case ChatFamily::kLlama3:
      return RenderLlama3(format, messages, add_generation_prompt, bos_token);
    case ChatFamily::kLlama31:
      return RenderLlama31(format, messages, add_generation_prompt, bos_token, tools);
    case ChatFamily::kLlama2:
      return RenderLlama2(messages, bos_token, eos_token);
    case ChatFamily::kZephyr:
      return RenderZephyr(messages, add_generation_prompt, eos_token);
  }
  return absl::InternalError("unknown chat family");
}

absl::StatusOr<std::string> RenderChat(const ChatFormat& format,
                                       absl::Span<const ChatMessage> messages,
                                       bool add_generation_prompt, absl::string_view bos_token,
                                       absl::string_view eos_token, absl::Span<const std::string> tools) {
  absl::StatusOr<RenderedChat> r =
      RenderChatWithContent(format, messages, add_generation_prompt, bos_token, eos_token, tools);
  if (!r.ok()) return r.status();
  return std::move(r->text);
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
