// JSON Schema compiled to a grammar: valid documents are accepted, invalid
// ones refused, random complete walks parse and match the schema, and what
// is not supported is refused by name with the path of its subschema.
#include "grammar/json_schema.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "absl/strings/match.h"
#include "nlohmann/json.hpp"

namespace pdserve::grammar {
namespace {

using json = nlohmann::ordered_json;

std::shared_ptr<const Grammar> Compile(const std::string& schema) {
  absl::StatusOr<CompiledSchema> c = CompileJsonSchema(schema, {});
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? c->grammar : nullptr;
}

bool Complete(const std::shared_ptr<const Grammar>& g, absl::string_view doc) {
  Matcher m(g);
  return m.Advance(doc) && m.state().can_end;
}

// A random document the grammar allows: at each step a random byte among
// those the state accepts, preferring to end (and to close) as it grows.
std::string RandomWalk(const std::shared_ptr<const Grammar>& g, std::mt19937* rng) {
  Stepper stepper(*g);
  State s = stepper.Initial(), next;
  std::string out;
  for (int step = 0; step < 4000; ++step) {
    if (s.can_end && (s.words.empty() || (*rng)() % 4 == 0)) return out;
    std::vector<uint8_t> ok;
    for (int b = 0; b < 256; ++b) {
      stepper.Step(s, static_cast<uint8_t>(b), &next);
      if (!next.dead()) ok.push_back(static_cast<uint8_t>(b));
    }
    if (ok.empty()) return out;
    // Past a few hundred bytes, favour closing characters so walks end.
    uint8_t pick = ok[(*rng)() % ok.size()];
    if (out.size() > 200) {
      for (uint8_t c : {'"', '}', ']'}) {
        if (std::find(ok.begin(), ok.end(), c) != ok.end() && (*rng)() % 2 == 0) pick = c;
      }
    }
    stepper.Step(s, pick, &next);
    std::swap(s, next);
    out.push_back(static_cast<char>(pick));
  }
  return out;
}

TEST(JsonSchemaTest, AnObjectWithRequiredAndOptionalPropertiesInOrder) {
  auto g = Compile(R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},
    "tags":{"type":"array","items":{"type":"string"}}},"required":["name","age"],"additionalProperties":false})");
  EXPECT_TRUE(Complete(g, R"({"name": "Ann", "age": 42})"));
  EXPECT_TRUE(Complete(g, R"({"name":"Ann","age":-7,"tags":["a", "b\n\u00e9"]})"));
  EXPECT_FALSE(Complete(g, R"({"age": 42, "name": "Ann"})"));  // Schema order.
  EXPECT_FALSE(Complete(g, R"({"name": "Ann"})"));             // age is required.
  EXPECT_FALSE(Complete(g, R"({"name": "Ann", "age": 4.5})"));
  EXPECT_FALSE(Complete(g, R"({"name": "Ann", "age": 042})"));
  EXPECT_FALSE(Complete(g, R"({"name": "Ann", "age": 1, "x": 1})"));
  EXPECT_FALSE(Complete(g, "{\"name\": \"A\x01\", \"age\": 1}"));  // Control characters are escaped in JSON.
  EXPECT_TRUE(Complete(g, R"({"name": "\ud83d\ude00 \u00e9", "age": 1})"));
  EXPECT_FALSE(Complete(g, R"({"name": "\ud83d", "age": 1})"));  // A lone surrogate.
  EXPECT_FALSE(Complete(g, R"({"name": "\ude00", "age": 1})"));
  EXPECT_FALSE(Complete(g, "{\"name\": \"\xc0\xaf\", \"age\": 1}"));  // An overlong UTF-8 form.
}

TEST(JsonSchemaTest, NumbersEnumsConstsAndAnyOf) {
  auto g = Compile(R"({"type":"object","properties":{
    "x":{"type":"number"},"unit":{"enum":["cm","in",null,3]},"v":{"const":{"a":[1,true]}},
    "id":{"anyOf":[{"type":"integer"},{"type":"string"},{"type":"null"}]}},
    "required":["x","unit","v","id"]})");
  EXPECT_TRUE(Complete(g, R"({"x": -0.5e+10, "unit": "cm", "v": {"a":[1,true]}, "id": 7})"));
  EXPECT_TRUE(Complete(g, R"({"x": 3, "unit": null, "v": {"a":[1,true]}, "id": "k"})"));
  EXPECT_TRUE(Complete(g, R"({"x": 3, "unit": 3, "v": {"a":[1,true]}, "id": null})"));
  EXPECT_FALSE(Complete(g, R"({"x": 3, "unit": "mm", "v": {"a":[1,true]}, "id": null})"));
  EXPECT_FALSE(Complete(g, R"({"x": 3., "unit": "cm", "v": {"a":[1,true]}, "id": null})"));
  EXPECT_FALSE(Complete(g, R"({"x": 3, "unit": "cm", "v": {"a":[1]}, "id": null})"));
  EXPECT_FALSE(Complete(g, R"({"x": 3, "unit": "cm", "v": {"a":[1,true]}, "id": true})"));
}

TEST(JsonSchemaTest, StringLengthsAndArrayCountsAreBounded) {
  auto g = Compile(R"({"type":"object","properties":{"code":{"type":"string","minLength":2,"maxLength":3},
    "list":{"type":"array","items":{"type":"integer"},"minItems":1,"maxItems":2},
    "long":{"type":"string","minLength":2}},"required":["code","list","long"]})");
  EXPECT_TRUE(Complete(g, R"({"code": "ab", "list": [1], "long": "xy"})"));
  EXPECT_TRUE(Complete(g, R"({"code": "\u00e9\n\ud83d\ude00", "list": [1, 2], "long": "xyzzy"})"));
  EXPECT_TRUE(Complete(g, "{\"code\": \"\xc3\xa9t\xc3\xa9\", \"list\": [1], \"long\": \"xy\"}"));
  EXPECT_FALSE(Complete(g, R"({"code": "a", "list": [1], "long": "xy"})"));
  EXPECT_FALSE(Complete(g, R"({"code": "abcd", "list": [1], "long": "xy"})"));
  EXPECT_FALSE(Complete(g, R"({"code": "ab", "list": [], "long": "xy"})"));
  EXPECT_FALSE(Complete(g, R"({"code": "ab", "list": [1, 2, 3], "long": "xy"})"));
  EXPECT_FALSE(Complete(g, R"({"code": "ab", "list": [1], "long": "x"})"));
  EXPECT_TRUE(Complete(Compile(R"({"type":"array","maxItems":0})"), "[]"));
  EXPECT_FALSE(CompileJsonSchema(R"({"type":"string","minLength":3,"maxLength":2})", {}).ok());
  EXPECT_FALSE(CompileJsonSchema(R"({"type":"string","maxLength":-1})", {}).ok());
  EXPECT_FALSE(CompileJsonSchema(R"({"type":"array","maxItems":100000})", {}).ok());
}

TEST(JsonSchemaTest, RecursiveDefinitionsThroughRef) {
  auto g = Compile(R"({"$defs":{"node":{"type":"object","properties":{"v":{"type":"integer"},
    "kids":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["v","kids"]}},
    "$ref":"#/$defs/node"})");
  EXPECT_TRUE(Complete(g, R"({"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 3, "kids": [{"v": 4, "kids": []}]}]})"));
  EXPECT_FALSE(Complete(g, R"({"v": 1, "kids": [{"v": 2}]})"));
  auto root = Compile(R"({"type":"object","properties":{"next":{"anyOf":[{"$ref":"#"},{"type":"null"}]}},
    "required":["next"]})");
  EXPECT_TRUE(Complete(root, R"({"next": {"next": {"next": null}}})"));
}

TEST(JsonSchemaTest, OpenObjectsAndAnyJson) {
  auto g = Compile(R"({"type":"object","additionalProperties":{"type":"boolean"}})");
  EXPECT_TRUE(Complete(g, R"({"a": true, "b": false})"));
  EXPECT_TRUE(Complete(g, "{}"));
  EXPECT_FALSE(Complete(g, R"({"a": 1})"));
  absl::StatusOr<std::shared_ptr<const Grammar>> any = CompileAnyJsonObject({});
  ASSERT_TRUE(any.ok());
  EXPECT_TRUE(Complete(*any, R"({"a": [1, {"b": null}, "x", -2.5E3], "c": {}})"));
  EXPECT_FALSE(Complete(*any, "[1]"));  // JSON mode writes an object.
  EXPECT_FALSE(Complete(*any, R"({"a": tru})"));
}

TEST(JsonSchemaTest, RandomWalksAreJsonThatMatchesTheSchema) {
  auto g = Compile(R"({"type":"object","properties":{"name":{"type":"string"},"n":{"type":"integer"},
    "ok":{"type":"boolean"},"pt":{"type":"object","properties":{"x":{"type":"number"},"y":{"type":"number"}},
    "required":["x","y"]},"kind":{"enum":["a","b"]}},"required":["name","n","pt","kind"]})");
  std::mt19937 rng(7);
  int complete = 0;
  for (int i = 0; i < 200; ++i) {
    const std::string doc = RandomWalk(g, &rng);
    if (!Complete(g, doc)) continue;
    ++complete;
    json j = json::parse(doc, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << doc;
    ASSERT_TRUE(j["name"].is_string()) << doc;
    ASSERT_TRUE(j["n"].is_number_integer()) << doc;
    ASSERT_TRUE(j["pt"]["x"].is_number()) << doc;
    ASSERT_TRUE(j["kind"] == "a" || j["kind"] == "b") << doc;
    if (j.contains("ok")) {
      ASSERT_TRUE(j["ok"].is_boolean()) << doc;
    }
    for (auto it = j.begin(); it != j.end(); ++it) {
      ASSERT_TRUE(it.key() == "name" || it.key() == "n" || it.key() == "ok" || it.key() == "pt" || it.key() == "kind");
    }
  }
  EXPECT_GT(complete, 150);
}

TEST(JsonSchemaTest, WhatIsNotSupportedIsRefusedByNameWithItsPath) {
  struct Case {
    const char* schema;
    const char* message;
  };
  const Case cases[] = {
      {R"({"type":"object","properties":{"age":{"type":"integer","minimum":0}}})",
       "schema at #/properties/age: 'minimum' is not supported"},
      {R"({"type":"string","pattern":"^a"})", "schema at #: 'pattern' is not supported"},
      {R"({"oneOf":[{"type":"string"}]})", "'oneOf' is not supported"},
      {R"({"type":"array","items":[{"type":"string"}]})", "schema at #/items: a list of schemas"},
      {R"({"type":"object","properties":{"a":{}},"required":["b"]})", "schema at #/required/0: 'b' is not among"},
      {R"({"$ref":"#/$defs/missing"})", "refers to nothing"},
      {R"({"$ref":"http://example.com/s.json"})", "only references inside the schema"},
      {R"({"type":"strnig"})", "schema at #/type: unknown type 'strnig'"},
      {R"({"enum":[]})", "schema at #/enum: must be a non-empty array"},
      {R"({"$ref":"#","type":"object"})", "'$ref' together with"},
      {R"({"properties":{"a/b":{"format":"date"}}})", "schema at #/properties/a~1b: 'format' is not supported"},
      {"[1,", "schema: not valid JSON"},
      {"false", "allows no value"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<CompiledSchema> r = CompileJsonSchema(c.schema, {});
    ASSERT_FALSE(r.ok()) << c.schema;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.schema;
    EXPECT_TRUE(absl::StrContains(r.status().message(), c.message)) << r.status() << " for " << c.schema;
  }
}

TEST(JsonSchemaTest, HostileSchemasHitTheirBounds) {
  SchemaOptions o;
  o.max_nodes = 2000;
  std::string big = R"({"enum":[)";
  for (int i = 0; i < 500; ++i) big += (i ? "," : "") + std::string("\"value number ") + std::to_string(i) + "\"";
  big += "]}";
  EXPECT_EQ(CompileJsonSchema(big, o).status().code(), absl::StatusCode::kResourceExhausted);
  std::string deep;
  for (int i = 0; i < 100; ++i) deep += R"({"type":"array","items":)";
  deep += "{}";
  for (int i = 0; i < 100; ++i) deep += "}";
  EXPECT_TRUE(absl::StrContains(CompileJsonSchema(deep, {}).status().message(), "nested deeper"));
  o.max_schema_bytes = 10;
  EXPECT_TRUE(absl::StrContains(CompileJsonSchema(big, o).status().message(), "bytes, more than"));
  // A cycle of references that writes nothing before recursing.
  EXPECT_EQ(CompileJsonSchema(R"({"anyOf":[{"$ref":"#"},{"type":"null"}]})", {}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(JsonSchemaTest, TheCanonicalFormKeepsKeyOrderAndDropsSpace) {
  absl::StatusOr<CompiledSchema> c = CompileJsonSchema(R"({ "type" : "object",
     "properties": { "z": {"type":"string"}, "a": {"type":"string"} } })", {});
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->canonical, R"({"type":"object","properties":{"z":{"type":"string"},"a":{"type":"string"}}})");
}

}  // namespace
}  // namespace pdserve::grammar

namespace pdserve::grammar {
namespace {

constexpr char kTools[] =
    R"({"parallel": false, "tools": [)"
    R"({"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"], "additionalProperties": false}},)"
    R"({"name": "tree", "parameters": {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["kids"], "additionalProperties": false}}}},)"
    R"({"name": "any"}]})";

// Tool calls in the Qwen syntax: only the tools named, each one's
// arguments valid against its own parameters ($refs resolved against that
// schema, not the spec), one call unless parallel.
TEST(ToolCallGrammarTest, CallsNameAToolAndFollowItsParameters) {
  absl::StatusOr<CompiledSchema> c = CompileToolCalls(kTools, {});
  ASSERT_TRUE(c.ok()) << c.status();
  const auto& g = c->grammar;
  EXPECT_TRUE(Complete(g, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": -2}}\n</tool_call>"));
  EXPECT_TRUE(Complete(g, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\":1,\"b\":2}}\n</tool_call>"));
  EXPECT_TRUE(Complete(g, "<tool_call>\n{\"name\": \"tree\", \"arguments\": {\"kids\": [{\"kids\": []}]}}\n</tool_call>"));
  EXPECT_TRUE(Complete(g, "<tool_call>\n{\"name\": \"any\", \"arguments\": {\"x\": [1, \"y\"]}}\n</tool_call>"));
  EXPECT_FALSE(Complete(g, "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>"));
  EXPECT_FALSE(Complete(g, "<tool_call>\n{\"name\": \"sub\", \"arguments\": {}}\n</tool_call>"));
  EXPECT_FALSE(Complete(g, "<tool_call>\n{\"name\": \"any\", \"arguments\": []}\n</tool_call>"));
  EXPECT_FALSE(Complete(g, "Sure! <tool_call>"));
  const std::string one = "<tool_call>\n{\"name\": \"any\", \"arguments\": {}}\n</tool_call>";
  EXPECT_FALSE(Complete(g, one + "\n" + one));
  // Complete after one call: nothing more is allowed (generation stops).
  Matcher m(g);
  ASSERT_TRUE(m.Advance(one));
  EXPECT_TRUE(m.state().complete());

  std::string parallel = kTools;
  parallel.replace(parallel.find("false"), 5, "true");
  absl::StatusOr<CompiledSchema> p = CompileToolCalls(parallel, {});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(Complete(p->grammar, one + "\n" + one + "\n" + one));
  EXPECT_FALSE(Complete(p->grammar, one + one));
  std::mt19937 rng(7);
  for (int i = 0; i < 50; ++i) {
    const std::string walk = RandomWalk(p->grammar, &rng);
    ASSERT_TRUE(absl::StartsWith(walk, "<tool_call>\n{\"name\": \"")) << walk;
    ASSERT_TRUE(absl::EndsWith(walk, "}\n</tool_call>")) << walk;
  }
}

TEST(ToolCallGrammarTest, Llama31CallsAreTheWholeMessage) {
  std::string spec = kTools;
  spec.replace(0, 1, R"({"syntax": "llama3.1", )");
  absl::StatusOr<CompiledSchema> c = CompileToolCalls(spec, {});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(Complete(c->grammar, "{\"name\": \"add\", \"parameters\": {\"a\": 1, \"b\": 2}}"));
  EXPECT_FALSE(Complete(c->grammar, "{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}"));
  EXPECT_FALSE(Complete(c->grammar, "<tool_call>\n{\"name\": \"any\", \"arguments\": {}}\n</tool_call>"));
  std::string parallel = spec;
  parallel.replace(parallel.find("false"), 5, "true");
  EXPECT_THAT(CompileToolCalls(parallel, {}).status().message(), ::testing::HasSubstr("never parallel"));
  EXPECT_THAT(CompileToolCalls(R"({"syntax": "mistral", "parallel": false, "tools": [{"name": "f"}]})", {})
                  .status()
                  .message(),
              ::testing::HasSubstr("unknown call syntax"));
}

TEST(ToolCallGrammarTest, BadToolsAreRefusedNamingTheTool) {
  EXPECT_THAT(CompileToolCalls(R"({"parallel": true, "tools": [{"name": "ok"}, {"name": "bad name"}]})", {})
                  .status()
                  .message(),
              ::testing::HasSubstr("tools[1].function.name: must be 1 to 64"));
  EXPECT_THAT(CompileToolCalls(
                  R"({"parallel": true, "tools": [{"name": "f", "parameters": {"type": "string", "pattern": "x"}}]})", {})
                  .status()
                  .message(),
              ::testing::HasSubstr("tools[0].function.parameters: schema at #: 'pattern' is not supported"));
  EXPECT_FALSE(CompileToolCalls(R"({"parallel": true, "tools": []})", {}).ok());
  EXPECT_FALSE(CompileToolCalls("[]", {}).ok());
  SchemaOptions tight;
  tight.max_nodes = 200;
  EXPECT_EQ(CompileToolCalls(kTools, tight).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(IsToolName("get_weather-2"));
  EXPECT_FALSE(IsToolName(std::string(65, 'a')));
  EXPECT_FALSE(IsToolName("a\"b"));
}

}  // namespace
}  // namespace pdserve::grammar
