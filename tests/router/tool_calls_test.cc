// Tool calls read out of streamed text: content and calls apart whatever
// the split of the text into pieces, arguments streamed as they come,
// malformed calls left as content.
#include "router/tool_calls.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace pdserve::router {
namespace {

struct Seen {
  std::string content;
  std::vector<std::string> names;
  std::vector<std::string> arguments;  // per call, the pieces joined
  int argument_pieces = 0;
};

// Feeds `text` in pieces of `step` bytes, then finishes.
Seen Parse(const std::string& text, size_t step, ToolSyntax syntax = ToolSyntax::kQwen) {
  ToolCallParser p("call_x", syntax);
  Seen s;
  auto take = [&](const ToolCallParser::Delta& d) {
    s.content += d.content;
    for (const auto& c : d.calls) {
      if (c.begins) {
        EXPECT_EQ(c.index, static_cast<int>(s.names.size()));
        EXPECT_EQ(c.id, "call_x_" + std::to_string(c.index));
        s.names.push_back(c.name);
        s.arguments.emplace_back();
      }
      if (!c.arguments.empty()) ++s.argument_pieces;
      s.arguments.at(c.index) += c.arguments;
    }
  };
  for (size_t i = 0; i < text.size(); i += step) take(p.Feed(text.substr(i, step)));
  take(p.Finish());
  EXPECT_EQ(p.calls().size(), s.names.size());
  for (size_t i = 0; i < p.calls().size() && i < s.arguments.size(); ++i) {
    EXPECT_EQ(p.calls()[i].arguments(), s.arguments[i]);
    EXPECT_EQ(p.calls()[i].name(), s.names[i]);
  }
  return s;
}

TEST(ToolCallParserTest, CallsAndContentWhateverThePieces) {
  const std::string text =
      "Let me check. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa}ris\\\"\", \"n\": [1, "
      "{\"x\": 2}]}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>";
  for (size_t step : {1, 2, 3, 7, 1000}) {
    const Seen s = Parse(text, step);
    EXPECT_EQ(s.content, "Let me check. ") << step;
    ASSERT_EQ(s.names.size(), 2u) << step;
    EXPECT_EQ(s.names[0], "get_weather");
    EXPECT_EQ(s.arguments[0], "{\"city\": \"Pa}ris\\\"\", \"n\": [1, {\"x\": 2}]}");
    EXPECT_EQ(s.names[1], "add");
    EXPECT_EQ(s.arguments[1], "{}");
    if (step == 1) EXPECT_GT(s.argument_pieces, 10);  // streamed as it came
  }
}

TEST(ToolCallParserTest, TextThatOnlyLooksLikeACallIsContent) {
  for (size_t step : {1, 4, 1000}) {
    EXPECT_EQ(Parse("a <tool b <tool_cal", step).content, "a <tool b <tool_cal");
    // Not JSON, or not {name, arguments}: the model's text, as it wrote it.
    const std::string bad = "x<tool_call>oops</tool_call>y";
    Seen s = Parse(bad, step);
    EXPECT_EQ(s.content, bad);
    EXPECT_TRUE(s.names.empty());
    s = Parse("<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f\"}</tool_call>", step);
    ASSERT_EQ(s.names.size(), 1u);  // other key order: read whole
    EXPECT_EQ(s.arguments[0], "{\"a\":1}");
    s = Parse("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>", step);
    ASSERT_EQ(s.names.size(), 1u);  // arguments as a JSON string
    EXPECT_EQ(s.arguments[0], "\"{\\\"a\\\": 1}\"");
  }
}

TEST(ToolCallParserTest, CutShortCallsKeepWhatTheyHave) {
  Seen s = Parse("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": [1, 2", 3);
  ASSERT_EQ(s.names.size(), 1u);
  EXPECT_EQ(s.arguments[0], "{\"a\": [1, 2");
  EXPECT_EQ(s.content, "");
  s = Parse("hi <tool_call>\n{\"na", 2);  // no header yet: content
  EXPECT_EQ(s.content, "hi <tool_call>\n{\"na");
  EXPECT_TRUE(s.names.empty());
  // Whitespace between or after calls is not content; words are.
  s = Parse("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n\n", 1);
  EXPECT_EQ(s.content, "");
  for (size_t step : {1, 2, 1000}) {
    s = Parse("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\nDone.\n <tool\n", step);
    EXPECT_EQ(s.content, "\nDone.\n <tool\n") << step;
  }
}

// Llama 3.1: a call is the whole message; anything else is content.
TEST(ToolCallParserTest, Llama31CallsAreTheWholeMessage) {
  for (size_t step : {1, 3, 1000}) {
    Seen s = Parse(" {\"name\": \"add\", \"parameters\": {\"a\": {\"b\": \"}\"}}}", step, ToolSyntax::kLlama31);
    ASSERT_EQ(s.names.size(), 1u) << step;
    EXPECT_EQ(s.names[0], "add");
    EXPECT_EQ(s.arguments[0], "{\"a\": {\"b\": \"}\"}}");
    EXPECT_EQ(s.content, "");
    if (step == 1) EXPECT_GT(s.argument_pieces, 5);
    s = Parse("{\"parameters\": {\"a\": 1}, \"name\": \"f\"}", step, ToolSyntax::kLlama31);
    ASSERT_EQ(s.names.size(), 1u) << step;  // other key order: read whole
    EXPECT_EQ(s.arguments[0], "{\"a\":1}");
    s = Parse("The answer is {\"name\": \"f\", \"parameters\": {}}", step, ToolSyntax::kLlama31);
    EXPECT_TRUE(s.names.empty());
    EXPECT_EQ(s.content, "The answer is {\"name\": \"f\", \"parameters\": {}}");
    s = Parse("{not a call}", step, ToolSyntax::kLlama31);
    EXPECT_TRUE(s.names.empty());
    EXPECT_EQ(s.content, "{not a call}");
    // Tags mean nothing here.
    s = Parse("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", step, ToolSyntax::kLlama31);
    EXPECT_TRUE(s.names.empty());
  }
}

TEST(ToolCallParserTest, WhichRequestsAreRead) {
  v1::GenerateRequest r;
  EXPECT_FALSE(ParsesToolCalls(r));
  r.add_tools()->set_name("f");
  EXPECT_TRUE(ParsesToolCalls(r));
  r.mutable_tool_choice()->set_mode(v1::ToolChoice::MODE_NONE);
  EXPECT_FALSE(ParsesToolCalls(r));
  r.mutable_tool_choice()->set_function("f");
  EXPECT_TRUE(ParsesToolCalls(r));
}

}  // namespace
}  // namespace pdserve::router
