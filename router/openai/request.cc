#include "router/openai/request.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grammar/json_schema.h"
#include "nlohmann/json.hpp"

namespace pdserve::router::openai {
namespace {

// Ordered: a response format's schema keeps its properties' order (the
// order the output writes them).
using json = nlohmann::ordered_json;

constexpr char kParamPayload[] = "type.pdserve.dev/openai.param";

absl::Status Bad(std::string param, absl::string_view why) {
  if (param.empty()) param = "\"\"";  // a field named by the empty string
  absl::Status s = absl::InvalidArgumentError(absl::StrCat(param, ": ", why));
  s.SetPayload(kParamPayload, absl::Cord(param));
  return s;
}

absl::StatusOr<double> Number(const std::string& param, const json& v) {
  if (!v.is_number()) return Bad(param, "must be a number");
  const double d = v.get<double>();
  if (!std::isfinite(d)) return Bad(param, "must be finite");
  return d;
}

absl::StatusOr<int64_t> Integer(const std::string& param, const json& v, int64_t lo, int64_t hi) {
  if (!v.is_number_integer()) return Bad(param, "must be an integer");
  if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)) {
    return Bad(param, absl::StrCat("must be at most ", hi));
  }
  const int64_t i = v.get<int64_t>();
  if (i < lo || i > hi) return Bad(param, absl::StrCat("must be in [", lo, ", ", hi, "]"));
  return i;
}

absl::StatusOr<bool> Bool(const std::string& param, const json& v) {
  if (!v.is_boolean()) return Bad(param, "must be true or false");
  return v.get<bool>();
}

absl::StatusOr<std::string> String(const std::string& param, const json& v) {
  if (!v.is_string()) return Bad(param, "must be a string");
  return v.get<std::string>();
}

#define PDSERVE_ASSIGN(lhs, expr)          \
  do {                                     \
    auto pdserve_v = (expr);               \
    if (!pdserve_v.ok()) return pdserve_v.status(); \
    lhs = *std::move(pdserve_v);           \
  } while (0)

absl::Status DecodeStop(const json& v, const DecodeLimits& limits, v1::GenerateRequest& g) {
  std::vector<std::string> stops;
  if (v.is_string()) {
    stops.push_back(v.get<std::string>());
  } else if (v.is_array()) {
    if (static_cast<int64_t>(v.size()) > limits.max_stop) {
      return Bad("stop", absl::StrCat("at most ", limits.max_stop, " stop strings"));
    }
    for (size_t i = 0; i < v.size(); ++i) {
      std::string s;
      PDSERVE_ASSIGN(s, String(absl::StrCat("stop[", i, "]"), v[i]));
      stops.push_back(std::move(s));
    }
  } else {
    return Bad("stop", "must be a string or a list of strings");
  }
  for (size_t i = 0; i < stops.size(); ++i) {
    const std::string param = v.is_array() ? absl::StrCat("stop[", i, "]") : "stop";
    if (stops[i].empty()) return Bad(param, "empty string");
    if (static_cast<int64_t>(stops[i].size()) > limits.max_stop_bytes) {
      return Bad(param, absl::StrCat("longer than ", limits.max_stop_bytes, " bytes"));
    }
    g.add_stop(stops[i]);
  }
  return absl::OkStatus();
}

// {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
// "json_schema": {"name", "schema", "strict", "description"}}. The schema
// itself is checked where it compiles (router/resolve.h).
absl::Status DecodeResponseFormat(const json& v, v1::GenerateRequest& g) {
  const std::string key = "response_format";
  if (!v.is_object() || !v.contains("type") || !v["type"].is_string()) {
    return Bad(key, "must be an object with a \"type\": text, json_object or json_schema");
  }
  const std::string type = v["type"].get<std::string>();
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.key() != "type" && !(type == "json_schema" && it.key() == "json_schema")) {
      return Bad(key + "." + it.key(), absl::StrCat("unknown field for a response format of type ", type));
    }
  }
  if (type == "text") return absl::OkStatus();
  if (type == "json_object") {
    g.mutable_response_format()->mutable_json_object();
    return absl::OkStatus();
  }
  if (type != "json_schema") return Bad(key + ".type", "must be text, json_object or json_schema");
  if (!v.contains("json_schema") || !v["json_schema"].is_object()) {
    return Bad(key + ".json_schema", "required: an object with name and schema");
  }
  const json& js = v["json_schema"];
  v1::JsonSchemaFormat* f = g.mutable_response_format()->mutable_json_schema();
  for (auto it = js.begin(); it != js.end(); ++it) {
    const std::string param = key + ".json_schema." + it.key();
    if (it.key() == "name") {
      std::string name;
      PDSERVE_ASSIGN(name, String(param, it.value()));
      f->set_name(name);
    } else if (it.key() == "description") {
      if (!it.value().is_string()) return Bad(param, "must be a string");
    } else if (it.key() == "strict") {
      if (!it.value().is_null()) {
        bool strict = false;
        PDSERVE_ASSIGN(strict, Bool(param, it.value()));
        f->set_strict(strict);
      }
    } else if (it.key() == "schema") {
      if (!it.value().is_object() && !it.value().is_boolean()) return Bad(param, "must be a JSON Schema object");
      f->set_schema(it.value().dump());
    } else {
      return Bad(param, "unknown field");
    }
  }
  if (f->name().empty()) return Bad(key + ".json_schema.name", "required");
  if (f->schema().empty()) f->set_schema("{}");  // OpenAI: no schema means any JSON.
  return absl::OkStatus();
}

absl::Status DecodePrompt(const json& v, v1::GenerateRequest& g) {
  if (v.is_string()) {
    g.set_text(v.get<std::string>());
    return absl::OkStatus();
  }
  if (!v.is_array()) return Bad("prompt", "must be a string or an array of token ids");
  if (!v.empty() && (v[0].is_string() || v[0].is_array())) {
    return Bad("prompt", "a list of prompts is not supported (send one request per prompt)");
  }
  for (size_t i = 0; i < v.size(); ++i) {
    int64_t id = 0;
    PDSERVE_ASSIGN(id, Integer(absl::StrCat("prompt[", i, "]"), v[i], 0, std::numeric_limits<int32_t>::max()));
    g.mutable_token_ids()->add_ids(static_cast<int32_t>(id));
  }
  if (v.empty()) return Bad("prompt", "empty");
  return absl::OkStatus();
}

// [{"id", "type": "function", "function": {"name", "arguments"}}, ...], the
// arguments being JSON text (router/resolve.h checks it is an object's).
absl::Status DecodeToolCalls(const std::string& param, const json& v, v1::ChatMessage& out) {
  if (!v.is_array()) return Bad(param, "must be an array of tool calls");
  for (size_t k = 0; k < v.size(); ++k) {
    const std::string at = absl::StrCat(param, "[", k, "]");
    const json& c = v[k];
    if (!c.is_object()) return Bad(at, "must be an object");
    v1::ToolCall* call = out.add_tool_calls();
    bool has_function = false;
    for (auto it = c.begin(); it != c.end(); ++it) {
      const std::string field = at + "." + it.key();
      if (it.key() == "id") {
        std::string id;
        PDSERVE_ASSIGN(id, String(field, it.value()));
        call->set_id(id);
      } else if (it.key() == "type") {
        if (it.value() != "function") return Bad(field, "must be \"function\"");
      } else if (it.key() == "function") {
        const json& f = it.value();
        if (!f.is_object()) return Bad(field, "must be an object with name and arguments");
        for (auto ft = f.begin(); ft != f.end(); ++ft) {
          const std::string ff = field + "." + ft.key();
          std::string text;
          if (ft.key() == "name") {
            PDSERVE_ASSIGN(text, String(ff, ft.value()));
            call->set_name(text);
          } else if (ft.key() == "arguments") {
            PDSERVE_ASSIGN(text, String(ff, ft.value()));
            call->set_arguments(text);
          } else {
            return Bad(ff, "unknown field");
          }
        }
        has_function = true;
      } else {
        return Bad(field, "unknown field");
      }
    }
    if (!has_function || call->name().empty()) return Bad(at + ".function.name", "required");
    if (call->arguments().empty()) call->set_arguments("{}");
  }
  return absl::OkStatus();
}

// [{"type": "function", "function": {"name", "description", "parameters",
// "strict"}}, ...]; the schemas are checked where they compile
// (router/resolve.h).
absl::Status DecodeTools(const json& v, v1::GenerateRequest& g) {
  if (!v.is_array()) return Bad("tools", "must be an array of tools");
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string at = absl::StrCat("tools[", i, "]");
    const json& t = v[i];
    if (!t.is_object()) return Bad(at, "must be an object");
    if (!t.contains("type") || t["type"] != "function") return Bad(at + ".type", "must be \"function\"");
    v1::Tool* tool = g.add_tools();
    for (auto it = t.begin(); it != t.end(); ++it) {
      if (it.key() == "type") continue;
      if (it.key() != "function") return Bad(at + "." + it.key(), "unknown field");
      const json& f = it.value();
      if (!f.is_object()) return Bad(at + ".function", "must be an object");
      for (auto ft = f.begin(); ft != f.end(); ++ft) {
        const std::string ff = at + ".function." + ft.key();
        std::string text;
        if (ft.key() == "name") {
          PDSERVE_ASSIGN(text, String(ff, ft.value()));
          tool->set_name(text);
        } else if (ft.key() == "description") {
          PDSERVE_ASSIGN(text, String(ff, ft.value()));
          tool->set_description(text);
        } else if (ft.key() == "parameters") {
          if (!ft.value().is_object()) return Bad(ff, "must be a JSON Schema object");
          tool->set_parameters(ft.value().dump());
        } else if (ft.key() == "strict") {
          // Accepted: every call of a required or named tool follows its
          // schema exactly whatever its value.
          if (!ft.value().is_null() && !ft.value().is_boolean()) return Bad(ff, "must be true or false");
        } else {
          return Bad(ff, "unknown field");
        }
      }
    }
    if (tool->name().empty()) return Bad(at + ".function.name", "required");
  }
  return absl::OkStatus();
}

// "none", "auto", "required" or {"type": "function", "function": {"name"}}.
absl::Status DecodeToolChoice(const json& v, v1::GenerateRequest& g) {
  v1::ToolChoice* c = g.mutable_tool_choice();
  if (v.is_string()) {
    const std::string mode = v.get<std::string>();
    if (mode == "none") {
      c->set_mode(v1::ToolChoice::MODE_NONE);
    } else if (mode == "auto") {
      c->set_mode(v1::ToolChoice::MODE_AUTO);
    } else if (mode == "required") {
      c->set_mode(v1::ToolChoice::MODE_REQUIRED);
    } else {
      return Bad("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\"}}");
    }
    return absl::OkStatus();
  }
  if (!v.is_object() || !v.contains("type") || v["type"] != "function" || !v.contains("function") ||
      !v["function"].is_object() || !v["function"].contains("name") || !v["function"]["name"].is_string()) {
    return Bad("tool_choice", "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\"}}");
  }
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (it.key() != "type" && it.key() != "function") return Bad("tool_choice." + it.key(), "unknown field");
  }
  c->set_function(v["function"]["name"].get<std::string>());
  return absl::OkStatus();
}

absl::Status DecodeMessages(const json& v, const DecodeLimits& limits, v1::GenerateRequest& g) {
  if (!v.is_array()) return Bad("messages", "must be an array of messages");
  if (v.empty()) return Bad("messages", "empty");
  if (static_cast<int64_t>(v.size()) > limits.max_messages) {
    return Bad("messages", absl::StrCat("more than ", limits.max_messages, " messages"));
  }
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string at = absl::StrCat("messages[", i, "]");
    const json& m = v[i];
    if (!m.is_object()) return Bad(at, "must be an object");
    v1::ChatMessage* out = g.mutable_chat()->add_messages();
    bool has_role = false;
    for (const auto& [key, value] : m.items()) {
      const std::string param = absl::StrCat(at, ".", key);
      if (key == "role") {
        std::string role;
        PDSERVE_ASSIGN(role, String(param, value));
        if (role == "developer") role = "system";  // the newer name for the same thing
        if (role != "system" && role != "user" && role != "assistant" && role != "tool") {
          return Bad(param,
                     absl::StrCat("'", role, "' is not supported (system, developer, user, assistant or tool)"));
        }
        out->set_role(role);
        has_role = true;
      } else if (key == "content") {
        if (value.is_null()) continue;
        if (value.is_string()) {
          out->set_content(value.get<std::string>());
          continue;
        }
        if (!value.is_array()) return Bad(param, "must be a string or an array of text parts");
        std::string text;
        for (size_t j = 0; j < value.size(); ++j) {
          const std::string part = absl::StrCat(param, "[", j, "]");
          const json& p = value[j];
          if (!p.is_object() || !p.contains("type")) return Bad(part, "must be an object with a type");
          std::string type;
          PDSERVE_ASSIGN(type, String(part + ".type", p["type"]));
          if (type != "text") {
            return Bad(part + ".type", absl::StrCat("'", type, "' parts are not supported (text only)"));
          }
          std::string t;
          PDSERVE_ASSIGN(t, String(part + ".text", p.contains("text") ? p["text"] : json()));
          text += t;
        }
        out->set_content(std::move(text));
      } else if (value.is_null()) {
        continue;
      } else if (key == "tool_calls") {
        if (absl::Status st = DecodeToolCalls(param, value, *out); !st.ok()) return st;
      } else if (key == "tool_call_id") {
        std::string id;
        PDSERVE_ASSIGN(id, String(param, value));
        out->set_tool_call_id(id);
      } else {
        // name, audio, refusal...: each would change what the model sees.
        return Bad(param, "not supported");
      }
    }
    if (!has_role) return Bad(at + ".role", "required");
    if (out->tool_calls_size() > 0 && out->role() != "assistant") {
      return Bad(at + ".tool_calls", "only an assistant message holds tool calls");
    }
    if (out->role() == "tool" && out->tool_call_id().empty()) return Bad(at + ".tool_call_id", "required");
  }
  return absl::OkStatus();
}

// A whole reply's worst case against limits.max_reply_entries. `completion`:
// the body gave max_completion_tokens (the field then named).
absl::Status CheckWholeReply(const OpenAiRequest& r, bool completion, const DecodeLimits& limits) {
  const bool chat = r.endpoint == Endpoint::kChatCompletions;
  const std::string param = completion ? "max_completion_tokens" : "max_tokens";
  int64_t tokens = r.generate.max_tokens();
  std::string given = absl::StrCat(tokens, " tokens");
  if (tokens == 0 && !chat) {
    tokens = limits.default_completion_tokens;
    given = absl::StrCat(tokens, " tokens (the default)");
  } else if (tokens == 0) {
    if (limits.context_length <= 0) {
      return Bad(param, "required for a reply with logprobs that is not streamed (or set stream: true)");
    }
    tokens = limits.context_length;
    given = absl::StrCat("the rest of the context, up to ", tokens, " tokens (max_tokens not given)");
  }
  const int64_t entries = WholeReplyEntries(tokens, r.top_logprobs);
  if (entries <= limits.max_reply_entries) return absl::OkStatus();
  return Bad(param, absl::StrCat("a reply of ", given, " with ", r.top_logprobs, " logprob alternatives each holds up to ",
                                 entries, " logprob entries, over this server's limit of ", limits.max_reply_entries,
                                 " for a reply that is not streamed: lower ", param, " or ",
                                 chat ? "top_logprobs" : "logprobs", ", or set stream: true"));
}

}  // namespace

int64_t WholeReplyEntries(int64_t max_tokens, int32_t alternatives) {
  return max_tokens * (1 + static_cast<int64_t>(alternatives));
}

std::string ParamOf(const absl::Status& status) {
  const absl::optional<absl::Cord> p = status.GetPayload(kParamPayload);
  return p.has_value() ? std::string(*p) : "";
}

absl::StatusOr<OpenAiRequest> DecodeRequest(Endpoint endpoint, absl::string_view body, const DecodeLimits& limits) {
  if (static_cast<int64_t>(body.size()) > limits.max_body_bytes) {
    return Bad("body", absl::StrCat("larger than ", limits.max_body_bytes, " bytes"));
  }
  // JSON has no raw NUL anywhere (in strings it is escaped); the parser
  // would stop at one and ignore what follows.
  if (const size_t nul = body.find('\0'); nul != absl::string_view::npos) {
    return Bad("body", absl::StrCat("not valid JSON: a NUL byte at offset ", nul));
  }
  // Checked before the parser (which recurses) sees the body.
  if (!grammar::CheckJsonDepth(body, limits.max_depth).ok()) {
    return Bad("body", absl::StrCat("nested deeper than ", limits.max_depth, " levels"));
  }
  json j;
  try {
    j = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {
    std::string why = e.what();
    if (const size_t at = why.find("] "); absl::StartsWith(why, "[json.exception") && at != std::string::npos) {
      why = why.substr(at + 2);
    }
    return Bad("body", absl::StrCat("not valid JSON: ", why));
  }
  if (!j.is_object()) return Bad("body", "must be a JSON object");

  const bool chat = endpoint == Endpoint::kChatCompletions;
  OpenAiRequest r;
  r.endpoint = endpoint;
  v1::GenerateRequest& g = r.generate;
  v1::SamplingParams& s = *g.mutable_sampling();
  std::optional<int64_t> max_tokens, max_completion_tokens;
  bool has_prompt = false;
  std::optional<int64_t> top_logprobs;
  for (const auto& [key, v] : j.items()) {
    if (v.is_null()) continue;  // null is "not given", for every field
    double d = 0;
    int64_t i = 0;
    bool b = false;
    if (key == "model") {
      std::string m;
      PDSERVE_ASSIGN(m, String(key, v));
      g.set_model(m);
    } else if (key == "prompt" && !chat) {
      if (absl::Status st = DecodePrompt(v, g); !st.ok()) return st;
      has_prompt = true;
    } else if (key == "messages" && chat) {
      if (absl::Status st = DecodeMessages(v, limits, g); !st.ok()) return st;
      has_prompt = true;
    } else if (key == "stream") {
      PDSERVE_ASSIGN(r.stream, Bool(key, v));
    } else if (key == "stream_options") {
      if (!v.is_object()) return Bad(key, "must be an object");
      // Its other options (e.g. continuous usage) only shape the chunks.
      if (v.contains("include_usage") && !v["include_usage"].is_null()) {
        PDSERVE_ASSIGN(r.include_usage, Bool("stream_options.include_usage", v["include_usage"]));
      }
    } else if (key == "max_tokens") {
      PDSERVE_ASSIGN(max_tokens, Integer(key, v, 1, std::numeric_limits<int32_t>::max()));
    } else if (key == "max_completion_tokens" && chat) {
      PDSERVE_ASSIGN(max_completion_tokens, Integer(key, v, 1, std::numeric_limits<int32_t>::max()));
    } else if (key == "temperature") {
      PDSERVE_ASSIGN(d, Number(key, v));
      s.set_temperature(static_cast<float>(d));
    } else if (key == "top_p") {
      PDSERVE_ASSIGN(d, Number(key, v));
      s.set_top_p(static_cast<float>(d));
    } else if (key == "min_p") {
      PDSERVE_ASSIGN(d, Number(key, v));
      s.set_min_p(static_cast<float>(d));
    } else if (key == "top_k") {
      PDSERVE_ASSIGN(i, Integer(key, v, -1, std::numeric_limits<int32_t>::max()));
      s.set_top_k(i < 0 ? 0 : static_cast<int32_t>(i));  // -1: off, as 0
    } else if (key == "seed") {
      PDSERVE_ASSIGN(i, Integer(key, v, 0, std::numeric_limits<int64_t>::max()));
      s.set_seed(static_cast<uint64_t>(i));
    } else if (key == "presence_penalty") {
      PDSERVE_ASSIGN(d, Number(key, v));
      s.set_presence_penalty(static_cast<float>(d));
    } else if (key == "frequency_penalty") {
      PDSERVE_ASSIGN(d, Number(key, v));
      s.set_frequency_penalty(static_cast<float>(d));
    } else if (key == "repetition_penalty") {
      PDSERVE_ASSIGN(d, Number(key, v));
      s.set_repetition_penalty(static_cast<float>(d));
    } else if (key == "stop") {
      if (absl::Status st = DecodeStop(v, limits, g); !st.ok()) return st;
    } else if (key == "stop_token_ids") {
      if (!v.is_array()) return Bad(key, "must be an array of token ids");
      for (size_t k = 0; k < v.size(); ++k) {
        PDSERVE_ASSIGN(i, Integer(absl::StrCat(key, "[", k, "]"), v[k], 0, std::numeric_limits<int32_t>::max()));
        g.add_stop_token_ids(static_cast<int32_t>(i));
      }
    } else if (key == "ignore_eos") {
      PDSERVE_ASSIGN(b, Bool(key, v));
      g.set_ignore_eos(b);
    } else if (key == "n") {
      PDSERVE_ASSIGN(i, Integer(key, v, 1, std::numeric_limits<int32_t>::max()));
      if (i != 1) return Bad(key, "only 1 is supported (send n requests with different seeds)");
    } else if (key == "logprobs" && chat) {
      PDSERVE_ASSIGN(r.logprobs, Bool(key, v));
    } else if (key == "top_logprobs" && chat) {
      PDSERVE_ASSIGN(top_logprobs, Integer(key, v, 0, 20));
    } else if (key == "logprobs") {
      PDSERVE_ASSIGN(i, Integer(key, v, 0, 20));
      r.logprobs = true;
      r.top_logprobs = static_cast<int32_t>(i);
    } else if (key == "logit_bias") {
      if (!v.is_object()) return Bad(key, "must be an object");
      if (!v.empty()) return Bad(key, "not supported");
    } else if (key == "best_of" && !chat) {
      PDSERVE_ASSIGN(i, Integer(key, v, 1, std::numeric_limits<int32_t>::max()));
      if (i != 1) return Bad(key, "only 1 is supported");
    } else if (key == "echo" && !chat) {
      PDSERVE_ASSIGN(b, Bool(key, v));
      if (b) return Bad(key, "not supported");
    } else if (key == "suffix" && !chat) {
      std::string sfx;
      PDSERVE_ASSIGN(sfx, String(key, v));
      if (!sfx.empty()) return Bad(key, "not supported");
    } else if (key == "response_format" && chat) {
      if (absl::Status st = DecodeResponseFormat(v, g); !st.ok()) return st;
    } else if (key == "tools" && chat) {
      if (absl::Status st = DecodeTools(v, g); !st.ok()) return st;
    } else if (key == "tool_choice" && chat) {
      if (absl::Status st = DecodeToolChoice(v, g); !st.ok()) return st;
    } else if (key == "parallel_tool_calls" && chat) {
      PDSERVE_ASSIGN(b, Bool(key, v));
      g.set_parallel_tool_calls(b);
    } else if (key == "tools" || key == "tool_choice" || key == "functions" || key == "function_call" ||
               key == "prediction" || key == "audio" || key == "modalities" || key == "web_search_options" ||
               key == "reasoning_effort") {
      return Bad(key, "not supported");
    } else if (std::find(std::begin(kIgnoredFields), std::end(kIgnoredFields), key) != std::end(kIgnoredFields)) {
      continue;  // cannot change the output
    } else {
      return Bad(key, chat ? "unknown field for /v1/chat/completions" : "unknown field for /v1/completions");
    }
  }
  if (!has_prompt) return Bad(chat ? "messages" : "prompt", "required");
  if (max_completion_tokens.has_value()) max_tokens = max_completion_tokens;
  if (max_tokens.has_value()) g.set_max_tokens(static_cast<int32_t>(*max_tokens));
  if (chat) {
    if (top_logprobs.has_value()) {
      if (!r.logprobs && *top_logprobs > 0) return Bad("top_logprobs", "requires logprobs: true");
      r.top_logprobs = static_cast<int32_t>(*top_logprobs);
    }
  }
  if (r.logprobs) g.set_logprobs(std::max(1, r.top_logprobs));
  if (!r.stream && r.logprobs) {
    if (absl::Status st = CheckWholeReply(r, max_completion_tokens.has_value(), limits); !st.ok()) return st;
  }
  return r;
}

}  // namespace pdserve::router::openai
