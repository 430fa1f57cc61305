#include "router/capacity/plan_config.h"

#include <cmath>
#include <fstream>
#include <initializer_list>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace pdserve::capacity {
namespace {

using nlohmann::json;

absl::Status Invalid(absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", what));
}

std::string TypeName(const json& v) { return v.is_null() ? "null" : v.type_name(); }

// One object of the config. Getters record the first error and the keys
// they read; Finish() refuses keys nobody read.
class Section {
 public:
  Section(const json& root, std::string name, bool required = true) : name_(std::move(name)) {
    auto it = root.find(name_);
    if (it == root.end()) {
      if (required) status_ = Invalid(name_, "is missing");
      return;
    }
    if (!it->is_object()) {
      status_ = Invalid(name_, absl::StrCat("must be an object, got ", TypeName(*it)));
      return;
    }
    obj_ = &*it;
  }

  void Int(const char* key, int64_t* out) {
    if (const json* v = Get(key, /*required=*/true)) ToInt(*v, Field(key), out);
  }
  void Number(const char* key, double* out) {
    if (const json* v = Get(key, /*required=*/true)) ToNumber(*v, Field(key), out);
  }
  void OptionalNumber(const char* key, std::optional<double>* out) {
    if (const json* v = Get(key, /*required=*/false)) {
      double d = 0;
      if (ToNumber(*v, Field(key), &d)) *out = d;
    }
  }
  void String(const char* key, bool required, std::string* out) {
    const json* v = Get(key, required);
    if (v == nullptr) return;
    if (!v->is_string()) {
      Fail(Invalid(Field(key), absl::StrCat("must be a string, got ", TypeName(*v))));
      return;
    }
    *out = v->get<std::string>();
  }
  void IntList(const char* key, std::vector<int64_t>* out) {
    const json* v = Get(key, /*required=*/false);
    if (v == nullptr) return;
    if (!v->is_array()) {
      Fail(Invalid(Field(key), absl::StrCat("must be a list, got ", TypeName(*v))));
      return;
    }
    for (const json& e : *v) {
      int64_t i = 0;
      if (!ToInt(e, Field(key), &i)) return;
      out->push_back(i);
    }
  }

  void Fail(absl::Status s) {
    if (status_.ok()) status_ = std::move(s);
  }

  absl::Status Finish() {
    if (status_.ok() && obj_ != nullptr) {
      for (const auto& [key, unused] : obj_->items()) {
        if (!read_.contains(key)) return Invalid(Field(key.c_str()), "is not a known field");
      }
    }
    return status_;
  }

 private:
  std::string Field(const char* key) const { return absl::StrCat(name_, ".", key); }

  const json* Get(const char* key, bool required) {
    read_.insert(key);
    if (obj_ == nullptr || !status_.ok()) return nullptr;
    auto it = obj_->find(key);
    if (it == obj_->end()) {
      if (required) Fail(Invalid(Field(key), "is missing"));
      return nullptr;
    }
    return &*it;
  }

  bool ToNumber(const json& v, const std::string& field, double* out) {
    if (!v.is_number()) {
      Fail(Invalid(field, absl::StrCat("must be a number, got ", TypeName(v))));
      return false;
    }
    *out = v.get<double>();
    return true;
  }

  bool ToInt(const json& v, const std::string& field, int64_t* out) {
    if (v.is_number_integer()) {
      *out = v.get<int64_t>();
      return true;
    }
    // 8e1 is an integer written as a float; 80.5 is not.
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (std::isfinite(d) && d == std::floor(d) && std::fabs(d) < 9e15) {
        *out = static_cast<int64_t>(d);
        return true;
      }
      Fail(Invalid(field, absl::StrCat("must be an integer, got ", v.dump())));
      return false;
    }
    Fail(Invalid(field, absl::StrCat("must be an integer, got ", TypeName(v))));
    return false;
  }

  std::string name_;
  const json* obj_ = nullptr;
  absl::Status status_;
  std::set<std::string, std::less<>> read_;
};

absl::StatusOr<std::vector<std::string>> ReadNotes(const json& root) {
  std::vector<std::string> notes;
  auto it = root.find("notes");
  if (it == root.end()) return notes;
  if (it->is_string()) {
    notes.push_back(it->get<std::string>());
    return notes;
  }
  if (it->is_array()) {
    for (const json& n : *it) {
      if (!n.is_string()) break;
      notes.push_back(n.get<std::string>());
    }
    if (notes.size() == it->size()) return notes;
  }
  return Invalid("notes", "must be a string or a list of strings");
}

absl::StatusOr<PlanInputs> FromJson(const json& root) {
  if (!root.is_object()) return Invalid("the config", absl::StrCat("must be an object, got ", TypeName(root)));
  static const std::set<std::string, std::less<>> kSections = {"notes",   "model",    "chip",   "decode", "prefill",
                                                               "handoff", "workload", "prefix", "report"};
  for (const auto& [key, unused] : root.items()) {
    if (!kSections.contains(key)) return Invalid(key, "is not a known section");
  }
  PlanInputs in;
  absl::StatusOr<std::vector<std::string>> notes = ReadNotes(root);
  if (!notes.ok()) return notes.status();
  in.notes = *std::move(notes);

  Section model(root, "model");
  ModelShape& m = in.model;
  model.String("name", /*required=*/false, &m.name);
  model.Int("layers", &m.layers);
  model.Int("hidden", &m.hidden);
  model.Int("q_heads", &m.q_heads);
  model.Int("kv_heads", &m.kv_heads);
  model.Int("head_dim", &m.head_dim);
  model.Number("params", &m.params);
  model.Number("bytes_per_weight", &m.bytes_per_weight);
  model.Number("bytes_per_kv_element", &m.bytes_per_kv_element);
  if (absl::Status s = model.Finish(); !s.ok()) return s;

  Section chip(root, "chip");
  ChipSpec& c = in.chip;
  chip.String("name", /*required=*/false, &c.name);
  chip.Number("memory_bytes", &c.memory_bytes);
  chip.Number("reserved_bytes", &c.reserved_bytes);
  chip.Number("bandwidth_bytes_per_s", &c.bandwidth_bytes_per_s);
  chip.Number("peak_flops", &c.peak_flops);
  chip.OptionalNumber("price_per_hour", &c.price_per_hour);
  if (absl::Status s = chip.Finish(); !s.ok()) return s;

  Section decode(root, "decode");
  DecodePoolSpec& d = in.decode;
  decode.Int("groups", &d.groups);
  decode.Int("chips_per_group", &d.chips_per_group);
  std::string layout;
  decode.String("kv_layout", /*required=*/true, &layout);
  decode.OptionalNumber("exchange_s_per_step", &d.exchange_s_per_step);
  decode.OptionalNumber("allreduce_s_per_step", &d.allreduce_s_per_step);
  if (absl::Status s = decode.Finish(); !s.ok()) return s;
  absl::StatusOr<KvLayout> kv_layout = ParseKvLayout(layout);
  if (!kv_layout.ok()) return kv_layout.status();
  d.kv_layout = *kv_layout;

  Section prefill(root, "prefill");
  PrefillPoolSpec& p = in.prefill;
  prefill.Int("groups", &p.groups);
  prefill.Int("chips_per_group", &p.chips_per_group);
  prefill.Number("utilization", &p.utilization);
  prefill.OptionalNumber("seconds_per_request", &p.seconds_per_request);
  if (absl::Status s = prefill.Finish(); !s.ok()) return s;

  Section handoff(root, "handoff");
  handoff.Number("link_bytes_per_s", &in.handoff.link_bytes_per_s);
  handoff.OptionalNumber("kv_bytes_per_request", &in.handoff.kv_bytes_per_request);
  if (absl::Status s = handoff.Finish(); !s.ok()) return s;

  std::optional<double> pool_hit, tier2_hit;
  Section workload(root, "workload");
  WorkloadSpec& w = in.workload;
  workload.Int("prompt_tokens", &w.prompt_tokens);
  workload.Int("history_tokens", &w.history_tokens);
  workload.Number("mean_output_tokens", &w.mean_output_tokens);
  workload.Number("step_time_target_s", &w.step_time_target_s);
  workload.OptionalNumber("target_requests_per_s", &w.target_requests_per_s);
  if (absl::Status s = workload.Finish(); !s.ok()) return s;

  Section prefix(root, "prefix", /*required=*/false);
  prefix.OptionalNumber("pool_hit_rate", &pool_hit);
  prefix.OptionalNumber("tier2_hit_rate", &tier2_hit);
  prefix.OptionalNumber("tier2_bytes_per_group", &in.prefix.tier2_bytes_per_group);
  prefix.OptionalNumber("tier2_read_bytes_per_s", &in.prefix.tier2_read_bytes_per_s);
  if (absl::Status s = prefix.Finish(); !s.ok()) return s;
  in.prefix.pool_hit_rate = pool_hit.value_or(0);
  in.prefix.tier2_hit_rate = tier2_hit.value_or(0);

  Section report(root, "report", /*required=*/false);
  report.IntList("batch_sizes", &in.table_batches);
  if (absl::Status s = report.Finish(); !s.ok()) return s;
  return in;
}

// A YAML scalar as JSON: quoted scalars stay strings; plain ones become
// null, booleans, integers or numbers when they read as such (YAML 1.2 core
// schema, without the .inf/.nan spellings, which no field accepts anyway).
json ScalarToJson(const YAML::Node& n) {
  const std::string& s = n.Scalar();
  if (n.Tag() == "!") return s;
  if (s.empty() || s == "~" || s == "null" || s == "Null" || s == "NULL") return nullptr;
  if (s == "true" || s == "True" || s == "TRUE") return true;
  if (s == "false" || s == "False" || s == "FALSE") return false;
  int64_t i = 0;
  if (absl::SimpleAtoi(s, &i)) return i;
  double d = 0;
  const bool numeric_start =
      absl::ascii_isdigit(static_cast<unsigned char>(s[0])) || s[0] == '-' || s[0] == '+' || s[0] == '.';
  if (numeric_start && absl::SimpleAtod(s, &d) && std::isfinite(d)) return d;
  return s;
}

absl::StatusOr<json> YamlToJson(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      return json(nullptr);
    case YAML::NodeType::Scalar:
      return ScalarToJson(n);
    case YAML::NodeType::Sequence: {
      json out = json::array();
      for (const YAML::Node& e : n) {
        absl::StatusOr<json> v = YamlToJson(e);
        if (!v.ok()) return v;
        out.push_back(*std::move(v));
      }
      return out;
    }
    case YAML::NodeType::Map: {
      json out = json::object();
      for (const auto& kv : n) {
        if (!kv.first.IsScalar()) return absl::InvalidArgumentError("YAML: map keys must be plain scalars");
        absl::StatusOr<json> v = YamlToJson(kv.second);
        if (!v.ok()) return v;
        out[kv.first.Scalar()] = *std::move(v);
      }
      return out;
    }
  }
  return json(nullptr);
}

}  // namespace

absl::StatusOr<PlanInputs> ParsePlanConfig(absl::string_view text, ConfigFormat format) {
  json root;
  if (format == ConfigFormat::kJson) {
    // The library reports the position of a syntax error only by throwing.
    try {
      root = json::parse(text.begin(), text.end());
    } catch (const json::exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("JSON: ", e.what()));
    }
  } else {
    YAML::Node doc;
    try {
      doc = YAML::Load(std::string(text));
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat("YAML: ", e.what()));
    }
    absl::StatusOr<json> converted = YamlToJson(doc);
    if (!converted.ok()) return converted.status();
    root = *std::move(converted);
  }
  return FromJson(root);
}

absl::StatusOr<PlanInputs> LoadPlanConfig(const std::string& path) {
  ConfigFormat format;
  if (absl::EndsWith(path, ".json")) {
    format = ConfigFormat::kJson;
  } else if (absl::EndsWith(path, ".yaml") || absl::EndsWith(path, ".yml")) {
    format = ConfigFormat::kYaml;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(path, ": unknown config format (.json, .yaml or .yml)"));
  }
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream text;
  text << f.rdbuf();
  absl::StatusOr<PlanInputs> in = ParsePlanConfig(text.str(), format);
  if (!in.ok()) return absl::Status(in.status().code(), absl::StrCat(path, ": ", in.status().message()));
  return in;
}

}  // namespace pdserve::capacity
