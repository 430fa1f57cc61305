// A client's request as the engine's: the prompt as ids (text tokenized,
// chat rendered with the model's template, or ids checked against the
// vocabulary), the sampling parameters checked and their defaults and seed
// resolved. Every front end (gRPC now) resolves through this, so a prompt
// is tokenized once and the same way whatever the API.
//
// Thread safety: thread-safe (const after Create).
#ifndef PDSERVE_ROUTER_RESOLVE_H_
#define PDSERVE_ROUTER_RESOLVE_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/generation.h"
#include "common/model_config.h"
#include "common/tokenizer/chat_template.h"
#include "common/tokenizer/tokenizer.h"
#include "pdserve/v1/generation.pb.h"

namespace pdserve::router {

class RequestResolver {
 public:
  // Loads the tokenizer and config of `model_dir`; `model_name` is the
  // name requests may give.
  static absl::StatusOr<std::unique_ptr<RequestResolver>> Create(const std::string& model_dir, std::string model_name);

  // What an unset (0) max_tokens means: an error (the gRPC API requires
  // it), or whatever room the context leaves after the prompt (OpenAI's
  // chat completions).
  enum class MaxTokens { kRequired, kToContext };

  // The validated engine request. Errors: INVALID_ARGUMENT naming the field.
  absl::StatusOr<GenerationRequest> Resolve(const v1::GenerateRequest& req,
                                            MaxTokens unset = MaxTokens::kRequired) const;

  const tok::Tokenizer& tokenizer() const { return *tokenizer_; }
  const ModelConfig& config() const { return config_; }
  const std::string& model_name() const { return model_name_; }

 private:
  RequestResolver() = default;

  std::string model_name_;
  ModelConfig config_;
  std::unique_ptr<tok::Tokenizer> tokenizer_;
  std::optional<tok::ChatFormat> chat_format_;
};

}  // namespace pdserve::router

#endif  // PDSERVE_ROUTER_RESOLVE_H_
