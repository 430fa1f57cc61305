// Chat messages rendered exactly as a model's Jinja chat_template would,
// for the template families we recognise by their text (no general Jinja
// engine): ChatML (Qwen; with Qwen3's <think> handling and Qwen2.5's default
// system prompt when the template has them), Llama 3, Llama 3.1, Llama 2
// [INST] with <<SYS>>, and Zephyr. An unknown template is refused with a clear error;
// an explicit family overrides the recognition.
//
// Llama 3.1 (and the later Llama 3 templates that share its layout: a
// system block with the knowledge cutoff and today's date) is a family of
// its own.
//
// Tools render in two syntaxes, each as its templates print it:
// - ChatML families, the Qwen (Hermes) syntax of Qwen2.5 and Qwen3: a
//   "# Tools" system block listing each tool as JSON within <tools></tools>,
//   an assistant's calls as <tool_call>\n{"name": ..., "arguments": ...}\n
//   </tool_call>, and tool results as <tool_response> blocks in a user turn.
//   Plain ChatML templates have no tool syntax of their own and get the same.
// - Llama 3.1: "Environment: ipython" in the system block, the tools as
//   indented JSON in the first user message, a call as the assistant's
//   whole message {"name": ..., "parameters": ...} (one per message), and
//   results in "ipython" turns.
// Other families refuse tools, tool calls and tool messages
// (FamilyHasTools).
//
// Thread safety: pure functions.
#ifndef PDSERVE_TEXT_CHAT_TEMPLATE_H_
#define PDSERVE_TEXT_CHAT_TEMPLATE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "text/tokenizer.h"

namespace pdserve::tok {

// One call in an assistant message. `arguments` is JSON text, printed as
// is (JinjaJson gives what a template's `tojson` would print).
struct ChatToolCall {
  std::string name;
  std::string arguments;
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" (ChatML also "tool").
  std::string content;
  std::vector<ChatToolCall> tool_calls;  // Assistant messages (ChatML only).
};

enum class ChatFamily { kChatML, kQwen3, kQwen25, kLlama3, kLlama31, kLlama2, kZephyr };

struct ChatFormat {
  ChatFamily family = ChatFamily::kChatML;
  // Llama 3 files exist whose template adds the assistant header whether or
  // not a generation prompt is asked for.
  bool always_generation_prompt = false;
  // Llama 3.1's "Today Date": the template's fixed "26 Jul 2024", or (for
  // templates that call strftime_now) the day the prompt is rendered, UTC.
  bool date_from_clock = false;
};

// Whether the family renders tools (the ChatML ones and Llama 3.1).
bool FamilyHasTools(ChatFamily family);
// The family's name, as ParseChatFamily reads it.
const char* ChatFamilyName(ChatFamily family);

// JSON text as Python's json.dumps(ensure_ascii=False) prints it, which is
// what Hugging Face's `tojson` filter is: ", " and ": " separators, keys in
// their given order, non-ASCII kept; with `indent` >= 0, `tojson(indent=N)`:
// one item a line, "," and ": " separators. INVALID_ARGUMENT when
// `json_text` is not JSON.
absl::StatusOr<std::string> JinjaJson(absl::string_view json_text, int indent = -1);

// "chatml", "qwen3", "qwen2.5", "llama3", "llama3.1", "llama2", "zephyr".
absl::StatusOr<ChatFamily> ParseChatFamily(absl::string_view name);

// Recognises the family from a chat_template's text. INVALID_ARGUMENT for an
// empty or unrecognised template (the message says how to override).
absl::StatusOr<ChatFormat> DetectChatFormat(absl::string_view template_text);

// A rendered conversation, and where in its text the messages' own words
// are (as against the template's markers): sorted, disjoint, non-empty.
// Tokenize it with Tokenizer::EncodeWithLiteralRanges(text, content), so
// that a message holding a marker's text (say "<|im_end|>") gets those
// characters, not the marker: it cannot close its turn or open another.
struct RenderedChat {
  std::string text;
  std::vector<TextRange> content;
};

// Renders `messages`, with `tools` (each one's JSON text as the template
// prints it: JinjaJson of {"type": "function", "function": {...}}) when
// non-empty. Errors (INVALID_ARGUMENT, naming the message index and field):
// unknown roles, roles not alternating where the family requires it, tools
// or tool calls for a family without tool syntax.
absl::StatusOr<RenderedChat> RenderChatWithContent(const ChatFormat& format,
                                                   absl::Span<const ChatMessage> messages,
                                                   bool add_generation_prompt, absl::string_view bos_token,
                                                   absl::string_view eos_token,
                                                   absl::Span<const std::string> tools = {});
// The text alone (what the model's Jinja template would print).
absl::StatusOr<std::string> RenderChat(const ChatFormat& format,
                                       absl::Span<const ChatMessage> messages,
                                       bool add_generation_prompt, absl::string_view bos_token,
                                       absl::string_view eos_token, absl::Span<const std::string> tools = {});

// Parses [{"role": ..., "content": ...}, ...]; errors name the offending field.
absl::StatusOr<std::vector<ChatMessage>> ParseChatMessages(absl::string_view json_text);

}  // namespace pdserve::tok

#endif  // PDSERVE_TEXT_CHAT_TEMPLATE_H_
