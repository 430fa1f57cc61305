// libFuzzer target: tokenizer.json (as Tokenizer::FromJson parses it), then
// encode/decode with whatever loaded. Must never crash; errors are fine.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "text/tokenizer.h"

#ifndef PDSERVE_FUZZ_ENTRY
#define PDSERVE_FUZZ_ENTRY LLVMFuzzerTestOneInput
#endif

extern "C" int PDSERVE_FUZZ_ENTRY(const uint8_t* data, size_t size) {
  const std::string json(reinterpret_cast<const char*>(data), size);
  auto tok = pdserve::tok::Tokenizer::FromJson(json, "", "fuzz");
  if (!tok.ok()) {
    if (tok.status().message().find("fuzz") == std::string::npos) {
      std::fprintf(stderr, "error does not name its source: %s\n", std::string(tok.status().message()).c_str());
      std::abort();
    }
    return 0;
  }
  for (const char* text : {"", "hello world", "  x\n\ty", "caf\xc3\xa9 \xe4\xb8\xad <s>", "\xf0\x9f\x98\x80"}) {
    auto ids = (*tok)->Encode(text, true);
    if (!ids.ok()) continue;
    auto back = (*tok)->Decode(*ids, false);
    (void)back;
  }
  const int32_t n = (*tok)->vocab_size();
  std::vector<int32_t> all;
  for (int32_t i = 0; i < n && i < 512; ++i) all.push_back(i);
  (void)(*tok)->Decode(all, true);
  return 0;
}
