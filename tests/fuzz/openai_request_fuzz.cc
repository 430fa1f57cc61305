// libFuzzer target: the OpenAI API's request bodies (router/openai/request.h),
// bytes from any HTTP client.
//
// The first input byte picks the endpoint (even: /v1/completions, odd:
// /v1/chat/completions), the rest is the body. Promises: no crash; a refusal
// is INVALID_ARGUMENT whose message starts with the field it names
// (ParamOf); an accepted body has a prompt, logprobs within 0..20 and stop
// strings within the limits, and decodes the same way twice.
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
#include "router/openai/request.h"

#ifndef PDSERVE_FUZZ_ENTRY
#define PDSERVE_FUZZ_ENTRY LLVMFuzzerTestOneInput
#endif

namespace {
[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "openai_request_fuzz: %s\n", what);
  std::abort();
}
}  // namespace

extern "C" int PDSERVE_FUZZ_ENTRY(const uint8_t* data, size_t size) {
  using namespace pdserve::router::openai;
  if (size == 0) return 0;
  const Endpoint endpoint = data[0] % 2 == 0 ? Endpoint::kCompletions : Endpoint::kChatCompletions;
  const absl::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  const DecodeLimits limits;
  const absl::StatusOr<OpenAiRequest> r = DecodeRequest(endpoint, body, limits);
  if (!r.ok()) {
    if (r.status().code() != absl::StatusCode::kInvalidArgument) Fail("a refusal that is not INVALID_ARGUMENT");
    const std::string param = ParamOf(r.status());
    if (param.empty()) Fail("a refusal that names no field");
    if (!absl::StartsWith(r.status().message(), param + ": ")) Fail("a message that does not start with its field");
    return 0;
  }
  const pdserve::v1::GenerateRequest& g = r->generate;
  if (g.prompt_case() == pdserve::v1::GenerateRequest::PROMPT_NOT_SET) Fail("accepted without a prompt");
  if (g.logprobs() < 0 || g.logprobs() > 20 || r->top_logprobs < 0 || r->top_logprobs > 20) {
    Fail("logprobs out of range");
  }
  if (g.stop_size() > limits.max_stop) Fail("too many stop strings");
  for (const std::string& s : g.stop()) {
    if (s.empty() || static_cast<int64_t>(s.size()) > limits.max_stop_bytes) Fail("a stop string out of bounds");
  }
  const absl::StatusOr<OpenAiRequest> again = DecodeRequest(endpoint, body, limits);
  if (!again.ok() || again->generate.SerializeAsString() != g.SerializeAsString() || again->stream != r->stream) {
    Fail("the same body decodes differently");
  }
  return 0;
}
