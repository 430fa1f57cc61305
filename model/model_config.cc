#include "model/model_config.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

using nlohmann::json;

class Reader {
 public:
  Reader(const json& j, absl::string_view source) : j_(j), source_(source) {}

  absl::Status Error(absl::string_view field, absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(source_, ": field '", field, "': ", what));
  }

  // A required (or defaulted) positive integer, at most `max` (sizes are
  // bounded so that every derived product fits in 64 bits).
  absl::StatusOr<int64_t> PositiveInt(absl::string_view field, std::optional<int64_t> def,
                                      int64_t max = int64_t{1} << 24) const {
    auto it = j_.find(field);
    if (it == j_.end() || it->is_null()) {
      if (def) return *def;
      return Error(field, "missing");
    }
    if (!it->is_number_integer()) return Error(field, "must be an integer");
    const int64_t v = it->get<int64_t>();
    if (v <= 0) return Error(field, absl::StrCat("must be positive, got ", v));
    if (v > max) return Error(field, absl::StrCat(v, " exceeds the supported maximum ", max));
    return v;
  }

  absl::StatusOr<double> PositiveNumber(absl::string_view field, double def) const {
    auto it = j_.find(field);
    if (it == j_.end() || it->is_null()) return def;
    if (!it->is_number()) return Error(field, "must be a number");
    const double v = it->get<double>();
    if (!(v > 0) || !std::isfinite(v)) return Error(field, absl::StrCat("must be positive, got ", v));
    return v;
  }

  absl::StatusOr<bool> Bool(absl::string_view field, bool def) const {
    auto it = j_.find(field);
    if (it == j_.end() || it->is_null()) return def;
    if (!it->is_boolean()) return Error(field, "must be true or false");
    return it->get<bool>();
  }

  const json* Find(absl::string_view field) const {
    auto it = j_.find(field);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }

 private:
  const json& j_;
  absl::string_view source_;
};

#define PD_ASSIGN(lhs, expr)              \
  do {                                    \
    auto _v = (expr);                     \
    if (!_v.ok()) return _v.status();     \
    lhs = *std::move(_v);                 \
  } while (0)

absl::StatusOr<std::vector<int32_t>> TokenIdList(const json& v, absl::string_view field,
                                                  const Reader& r) {
  std::vector<int32_t> ids;
  auto one = [&](const json& x) -> absl::Status {
    if (!x.is_number_integer() || x.get<int64_t>() < 0 || x.get<int64_t>() > INT32_MAX) {
      return r.Error(field, "must be a non-negative token id or a list of them");
    }
    ids.push_back(static_cast<int32_t>(x.get<int64_t>()));
    return absl::OkStatus();
  };
  if (v.is_array()) {
    for (const auto& x : v) {
      if (absl::Status s = one(x); !s.ok()) return s;
    }
  } else if (absl::Status s = one(v); !s.ok()) {
    return s;
  }
  return ids;
}

}  // namespace

int64_t ModelConfig::NumParameters() const {
  const int64_t per_layer = hidden_size * (QDim() + 2 * KvDim()) + QDim() * hidden_size +
                            3 * hidden_size * intermediate_size + 2 * hidden_size +
                            (qkv_bias ? QDim() + 2 * KvDim() : 0);
  return num_layers * per_layer + vocab_size * hidden_size * (tie_word_embeddings ? 1 : 2) +
         hidden_size;
}

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text, absl::string_view source) {
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not valid JSON"));
  }
  if (!j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a JSON object"));
  }
  Reader r(j, source);
  ModelConfig c;

  const json* archs = r.Find("architectures");
  if (archs == nullptr || !archs->is_array() || archs->size() != 1 || !(*archs)[0].is_string()) {
    return r.Error("architectures", "must be a list with one architecture name");
  }
  c.architecture_name = (*archs)[0].get<std::string>();
  if (c.architecture_name == "LlamaForCausalLM") {
    c.architecture = Architecture::kLlama;
  } else if (c.architecture_name == "MistralForCausalLM") {
    c.architecture = Architecture::kMistral;
  } else if (c.architecture_name == "Qwen2ForCausalLM") {
    c.architecture = Architecture::kQwen2;
    c.qkv_bias = true;
  } else {
    return r.Error("architectures",
                   absl::StrCat("unsupported architecture '", c.architecture_name,
                                "' (supported: LlamaForCausalLM, MistralForCausalLM, "
                                "Qwen2ForCausalLM)"));
  }

  PD_ASSIGN(c.vocab_size, r.PositiveInt("vocab_size", std::nullopt));
  PD_ASSIGN(c.hidden_size, r.PositiveInt("hidden_size", std::nullopt, int64_t{1} << 20));
  PD_ASSIGN(c.intermediate_size, r.PositiveInt("intermediate_size", std::nullopt, int64_t{1} << 22));
  PD_ASSIGN(c.num_layers, r.PositiveInt("num_hidden_layers", std::nullopt, 4096));
  PD_ASSIGN(c.num_heads, r.PositiveInt("num_attention_heads", std::nullopt, 4096));
  PD_ASSIGN(c.num_kv_heads, r.PositiveInt("num_key_value_heads", c.num_heads, 4096));
  if (c.hidden_size % c.num_heads != 0 && r.Find("head_dim") == nullptr) {
    return r.Error("head_dim", "missing and hidden_size is not a multiple of num_attention_heads");
  }
  PD_ASSIGN(c.head_dim, r.PositiveInt("head_dim", c.hidden_size / c.num_heads, 4096));
  PD_ASSIGN(c.max_position_embeddings, r.PositiveInt("max_position_embeddings", 4096));
  PD_ASSIGN(c.rms_norm_eps, r.PositiveNumber("rms_norm_eps", 1e-6));
  PD_ASSIGN(c.rope_theta, r.PositiveNumber("rope_theta", 10000.0));
  PD_ASSIGN(c.tie_word_embeddings, r.Bool("tie_word_embeddings", false));

  if (c.num_heads % c.num_kv_heads != 0) {
    return r.Error("num_key_value_heads",
                   absl::StrCat(c.num_kv_heads, " does not divide num_attention_heads ",
                                c.num_heads));
  }
  if (c.head_dim % 2 != 0) return r.Error("head_dim", "must be even for RoPE");
  if (c.vocab_size > INT32_MAX) return r.Error("vocab_size", "too large");

  if (const json* act = r.Find("hidden_act")) {
    if (!act->is_string() || act->get<std::string>() != "silu") {
      return r.Error("hidden_act", "only 'silu' is supported");
    }
  }
  bool attention_bias = false, mlp_bias = false;
  PD_ASSIGN(attention_bias, r.Bool("attention_bias", false));
  PD_ASSIGN(mlp_bias, r.Bool("mlp_bias", false));
  if (attention_bias) return r.Error("attention_bias", "biases on all attention projections are not supported");
  if (mlp_bias) return r.Error("mlp_bias", "MLP biases are not supported");

  // Sliding-window attention changes the result once a sequence is longer
  // than the window; refuse it unless it can never take effect.
  if (c.architecture == Architecture::kQwen2) {
    bool use_sw = false;
    PD_ASSIGN(use_sw, r.Bool("use_sliding_window", false));
    if (use_sw) return r.Error("use_sliding_window", "sliding-window attention is not supported");
  } else if (const json* sw = r.Find("sliding_window")) {
    if (!sw->is_number_integer()) return r.Error("sliding_window", "must be an integer or null");
    if (sw->get<int64_t>() < c.max_position_embeddings) {
      return r.Error("sliding_window",
                     absl::StrCat("sliding-window attention (window ", sw->get<int64_t>(),
                                  " < max_position_embeddings ", c.max_position_embeddings,
                                  ") is not supported"));
    }
  }

  if (const json* rs = r.Find("rope_scaling")) {
    if (!rs->is_object()) return r.Error("rope_scaling", "must be an object or null");
    Reader sr(*rs, source);
    const json* type = sr.Find("rope_type");
    if (type == nullptr) type = sr.Find("type");
    if (type == nullptr || !type->is_string()) {
      return r.Error("rope_scaling.rope_type", "missing");
    }
    const std::string t = type->get<std::string>();
    if (t == "default") {
      // Plain RoPE.
    } else if (t == "llama3") {
      Llama3RopeScaling s;
      auto err = [&](const absl::Status& st) {
        return absl::InvalidArgumentError(
            absl::StrCat(st.message(), " (in rope_scaling)"));
      };
      auto f = sr.PositiveNumber("factor", 0);
      auto lo = sr.PositiveNumber("low_freq_factor", 0);
      auto hi = sr.PositiveNumber("high_freq_factor", 0);
      auto orig = sr.PositiveInt("original_max_position_embeddings", std::nullopt);
      if (!f.ok()) return err(f.status());
      if (!lo.ok()) return err(lo.status());
      if (!hi.ok()) return err(hi.status());
      if (!orig.ok()) return err(orig.status());
      if (*f == 0 || *lo == 0 || *hi == 0) {
        return r.Error("rope_scaling", "llama3 needs factor, low_freq_factor and high_freq_factor");
      }
      if (!(*hi > *lo)) {
        return r.Error("rope_scaling.high_freq_factor", "must exceed low_freq_factor");
      }
      s.factor = *f;
      s.low_freq_factor = *lo;
      s.high_freq_factor = *hi;
      s.original_max_position_embeddings = *orig;
      c.rope_scaling = s;
    } else {
      return r.Error("rope_scaling.rope_type",
                     absl::StrCat("unsupported rope scaling type '", t,
                                  "' (supported: llama3, default)"));
    }
  }

  if (const json* bos = r.Find("bos_token_id")) {
    auto ids = TokenIdList(*bos, "bos_token_id", r);
    if (!ids.ok()) return ids.status();
    if (!ids->empty()) c.bos_token_id = (*ids)[0];
  }
  if (const json* eos = r.Find("eos_token_id")) {
    PD_ASSIGN(c.eos_token_ids, TokenIdList(*eos, "eos_token_id", r));
  }
  return c;
}

absl::Status ApplyGenerationConfig(absl::string_view json_text, absl::string_view source,
                                   ModelConfig& config) {
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": not a valid JSON object"));
  }
  Reader r(j, source);
  if (const json* eos = r.Find("eos_token_id")) {
    auto ids = TokenIdList(*eos, "eos_token_id", r);
    if (!ids.ok()) return ids.status();
    config.eos_token_ids = *std::move(ids);
  }
  if (const json* bos = r.Find("bos_token_id")) {
    auto ids = TokenIdList(*bos, "bos_token_id", r);
    if (!ids.ok()) return ids.status();
    if (!ids->empty()) config.bos_token_id = (*ids)[0];
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat(path, ": no such file"));
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

absl::StatusOr<ModelConfig> LoadModelConfig(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return text.status();
  absl::StatusOr<ModelConfig> config = ParseModelConfig(*text, path);
  if (!config.ok()) return config.status();
  const std::string gen_path = model_dir + "/generation_config.json";
  absl::StatusOr<std::string> gen = ReadFileToString(gen_path);
  if (gen.ok()) {
    if (absl::Status s = ApplyGenerationConfig(*gen, gen_path, *config); !s.ok()) return s;
  } else if (!absl::IsNotFound(gen.status())) {
    return gen.status();
  }
  return config;
}

}  // namespace pdserve
