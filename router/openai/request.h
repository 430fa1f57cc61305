// The body of an OpenAI API request (POST /v1/completions,
// /v1/chat/completions) as a pdserve.v1.GenerateRequest, which the router
// then resolves like any gRPC request (router/resolve.h): one request path
// whatever the API.
//
// Every field either maps to the request, is one that cannot change the
// output (listed in kIgnoredFields, accepted), or is refused with
// INVALID_ARGUMENT naming it: nothing is silently ignored. The field at
// fault is also attached to the status (ParamOf), for the error's "param".
//
// Thread safety: pure functions.
#ifndef PDSERVE_ROUTER_OPENAI_REQUEST_H_
#define PDSERVE_ROUTER_OPENAI_REQUEST_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pdserve/v1/generation.pb.h"

namespace pdserve::router::openai {

enum class Endpoint { kCompletions, kChatCompletions };

// The default bound on a whole reply's logprob entries (DecodeLimits::
// max_reply_entries): about 20 MB of reply at the few hundred bytes an entry
// takes as JSON, and room for 20 alternatives on each of 3,000 tokens.
inline constexpr int64_t kDefaultMaxReplyEntries = 65536;

// Bounds on what a body may hold, checked before and while decoding.
struct DecodeLimits {
  int64_t max_body_bytes = 8 << 20;
  int32_t max_depth = 32;  // nesting of objects and arrays
  int32_t max_stop = 16;   // stop strings
  int32_t max_stop_bytes = 256;
  int32_t max_messages = 4096;
  // A reply that is not streamed is held whole until its last token, with
  // every token's logprob entry (the chosen token and its alternatives): a
  // request whose worst case (WholeReplyEntries) passes this is refused,
  // naming max_tokens. Streams are sent as they go and are not bounded so.
  int64_t max_reply_entries = kDefaultMaxReplyEntries;
  // The model's context in positions: a chat's max_tokens when the body
  // gives none ("the rest of the context") is at most this. 0: unknown, and
  // a non-streamed chat with logprobs must then give max_tokens.
  int64_t context_length = 0;
  // completions' max_tokens when the body gives none (the caller's
  // default, which the worst case assumes).
  int32_t default_completion_tokens = 16;
};

struct OpenAiRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  // Everything that shapes the output; max_tokens is 0 when the body gave
  // none (the caller applies the endpoint's default: 16 for completions,
  // up to the context for chat).
  v1::GenerateRequest generate;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Chat: logprobs (bool) and top_logprobs; completions: logprobs N (the
  // chosen token's logprob and N alternatives). generate.logprobs is at
  // least 1 whenever logprobs are wanted; the response trims to
  // top_logprobs.
  bool logprobs = false;
  int32_t top_logprobs = 0;
};

// Fields accepted because they cannot change the output.
inline constexpr const char* kIgnoredFields[] = {"user", "metadata", "store", "service_tier"};

// Errors: INVALID_ARGUMENT with the field in ParamOf and in the message
// ("temperature: must be a number"), for malformed JSON ("body: ..."), too
// deep or too large bodies, unknown or unsupported fields, bad values, and
// non-streamed replies over limits.max_reply_entries ("max_tokens: ...").
absl::StatusOr<OpenAiRequest> DecodeRequest(Endpoint endpoint, absl::string_view body,
                                            const DecodeLimits& limits = {});

// The logprob entries a whole reply of up to `max_tokens` tokens holds
// with `alternatives` per token besides the chosen one (callers ask only
// when logprobs are wanted). No overflow for int32 arguments.
int64_t WholeReplyEntries(int64_t max_tokens, int32_t alternatives);

// The field a DecodeRequest error is about ("" when none).
std::string ParamOf(const absl::Status& status);

}  // namespace pdserve::router::openai

#endif  // PDSERVE_ROUTER_OPENAI_REQUEST_H_
