// Exactness against Hugging Face's own implementation: reference ids and
// decodings made by tests/fixtures/tokenizers/make_reference.mjs with the npm
// `tokenizers` package (HF's Rust library), on real tokenizer files.
#include "text/tokenizer.h"

#include "model/model_config.h"
#include "text/chat_template.h"
#include "text/detokenizer.h"
#include "text/stop_strings.h"

#include <algorithm>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace pdserve::tok {
namespace {

const std::string kDir = std::string(PDSERVE_SOURCE_DIR) + "/tests/fixtures/tokenizers/";

std::vector<nlohmann::json> ReadJsonl(const std::string& path) {
  std::ifstream f(path);
  std::vector<nlohmann::json> out;
  std::string line;
  while (std::getline(f, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

std::string Show(const std::vector<int32_t>& v) {
  std::string s;
  for (int32_t x : v) s += std::to_string(x) + ",";
  return s;
}

class ReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceTest, EncodeAndDecodeMatchHuggingFace) {
  auto tok = Tokenizer::Load(kDir + GetParam());
  ASSERT_TRUE(tok.ok()) << tok.status();
  const std::vector<nlohmann::json> cases = ReadJsonl(kDir + GetParam() + "/reference.jsonl");
  ASSERT_GT(cases.size(), 100u);
  int failures = 0;
  for (const auto& c : cases) {
    const std::string text = c["text"].get<std::string>();
    const auto want = c["ids"].get<std::vector<int32_t>>();
    const auto want_special = c["ids_special"].get<std::vector<int32_t>>();
    auto got = (*tok)->Encode(text, false);
    auto got_special = (*tok)->Encode(text, true);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(got_special.ok());
    if (*got != want || *got_special != want_special) {
      if (++failures <= 5) {
        ADD_FAILURE() << "text: " << nlohmann::json(text).dump() << "\n want: " << Show(want)
                      << "\n  got: " << Show(*got) << "\n want+special: " << Show(want_special)
                      << "\n  got+special: " << Show(*got_special);
      }
      continue;
    }
    auto decoded = (*tok)->Decode(want, false);
    auto decoded_skip = (*tok)->Decode(want_special, true);
    ASSERT_TRUE(decoded.ok());
    ASSERT_TRUE(decoded_skip.ok());
    if (*decoded != c["decoded"].get<std::string>() ||
        (c.contains("decoded_skip_special") && *decoded_skip != c["decoded_skip_special"].get<std::string>())) {
      if (++failures <= 5) {
        ADD_FAILURE() << "decode of " << nlohmann::json(text).dump() << "\n want: "
                      << c["decoded"].dump() << "\n  got: " << nlohmann::json(*decoded).dump()
                      << "\n want skip: " << c.value("decoded_skip_special", nlohmann::json()).dump()
                      << "\n  got skip: " << nlohmann::json(*decoded_skip).dump();
      }
    }
  }
  EXPECT_EQ(failures, 0) << "of " << cases.size() << " cases";
}

// Streaming equals the full decode for every prefix of every test sequence,
// with and without prompt context. Prefixes that stop inside a character are
// the exception: there HF's byte-fallback decode turns the whole run of byte
// tokens (valid characters before the cut included) into U+FFFD, while a
// stream keeps the characters it already showed (the rule, and a reference
// for it, are in detokenizer_test.cc); the whole sequence is always checked.
TEST_P(ReferenceTest, StreamingEqualsFullDecodeForEveryPrefix) {
  auto tok = Tokenizer::Load(kDir + GetParam());
  ASSERT_TRUE(tok.ok()) << tok.status();
  int checked = 0;
  for (const auto& c : ReadJsonl(kDir + GetParam() + "/reference.jsonl")) {
    const auto ids = c["ids_special"].get<std::vector<int32_t>>();
    // A real prompt is the encoding of complete text, so its decode never
    // ends inside a character: cut the context where that holds.
    size_t cut = ids.size() / 3;
    auto ends_clean = [&](size_t k) {
      const std::string t = *(*tok)->Decode(absl::MakeConstSpan(ids).first(k));
      return t.size() < 3 || t.compare(t.size() - 3, 3, "\xef\xbf\xbd") != 0;
    };
    while (cut > 0 && !ends_clean(cut)) --cut;
    for (size_t context : {size_t{0}, cut}) {
      const std::vector<int32_t> prompt(ids.begin(), ids.begin() + context);
      const std::string prompt_text = *(*tok)->Decode(prompt);
      IncrementalDetokenizer detok(**tok, prompt, /*skip_special_tokens=*/false);
      std::string streamed;
      for (size_t p = context; p < ids.size(); ++p) {
        auto delta = detok.Add(ids[p]);
        ASSERT_TRUE(delta.ok());
        streamed += *delta;
        IncrementalDetokenizer copy = detok;
        const std::string rest = *copy.Finish();
        const std::vector<int32_t> upto(ids.begin(), ids.begin() + p + 1);
        const std::string full = *(*tok)->Decode(upto);
        const bool cut_inside_char =
            full.size() >= 3 && full.compare(full.size() - 3, 3, "\xef\xbf\xbd") == 0;
        if (cut_inside_char && p + 1 < ids.size()) continue;
        ASSERT_EQ(prompt_text + streamed + rest, full)
            << "case " << nlohmann::json(c["text"]).dump() << " context " << context << " prefix " << p;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 1000);
}

INSTANTIATE_TEST_SUITE_P(RealTokenizers, ReferenceTest, ::testing::Values("llama3", "qwen3", "llama2"),
                         [](const auto& info) { return info.param; });

struct ChatFixture {
  std::string tokenizer;      // Directory with tokenizer files.
  std::string template_file;  // "" = the tokenizer_config.json chat_template.
  std::string reference;      // Relative path of the *_reference.jsonl.
  ChatFamily family;
};

// Each fixture's tokenizer and the chat format its template is detected as.
class ChatTemplateTest : public ::testing::TestWithParam<ChatFixture> {
 protected:
  void SetUp() override {
    const ChatFixture& f = GetParam();
    absl::StatusOr<std::unique_ptr<Tokenizer>> loaded = Tokenizer::Load(kDir + f.tokenizer);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    tok = *std::move(loaded);
    std::string tmpl = tok->chat_template();
    if (!f.template_file.empty()) tmpl = *ReadFileToString(kDir + f.template_file);
    absl::StatusOr<ChatFormat> detected = DetectChatFormat(tmpl);
    ASSERT_TRUE(detected.ok()) << detected.status();
    format = *detected;
  }
  std::unique_ptr<Tokenizer> tok;
  ChatFormat format;
};

TEST_P(ChatTemplateTest, RendersLikeJinja) {
  const ChatFixture& f = GetParam();
  EXPECT_EQ(format.family, f.family);
  const nlohmann::json cases = nlohmann::json::parse(*ReadFileToString(kDir + "chat_cases.json"));
  int n = 0;
  for (const auto& ref : ReadJsonl(kDir + f.reference)) {
    std::vector<ChatMessage> messages;
    for (const auto& m : cases[ref["case"].get<int>()]["messages"]) {
      messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
    auto text = RenderChat(format, messages, ref["add_generation_prompt"].get<bool>(),
                           tok->bos_token(), tok->eos_token());
    if (ref.contains("error")) {
      EXPECT_FALSE(text.ok()) << "case " << ref["case"] << " should be refused";
      continue;
    }
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_EQ(*text, ref["text"].get<std::string>()) << "case " << ref["case"];
    if (ref.contains("ids")) {
      EXPECT_EQ(*tok->Encode(*text, false), ref["ids"].get<std::vector<int32_t>>())
          << "case " << ref["case"];
    }
    ++n;
  }
  EXPECT_GE(n, 12);
}

// A message's words are text: where one spells a marker ("<|eot_id|>",
// "<|im_start|>", "</s>"), its characters reach the model, not the marker
// (HF's apply_chat_template would match them as special tokens, and the
// message could close its turn and open a system one). Messages that spell
// no marker get HF's ids exactly.
TEST_P(ChatTemplateTest, MessagesAreTextEvenWhereTheySpellAMarker) {
  const ChatFixture& f = GetParam();
  const nlohmann::json cases = nlohmann::json::parse(*ReadFileToString(kDir + "chat_cases.json"));
  int spelled = 0;
  for (const auto& ref : ReadJsonl(kDir + f.reference)) {
    if (ref.contains("error")) continue;
    std::vector<ChatMessage> messages;
    bool spells_a_marker = false;
    for (const auto& m : cases[ref["case"].get<int>()]["messages"]) {
      messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
      const std::vector<int32_t> alone = *tok->Encode(messages.back().content, false);
      for (int32_t id : alone) spells_a_marker |= tok->IsSpecial(id);
    }
    auto rendered = RenderChatWithContent(format, messages, ref["add_generation_prompt"].get<bool>(),
                                          tok->bos_token(), tok->eos_token());
    ASSERT_TRUE(rendered.ok()) << rendered.status();
    EXPECT_EQ(rendered->text, ref["text"].get<std::string>()) << "case " << ref["case"];
    auto ids = tok->EncodeWithLiteralRanges(rendered->text, rendered->content);
    ASSERT_TRUE(ids.ok()) << ids.status();
    if (!spells_a_marker) {
      if (ref.contains("ids")) {
        EXPECT_EQ(*ids, ref["ids"].get<std::vector<int32_t>>()) << "case " << ref["case"];
      }
      continue;
    }
    ++spelled;
    // The special ids are the template's alone: those of the same
    // conversation with every message's words replaced by "x".
    std::string markers_only;
    size_t at = 0;
    for (const TextRange& r : rendered->content) {
      markers_only += rendered->text.substr(at, r.begin - at) + "x";
      at = r.end;
    }
    markers_only += rendered->text.substr(at);
    auto specials = [&](const std::vector<int32_t>& v) {
      std::vector<int32_t> out;
      for (int32_t id : v) {
        if (tok->IsSpecial(id)) out.push_back(id);
      }
      return out;
    };
    EXPECT_EQ(specials(*ids), specials(*tok->Encode(markers_only, false))) << "case " << ref["case"];
    EXPECT_NE(*ids, *tok->Encode(rendered->text, false)) << "case " << ref["case"];
  }
  EXPECT_GE(spelled, 1) << "no case spells a marker of this tokenizer";
}

TEST(ChatRoleTest, EveryFamilyRefusesUnknownRoles) {
  for (ChatFamily family : {ChatFamily::kChatML, ChatFamily::kQwen3, ChatFamily::kLlama3, ChatFamily::kLlama2,
                            ChatFamily::kZephyr}) {
    for (const std::string& role : {std::string("narrator"), std::string("user<|end_header_id|>"), std::string()}) {
      auto r = RenderChat({family}, {{"user", "a"}, {role, "b"}}, true, "<s>", "</s>");
      EXPECT_THAT(r.status().message(), ::testing::HasSubstr("messages[1]: unknown role"))
          << static_cast<int>(family) << " " << role;
    }
  }
}

TEST(TokenizerTest, LiteralRangesMustBeInOrderAndInsideTheText) {
  auto tok = Tokenizer::Load(kDir + "llama3");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_FALSE((*tok)->EncodeWithLiteralRanges("abc", {{0, 4}}).ok());
  EXPECT_FALSE((*tok)->EncodeWithLiteralRanges("abcdef", {{2, 4}, {3, 5}}).ok());
  EXPECT_FALSE((*tok)->EncodeWithLiteralRanges("abc", {{2, 1}}).ok());
  // A marker half inside a range is text too; one just after it is a marker.
  const std::string text = "ab<|eot_id|><|eot_id|>";
  auto ids = (*tok)->EncodeWithLiteralRanges(text, {{0, 4}});
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(ids->back(), 128009);
  EXPECT_EQ(std::count(ids->begin(), ids->end(), 128009), 1);
  EXPECT_EQ(*(*tok)->Decode(*ids), text);
}

INSTANTIATE_TEST_SUITE_P(
    Families, ChatTemplateTest,
    ::testing::Values(ChatFixture{"qwen3", "", "qwen3/chat_reference.jsonl", ChatFamily::kQwen3},
                      ChatFixture{"llama3", "", "llama3/chat_reference.jsonl", ChatFamily::kLlama3},
                      ChatFixture{"llama3", "llama3.1/chat_template.jinja", "llama3.1/chat_reference.jsonl",
                                  ChatFamily::kLlama31},
                      ChatFixture{"llama2", "llama2/chat_template.jinja", "llama2/chat_reference.jsonl",
                                  ChatFamily::kLlama2},
                      ChatFixture{"llama2", "zephyr_template.jinja", "zephyr_chat_reference.jsonl",
                                  ChatFamily::kZephyr}),
    [](const auto& info) {
      return info.param.template_file.empty() ? info.param.tokenizer
                                              : info.param.tokenizer + "_" + std::to_string(info.index);
    });

TEST(ChatTemplateTest, UnknownTemplatesAndBadMessagesAreRefused) {
  EXPECT_THAT(DetectChatFormat("{{ messages }}").status().message(),
              ::testing::HasSubstr("unrecognised chat template"));
  EXPECT_EQ(DetectChatFormat("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ParseChatMessages("[{\"role\": \"user\"}]").status().message(),
              ::testing::HasSubstr("messages[0]: 'content'"));
  EXPECT_THAT(ParseChatMessages("[{\"role\": \"user\", \"content\": \"x\", \"name\": 1}]").status().message(),
              ::testing::HasSubstr("unknown field 'name'"));
  EXPECT_THAT(ParseChatMessages("{}").status().message(), ::testing::HasSubstr("must be a JSON list"));
  EXPECT_EQ(*ParseChatFamily("zephyr"), ChatFamily::kZephyr);
  EXPECT_FALSE(ParseChatFamily("vicuna").ok());
  auto bad_role = RenderChat({ChatFamily::kChatML}, {{"narrator", "x"}}, false, "", "");
  EXPECT_THAT(bad_role.status().message(), ::testing::HasSubstr("messages[0]: unknown role 'narrator'"));
}

// The messages and tools of a tool_cases.json case, as the router passes
// them: tools and arguments as JinjaJson prints them.
namespace {
void ToolCase(const nlohmann::ordered_json& c, std::vector<ChatMessage>& messages, std::vector<std::string>& tools) {
  for (const auto& t : c["tools"]) tools.push_back(*JinjaJson(t.dump()));
  for (const auto& m : c["messages"]) {
    ChatMessage msg{m["role"].get<std::string>(), m["content"].is_null() ? "" : m["content"].get<std::string>()};
    if (m.contains("tool_calls")) {
      for (const auto& call : m["tool_calls"]) {
        msg.tool_calls.push_back({call["function"]["name"].get<std::string>(),
                                  *JinjaJson(call["function"]["arguments"].dump())});
      }
    }
    messages.push_back(std::move(msg));
  }
}
}  // namespace

// Tools, calls and results exactly as the Qwen3 template prints them
// (jinja2: render_chat.py --tools). Plain ChatML renders the same, and
// the tools' and calls' words are text: a description spelling
// "<|im_end|>" does not end the system turn.
TEST(ChatToolsTest, ToolsCallsAndResultsRenderAsTheQwenTemplateDoes) {
  auto tok = Tokenizer::Load(kDir + "qwen3");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const nlohmann::ordered_json cases = nlohmann::ordered_json::parse(*ReadFileToString(kDir + "tool_cases.json"));
  const std::vector<nlohmann::json> refs = ReadJsonl(kDir + "qwen3/tool_chat_reference.jsonl");
  ASSERT_EQ(refs.size(), 2 * cases.size());
  for (const auto& ref : refs) {
    std::vector<ChatMessage> messages;
    std::vector<std::string> tools;
    ToolCase(cases[ref["case"].get<int>()], messages, tools);
    const bool gen = ref["add_generation_prompt"].get<bool>();
    for (ChatFamily family : {ChatFamily::kQwen3, ChatFamily::kChatML}) {
      auto r = RenderChatWithContent({family}, messages, gen, "", "", tools);
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(r->text, ref["text"].get<std::string>()) << "case " << ref["case"] << " family "
                                                         << ChatFamilyName(family);
      auto ids = (*tok)->EncodeWithLiteralRanges(r->text, r->content);
      ASSERT_TRUE(ids.ok()) << ids.status();
      std::string markers_only;
      size_t at = 0;
      for (const TextRange& range : r->content) {
        markers_only += r->text.substr(at, range.begin - at) + "x";
        at = range.end;
      }
      markers_only += r->text.substr(at);
      const std::vector<int32_t> plain = *(*tok)->Encode(markers_only, false);
      const int32_t im_end = 151645;
      EXPECT_EQ(std::count(ids->begin(), ids->end(), im_end), std::count(plain.begin(), plain.end(), im_end))
          << "case " << ref["case"];
    }
  }
  // Qwen2.5 puts its default system prompt before the tools.
  std::vector<ChatMessage> messages;
  std::vector<std::string> tools;
  ToolCase(cases[0], messages, tools);
  auto qwen25 = RenderChat({ChatFamily::kQwen25}, messages, true, "", "", tools);
  ASSERT_TRUE(qwen25.ok());
  EXPECT_THAT(*qwen25, ::testing::StartsWith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You "
                                             "are a helpful assistant.\n\n# Tools\n\n"));
  // Families without tool syntax refuse tools and calls by name.
  auto llama = RenderChat({ChatFamily::kLlama3}, messages, true, "", "", tools);
  EXPECT_TRUE(FamilyHasTools(ChatFamily::kLlama31));
  EXPECT_THAT(llama.status().message(), ::testing::HasSubstr("tools: the llama3 chat template has no tool syntax"));
  std::vector<ChatMessage> called = {{"user", "x"}, {"assistant", "", {{"f", "{}"}}}};
  EXPECT_THAT(RenderChat({ChatFamily::kZephyr}, called, true, "", "").status().message(),
              ::testing::HasSubstr("messages[1]: tool_calls: the zephyr chat template"));
  std::vector<ChatMessage> misplaced = {{"user", "x", {{"f", "{}"}}}};
  EXPECT_THAT(RenderChat({ChatFamily::kChatML}, misplaced, true, "", "").status().message(),
              ::testing::HasSubstr("only an assistant message holds tool calls"));
}

// Llama 3.1's tool syntax as its template prints it (jinja2:
// render_chat.py --tools llama3.1): tools as indented JSON in the first
// user message, a call as the assistant's whole message, results quoted in
// ipython turns; two calls in one message are refused, as the template
// refuses them.
TEST(ChatToolsTest, Llama31ToolsRenderAsItsTemplateDoes) {
  auto tok = Tokenizer::Load(kDir + "llama3");
  ASSERT_TRUE(tok.ok()) << tok.status();
  const auto format = DetectChatFormat(*ReadFileToString(kDir + "llama3.1/chat_template.jinja"));
  ASSERT_TRUE(format.ok()) << format.status();
  EXPECT_EQ(format->family, ChatFamily::kLlama31);
  EXPECT_FALSE(format->date_from_clock);
  const nlohmann::ordered_json cases = nlohmann::ordered_json::parse(*ReadFileToString(kDir + "tool_cases.json"));
  int rendered = 0, refused = 0;
  for (const auto& ref : ReadJsonl(kDir + "llama3.1/tool_chat_reference.jsonl")) {
    std::vector<ChatMessage> messages;
    std::vector<std::string> tools;
    ToolCase(cases[ref["case"].get<int>()], messages, tools);
    auto r = RenderChatWithContent(*format, messages, ref["add_generation_prompt"].get<bool>(), (*tok)->bos_token(),
                                   (*tok)->eos_token(), tools);
    if (ref.contains("error")) {
      EXPECT_THAT(r.status().message(), ::testing::HasSubstr("one call per message")) << "case " << ref["case"];
      ++refused;
      continue;
    }
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->text, ref["text"].get<std::string>()) << "case " << ref["case"];
    auto ids = (*tok)->EncodeWithLiteralRanges(r->text, r->content);
    ASSERT_TRUE(ids.ok()) << ids.status();
    ++rendered;
  }
  EXPECT_EQ(rendered, 8);
  EXPECT_EQ(refused, 2);
}

TEST(ChatToolsTest, JinjaJsonPrintsAsPythonsJsonDumps) {
  EXPECT_EQ(*JinjaJson(R"({"a":[1,{}],"b":{"c":[]}})", 2),
            "{\n  \"a\": [\n    1,\n    {}\n  ],\n  \"b\": {\n    \"c\": []\n  }\n}");
  EXPECT_EQ(*JinjaJson(R"({"b":1,"a":[1,2.5,null,true],"c":{"d":"\u00e9\n\"x\""},"e":{},"f":[]})"),
            "{\"b\": 1, \"a\": [1, 2.5, null, true], \"c\": {\"d\": \"\xc3\xa9\\n\\\"x\\\"\"}, \"e\": {}, \"f\": []}");
  EXPECT_FALSE(JinjaJson("{").ok());
}

TEST(StopStringsTest, MatchesAcrossDeltasAndHoldsBackPrefixes) {
  StopStringMatcher m({"STOP", "\n\n"});
  EXPECT_EQ(m.Feed("Hello S").text, "Hello ");  // "S" might start STOP.
  auto r = m.Feed("T");
  EXPECT_EQ(r.text, "");
  EXPECT_FALSE(r.stopped);
  r = m.Feed("OP and more");
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.text, "");
  EXPECT_EQ(r.matched, "STOP");
  EXPECT_EQ(m.Feed("ignored").text, "");

  StopStringMatcher n({"STOP"});
  EXPECT_EQ(n.Feed("ST").text, "");
  EXPECT_EQ(n.Feed("ART").text, "START");  // Not a stop after all.
  EXPECT_EQ(n.Feed("xS").text, "x");
  EXPECT_EQ(n.Flush(), "S");

  StopStringMatcher earliest({"cd", "bcde"});
  auto e = earliest.Feed("abcdef");
  EXPECT_TRUE(e.stopped);
  EXPECT_EQ(e.text, "a");
  EXPECT_EQ(e.matched, "bcde");
}

TEST(StopStringsTest, StopStringSplitAcrossTokensIsCaughtAndNotEmitted) {
  auto tok = Tokenizer::Load(kDir + "llama3");
  ASSERT_TRUE(tok.ok());
  const std::string text = "The answer is forty-two. END OF STORY and then some.";
  const std::vector<int32_t> ids = *(*tok)->Encode(text);
  IncrementalDetokenizer detok(**tok, {}, false);
  StopStringMatcher stops({"OF STO"});
  std::string out;
  bool stopped = false;
  for (int32_t id : ids) {
    auto r = stops.Feed(*detok.Add(id));
    out += r.text;
    if (r.stopped) {
      stopped = true;
      break;
    }
  }
  EXPECT_TRUE(stopped);
  EXPECT_EQ(out, "The answer is forty-two. END ");
}

}  // namespace
}  // namespace pdserve::tok
