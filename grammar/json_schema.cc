#include "grammar/json_schema.h"

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace pdserve::grammar {
namespace {

using json = nlohmann::ordered_json;

constexpr const char* kDescriptive[] = {"title",    "description", "default",    "examples", "$comment",
                                        "$schema",  "$id",         "deprecated", "readOnly", "writeOnly"};
constexpr const char* kTypes[] = {"object", "array", "string", "number", "integer", "boolean", "null"};

bool Descriptive(const std::string& key) {
  return std::find_if(std::begin(kDescriptive), std::end(kDescriptive),
                      [&](const char* k) { return key == k; }) != std::end(kDescriptive);
}

std::string Where(const std::string& pointer) { return absl::StrCat("schema at #", pointer); }

absl::Status Bad(const std::string& pointer, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(Where(pointer), ": ", why));
}

// "/a~1b" escaping of one JSON Pointer token.
std::string Token(const std::string& key) {
  std::string out;
  for (char c : key) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

absl::Status CheckJsonDepth(absl::string_view text, int32_t max_depth) {
  int32_t depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) {
        return absl::InvalidArgumentError(absl::StrCat("schema: nested deeper than ", max_depth, " levels"));
      }
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return absl::OkStatus();
}

namespace {

class Compiler {
 public:
  // `b` may be shared with other compilers (one per schema root, each with
  // its own references), so that several schemas make one grammar.
  Compiler(const json& root, const SchemaOptions& o, Builder& b) : root_(root), o_(o), b_(b) {}

  absl::StatusOr<std::shared_ptr<const Grammar>> Schema() {
    absl::StatusOr<uint32_t> top = RootRule();
    if (!top.ok()) return top.status();
    return b_.Build(*top, o_.max_depth);
  }

  // The root schema as a rule, with everything it refers to.
  absl::StatusOr<uint32_t> RootRule() {
    const uint32_t top = b_.NewRule();
    ref_rules_["#"] = top;
    absl::StatusOr<Frag> body = Compile(root_, "");
    if (!body.ok()) return body.status();
    b_.Define(top, *body);
    if (absl::Status s = DefinePending(); !s.ok()) return s;
    return top;
  }

  absl::StatusOr<std::shared_ptr<const Grammar>> AnyObject() {
    const uint32_t top = b_.NewRule();
    b_.Define(top, b_.Call(AnyObjectRule()));
    return b_.Build(top, o_.max_depth);
  }

  uint32_t AnyObjectRuleForTools() { return AnyObjectRule(); }

 private:
  absl::Status Budget() {
    if (b_.over_budget()) {
      return absl::ResourceExhaustedError(absl::StrCat("schema: its grammar needs more than ", o_.max_nodes,
                                                       " nodes (raise --grammar_max_nodes, or simplify the schema)"));
    }
    return absl::OkStatus();
  }

  // ---- Shared rules: the JSON primitives and "any value". ----

  // Edges for one JSON string character from `from` to `to`: a plain
  // byte, a UTF-8 sequence as RFC 3629 defines it (no overlongs, no
  // surrogates), or an escape, where \u surrogates come only as a high one
  // then a low one (strict parsers refuse a lone surrogate, and a pair is
  // one character). The first byte of every character is an edge of
  // `from`, so inside a string a matcher holds one stack.
  void Character(uint32_t from, uint32_t to) {
    const uint32_t c1 = b_.NewNode(), c2 = b_.NewNode(), c3 = b_.NewNode();
    const uint32_t e0 = b_.NewNode(), ed = b_.NewNode(), f0 = b_.NewNode(), f4 = b_.NewNode();
    const uint32_t esc = b_.NewNode(), u1 = b_.NewNode(), u2 = b_.NewNode(), u3 = b_.NewNode(), u4 = b_.NewNode();
    b_.AddRange(from, 0x20, 0x21, to);
    b_.AddRange(from, 0x23, 0x5B, to);
    b_.AddRange(from, 0x5D, 0x7F, to);
    b_.AddRange(from, '\\', '\\', esc);
    b_.AddRange(from, 0xC2, 0xDF, c1);
    b_.AddRange(from, 0xE0, 0xE0, e0);
    b_.AddRange(from, 0xE1, 0xEC, c2);
    b_.AddRange(from, 0xED, 0xED, ed);
    b_.AddRange(from, 0xEE, 0xEF, c2);
    b_.AddRange(from, 0xF0, 0xF0, f0);
    b_.AddRange(from, 0xF1, 0xF3, c3);
    b_.AddRange(from, 0xF4, 0xF4, f4);
    b_.AddRange(c1, 0x80, 0xBF, to);
    b_.AddRange(c2, 0x80, 0xBF, c1);
    b_.AddRange(c3, 0x80, 0xBF, c2);
    b_.AddRange(e0, 0xA0, 0xBF, c1);
    b_.AddRange(ed, 0x80, 0x9F, c1);
    b_.AddRange(f0, 0x90, 0xBF, c2);
    b_.AddRange(f4, 0x80, 0x8F, c2);
    for (char c : std::string("\"\\/bfnrt")) b_.AddRange(esc, c, c, to);
    b_.AddRange(esc, 'u', 'u', u1);
    auto hex_to = [&](uint32_t a, uint32_t z) {
      b_.AddRange(a, '0', '9', z);
      b_.AddRange(a, 'a', 'f', z);
      b_.AddRange(a, 'A', 'F', z);
    };
    const uint32_t ud = b_.NewNode(), h3 = b_.NewNode(), h4 = b_.NewNode(), h5 = b_.NewNode(), h6 = b_.NewNode();
    const uint32_t h7 = b_.NewNode(), h8 = b_.NewNode(), h9 = b_.NewNode(), h10 = b_.NewNode();
    b_.AddRange(u1, '0', '9', u2);
    b_.AddRange(u1, 'a', 'c', u2);
    b_.AddRange(u1, 'A', 'C', u2);
    b_.AddRange(u1, 'e', 'f', u2);
    b_.AddRange(u1, 'E', 'F', u2);
    b_.AddRange(u1, 'd', 'd', ud);
    b_.AddRange(u1, 'D', 'D', ud);
    hex_to(u2, u3);
    b_.AddRange(ud, '0', '7', u3);
    hex_to(u3, u4);
    hex_to(u4, to);
    b_.AddRange(ud, '8', '9', h3);
    b_.AddRange(ud, 'a', 'b', h3);
    b_.AddRange(ud, 'A', 'B', h3);
    hex_to(h3, h4);
    hex_to(h4, h5);
    b_.AddRange(h5, '\\', '\\', h6);
    b_.AddRange(h6, 'u', 'u', h7);
    b_.AddRange(h7, 'd', 'd', h8);
    b_.AddRange(h7, 'D', 'D', h8);
    b_.AddRange(h8, 'c', 'f', h9);
    b_.AddRange(h8, 'C', 'F', h9);
    hex_to(h9, h10);
    hex_to(h10, to);
  }

  // A string of any length (shared by every unbounded string).
  uint32_t StringRule() {
    if (string_ != kNone) return string_;
    string_ = b_.NewRule();
    const uint32_t in = b_.NewNode(), body = b_.NewNode(), out = b_.NewNode();
    b_.AddRange(in, '"', '"', body);
    b_.AddRange(body, '"', '"', out);
    Character(body, body);
    b_.Define(string_, Frag{in, out});
    return string_;
  }

  // A string of min..max characters (max < 0: no bound), one rule per pair.
  uint32_t StringRule(int64_t min, int64_t max) {
    if (min == 0 && max < 0) return StringRule();
    const std::pair<int64_t, int64_t> key{min, max};
    if (auto it = bounded_strings_.find(key); it != bounded_strings_.end()) return it->second;
    const uint32_t r = b_.NewRule();
    bounded_strings_[key] = r;
    const uint32_t in = b_.NewNode(), out = b_.NewNode();
    uint32_t at = b_.NewNode();  // `i` characters written.
    b_.AddRange(in, '"', '"', at);
    const int64_t chain = max < 0 ? min : max;
    for (int64_t i = 0; i < chain && !b_.over_budget(); ++i) {
      if (i >= min) b_.AddRange(at, '"', '"', out);
      const uint32_t next = b_.NewNode();
      Character(at, next);
      at = next;
    }
    b_.AddRange(at, '"', '"', out);
    if (max < 0) Character(at, at);
    b_.Define(r, Frag{in, out});
    return r;
  }

  // `min`..`max` decimal digits.
  Frag Digits(int min, int max) {
    std::vector<Frag> parts;
    for (int i = 0; i < min; ++i) parts.push_back(b_.Range('0', '9'));
    Frag rest = b_.Empty();
    for (int i = max - min; i > 0; --i) rest = b_.Opt(b_.Seq({b_.Range('0', '9'), rest}));
    parts.push_back(rest);
    return b_.Seq(parts);
  }

  Frag IntegerPart() {
    return b_.Seq({b_.Opt(b_.Literal("-")), b_.Alt({b_.Literal("0"), b_.Seq({b_.Range('1', '9'), Digits(0, 15)})})});
  }

  uint32_t IntegerRule() {
    if (integer_ != kNone) return integer_;
    integer_ = b_.NewRule();
    b_.Define(integer_, IntegerPart());
    return integer_;
  }

  uint32_t NumberRule() {
    if (number_ != kNone) return number_;
    number_ = b_.NewRule();
    Frag frac = b_.Opt(b_.Seq({b_.Literal("."), Digits(1, 16)}));
    Frag exp = b_.Opt(b_.Seq({b_.Alt({b_.Literal("e"), b_.Literal("E")}),
                              b_.Opt(b_.Alt({b_.Literal("+"), b_.Literal("-")})), Digits(1, 2)}));
    b_.Define(number_, b_.Seq({IntegerPart(), frac, exp}));
    return number_;
  }

  Frag Space() { return b_.Opt(b_.Literal(" ")); }

  // '{' [key ':' value (',' key ':' value)*] '}' with keys any string.
  Frag FreeObject(uint32_t value_rule) {
    auto member = [&] { return b_.Seq({b_.Call(StringRule()), b_.Literal(":"), Space(), b_.Call(value_rule)}); };
    Frag more = b_.Star(b_.Seq({b_.Literal(","), Space(), member()}));
    return b_.Seq({b_.Literal("{"), b_.Opt(b_.Seq({member(), more})), b_.Literal("}")});
  }

  // '[' items ']' with min..max items (max < 0: no bound).
  Frag Array(uint32_t item_rule, int64_t min = 0, int64_t max = -1) {
    if (max == 0) return b_.Literal("[]");
    auto next = [&] { return b_.Seq({b_.Literal(","), Space(), b_.Call(item_rule)}); };
    std::vector<Frag> items{b_.Call(item_rule)};
    for (int64_t i = 1; i < min && !b_.over_budget(); ++i) items.push_back(next());
    if (max < 0) {
      items.push_back(b_.Star(next()));
    } else {
      Frag rest = b_.Empty();
      for (int64_t i = max - std::max<int64_t>(min, 1); i > 0 && !b_.over_budget(); --i) {
        rest = b_.Opt(b_.Seq({next(), rest}));
      }
      items.push_back(rest);
    }
    Frag body = b_.Seq(items);
    return b_.Seq({b_.Literal("["), min == 0 ? b_.Opt(body) : body, b_.Literal("]")});
  }

  uint32_t AnyValueRule() {
    if (any_value_ != kNone) return any_value_;
    any_value_ = b_.NewRule();
    const uint32_t array = b_.NewRule();
    b_.Define(array, Array(any_value_));
    b_.Define(any_value_, b_.Alt({b_.Call(AnyObjectRule()), b_.Call(array), b_.Call(StringRule()),
                                  b_.Call(NumberRule()), b_.Literal("true"), b_.Literal("false"),
                                  b_.Literal("null")}));
    return any_value_;
  }

  uint32_t AnyObjectRule() {
    if (any_object_ != kNone) return any_object_;
    any_object_ = b_.NewRule();
    b_.Define(any_object_, FreeObject(AnyValueRule()));
    return any_object_;
  }

  // A subschema as a rule of its own (for items, values, anyOf options).
  absl::StatusOr<uint32_t> Rule(const json& s, const std::string& pointer) {
    absl::StatusOr<Frag> f = Compile(s, pointer);
    if (!f.ok()) return f.status();
    const uint32_t r = b_.NewRule();
    b_.Define(r, *f);
    return r;
  }

  // ---- Schemas ----

  absl::StatusOr<Frag> Compile(const json& s, const std::string& pointer) {
    if (absl::Status st = Budget(); !st.ok()) return st;
    if (s.is_boolean()) {
      if (s.get<bool>()) return b_.Call(AnyValueRule());
      return Bad(pointer, "the schema 'false' allows no value");
    }
    if (!s.is_object()) return Bad(pointer, "a schema must be an object or a boolean");
    std::vector<std::string> constraining;
    for (auto it = s.begin(); it != s.end(); ++it) {
      const std::string& k = it.key();
      if (Descriptive(k) || k == "$defs" || k == "definitions") continue;
      static const char* kKnown[] = {"type",      "properties", "required",  "additionalProperties",
                                     "items",     "enum",       "const",     "anyOf",
                                     "$ref",      "minLength",  "maxLength", "minItems",
                                     "maxItems"};
      if (std::find_if(std::begin(kKnown), std::end(kKnown), [&](const char* x) { return k == x; }) ==
          std::end(kKnown)) {
        return Bad(pointer, absl::StrCat("'", k, "' is not supported"));
      }
      constraining.push_back(k);
    }
    for (const char* defs : {"$defs", "definitions"}) {
      if (s.contains(defs) && !s[defs].is_object()) {
        return Bad(absl::StrCat(pointer, "/", defs), "must be an object of schemas");
      }
    }
    auto alone = [&](const char* k) -> absl::Status {
      if (constraining.size() > 1) {
        return Bad(pointer, absl::StrCat("'", k, "' together with '",
                                         absl::StrJoin(constraining, "', '"), "' is not supported"));
      }
      return absl::OkStatus();
    };
    if (s.contains("$ref")) {
      if (absl::Status st = alone("$ref"); !st.ok()) return st;
      return Ref(s["$ref"], absl::StrCat(pointer, "/$ref"));
    }
    if (s.contains("anyOf")) {
      if (absl::Status st = alone("anyOf"); !st.ok()) return st;
      const json& options = s["anyOf"];
      if (!options.is_array() || options.empty()) return Bad(pointer + "/anyOf", "must be a non-empty array");
      std::vector<Frag> alts;
      for (size_t i = 0; i < options.size(); ++i) {
        absl::StatusOr<Frag> f = Compile(options[i], absl::StrCat(pointer, "/anyOf/", i));
        if (!f.ok()) return f.status();
        alts.push_back(*f);
      }
      return b_.Alt(alts);
    }
    if (s.contains("const")) {
      if (s.contains("enum")) return Bad(pointer, "'const' together with 'enum' is not supported");
      return b_.Literal(s["const"].dump());
    }
    if (s.contains("enum")) {
      const json& values = s["enum"];
      if (!values.is_array() || values.empty()) return Bad(pointer + "/enum", "must be a non-empty array");
      std::vector<Frag> alts;
      for (const json& v : values) alts.push_back(b_.Literal(v.dump()));
      return b_.Alt(alts);
    }
    std::vector<std::string> types;
    if (s.contains("type")) {
      const json& t = s["type"];
      if (t.is_string()) {
        types.push_back(t.get<std::string>());
      } else if (t.is_array() && !t.empty()) {
        for (const json& x : t) {
          if (!x.is_string()) return Bad(pointer + "/type", "must be a type name or a list of them");
          types.push_back(x.get<std::string>());
        }
      } else {
        return Bad(pointer + "/type", "must be a type name or a non-empty list of them");
      }
      for (const std::string& name : types) {
        if (std::find_if(std::begin(kTypes), std::end(kTypes), [&](const char* x) { return name == x; }) ==
            std::end(kTypes)) {
          return Bad(pointer + "/type", absl::StrCat("unknown type '", name, "'"));
        }
      }
    } else if (s.contains("properties") || s.contains("required") || s.contains("additionalProperties")) {
      types.push_back("object");
    } else if (s.contains("items")) {
      types.push_back("array");
    } else {
      return b_.Call(AnyValueRule());
    }
    std::vector<Frag> alts;
    for (const std::string& t : types) {
      absl::StatusOr<Frag> f = Typed(s, t, pointer);
      if (!f.ok()) return f.status();
      alts.push_back(*f);
    }
    return alts.size() == 1 ? alts[0] : b_.Alt(alts);
  }

  // A length or count keyword: a non-negative integer, within what the
  // grammar can unroll (every bound costs nodes; see max_nodes).
  absl::Status Bound(const json& s, const char* key, const std::string& pointer, int64_t* out) {
    if (!s.contains(key)) return absl::OkStatus();
    const json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0) {
      return Bad(absl::StrCat(pointer, "/", key), "must be a non-negative integer");
    }
    if (v.get<int64_t>() > kMaxBound) {
      return Bad(absl::StrCat(pointer, "/", key), absl::StrCat("more than ", kMaxBound, " is not supported"));
    }
    *out = v.get<int64_t>();
    return absl::OkStatus();
  }

  absl::StatusOr<Frag> Typed(const json& s, const std::string& t, const std::string& pointer) {
    if (t == "string") {
      int64_t min = 0, max = -1;
      if (absl::Status st = Bound(s, "minLength", pointer, &min); !st.ok()) return st;
      if (absl::Status st = Bound(s, "maxLength", pointer, &max); !st.ok()) return st;
      if (max >= 0 && min > max) return Bad(pointer, "'minLength' is more than 'maxLength'");
      return b_.Call(StringRule(min, max));
    }
    if (t == "integer") return b_.Call(IntegerRule());
    if (t == "number") return b_.Call(NumberRule());
    if (t == "boolean") return b_.Alt({b_.Literal("true"), b_.Literal("false")});
    if (t == "null") return b_.Literal("null");
    if (t == "array") {
      int64_t min = 0, max = -1;
      if (absl::Status st = Bound(s, "minItems", pointer, &min); !st.ok()) return st;
      if (absl::Status st = Bound(s, "maxItems", pointer, &max); !st.ok()) return st;
      if (max >= 0 && min > max) return Bad(pointer, "'minItems' is more than 'maxItems'");
      uint32_t item = kNone;
      if (s.contains("items")) {
        if (s["items"].is_array()) return Bad(pointer + "/items", "a list of schemas (tuple items) is not supported");
        absl::StatusOr<uint32_t> r = Rule(s["items"], pointer + "/items");
        if (!r.ok()) return r.status();
        item = *r;
      } else {
        item = AnyValueRule();
      }
      return Array(item, min, max);
    }
    return Object(s, pointer);
  }

  absl::StatusOr<Frag> Object(const json& s, const std::string& pointer) {
    const json empty = json::object();
    const json& props = s.contains("properties") ? s["properties"] : empty;
    if (!props.is_object()) return Bad(pointer + "/properties", "must be an object of schemas");
    std::vector<std::string> names;
    for (auto it = props.begin(); it != props.end(); ++it) names.push_back(it.key());
    std::vector<bool> required(names.size(), false);
    if (s.contains("required")) {
      const json& req = s["required"];
      if (!req.is_array()) return Bad(pointer + "/required", "must be an array of property names");
      for (size_t i = 0; i < req.size(); ++i) {
        if (!req[i].is_string()) return Bad(absl::StrCat(pointer, "/required/", i), "must be a property name");
        auto at = std::find(names.begin(), names.end(), req[i].get<std::string>());
        if (at == names.end()) {
          return Bad(absl::StrCat(pointer, "/required/", i),
                     absl::StrCat("'", req[i].get<std::string>(), "' is not among the properties"));
        }
        required[at - names.begin()] = true;
      }
    }
    const json* additional = s.contains("additionalProperties") ? &s["additionalProperties"] : nullptr;
    if (additional != nullptr && !additional->is_boolean() && !additional->is_object()) {
      return Bad(pointer + "/additionalProperties", "must be a boolean or a schema");
    }
    if (names.empty()) {
      if (additional != nullptr && additional->is_boolean() && !additional->get<bool>()) return b_.Literal("{}");
      uint32_t value = AnyValueRule();
      if (additional != nullptr && additional->is_object()) {
        absl::StatusOr<uint32_t> r = Rule(*additional, pointer + "/additionalProperties");
        if (!r.ok()) return r.status();
        value = *r;
      }
      return FreeObject(value);
    }
    // The listed properties in order, each optional one skippable: node
    // at[i][e] is "before property i, e = something was written already
    // (a comma comes first)".
    const size_t n = names.size();
    std::vector<std::array<uint32_t, 2>> at(n + 1);
    for (auto& a : at) a = {b_.NewNode(), b_.NewNode()};
    const uint32_t close = b_.NewNode();
    Frag open = b_.Literal("{");
    b_.AddEmpty(open.out, at[0][0]);
    for (size_t i = 0; i < n; ++i) {
      absl::StatusOr<uint32_t> value = Rule(props[names[i]], absl::StrCat(pointer, "/properties/", Token(names[i])));
      if (!value.ok()) return value.status();
      Frag kv = b_.Seq({b_.Literal(json(names[i]).dump()), b_.Literal(":"), Space(), b_.Call(*value)});
      b_.AddEmpty(kv.out, at[i + 1][1]);
      b_.AddEmpty(at[i][0], kv.in);
      Frag comma = b_.Seq({b_.Literal(","), Space()});
      b_.AddEmpty(at[i][1], comma.in);
      b_.AddEmpty(comma.out, kv.in);
      if (!required[i]) {
        b_.AddEmpty(at[i][0], at[i + 1][0]);
        b_.AddEmpty(at[i][1], at[i + 1][1]);
      }
    }
    b_.AddEmpty(at[n][0], close);
    b_.AddEmpty(at[n][1], close);
    Frag end = b_.Literal("}");
    b_.AddEmpty(close, end.in);
    return Frag{open.in, end.out};
  }

  absl::StatusOr<Frag> Ref(const json& ref, const std::string& pointer) {
    if (!ref.is_string()) return Bad(pointer, "must be a string");
    const std::string target = ref.get<std::string>();
    if (target.empty() || target[0] != '#') {
      return Bad(pointer, absl::StrCat("'", target, "' is not supported: only references inside the schema ('#...')"));
    }
    if (auto it = ref_rules_.find(target); it != ref_rules_.end()) return b_.Call(it->second);
    const std::string path = target.substr(1);
    if (path.rfind("/$defs/", 0) != 0 && path.rfind("/definitions/", 0) != 0) {
      return Bad(pointer, absl::StrCat("'", target, "' is not supported: only '#', '#/$defs/...' and '#/definitions/...'"));
    }
    const json* node = nullptr;
    try {
      const json::json_pointer p(path);
      if (root_.contains(p)) node = &root_.at(p);
    } catch (const json::exception&) {
      return Bad(pointer, absl::StrCat("'", target, "' is not a JSON Pointer"));
    }
    if (node == nullptr) return Bad(pointer, absl::StrCat("'", target, "' refers to nothing in the schema"));
    const uint32_t r = b_.NewRule();
    ref_rules_[target] = r;
    pending_.push_back({r, node, path});
    return b_.Call(r);
  }

  // Referenced schemas are compiled once each, after the one that first
  // refers to them, so recursion ends.
  absl::Status DefinePending() {
    while (!pending_.empty()) {
      Pending p = pending_.back();
      pending_.pop_back();
      absl::StatusOr<Frag> f = Compile(*p.schema, p.pointer);
      if (!f.ok()) return f.status();
      b_.Define(p.rule, *f);
    }
    return Budget();
  }

  static constexpr uint32_t kNone = ~0u;
  static constexpr int64_t kMaxBound = 4096;
  struct Pending {
    uint32_t rule;
    const json* schema;
    std::string pointer;
  };

  const json& root_;
  const SchemaOptions& o_;
  Builder& b_;
  absl::flat_hash_map<std::pair<int64_t, int64_t>, uint32_t> bounded_strings_;
  uint32_t string_ = kNone, integer_ = kNone, number_ = kNone, any_value_ = kNone, any_object_ = kNone;
  absl::flat_hash_map<std::string, uint32_t> ref_rules_;
  std::vector<Pending> pending_;
};

}  // namespace

absl::StatusOr<CompiledSchema> CompileJsonSchema(absl::string_view schema, const SchemaOptions& options) {
  if (static_cast<int64_t>(schema.size()) > options.max_schema_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("schema: ", schema.size(), " bytes, more than the ",
                                                   options.max_schema_bytes, " allowed (--grammar_max_schema_bytes)"));
  }
  if (absl::Status s = CheckJsonDepth(schema, options.max_schema_depth); !s.ok()) return s;
  json root = json::parse(schema, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError("schema: not valid JSON");
  Builder b(options.max_nodes);
  Compiler c(root, options, b);
  absl::StatusOr<std::shared_ptr<const Grammar>> g = c.Schema();
  if (!g.ok()) return g.status();
  return CompiledSchema{*std::move(g), root.dump()};
}

absl::StatusOr<std::shared_ptr<const Grammar>> CompileAnyJsonObject(const SchemaOptions& options) {
  const json root = json::object();
  Builder b(options.max_nodes);
  Compiler c(root, options, b);
  return c.AnyObject();
}

bool IsToolName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char ch : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(ch)) && ch != '_' && ch != '-') return false;
  }
  return true;
}

absl::StatusOr<CompiledSchema> CompileToolCalls(absl::string_view spec, const SchemaOptions& options) {
  if (static_cast<int64_t>(spec.size()) > options.max_schema_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("tools: ", spec.size(), " bytes of parameter schemas, more than the ",
                                                   options.max_schema_bytes, " allowed (--grammar_max_schema_bytes)"));
  }
  // The spec nests each schema two levels down.
  if (absl::Status s = CheckJsonDepth(spec, options.max_schema_depth + 3); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("tools: ", s.message()));
  }
  const json root = json::parse(spec, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object() || !root.contains("tools") || !root["tools"].is_array() ||
      root["tools"].empty() || !root.contains("parallel") || !root["parallel"].is_boolean()) {
    return absl::InvalidArgumentError("tools: the spec must be {\"parallel\": bool, \"tools\": [...]}");
  }
  std::string syntax = "qwen";
  if (root.contains("syntax")) {
    if (!root["syntax"].is_string()) return absl::InvalidArgumentError("tools: the spec's syntax must be a string");
    syntax = root["syntax"].get<std::string>();
  }
  if (syntax != "qwen" && syntax != "llama3.1") {
    return absl::InvalidArgumentError(absl::StrCat("tools: unknown call syntax '", syntax, "' (qwen, llama3.1)"));
  }
  const bool llama = syntax == "llama3.1";
  if (llama && root["parallel"].get<bool>()) {
    return absl::InvalidArgumentError("tools: the llama3.1 syntax makes one call per message, never parallel ones");
  }
  Builder b(options.max_nodes);
  std::vector<Frag> calls;
  const json& tools = root["tools"];
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string at = absl::StrCat("tools[", i, "]");
    const json& t = tools[i];
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string() || !IsToolName(t["name"].get<std::string>())) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".function.name: must be 1 to 64 of A-Z, a-z, 0-9, _ and -"));
    }
    const std::string name = t["name"].get<std::string>();
    uint32_t args = 0;
    if (!t.contains("parameters")) {
      const json none = json::object();
      Compiler c(none, options, b);
      args = c.AnyObjectRuleForTools();
    } else {
      Compiler c(t["parameters"], options, b);
      absl::StatusOr<uint32_t> r = c.RootRule();
      if (!r.ok()) return absl::Status(r.status().code(), absl::StrCat(at, ".function.parameters: ", r.status().message()));
      args = *r;
    }
    if (llama) {
      calls.push_back(b.Seq({b.Literal(absl::StrCat("{\"name\": \"", name, "\", \"parameters\": ")), b.Call(args),
                             b.Literal("}")}));
    } else {
      calls.push_back(b.Seq({b.Literal(absl::StrCat("<tool_call>\n{\"name\": \"", name, "\", \"arguments\": ")),
                             b.Call(args), b.Literal("}\n</tool_call>")}));
    }
    if (b.over_budget()) break;
  }
  const uint32_t one = b.NewRule();
  b.Define(one, b.Alt(calls));
  const uint32_t top = b.NewRule();
  if (root["parallel"].get<bool>()) {
    b.Define(top, b.Seq({b.Call(one), b.Star(b.Seq({b.Literal("\n"), b.Call(one)}))}));
  } else {
    b.Define(top, b.Call(one));
  }
  if (b.over_budget()) {
    return absl::ResourceExhaustedError(absl::StrCat("tools: their grammar needs more than ", options.max_nodes,
                                                     " nodes (raise --grammar_max_nodes, or simplify the schemas)"));
  }
  absl::StatusOr<std::shared_ptr<const Grammar>> g = b.Build(top, options.max_depth);
  if (!g.ok()) return g.status();
  return CompiledSchema{*std::move(g), root.dump()};
}

}  // namespace pdserve::grammar
