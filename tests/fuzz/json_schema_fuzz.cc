// libFuzzer target: JSON Schema compilation (grammar/json_schema.h), text
// from any client's response_format.
//
// Promises: no crash, and a bounded cost (small node budget here, so a
// hostile schema hits it rather than running long); a refusal is
// INVALID_ARGUMENT or RESOURCE_EXHAUSTED with a message that starts with
// "schema"; an accepted schema compiles to a grammar whose canonical text
// compiles again to the same canonical text, and a matcher walks the
// schema's own JSON text without crashing (accepted or not).
//
// The entry point is LLVMFuzzerTestOneInput for the fuzzer; the corpus replay
// test compiles this file with -DPDSERVE_FUZZ_ENTRY=<name>.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "grammar/grammar.h"
#include "grammar/json_schema.h"

#ifndef PDSERVE_FUZZ_ENTRY
#define PDSERVE_FUZZ_ENTRY LLVMFuzzerTestOneInput
#endif

namespace {
[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "json_schema_fuzz: %s\n", what);
  std::abort();
}
}  // namespace

extern "C" int PDSERVE_FUZZ_ENTRY(const uint8_t* data, size_t size) {
  using namespace pdserve::grammar;
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  SchemaOptions o;
  o.max_nodes = 20000;
  const absl::StatusOr<CompiledSchema> c = CompileJsonSchema(text, o);
  if (!c.ok()) {
    const absl::StatusCode code = c.status().code();
    if (code != absl::StatusCode::kInvalidArgument && code != absl::StatusCode::kResourceExhausted) {
      Fail("a refusal that is neither INVALID_ARGUMENT nor RESOURCE_EXHAUSTED");
    }
    if (!absl::StartsWith(c.status().message(), "schema") && !absl::StartsWith(c.status().message(), "grammar")) {
      Fail("a refusal that does not name the schema");
    }
    return 0;
  }
  if (c->grammar == nullptr) Fail("an accepted schema without a grammar");
  const absl::StatusOr<CompiledSchema> again = CompileJsonSchema(c->canonical, o);
  if (!again.ok() || again->canonical != c->canonical) Fail("the canonical text does not compile to itself");
  Matcher m(c->grammar);
  for (char ch : text) {
    if (!m.Advance(absl::string_view(&ch, 1))) break;
  }
  return 0;
}
