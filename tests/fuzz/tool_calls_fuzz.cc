// libFuzzer target: tool calls read out of generated text
// (router/tool_calls.h), text a model writes (and a client can steer).
//
// The first byte picks the size of the pieces the rest is fed in (1 to
// 16), as tokens arrive, and the syntax (bit 4: Llama 3.1's, else Qwen's). Promises: no crash; the same content and calls
// whatever the pieces (one piece against many); every call's name is a
// tool name; a stream's argument pieces join to the call's arguments.
//
// The entry point is LLVMFuzzerTestOneInput for the fuzzer; the corpus replay
// test compiles this file with -DPDSERVE_FUZZ_ENTRY=<name>.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "router/tool_calls.h"

#ifndef PDSERVE_FUZZ_ENTRY
#define PDSERVE_FUZZ_ENTRY LLVMFuzzerTestOneInput
#endif

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "tool_calls_fuzz: %s\n", what);
  std::abort();
}

struct Read {
  std::string content;
  std::vector<std::string> names, arguments;
};

Read Parse(absl::string_view text, size_t step, pdserve::router::ToolSyntax syntax) {
  pdserve::router::ToolCallParser p("call", syntax);
  Read r;
  auto take = [&](const pdserve::router::ToolCallParser::Delta& d) {
    r.content += d.content;
    for (const auto& c : d.calls) {
      if (c.begins) {
        if (c.index != static_cast<int>(r.names.size())) Fail("a call begun out of order");
        r.names.push_back(c.name);
        r.arguments.emplace_back();
      }
      if (c.index < 0 || c.index >= static_cast<int>(r.arguments.size())) Fail("arguments of a call not begun");
      r.arguments[c.index] += c.arguments;
    }
  };
  for (size_t i = 0; i < text.size(); i += step) take(p.Feed(text.substr(i, step)));
  take(p.Finish());
  if (p.calls().size() != r.names.size()) Fail("calls() and the deltas disagree on the count");
  for (size_t i = 0; i < r.names.size(); ++i) {
    if (p.calls()[i].arguments() != r.arguments[i]) Fail("the argument pieces do not join to the call's arguments");
    const std::string& n = r.names[i];
    if (n.empty() || n.size() > 64) Fail("a call's name is not a tool name");
    for (char ch : n) {
      const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                      ch == '-';
      if (!ok) Fail("a call's name is not a tool name");
    }
  }
  return r;
}

}  // namespace

extern "C" int PDSERVE_FUZZ_ENTRY(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t step = 1 + data[0] % 16;
  const auto syntax = (data[0] & 16) != 0 ? pdserve::router::ToolSyntax::kLlama31 : pdserve::router::ToolSyntax::kQwen;
  const absl::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  const Read whole = Parse(text, text.size() + 1, syntax);
  const Read pieces = Parse(text, step, syntax);
  if (whole.content != pieces.content) Fail("the content depends on how the text was split");
  if (whole.names != pieces.names || whole.arguments != pieces.arguments) {
    Fail("the calls depend on how the text was split");
  }
  return 0;
}
