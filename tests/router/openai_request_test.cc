// The OpenAI API's request bodies as GenerateRequests: every field maps,
// is accepted because it cannot change the output, or is refused naming it.
#include "router/openai/request.h"

#include <cstdint>
#include <limits>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace pdserve::router::openai {
namespace {

absl::StatusOr<OpenAiRequest> Completion(const std::string& body) {
  return DecodeRequest(Endpoint::kCompletions, body);
}
absl::StatusOr<OpenAiRequest> Chat(const std::string& body) { return DecodeRequest(Endpoint::kChatCompletions, body); }

// The refusal of `r` names `param`, in the message and for the error's "param".
void ExpectRefused(const absl::StatusOr<OpenAiRequest>& r, const std::string& param, const std::string& why = "") {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParamOf(r.status()), param) << r.status();
  EXPECT_TRUE(absl::StartsWith(r.status().message(), param + ": ")) << r.status();
  EXPECT_TRUE(absl::StrContains(r.status().message(), why)) << r.status();
}

TEST(OpenAiRequestTest, ACompletionMapsEverySamplingField) {
  const absl::StatusOr<OpenAiRequest> r = Completion(R"({
    "model": "kjv-tiny", "prompt": "In the beginning", "max_tokens": 12, "temperature": 0.5, "top_p": 0.9,
    "top_k": 40, "min_p": 0.05, "seed": 7, "presence_penalty": 0.25, "frequency_penalty": -0.5,
    "repetition_penalty": 1.1, "stop": ["\n", "LORD"], "logprobs": 3, "ignore_eos": true, "stream": true,
    "stream_options": {"include_usage": true}, "stop_token_ids": [9]})");
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest& g = r->generate;
  EXPECT_EQ(g.model(), "kjv-tiny");
  EXPECT_EQ(g.text(), "In the beginning");
  EXPECT_EQ(g.max_tokens(), 12);
  EXPECT_FLOAT_EQ(g.sampling().temperature(), 0.5f);
  EXPECT_FLOAT_EQ(g.sampling().top_p(), 0.9f);
  EXPECT_EQ(g.sampling().top_k(), 40);
  EXPECT_FLOAT_EQ(g.sampling().min_p(), 0.05f);
  EXPECT_EQ(g.sampling().seed(), 7u);
  EXPECT_FLOAT_EQ(g.sampling().presence_penalty(), 0.25f);
  EXPECT_FLOAT_EQ(g.sampling().frequency_penalty(), -0.5f);
  EXPECT_FLOAT_EQ(g.sampling().repetition_penalty(), 1.1f);
  ASSERT_EQ(g.stop_size(), 2);
  EXPECT_EQ(g.stop(1), "LORD");
  EXPECT_EQ(g.stop_token_ids(0), 9);
  EXPECT_TRUE(g.ignore_eos());
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  EXPECT_TRUE(r->logprobs);
  EXPECT_EQ(r->top_logprobs, 3);
  EXPECT_EQ(g.logprobs(), 3);
}

TEST(OpenAiRequestTest, UnsetFieldsStayUnsetAndNullIsUnset) {
  const absl::StatusOr<OpenAiRequest> r =
      Completion(R"({"prompt": [1, 2, 3], "temperature": null, "seed": null, "stop": null, "n": 1, "user": "u"})");
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest& g = r->generate;
  EXPECT_EQ(g.token_ids().ids_size(), 3);
  EXPECT_FALSE(g.sampling().has_temperature());
  EXPECT_FALSE(g.sampling().has_seed());
  EXPECT_EQ(g.max_tokens(), 0);  // the endpoint's default applies
  EXPECT_FALSE(r->stream);
  EXPECT_FALSE(r->logprobs);
  EXPECT_EQ(g.logprobs(), 0);
}

TEST(OpenAiRequestTest, AChatJoinsTextPartsAndMapsDeveloperToSystem) {
  const absl::StatusOr<OpenAiRequest> r = Chat(R"({"messages": [
      {"role": "developer", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Who was "}, {"type": "text", "text": "Isaac?"}]}],
    "max_tokens": 5, "max_completion_tokens": 9, "logprobs": true})");
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest& g = r->generate;
  ASSERT_EQ(g.chat().messages_size(), 2);
  EXPECT_EQ(g.chat().messages(0).role(), "system");
  EXPECT_EQ(g.chat().messages(1).content(), "Who was Isaac?");
  EXPECT_EQ(g.max_tokens(), 9);  // max_completion_tokens wins
  // logprobs without alternatives: the chosen token's logprob only.
  EXPECT_TRUE(r->logprobs);
  EXPECT_EQ(r->top_logprobs, 0);
  EXPECT_EQ(g.logprobs(), 1);
}

TEST(OpenAiRequestTest, FieldsThatWouldChangeTheOutputAreRefusedByName) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  ExpectRefused(Chat("{" + msgs + R"(, "tools": [{"type": "function"}]})"), "tools[0].function.name", "required");
  ExpectRefused(Chat("{" + msgs + R"(, "tools": [{"type": "code_interpreter"}]})"), "tools[0].type");
  ExpectRefused(Chat("{" + msgs + R"(, "tools": [{"type": "function", "function": {"name": "f", "parameters": 1}}]})"),
                "tools[0].function.parameters");
  ExpectRefused(Chat("{" + msgs + R"(, "tool_choice": "sometimes"})"), "tool_choice");
  ExpectRefused(Chat("{" + msgs + R"(, "tool_choice": {"type": "function"}})"), "tool_choice");
  ExpectRefused(Completion(R"({"prompt": "x", "tools": []})"), "tools", "not supported");
  ExpectRefused(Chat(R"({"messages": [{"role": "user", "content": "x", "tool_calls": [{"type": "function",
                "function": {"name": "f"}}]}]})"),
                "messages[0].tool_calls", "only an assistant");
  ExpectRefused(Chat(R"({"messages": [{"role": "assistant", "tool_calls": [{"type": "function",
                "function": {"arguments": "{}"}}]}]})"),
                "messages[0].tool_calls[0].function.name", "required");
  ExpectRefused(Chat("{" + msgs + R"(, "response_format": {"type": "xml"}})"), "response_format.type");
  ExpectRefused(Chat("{" + msgs + R"(, "response_format": {"type": "json_schema"}})"), "response_format.json_schema",
                "required");
  ExpectRefused(Chat("{" + msgs + R"(, "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}})"),
                "response_format.json_schema.name", "required");
  ExpectRefused(Chat("{" + msgs + R"(, "response_format": {"type": "json_schema", "json_schema": {"name": "a",
                "schema": "{}"}}})"),
                "response_format.json_schema.schema", "must be a JSON Schema object");
  ExpectRefused(Chat("{" + msgs + R"(, "response_format": {"type": "json_object", "schema": {}}})"),
                "response_format.schema", "unknown field");
  ExpectRefused(Chat("{" + msgs + R"(, "n": 2})"), "n", "only 1");
  ExpectRefused(Chat("{" + msgs + R"(, "top_logprobs": 2})"), "top_logprobs", "requires logprobs");
  ExpectRefused(Chat("{" + msgs + R"(, "logit_bias": {"5": 100}})"), "logit_bias");
  ExpectRefused(Chat(R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})"),
                "messages[0].content[0].type", "'image_url' parts are not supported");
  ExpectRefused(Chat(R"({"messages": [{"role": "user", "content": "x", "name": "bob"}]})"), "messages[0].name");
  ExpectRefused(Chat(R"({"messages": [{"role": "tool", "content": "x"}]})"), "messages[0].tool_call_id", "required");
  ExpectRefused(Chat(R"({"messages": [{"role": "robot", "content": "x"}]})"), "messages[0].role");
  ExpectRefused(Completion(R"({"prompt": "x", "best_of": 2})"), "best_of");
  ExpectRefused(Completion(R"({"prompt": "x", "echo": true})"), "echo");
  ExpectRefused(Completion(R"({"prompt": "x", "suffix": "end"})"), "suffix");
  ExpectRefused(Completion(R"({"prompt": ["a", "b"]})"), "prompt", "a list of prompts");
  ExpectRefused(Completion(R"({"prompt": "x", "temprature": 1})"), "temprature", "unknown field");
  // A chat-only field on the completions endpoint is unknown there.
  ExpectRefused(Completion(R"({"prompt": "x", "max_completion_tokens": 4})"), "max_completion_tokens");
}

TEST(OpenAiRequestTest, ResponseFormatsMapToTheRequestWithTheSchemasKeyOrderKept) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  absl::StatusOr<OpenAiRequest> r = Chat("{" + msgs + R"(, "response_format": {"type": "json_object"}})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->generate.response_format().has_json_object());
  r = Chat("{" + msgs + R"(, "response_format": {"type": "json_schema", "json_schema": {"name": "p",
      "strict": true, "schema": {"type": "object", "properties": {"z": {"type": "string"},
      "a": {"type": "integer"}}, "required": ["z", "a"]}}}})");
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::JsonSchemaFormat& f = r->generate.response_format().json_schema();
  EXPECT_EQ(f.name(), "p");
  EXPECT_TRUE(f.strict());
  EXPECT_EQ(f.schema(),
            R"({"type":"object","properties":{"z":{"type":"string"},"a":{"type":"integer"}},"required":["z","a"]})");
  r = Chat("{" + msgs + R"(, "response_format": {"type": "text"}})");
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->generate.has_response_format());
}

TEST(OpenAiRequestTest, ToolsToolChoiceAndToolMessagesMapToTheRequest) {
  absl::StatusOr<OpenAiRequest> r = Chat(R"({"messages": [
      {"role": "user", "content": "Add 1 and 2"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "3"}],
    "tools": [{"type": "function", "function": {"name": "add", "description": "Adds.", "strict": true,
      "parameters": {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}}}],
    "tool_choice": {"type": "function", "function": {"name": "add"}}, "parallel_tool_calls": false})");
  ASSERT_TRUE(r.ok()) << r.status();
  const v1::GenerateRequest& g = r->generate;
  ASSERT_EQ(g.tools_size(), 1);
  EXPECT_EQ(g.tools(0).name(), "add");
  EXPECT_EQ(g.tools(0).description(), "Adds.");
  EXPECT_EQ(g.tools(0).parameters(), R"({"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"integer"}}})");
  EXPECT_EQ(g.tool_choice().function(), "add");
  EXPECT_FALSE(g.parallel_tool_calls());
  ASSERT_EQ(g.chat().messages_size(), 3);
  ASSERT_EQ(g.chat().messages(1).tool_calls_size(), 1);
  EXPECT_EQ(g.chat().messages(1).tool_calls(0).id(), "call_1");
  EXPECT_EQ(g.chat().messages(1).tool_calls(0).arguments(), R"({"a": 1, "b": 2})");
  EXPECT_EQ(g.chat().messages(2).role(), "tool");
  EXPECT_EQ(g.chat().messages(2).tool_call_id(), "call_1");
  for (const char* choice : {"\"none\"", "\"auto\"", "\"required\""}) {
    r = Chat(absl::StrCat(R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": )", choice, "}"));
    ASSERT_TRUE(r.ok()) << choice;
    EXPECT_TRUE(r->generate.has_tool_choice());
  }
}

TEST(OpenAiRequestTest, FieldsThatCannotChangeTheOutputAreAccepted) {
  for (const char* body :
       {R"({"prompt": "x", "user": "u", "n": 1, "best_of": 1, "echo": false, "suffix": "", "logit_bias": {}})",
        R"({"prompt": "x", "metadata": {"a": "b"}, "store": false, "stream_options": {"include_usage": false}})"}) {
    EXPECT_TRUE(Completion(body).ok()) << body;
  }
  EXPECT_TRUE(Chat(R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "text"},
                       "parallel_tool_calls": true, "service_tier": "auto"})")
                  .ok());
}

TEST(OpenAiRequestTest, BadValuesNameTheirField) {
  ExpectRefused(Completion(R"({"prompt": "x", "temperature": "hot"})"), "temperature", "must be a number");
  ExpectRefused(Completion(R"({"prompt": "x", "max_tokens": 1.5})"), "max_tokens", "must be an integer");
  ExpectRefused(Completion(R"({"prompt": "x", "max_tokens": 0})"), "max_tokens");
  ExpectRefused(Completion(R"({"prompt": "x", "seed": -1})"), "seed");
  ExpectRefused(Completion(R"({"prompt": "x", "logprobs": 21})"), "logprobs");
  ExpectRefused(Completion(R"({"prompt": [1, -2]})"), "prompt[1]");
  ExpectRefused(Completion(R"({"prompt": "x", "stop": ["a", ""]})"), "stop[1]", "empty");
  ExpectRefused(Completion(R"({"prompt": "x", "stop": 5})"), "stop");
  ExpectRefused(Completion(R"({"prompt": "x", "stream": "yes"})"), "stream");
  ExpectRefused(Completion(R"({"max_tokens": 3})"), "prompt", "required");
  ExpectRefused(Chat(R"({"messages": []})"), "messages", "empty");
  ExpectRefused(Chat(R"({"messages": [{"content": "x"}]})"), "messages[0].role", "required");
}

TEST(OpenAiRequestTest, MalformedBodiesAreRefusedAsTheBody) {
  ExpectRefused(Completion(R"({"prompt": "x",)"), "body", "not valid JSON");
  ExpectRefused(Completion("[1, 2]"), "body", "must be a JSON object");
  ExpectRefused(Completion(std::string("{\"prompt\": \"x\"}\0trailing", 24)), "body", "a NUL byte at offset 15");
  ExpectRefused(Completion(R"({"": 1})"), "\"\"", "unknown field");
  ExpectRefused(Completion("{\"prompt\": \"\xff\xfe\"}"), "body", "not valid JSON");
  ExpectRefused(Completion("{\"prompt\": " + std::string(100, '[') + std::string(100, ']') + "}"), "body",
                "nested deeper than 32");
  DecodeLimits small;
  small.max_body_bytes = 16;
  ExpectRefused(DecodeRequest(Endpoint::kCompletions, R"({"prompt": "a long enough prompt"})", small), "body",
                "larger than 16 bytes");
  DecodeLimits few;
  few.max_stop = 1;
  ExpectRefused(DecodeRequest(Endpoint::kCompletions, R"({"prompt": "x", "stop": ["a", "b"]})", few), "stop",
                "at most 1");
  // Brackets inside strings do not count as nesting.
  EXPECT_TRUE(Completion("{\"prompt\": \"" + std::string(100, '[') + "\"}").ok());
}

// A reply that is not streamed is held whole: its worst case, max_tokens x
// (1 + top_logprobs) logprob entries, is bounded; streams are not.
TEST(OpenAiRequestTest, AWholeReplyOverTheEntryLimitIsRefusedNamingMaxTokens) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  DecodeLimits limits;
  limits.max_reply_entries = 2100;
  limits.context_length = 4096;
  auto chat = [&](const std::string& rest) {
    return DecodeRequest(Endpoint::kChatCompletions, "{" + msgs + ", " + rest + "}", limits);
  };
  EXPECT_TRUE(chat(R"("logprobs": true, "top_logprobs": 20, "max_tokens": 100)").ok());  // 2100 entries
  ExpectRefused(chat(R"("logprobs": true, "top_logprobs": 20, "max_tokens": 101)"), "max_tokens",
                "up to 2121 logprob entries, over this server's limit of 2100");
  ExpectRefused(chat(R"("logprobs": true, "top_logprobs": 20, "max_completion_tokens": 101)"),
                "max_completion_tokens", "lower max_completion_tokens or top_logprobs");
  // No max_tokens: the rest of the context, at most the whole context.
  ExpectRefused(chat(R"("logprobs": true, "top_logprobs": 1)"), "max_tokens",
                "the rest of the context, up to 4096 tokens");
  EXPECT_TRUE(chat(R"("logprobs": true, "top_logprobs": 1, "max_tokens": 1050)").ok());
  // Without logprobs a reply holds its text only; streamed, nothing is held.
  EXPECT_TRUE(chat(R"("max_tokens": 4000)").ok());
  EXPECT_TRUE(chat(R"("logprobs": true, "top_logprobs": 20, "stream": true)").ok());
  // Completions: logprobs N is N alternatives; no max_tokens is the default.
  auto completion = [&](const std::string& rest) {
    return DecodeRequest(Endpoint::kCompletions, R"({"prompt": "x", )" + rest + "}", limits);
  };
  ExpectRefused(completion(R"("logprobs": 20, "max_tokens": 101)"), "max_tokens", "lower max_tokens or logprobs");
  EXPECT_TRUE(completion(R"("logprobs": 20)").ok());  // 16 tokens
  limits.default_completion_tokens = 200;
  ExpectRefused(completion(R"("logprobs": 20)"), "max_tokens", "200 tokens (the default)");
}

TEST(OpenAiRequestTest, AWholeChatReplyWithLogprobsNeedsMaxTokensWhenTheContextIsUnknown) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  ExpectRefused(Chat("{" + msgs + R"(, "logprobs": true, "top_logprobs": 20})"), "max_tokens",
                "required for a reply with logprobs that is not streamed");
  EXPECT_TRUE(Chat("{" + msgs + R"(, "logprobs": true, "top_logprobs": 20, "max_tokens": 3000})").ok());
  EXPECT_TRUE(Chat("{" + msgs + R"(, "logprobs": true, "top_logprobs": 20, "stream": true})").ok());
  EXPECT_TRUE(Chat("{" + msgs + "}").ok());
  // The default limit lets 20 alternatives on 3,000 tokens through, not 4,000.
  ExpectRefused(Chat("{" + msgs + R"(, "logprobs": true, "top_logprobs": 20, "max_tokens": 4000})"), "max_tokens");
  EXPECT_EQ(WholeReplyEntries(std::numeric_limits<int32_t>::max(), 20), int64_t{2147483647} * 21);
}

}  // namespace
}  // namespace pdserve::router::openai
