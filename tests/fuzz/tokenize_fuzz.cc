// libFuzzer target: encode/decode of arbitrary bytes with the real tokenizer
// files in tests/fixtures/tokenizers. The first input byte picks the
// tokenizer; the rest is the text. Checks, besides "no crash":
//  - invalid UTF-8 is refused, never encoded;
//  - Llama 3 (byte-level, no normalizer) round-trips exactly;
//  - the streamed decode of the ids equals their full decode.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "text/detokenizer.h"
#include "text/tokenizer.h"
#include "text/unicode_util.h"

#ifndef PDSERVE_FUZZ_ENTRY
#define PDSERVE_FUZZ_ENTRY LLVMFuzzerTestOneInput
#endif

namespace {

const pdserve::tok::Tokenizer& Get(int which) {
  static const char* kNames[] = {"llama3", "qwen3", "llama2"};
  static std::unique_ptr<pdserve::tok::Tokenizer> cache[3];
  if (cache[which] == nullptr) {
    auto t = pdserve::tok::Tokenizer::Load(std::string(PDSERVE_SOURCE_DIR) +
                                           "/tests/fixtures/tokenizers/" + kNames[which]);
    if (!t.ok()) {
      std::fprintf(stderr, "cannot load tokenizer: %s\n", std::string(t.status().message()).c_str());
      std::abort();
    }
    cache[which] = *std::move(t);
  }
  return *cache[which];
}

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "%s\n", what);
  std::abort();
}

}  // namespace

extern "C" int PDSERVE_FUZZ_ENTRY(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int which = data[0] % 3;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  const pdserve::tok::Tokenizer& tok = Get(which);
  auto ids = tok.Encode(text, false);
  const bool valid = pdserve::tok::Utf8Lossy(text) == text;
  if (ids.ok() != valid) Fail("Encode must accept exactly the valid UTF-8 inputs");
  if (!ids.ok()) return 0;
  auto decoded = tok.Decode(*ids, false);
  if (!decoded.ok()) Fail("Decode of Encode output failed");
  if (which == 0 && *decoded != text) Fail("Llama 3 byte-level BPE did not round-trip");
  pdserve::tok::IncrementalDetokenizer detok(tok, {}, false);
  std::string streamed;
  for (int32_t id : *ids) {
    auto d = detok.Add(id);
    if (!d.ok()) Fail("streaming decode failed");
    streamed += *d;
  }
  streamed += *detok.Finish();
  if (streamed != *decoded) Fail("streamed text differs from the full decode");
  return 0;
}
