// Chat messages rendered exactly as a model's Jinja chat_template would,
// for the template families we recognise by their text (no general Jinja
// engine): ChatML (Qwen; with Qwen3's <think> handling and Qwen2.5's default
// system prompt when the template has them), Llama 3, Llama 2 [INST] with
// <<SYS>>, and Zephyr. An unknown template is refused with a clear error;
// an explicit family overrides the recognition.
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

struct ChatMessage {
  std::string role;  // "system", "user", "assistant" (ChatML also "tool").
  std::string content;
};

enum class ChatFamily { kChatML, kQwen3, kQwen25, kLlama3, kLlama2, kZephyr };

struct ChatFormat {
  ChatFamily family = ChatFamily::kChatML;
  // Llama 3 files exist whose template adds the assistant header whether or
  // not a generation prompt is asked for.
  bool always_generation_prompt = false;
};

// "chatml", "qwen3", "qwen2.5", "llama3", "llama2", "zephyr".
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

// Renders `messages`. Errors (INVALID_ARGUMENT, naming the message index and
// field): unknown roles, roles not alternating where the family requires it.
absl::StatusOr<RenderedChat> RenderChatWithContent(const ChatFormat& format,
                                                   absl::Span<const ChatMessage> messages,
                                                   bool add_generation_prompt, absl::string_view bos_token,
                                                   absl::string_view eos_token);
// The text alone (what the model's Jinja template would print).
absl::StatusOr<std::string> RenderChat(const ChatFormat& format,
                                       absl::Span<const ChatMessage> messages,
                                       bool add_generation_prompt, absl::string_view bos_token,
                                       absl::string_view eos_token);

// Parses [{"role": ..., "content": ...}, ...]; errors name the offending field.
absl::StatusOr<std::vector<ChatMessage>> ParseChatMessages(absl::string_view json_text);

}  // namespace pdserve::tok

#endif  // PDSERVE_TEXT_CHAT_TEMPLATE_H_
