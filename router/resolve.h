// A client's request as the engine's: the prompt as ids (text tokenized,
// chat rendered with the model's template and its messages' words
// tokenized as text, never as the template's special tokens, or ids
// checked against the vocabulary), the sampling parameters checked and
// their defaults and seed resolved. Every front end (gRPC and the OpenAI
// HTTP API) resolves through this, so a prompt is tokenized once and the
// same way whatever the API.
//
// Thread safety: thread-safe (const after Create).
#ifndef PDSERVE_ROUTER_RESOLVE_H_
#define PDSERVE_ROUTER_RESOLVE_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "engine/generation.h"
#include "grammar/constraint.h"
#include "model/model_config.h"
#include "router/tool_calls.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "pdserve/v1/generation.pb.h"

namespace pdserve::router {

// What one request may hold, whatever the API (the gRPC and HTTP servers
// also bound a whole message: 8 MiB by default).
struct RequestLimits {
  int64_t max_text_bytes = 4 << 20;  // text, or all chat contents together
  int32_t max_messages = 4096;
  int32_t max_stop = 16;
  int32_t max_stop_bytes = 256;
  int32_t max_stop_token_ids = 64;
  int32_t max_request_id_bytes = 128;
  int32_t max_tools = 128;
};

class RequestResolver {
 public:
  // Loads the tokenizer and config of `model_dir`; `model_name` is the
  // name requests may give.
  static absl::StatusOr<std::unique_ptr<RequestResolver>> Create(const std::string& model_dir, std::string model_name,
                                                                  grammar::GrammarOptions grammar = {});

  // What an unset (0) max_tokens means: an error (the gRPC API requires
  // it), or whatever room the context leaves after the prompt (OpenAI's
  // chat completions).
  enum class MaxTokens { kRequired, kToContext };

  // The validated engine request, within `limits` (prompt tokens within the
  // model's context, logprobs at most 20, chat roles system, user or
  // assistant), its response format compiled (grammars(), cached by the
  // schema's hash). Errors: INVALID_ARGUMENT naming the field
  // ("response_format.json_schema.schema: schema at #/properties/a: ...").
  absl::StatusOr<GenerationRequest> Resolve(const v1::GenerateRequest& req,
                                            MaxTokens unset = MaxTokens::kRequired) const;
  const RequestLimits& limits() const { return limits_; }

  const tok::Tokenizer& tokenizer() const { return *tokenizer_; }
  grammar::GrammarCache& grammars() const { return *grammars_; }
  const ModelConfig& config() const { return config_; }
  const std::string& model_name() const { return model_name_; }
  // The syntax of tool calls in the model's chat template.
  ToolSyntax tool_syntax() const {
    return chat_format_.has_value() && chat_format_->family == tok::ChatFamily::kLlama31 ? ToolSyntax::kLlama31
                                                                                         : ToolSyntax::kQwen;
  }

 private:
  RequestResolver() = default;

  std::string model_name_;
  RequestLimits limits_;
  ModelConfig config_;
  std::unique_ptr<tok::Tokenizer> tokenizer_;
  std::unique_ptr<grammar::GrammarCache> grammars_;
  std::optional<tok::ChatFormat> chat_format_;
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_RESOLVE_H_
