#include "router/openai/response.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "router/api_keys.h"
#include "router/openai/request.h"
#include "utf8proc.h"

namespace pdserve::router::openai {
namespace {

using json = nlohmann::json;

std::string Dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

const char* FinishName(v1::FinishReason f) {
  switch (f) {
    case v1::FINISH_REASON_STOP: return "stop";
    case v1::FINISH_REASON_LENGTH: return "length";
    case v1::FINISH_REASON_TOOL_CALLS: return "tool_calls";
    default: return nullptr;
  }
}

json Bytes(std::string_view b) {
  json a = json::array();
  for (const char c : b) a.push_back(static_cast<int>(static_cast<unsigned char>(c)));
  return a;
}

json Usage(const v1::GenerateFinal& f) {
  const int64_t prompt = f.usage().prompt_tokens(), completion = f.usage().completion_tokens();
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", f.timings().cached_prompt_tokens()}}}};
}

json Extra(const v1::GenerateFinal& f) {
  const v1::Timings& t = f.timings();
  return {{"seed", f.seed()},
          {"timings",
           {{"ttft_s", t.ttft()}, {"router_queue_s", t.router_queue()}, {"queue_s", t.queue()},
            {"prefill_s", t.prefill()}, {"handoff_s", t.handoff()}, {"first_gap_s", t.first_gap()}, {"mean_itl_s", t.mean_itl()}, {"max_itl_s", t.max_itl()}, {"total_s", t.total()},
            {"colocated", t.colocated()}, {"local_prefill", t.local_prefill()},
            {"router_relay_p50_s", t.router_relay_p50()}, {"router_relay_p99_s", t.router_relay_p99()}}}};
}

json ErrorJson(std::string_view message, std::string_view type, std::string_view param, std::string_view code) {
  json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return {{"error", e}};
}

}  // namespace

std::string ReplaceInvalidUtf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    utf8proc_int32_t cp = 0;
    const utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(bytes.data() + i),
                                                static_cast<utf8proc_ssize_t>(bytes.size() - i), &cp);
    if (n > 0) {
      out.append(bytes.substr(i, static_cast<size_t>(n)));
      i += static_cast<size_t>(n);
    } else {
      out += "\xEF\xBF\xBD";  // U+FFFD, one per invalid byte
      ++i;
    }
  }
  return out;
}

std::string TokenBytes(const tok::Tokenizer& tokenizer, int32_t id) {
  if (const std::optional<uint8_t> b = tokenizer.FallbackByte(id); b.has_value()) {
    return std::string(1, static_cast<char>(*b));
  }
  absl::StatusOr<std::string> s = tokenizer.Decode({&id, 1});
  return s.ok() ? *std::move(s) : std::string();
}

ResponseWriter::ResponseWriter(const OpenAiRequest& request, std::string id, int64_t created, std::string model,
                               const tok::Tokenizer* tokenizer, ToolSyntax tool_syntax)
    : endpoint_(request.endpoint),
      logprobs_(request.logprobs),
      top_logprobs_(request.top_logprobs),
      include_usage_(request.include_usage),
      id_(std::move(id)),
      created_(created),
      model_(std::move(model)),
      tokenizer_(tokenizer) {
  if (endpoint_ == Endpoint::kChatCompletions && ParsesToolCalls(request.generate)) {
    // Call ids follow the response's: "chatcmpl-X" makes "call_X_0", ...
    const size_t dash = id_.find('-');
    tools_.emplace(absl::StrCat("call_", dash == std::string::npos ? id_ : id_.substr(dash + 1)), tool_syntax);
  }
  json head = {{"id", id_},
               {"object", endpoint_ == Endpoint::kChatCompletions ? "chat.completion.chunk" : "text_completion"},
               {"created", created_},
               {"model", model_}};
  if (include_usage_) head["usage"] = nullptr;
  chunk_head_ = Dump(head);
  chunk_head_.pop_back();  // the closing brace
  chunk_head_ = absl::StrCat("data: ", chunk_head_, ",\"choices\":[");
}

std::vector<ResponseWriter::Entry> ResponseWriter::Entries(const v1::TokenChunk& chunk) {
  std::vector<Entry> out;
  if (!logprobs_) return out;
  for (const v1::TokenLogprob& lp : chunk.logprobs()) {
    Entry e;
    e.bytes = TokenBytes(*tokenizer_, lp.token_id());
    e.logprob = lp.logprob();
    for (int i = 0; i < lp.top_size() && i < top_logprobs_; ++i) {
      e.top.push_back({TokenBytes(*tokenizer_, lp.top(i).token_id()), lp.top(i).logprob()});
    }
    e.text_offset = text_bytes_;
    text_bytes_ += static_cast<int64_t>(e.bytes.size());
    out.push_back(std::move(e));
  }
  return out;
}

namespace {

// The logprobs object of a choice holding `entries`.
json LogprobsJson(Endpoint endpoint, const auto& entries) {
  if (endpoint == Endpoint::kChatCompletions) {
    json content = json::array();
    for (const auto& e : entries) {
      json top = json::array();
      for (const auto& a : e.top) {
        top.push_back({{"token", ReplaceInvalidUtf8(a.bytes)}, {"logprob", a.logprob}, {"bytes", Bytes(a.bytes)}});
      }
      content.push_back({{"token", ReplaceInvalidUtf8(e.bytes)}, {"logprob", e.logprob}, {"bytes", Bytes(e.bytes)},
                         {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top_logprobs = json::array(),
       offsets = json::array();
  for (const auto& e : entries) {
    tokens.push_back(ReplaceInvalidUtf8(e.bytes));
    token_logprobs.push_back(e.logprob);
    json top = json::object();
    for (const auto& a : e.top) top[ReplaceInvalidUtf8(a.bytes)] = a.logprob;
    top_logprobs.push_back(top);
    offsets.push_back(e.text_offset);
  }
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top_logprobs},
          {"text_offset", offsets}};
}

}  // namespace

namespace {

// A stream delta's tool_calls: a call begun carries its id, type and name.
json CallPiecesJson(const std::vector<ToolCallParser::CallPiece>& pieces) {
  json out = json::array();
  for (const ToolCallParser::CallPiece& p : pieces) {
    if (p.begins) {
      out.push_back({{"index", p.index},
                     {"id", p.id},
                     {"type", "function"},
                     {"function", {{"name", p.name}, {"arguments", p.arguments}}}});
    } else {
      out.push_back({{"index", p.index}, {"function", {{"arguments", p.arguments}}}});
    }
  }
  return out;
}

}  // namespace

const char* ResponseWriter::Finish(const v1::GenerateFinal& final) const {
  // A stop after calls is the calls' end; a length cut is still a length.
  if (tools_.has_value() && !tools_->calls().empty() && final.finish_reason() == v1::FINISH_REASON_STOP) {
    return "tool_calls";
  }
  return FinishName(final.finish_reason());
}

std::string ResponseWriter::Chunk(const std::string& choice_json) const {
  return absl::StrCat(chunk_head_, choice_json, "]}\n\n");
}

std::string ResponseWriter::ChunkEvents(const v1::TokenChunk& chunk) {
  std::string out;
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  if (chat && !role_sent_) {
    role_sent_ = true;
    out += Chunk(Dump({{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}, {"logprobs", nullptr},
                       {"finish_reason", nullptr}}));
  }
  const std::vector<Entry> entries = Entries(chunk);
  json choice = {{"index", 0}, {"finish_reason", nullptr},
                 {"logprobs", logprobs_ ? LogprobsJson(endpoint_, entries) : json(nullptr)}};
  if (chat && tools_.has_value()) {
    const ToolCallParser::Delta d = tools_->Feed(chunk.text());
    if (d.empty() && entries.empty()) return out;  // all held back, nothing to say yet
    choice["delta"] = json::object();
    if (!d.content.empty() || d.calls.empty()) choice["delta"]["content"] = d.content;
    if (!d.calls.empty()) choice["delta"]["tool_calls"] = CallPiecesJson(d.calls);
  } else if (chat) {
    choice["delta"] = {{"content", chunk.text()}};
  } else {
    choice["text"] = chunk.text();
  }
  return out + Chunk(Dump(choice));
}

std::string ResponseWriter::FinalEvents(const v1::GenerateFinal& final) {
  std::string out;
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  if (tools_.has_value() && final.finish_reason() != v1::FINISH_REASON_ERROR &&
      final.finish_reason() != v1::FINISH_REASON_CANCELLED) {
    if (chat && !role_sent_) out += ChunkEvents(v1::TokenChunk());
    const ToolCallParser::Delta d = tools_->Finish();
    if (!d.empty()) {
      json delta = json::object();
      if (!d.content.empty()) delta["content"] = d.content;
      if (!d.calls.empty()) delta["tool_calls"] = CallPiecesJson(d.calls);
      out += Chunk(Dump({{"index", 0}, {"delta", delta}, {"logprobs", nullptr}, {"finish_reason", nullptr}}));
    }
  }
  const char* finish = Finish(final);
  if (finish == nullptr) {
    // The request failed or was cancelled after the stream began: OpenAI's
    // streams carry an error object in a data event.
    const std::string why = final.error().empty() ? "the request was cancelled" : final.error();
    out += absl::StrCat("data: ", Dump(ErrorJson(why, "server_error", "", "")), "\n\n");
  } else {
    if (chat && !role_sent_) out += ChunkEvents(v1::TokenChunk());
    json choice = {{"index", 0}, {"finish_reason", finish}, {"logprobs", nullptr}};
    if (chat) {
      choice["delta"] = json::object();
    } else {
      choice["text"] = "";
    }
    out += Chunk(Dump(choice));
    if (include_usage_) {
      json j = {{"id", id_},
                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created_},
                {"model", model_},
                {"choices", json::array()},
                {"usage", Usage(final)},
                {"pdserve", Extra(final)}};
      out += absl::StrCat("data: ", Dump(j), "\n\n");
    }
  }
  return out + "data: [DONE]\n\n";
}

void ResponseWriter::Add(const v1::TokenChunk& chunk) {
  text_ += tools_.has_value() ? tools_->Feed(chunk.text()).content : chunk.text();
  std::vector<Entry> e = Entries(chunk);
  entries_.insert(entries_.end(), std::make_move_iterator(e.begin()), std::make_move_iterator(e.end()));
}

std::string ResponseWriter::Body(const v1::GenerateFinal& final) {
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  if (tools_.has_value()) text_ += tools_->Finish().content;
  const char* finish = Finish(final);
  json choice = {{"index", 0}, {"finish_reason", finish == nullptr ? json(nullptr) : json(finish)},
                 {"logprobs", logprobs_ ? LogprobsJson(endpoint_, entries_) : json(nullptr)}};
  if (chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text_}};
    if (tools_.has_value() && !tools_->calls().empty()) {
      json calls = json::array();
      for (const v1::ToolCall& c : tools_->calls()) {
        calls.push_back({{"id", c.id()},
                         {"type", "function"},
                         {"function", {{"name", c.name()}, {"arguments", c.arguments()}}}});
      }
      choice["message"]["tool_calls"] = std::move(calls);
      if (text_.empty()) choice["message"]["content"] = nullptr;
    }
  } else {
    choice["text"] = text_;
  }
  const json j = {{"id", id_},
                  {"object", chat ? "chat.completion" : "text_completion"},
                  {"created", created_},
                  {"model", model_},
                  {"choices", json::array({choice})},
                  {"usage", Usage(final)},
                  {"pdserve", Extra(final)}};
  return Dump(j);
}

HttpError ErrorFor(const absl::Status& status) {
  HttpError e;
  std::string type = "server_error", code;
  std::string param = ParamOf(status);
  if (param.empty() && status.code() == absl::StatusCode::kInvalidArgument) {
    // The resolver's errors start with the field too ("max_tokens: ...").
    const absl::string_view m = status.message();
    const size_t colon = m.find(": ");
    if (colon != absl::string_view::npos && m.substr(0, colon).find(' ') == absl::string_view::npos) {
      param = std::string(m.substr(0, colon));
      // The sampler's checks: "sampling: 'top_p' must be ...".
      if (param == "sampling" && m.size() > colon + 3 && m[colon + 2] == '\'') {
        const size_t end = m.find('\'', colon + 3);
        if (end != absl::string_view::npos) param = std::string(m.substr(colon + 3, end - colon - 3));
      }
    }
  }
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      e.status = 400;
      type = "invalid_request_error";
      if (absl::StartsWith(status.message(), "model: unknown model")) {
        e.status = 404;
        code = "model_not_found";
      }
      break;
    case absl::StatusCode::kUnauthenticated:
      e.status = 401;
      type = "authentication_error";
      code = "invalid_api_key";
      break;
    case absl::StatusCode::kResourceExhausted:
      e.status = 429;
      type = "rate_limit_error";
      if (auto p = status.GetPayload(kRetryAfterPayload); p.has_value()) {
        double s = 1;
        if (absl::SimpleAtod(std::string(*p), &s)) e.retry_after_seconds = std::max<int64_t>(1, std::ceil(s));
      }
      break;
    case absl::StatusCode::kUnavailable:
      e.status = 503;
      break;
    case absl::StatusCode::kCancelled:
      e.status = 499;
      break;
    default:
      e.status = 500;
  }
  e.body = Dump(ErrorJson(std::string(status.message()), type, param, code));
  return e;
}

std::vector<std::pair<std::string, std::string>> ErrorHeaders(const HttpError& e) {
  if (e.status == 429) return {{"Retry-After", std::to_string(e.retry_after_seconds)}};
  return {};
}

}  // namespace pdserve::router::openai
