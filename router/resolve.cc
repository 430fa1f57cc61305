#include "router/resolve.h"

#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/unknown_field_set.h"
#include "grammar/json_schema.h"
#include "nlohmann/json.hpp"

namespace pdserve::router {
namespace {

using ordered_json = nlohmann::ordered_json;

// A request's tools as the template shows them, and the spec of the
// grammar their calls follow (CompileToolCalls).
struct ResolvedTools {
  std::vector<std::string> shown;  // JinjaJson of {"type": "function", "function": {...}}
  ordered_json specs = ordered_json::array();  // {"name", "parameters"} each
};

absl::StatusOr<ResolvedTools> ResolveTools(const v1::GenerateRequest& req, int32_t max_tools) {
  ResolvedTools out;
  if (req.tools_size() > max_tools) {
    return absl::InvalidArgumentError(absl::StrCat("tools: ", req.tools_size(), " tools, more than ", max_tools));
  }
  absl::flat_hash_set<std::string> names;
  for (int i = 0; i < req.tools_size(); ++i) {
    const v1::Tool& t = req.tools(i);
    const std::string at = absl::StrCat("tools[", i, "].function");
    if (!grammar::IsToolName(t.name())) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".name: must be 1 to 64 of A-Z, a-z, 0-9, _ and -"));
    }
    if (!names.insert(t.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".name: '", t.name(), "' is given twice"));
    }
    ordered_json fn = {{"name", t.name()}};
    if (!t.description().empty()) fn["description"] = t.description();
    ordered_json spec = {{"name", t.name()}};
    if (!t.parameters().empty()) {
      if (absl::Status st = grammar::CheckJsonDepth(t.parameters(), 32); !st.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(at, ".parameters: ", st.message()));
      }
      ordered_json params = ordered_json::parse(t.parameters(), nullptr, /*allow_exceptions=*/false);
      if (params.is_discarded() || !params.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(at, ".parameters: must be a JSON Schema object"));
      }
      fn["parameters"] = params;
      spec["parameters"] = std::move(params);
    }
    absl::StatusOr<std::string> shown = tok::JinjaJson(ordered_json({{"type", "function"}, {"function", fn}}).dump());
    if (!shown.ok()) return shown.status();
    out.shown.push_back(*std::move(shown));
    out.specs.push_back(std::move(spec));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RequestResolver>> RequestResolver::Create(const std::string& model_dir,
                                                                         std::string model_name,
                                                                         grammar::GrammarOptions grammar) {
  std::unique_ptr<RequestResolver> r(new RequestResolver());
  r->model_name_ = std::move(model_name);
  absl::StatusOr<ModelConfig> config = LoadModelConfig(model_dir);
  if (!config.ok()) return config.status();
  r->config_ = *std::move(config);
  absl::StatusOr<std::unique_ptr<tok::Tokenizer>> tokenizer = tok::Tokenizer::Load(model_dir);
  if (!tokenizer.ok()) return tokenizer.status();
  r->tokenizer_ = *std::move(tokenizer);
  const tok::Tokenizer* t = r->tokenizer_.get();
  r->grammars_ = std::make_unique<grammar::GrammarCache>(
      std::move(grammar), [t] { return grammar::Vocabulary::FromTokenizer(*t); });
  if (!r->tokenizer_->chat_template().empty()) {
    absl::StatusOr<tok::ChatFormat> f = tok::DetectChatFormat(r->tokenizer_->chat_template());
    if (f.ok()) r->chat_format_ = *f;
  }
  return r;
}

absl::StatusOr<GenerationRequest> RequestResolver::Resolve(const v1::GenerateRequest& req, MaxTokens unset) const {
  if (!req.model().empty() && req.model() != model_name_) {
    return absl::InvalidArgumentError(
        absl::StrCat("model: unknown model '", req.model(), "' (this cluster serves '", model_name_, "')"));
  }
  const RequestLimits& lim = limits_;
  if (static_cast<int64_t>(req.request_id().size()) > lim.max_request_id_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("request_id: ", req.request_id().size(), " bytes, more than ", lim.max_request_id_bytes));
  }
  if (req.stop_size() > lim.max_stop) {
    return absl::InvalidArgumentError(absl::StrCat("stop: ", req.stop_size(), " strings, more than ", lim.max_stop));
  }
  if (req.stop_token_ids_size() > lim.max_stop_token_ids) {
    return absl::InvalidArgumentError(
        absl::StrCat("stop_token_ids: ", req.stop_token_ids_size(), " ids, more than ", lim.max_stop_token_ids));
  }
  if (static_cast<int64_t>(req.text().size()) > lim.max_text_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("text: ", req.text().size(), " bytes, more than ", lim.max_text_bytes));
  }
  if (req.chat().messages_size() > lim.max_messages) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat.messages: ", req.chat().messages_size(), " messages, more than ", lim.max_messages));
  }
  int64_t chat_bytes = 0;
  for (const v1::ChatMessage& m : req.chat().messages()) chat_bytes += static_cast<int64_t>(m.content().size());
  if (chat_bytes > lim.max_text_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("chat.messages: ", chat_bytes, " bytes of content, more than ", lim.max_text_bytes));
  }
  const google::protobuf::UnknownFieldSet& unknown = req.GetReflection()->GetUnknownFields(req);
  if (!unknown.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown field number ", unknown.field(0).number(), " (not part of pdserve.v1.GenerateRequest)"));
  }
  absl::StatusOr<ResolvedTools> resolved_tools = ResolveTools(req, lim.max_tools);
  if (!resolved_tools.ok()) return resolved_tools.status();
  const ResolvedTools& tools = *resolved_tools;
  int64_t chat_bytes_with_tools = chat_bytes;
  for (const std::string& t : tools.shown) chat_bytes_with_tools += static_cast<int64_t>(t.size());
  if (req.tools_size() > 0 && req.prompt_case() != v1::GenerateRequest::kChat) {
    return absl::InvalidArgumentError("tools: only a chat prompt carries tools");
  }
  const bool named = req.tool_choice().choice_case() == v1::ToolChoice::kFunction;
  const bool required = req.tool_choice().choice_case() == v1::ToolChoice::kMode &&
                        req.tool_choice().mode() == v1::ToolChoice::MODE_REQUIRED;
  if (req.has_tool_choice() && req.tools_size() == 0) {
    return absl::InvalidArgumentError("tool_choice: given without tools");
  }
  if ((named || required) && req.has_response_format() &&
      req.response_format().format_case() != v1::ResponseFormat::FORMAT_NOT_SET) {
    return absl::InvalidArgumentError(
        "tool_choice: a required or named tool call cannot be combined with a response_format");
  }
  GenerationRequest r;
  switch (req.prompt_case()) {
    case v1::GenerateRequest::kText: {
      if (req.text().empty()) return absl::InvalidArgumentError("text: the prompt is empty");
      absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->Encode(req.text(), false);
      if (!ids.ok()) return absl::InvalidArgumentError(absl::StrCat("text: ", ids.status().message()));
      r.prompt = *std::move(ids);
      break;
    }
    case v1::GenerateRequest::kChat: {
      if (req.chat().messages().empty()) return absl::InvalidArgumentError("chat.messages: empty");
      if (!chat_format_.has_value()) {
        return absl::InvalidArgumentError("chat: this model has no recognised chat template; send text or token_ids");
      }
      std::vector<tok::ChatMessage> messages;
      for (int i = 0; i < req.chat().messages_size(); ++i) {
        const v1::ChatMessage& m = req.chat().messages(i);
        const std::string at = absl::StrCat("chat.messages[", i, "]");
        // The API's four roles (the HTTP API's "developer" arrives as
        // "system"), whatever else a template could render.
        if (m.role() != "system" && m.role() != "user" && m.role() != "assistant" && m.role() != "tool") {
          return absl::InvalidArgumentError(absl::StrCat(at, ".role: must be system, user, assistant or tool"));
        }
        if (m.role() == "tool" && !tok::FamilyHasTools(chat_format_->family)) {
          return absl::InvalidArgumentError(absl::StrCat(at, ".role: the ", tok::ChatFamilyName(chat_format_->family),
                                                         " chat template has no tool messages"));
        }
        tok::ChatMessage msg{m.role(), m.content()};
        for (int k = 0; k < m.tool_calls_size(); ++k) {
          const v1::ToolCall& call = m.tool_calls(k);
          const std::string cat = absl::StrCat(at, ".tool_calls[", k, "]");
          if (m.role() != "assistant") {
            return absl::InvalidArgumentError(absl::StrCat(cat, ": only an assistant message holds tool calls"));
          }
          if (!grammar::IsToolName(call.name())) {
            return absl::InvalidArgumentError(absl::StrCat(cat, ".function.name: must be 1 to 64 of A-Z, a-z, 0-9, _ and -"));
          }
          // Shown as the template's tojson prints an object, as the model
          // writes calls (and as vLLM passes arguments to templates).
          absl::Status depth = grammar::CheckJsonDepth(call.arguments(), 32);
          absl::StatusOr<std::string> args =
              depth.ok() ? tok::JinjaJson(call.arguments()) : absl::StatusOr<std::string>(depth);
          if (!args.ok() || args->empty() || (*args)[0] != '{') {
            return absl::InvalidArgumentError(absl::StrCat(cat, ".function.arguments: must be the JSON text of an object"));
          }
          chat_bytes_with_tools += static_cast<int64_t>(call.arguments().size());
          msg.tool_calls.push_back({call.name(), *std::move(args)});
        }
        messages.push_back(std::move(msg));
      }
      if (chat_bytes_with_tools > lim.max_text_bytes) {
        return absl::InvalidArgumentError(absl::StrCat("chat.messages: ", chat_bytes_with_tools,
                                                       " bytes of content, tool calls and tools, more than ",
                                                       lim.max_text_bytes));
      }
      absl::StatusOr<tok::RenderedChat> rendered =
          tok::RenderChatWithContent(*chat_format_, messages, /*add_generation_prompt=*/true, tokenizer_->bos_token(),
                                     tokenizer_->eos_token(), tools.shown);
      if (!rendered.ok()) {
        const bool about_tools = absl::StartsWith(rendered.status().message(), "tools");
        return absl::InvalidArgumentError(absl::StrCat(about_tools ? "" : "chat.", rendered.status().message()));
      }
      // The template's markers are special tokens; the messages' words are
      // text even where they spell a marker, so no message can end its turn
      // or open another.
      absl::StatusOr<std::vector<int32_t>> ids = tokenizer_->EncodeWithLiteralRanges(rendered->text, rendered->content);
      if (!ids.ok()) return absl::InvalidArgumentError(absl::StrCat("chat: ", ids.status().message()));
      r.prompt = *std::move(ids);
      break;
    }
    case v1::GenerateRequest::kTokenIds: {
      if (req.token_ids().ids().empty()) return absl::InvalidArgumentError("token_ids: the prompt is empty");
      for (int i = 0; i < req.token_ids().ids_size(); ++i) {
        const int32_t id = req.token_ids().ids(i);
        if (id < 0 || id >= config_.vocab_size) {
          return absl::InvalidArgumentError(
              absl::StrCat("token_ids.ids[", i, "]: ", id, " is outside the vocabulary (", config_.vocab_size, ")"));
        }
      }
      r.prompt.assign(req.token_ids().ids().begin(), req.token_ids().ids().end());
      break;
    }
    case v1::GenerateRequest::PROMPT_NOT_SET:
      return absl::InvalidArgumentError("prompt: one of text, chat or token_ids is required");
  }
  if (r.prompt.empty()) return absl::InvalidArgumentError("prompt: it tokenizes to nothing");
  const int64_t context = config_.max_position_embeddings;
  int64_t max_tokens = req.max_tokens();
  if (max_tokens == 0 && unset == MaxTokens::kToContext) {
    max_tokens = context - static_cast<int64_t>(r.prompt.size());
    if (max_tokens < 1) {
      return absl::InvalidArgumentError(absl::StrCat("messages: the prompt (", r.prompt.size(),
                                                     " tokens) fills the model's context (", context, ")"));
    }
  }
  if (max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: must be at least 1, got ", max_tokens));
  }
  if (static_cast<int64_t>(r.prompt.size()) + max_tokens > context) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens: the prompt (", r.prompt.size(), " tokens) + max_tokens (",
                                                   max_tokens, ") exceeds the model's context (", context, ")"));
  }
  SamplingParams& p = r.params;
  const v1::SamplingParams& s = req.sampling();
  if (s.has_temperature()) p.temperature = s.temperature();
  if (s.has_top_k()) p.top_k = s.top_k();
  if (s.has_top_p()) p.top_p = s.top_p();
  if (s.has_min_p()) p.min_p = s.min_p();
  if (s.has_repetition_penalty()) p.repetition_penalty = s.repetition_penalty();
  if (s.has_presence_penalty()) p.presence_penalty = s.presence_penalty();
  if (s.has_frequency_penalty()) p.frequency_penalty = s.frequency_penalty();
  if (s.has_seed()) p.seed = s.seed();
  switch (req.response_format().format_case()) {
    case v1::ResponseFormat::kJsonObject: {
      absl::StatusOr<std::shared_ptr<const grammar::Constraint>> c = grammars_->JsonObject();
      if (!c.ok()) return c.status();
      r.constraint = *std::move(c);
      break;
    }
    case v1::ResponseFormat::kJsonSchema: {
      absl::StatusOr<std::shared_ptr<const grammar::Constraint>> c =
          grammars_->FromSchema(req.response_format().json_schema().schema());
      if (!c.ok()) {
        return absl::Status(c.status().code(),
                            absl::StrCat("response_format.json_schema.schema: ", c.status().message()));
      }
      r.constraint = *std::move(c);
      break;
    }
    case v1::ResponseFormat::FORMAT_NOT_SET:
      break;
  }
  if (req.tools_size() > 0) {
    // Every tool's schema is checked, whatever the choice; a required or
    // named call is generated under the grammar of the tools it may call.
    // Llama 3.1 makes one call per message.
    const bool llama = tool_syntax() == ToolSyntax::kLlama31;
    const char* syntax = llama ? "llama3.1" : "qwen";
    ordered_json spec = {{"syntax", syntax},
                         {"parallel", !llama && (req.has_parallel_tool_calls() ? req.parallel_tool_calls() : true)},
                         {"tools", tools.specs}};
    absl::StatusOr<std::shared_ptr<const grammar::Constraint>> all = grammars_->ToolCalls(spec.dump());
    if (!all.ok()) return all.status();
    if (required) r.constraint = *std::move(all);
    if (named) {
      const std::string& want = req.tool_choice().function();
      ordered_json one = ordered_json::array();
      for (const auto& t : tools.specs) {
        if (t["name"] == want) one.push_back(t);
      }
      if (one.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("tool_choice.function.name: '", want, "' is not one of the tools"));
      }
      absl::StatusOr<std::shared_ptr<const grammar::Constraint>> c =
          grammars_->ToolCalls(ordered_json({{"syntax", syntax}, {"parallel", false}, {"tools", one}}).dump());
      if (!c.ok()) return c.status();
      r.constraint = *std::move(c);
    }
  }
  p.max_tokens = static_cast<int32_t>(max_tokens);
  p.ignore_eos = req.ignore_eos();
  p.logprobs = req.logprobs();
  for (int i = 0; i < req.stop_token_ids_size(); ++i) {
    const int32_t id = req.stop_token_ids(i);
    if (id < 0 || id >= config_.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("stop_token_ids[", i, "]: ", id, " is outside the vocabulary"));
    }
    p.stop_token_ids.push_back(id);
  }
  if (absl::Status st = ValidateSamplingParams(p, config_.vocab_size); !st.ok()) return st;
  p.seed = ResolveSeed(p);
  for (int i = 0; i < req.stop_size(); ++i) {
    if (req.stop(i).empty()) return absl::InvalidArgumentError(absl::StrCat("stop[", i, "]: empty string"));
    if (static_cast<int64_t>(req.stop(i).size()) > lim.max_stop_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop[", i, "]: ", req.stop(i).size(), " bytes, more than ", lim.max_stop_bytes));
    }
    r.stop_strings.push_back(req.stop(i));
  }
  r.eos_ids = config_.eos_token_ids;
  return r;
}

}  // namespace pdserve::router
