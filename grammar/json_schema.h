// JSON Schema (the subset OpenAI's strict structured outputs accept) and
// "any JSON object" compiled to a Grammar whose every complete input is
// JSON valid against the schema.
//
// Supported: "type" (one or a list) of object, array, string, number,
// integer, boolean, null; "properties", "required" and
// "additionalProperties" (false, true or a schema); "items"; "minLength"
// and "maxLength" (in characters, a surrogate pair escape being one);
// "minItems" and "maxItems" (each at most 4096); "enum"; "const"; "anyOf";
// "$ref" to "#" or to anything under "#/$defs" or
// "#/definitions" (recursion included); and the keywords that describe
// without constraining (title, description, default, examples, $comment,
// $schema, $id, deprecated, readOnly, writeOnly). Every other keyword is
// refused by name, with the JSON Pointer of the subschema that holds it:
// nothing is ignored that would let an output break the schema.
//
// What the generated text looks like: properties appear in the order the
// schema lists them; optional ones may be left out; properties the schema
// does not list are never generated (additionalProperties only matters for
// an object that lists none). Whitespace is one optional space after ':'
// and ','; numbers have at most 16 integer digits, 16 fraction digits and
// 2 exponent digits (so every number is a finite double).
//
// Bounds (SchemaOptions): the schema's bytes and nesting, and the grammar's
// nodes, so that a hostile schema costs at most a bounded compile.
//
// Thread safety: pure functions.
#ifndef PDSERVE_GRAMMAR_JSON_SCHEMA_H_
#define PDSERVE_GRAMMAR_JSON_SCHEMA_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grammar/grammar.h"

namespace pdserve::grammar {

struct SchemaOptions {
  int64_t max_schema_bytes = 64 << 10;
  int32_t max_schema_depth = 32;  // Nesting of the schema document itself.
  int64_t max_nodes = 100000;     // Grammar nodes (about 40 bytes each, plus edges).
  int32_t max_depth = 128;        // Frames of a matcher's stack (nesting of the output).
};

struct CompiledSchema {
  std::shared_ptr<const Grammar> grammar;
  std::string canonical;  // The schema as compact JSON, key order kept.
};

// Errors: INVALID_ARGUMENT "schema at #/properties/age: 'minimum' is not
// supported", "schema: not JSON ...", and the like; RESOURCE_EXHAUSTED
// when a bound is passed.
absl::StatusOr<CompiledSchema> CompileJsonSchema(absl::string_view schema, const SchemaOptions& options);

// INVALID_ARGUMENT when `text` nests objects and arrays deeper than
// `max_depth` (checked before a recursive parser sees it).
absl::Status CheckJsonDepth(absl::string_view text, int32_t max_depth);

// Any JSON object (OpenAI's json_object response format).
absl::StatusOr<std::shared_ptr<const Grammar>> CompileAnyJsonObject(const SchemaOptions& options);

// A tool's name as OpenAI's API allows it: 1 to 64 of [A-Za-z0-9_-] (so it
// needs no escaping inside a JSON string).
bool IsToolName(absl::string_view name);

// Tool calls in the syntax the chat template shows the model
// (text/chat_template.h): "qwen" (the ChatML families, the default),
//   <tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>
// or "llama3.1",
//   {"name": "NAME", "parameters": ARGS}
// where NAME is one of the tools and ARGS is valid against that tool's
// parameters schema (any object when it has none); with "parallel" (qwen
// only), one or more calls separated by "\n". `spec` is JSON:
//   {"syntax": ..., "parallel": bool, "tools": [{"name": ..., "parameters": {...}}, ...]}
// Errors name the tool ("tools[1].function.parameters: schema at #/...").
// The canonical text is `spec` compact, key order kept.
absl::StatusOr<CompiledSchema> CompileToolCalls(absl::string_view spec, const SchemaOptions& options);

}  // namespace pdserve::grammar

#endif  // PDSERVE_GRAMMAR_JSON_SCHEMA_H_
