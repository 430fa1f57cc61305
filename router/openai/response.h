// pdserve's messages (GenerateResponse chunks and final) in the OpenAI
// API's shapes: streamed chunks as server-sent events, whole responses,
// usage, logprobs and errors. Pure formatting: the HTTP layer calls these
// in the order the relay emits.
//
// Shapes follow OpenAI's API reference: completions (object
// "text_completion", choices[].text, logprobs as tokens / token_logprobs /
// top_logprobs / text_offset) and chat completions (object
// "chat.completion" / "chat.completion.chunk", choices[].message or .delta,
// logprobs.content[] with token, logprob, bytes and top_logprobs). A
// token's text shows invalid UTF-8 (a token that is part of a character) as
// U+FFFD; its raw bytes are in "bytes". pdserve's seed and timings go in an
// extra "pdserve" object that standard clients ignore. A chat with tools
// returns the calls its output makes as message.tool_calls (streamed as
// delta.tool_calls: id, type and name first, then the arguments in
// pieces) with finish_reason "tool_calls".
//
// Thread safety: a ResponseWriter belongs to one request.
#ifndef PDSERVE_ROUTER_OPENAI_RESPONSE_H_
#define PDSERVE_ROUTER_OPENAI_RESPONSE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "text/tokenizer.h"
#include "pdserve/v1/generation.pb.h"
#include "router/openai/request.h"
#include "router/tool_calls.h"

namespace pdserve::router::openai {

// `bytes` as UTF-8 text, each invalid sequence replaced by U+FFFD.
std::string ReplaceInvalidUtf8(std::string_view bytes);

// The raw bytes token `id` stands for (its piece of the decoded text).
std::string TokenBytes(const tok::Tokenizer& tokenizer, int32_t id);

class ResponseWriter {
 public:
  // `id`: the response id ("cmpl-..." / "chatcmpl-..."); `created`: Unix
  // seconds; `model`: the served model's name. `tokenizer` outlives it.
  // `tool_syntax`: how the model's template writes tool calls.
  ResponseWriter(const OpenAiRequest& request, std::string id, int64_t created, std::string model,
                 const tok::Tokenizer* tokenizer, ToolSyntax tool_syntax = ToolSyntax::kQwen);

  // Streaming: the events for one chunk ("data: {...}\n\n"; the first chat
  // chunk is preceded by one announcing the assistant role).
  std::string ChunkEvents(const v1::TokenChunk& chunk);
  // Streaming: the end: a chunk with the finish reason (or an error
  // event), usage when asked for, then "data: [DONE]".
  std::string FinalEvents(const v1::GenerateFinal& final);

  // Not streaming: collects chunks, then the whole JSON body.
  void Add(const v1::TokenChunk& chunk);
  std::string Body(const v1::GenerateFinal& final);

 private:
  // One token's logprob entry, as both endpoints need it.
  struct Alternative {
    std::string bytes;
    float logprob = 0;
  };
  struct Entry {
    std::string bytes;  // the token's raw bytes
    float logprob = 0;
    std::vector<Alternative> top;
    int64_t text_offset = 0;  // completions: where its text starts
  };
  std::vector<Entry> Entries(const v1::TokenChunk& chunk);
  // The chunk JSON around `choice` (usage null when the client asked for
  // usage: every chunk but the last carries the field).
  std::string Chunk(const std::string& choice_json) const;
  // The OpenAI finish_reason ("tool_calls" when the output ended with
  // calls), or nullptr for a failed or cancelled request.
  const char* Finish(const v1::GenerateFinal& final) const;

  const Endpoint endpoint_;
  const bool logprobs_;
  const int32_t top_logprobs_;
  const bool include_usage_;
  const std::string id_;
  const int64_t created_;
  const std::string model_;
  const tok::Tokenizer* const tokenizer_;
  // Every chunk's fields before "choices" ("data: {...,"), made once: the
  // chunk is spliced per streamed message, not built and dumped again.
  std::string chunk_head_;
  bool role_sent_ = false;
  int64_t text_bytes_ = 0;  // completions' text_offset runs over the whole text
  std::string text_;        // not streaming: everything so far
  std::vector<Entry> entries_;
  // Chat with tools (and tool_choice not "none"): the output read for
  // calls (router/tool_calls.h), streamed as OpenAI streams them.
  std::optional<ToolCallParser> tools_;
};

// {"error": {"message", "type", "param", "code"}} for `status`, and the
// HTTP status it maps to: INVALID_ARGUMENT 400 (404 for an unknown model),
// UNAUTHENTICATED 401, RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, CANCELLED
// 499, others 500.
struct HttpError {
  int status = 500;
  std::string body;
  // 429's Retry-After: the status's kRetryAfterPayload rounded up, else 1.
  int64_t retry_after_seconds = 1;
};
HttpError ErrorFor(const absl::Status& status);
// The headers an error reply carries besides its body: Retry-After for 429.
std::vector<std::pair<std::string, std::string>> ErrorHeaders(const HttpError& e);

}  // namespace pdserve::router::openai

#endif  // PDSERVE_ROUTER_OPENAI_RESPONSE_H_
