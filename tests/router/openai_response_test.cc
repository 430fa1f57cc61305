// pdserve's messages in the OpenAI API's shapes: streamed events, whole
// bodies, usage, logprobs (a token's text with invalid UTF-8 as U+FFFD and
// its raw bytes), errors and their HTTP statuses.
#include "router/openai/response.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace pdserve::router::openai {
namespace {

using json = nlohmann::json;

class OpenAiResponseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<tok::Tokenizer>> t =
        tok::Tokenizer::Load(std::string(PDSERVE_SOURCE_DIR) + "/deploy/models/kjv-tiny");
    ASSERT_TRUE(t.ok()) << t.status();
    tokenizer_ = *std::move(t);
  }
  static OpenAiRequest Request(Endpoint e, bool logprobs = false, int top = 0, bool usage = false) {
    OpenAiRequest r;
    r.endpoint = e;
    r.logprobs = logprobs;
    r.top_logprobs = top;
    r.include_usage = usage;
    return r;
  }
  v1::TokenChunk Chunk(const std::string& text, std::vector<int32_t> ids, bool with_logprobs = false) const {
    v1::TokenChunk c;
    c.set_text(text);
    for (int32_t id : ids) {
      c.add_token_ids(id);
      if (!with_logprobs) continue;
      v1::TokenLogprob* lp = c.add_logprobs();
      lp->set_token_id(id);
      lp->set_logprob(-0.5f);
      for (int k = 0; k < 3; ++k) {
        v1::TopLogprob* t = lp->add_top();
        t->set_token_id(id + k);
        t->set_logprob(-0.5f - k);
      }
    }
    return c;
  }
  static v1::GenerateFinal Final(v1::FinishReason f) {
    v1::GenerateFinal fin;
    fin.set_finish_reason(f);
    fin.mutable_usage()->set_prompt_tokens(7);
    fin.mutable_usage()->set_completion_tokens(3);
    fin.mutable_timings()->set_cached_prompt_tokens(4);
    fin.set_seed(99);
    return fin;
  }
  // The JSON of each "data: " event of `events`; "[DONE]" as a string.
  static std::vector<json> Events(const std::string& events) {
    std::vector<json> out;
    EXPECT_TRUE(absl::EndsWith(events, "\n\n"));
    for (absl::string_view e : absl::StrSplit(events, "\n\n", absl::SkipEmpty())) {
      EXPECT_TRUE(absl::StartsWith(e, "data: ")) << e;
      e.remove_prefix(6);
      out.push_back(e == "[DONE]" ? json("[DONE]") : json::parse(e));
    }
    return out;
  }
  std::unique_ptr<tok::Tokenizer> tokenizer_;
};

TEST(ReplaceInvalidUtf8Test, EachInvalidByteBecomesOneReplacementCharacter) {
  EXPECT_EQ(ReplaceInvalidUtf8("abc"), "abc");
  EXPECT_EQ(ReplaceInvalidUtf8("\xE2\x82\xAC"), "\xE2\x82\xAC");  // a whole euro sign
  EXPECT_EQ(ReplaceInvalidUtf8("a\xFF" "b"), "a\xEF\xBF\xBD" "b");
  EXPECT_EQ(ReplaceInvalidUtf8("\xE2\x82"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // a character cut short
}

TEST_F(OpenAiResponseTest, AChatStreamAnnouncesTheRoleThenSendsOneEventPerChunk) {
  ResponseWriter w(Request(Endpoint::kChatCompletions, false, 0, true), "chatcmpl-1", 1700000000, "kjv-tiny",
                   tokenizer_.get());
  std::vector<json> ev = Events(w.ChunkEvents(Chunk("And", {10})));
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(ev[1]["object"], "chat.completion.chunk");
  EXPECT_EQ(ev[1]["id"], "chatcmpl-1");
  EXPECT_EQ(ev[1]["created"], 1700000000);
  EXPECT_EQ(ev[1]["model"], "kjv-tiny");
  EXPECT_EQ(ev[1]["choices"][0]["delta"]["content"], "And");
  EXPECT_TRUE(ev[1]["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(ev[1].contains("usage") && ev[1]["usage"].is_null());  // usage asked for: null until the end
  ev = Events(w.ChunkEvents(Chunk(" God", {11})));
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0]["choices"][0]["delta"]["content"], " God");
  ev = Events(w.FinalEvents(Final(v1::FINISH_REASON_LENGTH)));
  ASSERT_EQ(ev.size(), 3u);
  EXPECT_EQ(ev[0]["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(ev[0]["choices"][0]["delta"], json::object());
  EXPECT_TRUE(ev[1]["choices"].empty());
  EXPECT_EQ(ev[1]["usage"]["prompt_tokens"], 7);
  EXPECT_EQ(ev[1]["usage"]["completion_tokens"], 3);
  EXPECT_EQ(ev[1]["usage"]["total_tokens"], 10);
  EXPECT_EQ(ev[1]["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
  EXPECT_EQ(ev[1]["pdserve"]["seed"], 99);
  EXPECT_EQ(ev[2], "[DONE]");
}

TEST_F(OpenAiResponseTest, WithoutIncludeUsageTheStreamEndsWithTheFinishAndDone) {
  ResponseWriter w(Request(Endpoint::kCompletions), "cmpl-1", 1, "m", tokenizer_.get());
  std::vector<json> ev = Events(w.ChunkEvents(Chunk("In", {5})));
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0]["object"], "text_completion");
  EXPECT_EQ(ev[0]["choices"][0]["text"], "In");
  EXPECT_FALSE(ev[0].contains("usage"));
  ev = Events(w.FinalEvents(Final(v1::FINISH_REASON_STOP)));
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0]["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(ev[1], "[DONE]");
}

TEST_F(OpenAiResponseTest, AFailureAfterTheFirstTokenIsAnErrorEvent) {
  ResponseWriter w(Request(Endpoint::kChatCompletions), "chatcmpl-2", 1, "m", tokenizer_.get());
  (void)w.ChunkEvents(Chunk("x", {5}));
  v1::GenerateFinal f = Final(v1::FINISH_REASON_ERROR);
  f.set_error("no decode worker left to continue on");
  const std::vector<json> ev = Events(w.FinalEvents(f));
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0]["error"]["message"], "no decode worker left to continue on");
  EXPECT_EQ(ev[0]["error"]["type"], "server_error");
  EXPECT_EQ(ev[1], "[DONE]");
}

TEST_F(OpenAiResponseTest, WholeBodiesCarryTextFinishUsageAndTheExtraTimings) {
  ResponseWriter chat(Request(Endpoint::kChatCompletions), "chatcmpl-3", 5, "m", tokenizer_.get());
  chat.Add(Chunk("And", {10}));
  chat.Add(Chunk(" God", {11}));
  json j = json::parse(chat.Body(Final(v1::FINISH_REASON_STOP)));
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "And God");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(j["usage"]["total_tokens"], 10);
  EXPECT_TRUE(j["pdserve"]["timings"].contains("ttft_s"));
  ResponseWriter cmpl(Request(Endpoint::kCompletions), "cmpl-3", 5, "m", tokenizer_.get());
  cmpl.Add(Chunk("said", {12}));
  j = json::parse(cmpl.Body(Final(v1::FINISH_REASON_LENGTH)));
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], "said");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
}

TEST_F(OpenAiResponseTest, ChatLogprobsGiveEachTokensTextBytesAndTheAskedAlternatives) {
  ResponseWriter w(Request(Endpoint::kChatCompletions, true, 2), "c", 1, "m", tokenizer_.get());
  w.Add(Chunk("x", {300, 301}, true));
  const json j = json::parse(w.Body(Final(v1::FINISH_REASON_LENGTH)));
  const json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  const std::string bytes = TokenBytes(*tokenizer_, 300);
  ASSERT_FALSE(bytes.empty());
  EXPECT_EQ(content[0]["token"], ReplaceInvalidUtf8(bytes));
  ASSERT_EQ(content[0]["bytes"].size(), bytes.size());
  EXPECT_EQ(content[0]["bytes"][0], static_cast<int>(static_cast<unsigned char>(bytes[0])));
  EXPECT_FLOAT_EQ(content[0]["logprob"].get<float>(), -0.5f);
  ASSERT_EQ(content[0]["top_logprobs"].size(), 2u);  // 3 sent, 2 asked for
  EXPECT_FLOAT_EQ(content[0]["top_logprobs"][1]["logprob"].get<float>(), -1.5f);
}

TEST_F(OpenAiResponseTest, CompletionLogprobsHaveTokensOffsetsAndTopMaps) {
  ResponseWriter w(Request(Endpoint::kCompletions, true, 1), "c", 1, "m", tokenizer_.get());
  std::vector<json> ev = Events(w.ChunkEvents(Chunk("ab", {300, 301}, true)));
  const json& lp = ev[0]["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 2u);
  EXPECT_EQ(lp["text_offset"][0], 0);
  EXPECT_EQ(lp["text_offset"][1], static_cast<int64_t>(TokenBytes(*tokenizer_, 300).size()));
  EXPECT_EQ(lp["top_logprobs"][0].size(), 1u);
  ev = Events(w.ChunkEvents(Chunk("c", {302}, true)));
  // Offsets run over the whole text, across chunks.
  EXPECT_EQ(ev[0]["choices"][0]["logprobs"]["text_offset"][0],
            static_cast<int64_t>(TokenBytes(*tokenizer_, 300).size() + TokenBytes(*tokenizer_, 301).size()));
}

TEST(OpenAiErrorTest, StatusesMapToOpenAiErrorsAndHttpCodes) {
  absl::StatusOr<OpenAiRequest> bad = DecodeRequest(Endpoint::kCompletions, R"({"prompt": "x", "n": 3})");
  HttpError e = ErrorFor(bad.status());
  EXPECT_EQ(e.status, 400);
  json j = json::parse(e.body);
  EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  EXPECT_EQ(j["error"]["param"], "n");
  EXPECT_TRUE(absl::StartsWith(j["error"]["message"].get<std::string>(), "n: only 1"));
  e = ErrorFor(absl::InvalidArgumentError("model: unknown model 'gpt-4' (this cluster serves 'kjv-tiny')"));
  EXPECT_EQ(e.status, 404);
  EXPECT_EQ(json::parse(e.body)["error"]["code"], "model_not_found");
  EXPECT_EQ(json::parse(ErrorFor(absl::InvalidArgumentError("max_tokens: must be at least 1")).body)["error"]["param"],
            "max_tokens");
  EXPECT_EQ(json::parse(ErrorFor(absl::InvalidArgumentError("sampling: 'top_p' must be in (0, 1]")).body)["error"]
                       ["param"],
            "top_p");
  EXPECT_EQ(ErrorFor(absl::UnauthenticatedError("no API key")).status, 401);
  EXPECT_EQ(ErrorFor(absl::ResourceExhaustedError("admission queue full")).status, 429);
  EXPECT_EQ(ErrorFor(absl::UnavailableError("no healthy decode worker")).status, 503);
  EXPECT_EQ(ErrorFor(absl::InternalError("x")).status, 500);
  EXPECT_TRUE(json::parse(ErrorFor(absl::InternalError("x")).body)["error"]["param"].is_null());
}

// A chat with tools: calls come back as tool_calls (streamed: id, type and
// name first, then the arguments in pieces) with finish_reason
// "tool_calls"; text around them is content.
TEST_F(OpenAiResponseTest, ToolCallsStreamAsDeltasAndReturnWhole) {
  OpenAiRequest req = Request(Endpoint::kChatCompletions);
  req.generate.add_tools()->set_name("add");
  const std::vector<std::string> pieces = {"<tool_", "call>\n{\"name\": \"add\", \"argu", "ments\": {\"a\": ",
                                           "1}}\n</tool_call>"};
  ResponseWriter stream(req, "chatcmpl-7", 1, "m", tokenizer_.get());
  std::string events;
  for (const std::string& p : pieces) events += stream.ChunkEvents(Chunk(p, {1}));
  events += stream.FinalEvents(Final(v1::FINISH_REASON_STOP));
  std::string arguments;
  int headers = 0;
  std::string finish;
  for (const json& e : Events(events)) {
    if (!e.is_object() || e["choices"].empty()) continue;
    const json& choice = e["choices"][0];
    if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
    const json& delta = choice["delta"];
    if (delta.contains("content") && delta["content"].is_string()) {
      EXPECT_EQ(delta["content"], "");
    }
    if (!delta.contains("tool_calls")) continue;
    for (const json& c : delta["tool_calls"]) {
      EXPECT_EQ(c["index"], 0);
      if (c.contains("id")) {
        ++headers;
        EXPECT_EQ(c["id"], "call_7_0");
        EXPECT_EQ(c["type"], "function");
        EXPECT_EQ(c["function"]["name"], "add");
      }
      arguments += c["function"]["arguments"].get<std::string>();
    }
  }
  EXPECT_EQ(headers, 1);
  EXPECT_EQ(arguments, "{\"a\": 1}");
  EXPECT_EQ(finish, "tool_calls");

  ResponseWriter whole(req, "chatcmpl-7", 1, "m", tokenizer_.get());
  whole.Add(Chunk("Sure. ", {1}));
  for (const std::string& p : pieces) whole.Add(Chunk(p, {1}));
  const json body = json::parse(whole.Body(Final(v1::FINISH_REASON_STOP)));
  const json& message = body["choices"][0]["message"];
  EXPECT_EQ(body["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_EQ(message["content"], "Sure. ");
  ASSERT_EQ(message["tool_calls"].size(), 1u);
  EXPECT_EQ(message["tool_calls"][0]["function"]["arguments"], "{\"a\": 1}");

  // Cut short by max_tokens: still a length, the call as far as it got.
  ResponseWriter cut(req, "chatcmpl-8", 1, "m", tokenizer_.get());
  for (size_t i = 0; i + 1 < pieces.size(); ++i) cut.Add(Chunk(pieces[i], {1}));
  const json cut_body = json::parse(cut.Body(Final(v1::FINISH_REASON_LENGTH)));
  EXPECT_EQ(cut_body["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(cut_body["choices"][0]["message"]["content"].is_null());

  // tool_choice "none": the text is content, as written.
  req.generate.mutable_tool_choice()->set_mode(v1::ToolChoice::MODE_NONE);
  ResponseWriter none(req, "chatcmpl-9", 1, "m", tokenizer_.get());
  for (const std::string& p : pieces) none.Add(Chunk(p, {1}));
  const json none_body = json::parse(none.Body(Final(v1::FINISH_REASON_STOP)));
  EXPECT_EQ(none_body["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(none_body["choices"][0]["message"]["content"], absl::StrJoin(pieces, ""));
}

// Llama 3.1's calls are the whole message.
TEST_F(OpenAiResponseTest, Llama31CallsAreReadFromTheWholeMessage) {
  OpenAiRequest req = Request(Endpoint::kChatCompletions);
  req.generate.add_tools()->set_name("add");
  ResponseWriter whole(req, "chatcmpl-5", 1, "m", tokenizer_.get(), ToolSyntax::kLlama31);
  for (const char* p : {"{\"name\": \"a", "dd\", \"parameters\": {\"a\"", ": 2}}"}) whole.Add(Chunk(p, {1}));
  const json body = json::parse(whole.Body(Final(v1::FINISH_REASON_STOP)));
  EXPECT_EQ(body["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_TRUE(body["choices"][0]["message"]["content"].is_null());
  ASSERT_EQ(body["choices"][0]["message"]["tool_calls"].size(), 1u);
  EXPECT_EQ(body["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "add");
  EXPECT_EQ(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"], "{\"a\": 2}");
  ResponseWriter words(req, "chatcmpl-6", 1, "m", tokenizer_.get(), ToolSyntax::kLlama31);
  words.Add(Chunk("It is 4.", {1}));
  const json text = json::parse(words.Body(Final(v1::FINISH_REASON_STOP)));
  EXPECT_EQ(text["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(text["choices"][0]["message"]["content"], "It is 4.");
}

}  // namespace
}  // namespace pdserve::router::openai
