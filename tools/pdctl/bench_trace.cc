#include "tools/pdctl/bench_trace.h"

#include <cstdint>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"

namespace pdserve::pdctl {
namespace {

using nlohmann::json;

// At most this much of an offending value goes into an error message.
constexpr size_t kShownValueChars = 40;

std::string Shown(const json& v) {
  std::string s = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > kShownValueChars) s = absl::StrCat(s.substr(0, kShownValueChars), "...");
  return s;
}

// The integer at `key` of `entry`, in [lo, hi]; false (and *error set) when
// it is present but not such an integer. An absent key leaves *out alone.
bool ReadInt(const json& entry, const char* key, int64_t lo, int64_t hi, const std::string& where, int64_t* out,
             absl::Status* error) {
  const auto it = entry.find(key);
  if (it == entry.end()) return true;
  bool in_range = false;
  if (it->is_number_unsigned()) {
    const uint64_t v = it->get<uint64_t>();
    in_range = v <= static_cast<uint64_t>(hi) && static_cast<int64_t>(v) >= lo;
    if (in_range) *out = static_cast<int64_t>(v);
  } else if (it->is_number_integer()) {
    const int64_t v = it->get<int64_t>();
    in_range = v >= lo && v <= hi;
    if (in_range) *out = v;
  }
  if (!in_range) {
    *error = absl::InvalidArgumentError(
        absl::StrCat(where, ": '", key, "' must be an integer in [", lo, ", ", hi, "], got ", Shown(*it)));
  }
  return in_range;
}

absl::StatusOr<TraceEntry> ParseLine(absl::string_view line, const std::string& where) {
  const json entry = json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
  if (entry.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(where, ": not valid JSON"));
  if (!entry.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expected a JSON object, got ", entry.type_name()));
  }
  for (const char* key : {"prompt_tokens", "output_tokens"}) {
    if (!entry.contains(key)) return absl::InvalidArgumentError(absl::StrCat(where, ": '", key, "' is missing"));
  }
  int64_t prompt = 0, output = 0, group = -1, prefix = -1;
  absl::Status error;
  if (!ReadInt(entry, "prompt_tokens", 1, kMaxTraceTokens, where, &prompt, &error) ||
      !ReadInt(entry, "output_tokens", 1, kMaxTraceTokens, where, &output, &error) ||
      !ReadInt(entry, "prefix_group", 0, INT64_MAX, where, &group, &error) ||
      !ReadInt(entry, "prefix_tokens", 0, prompt, where, &prefix, &error)) {
    return error;
  }
  if ((group < 0) != (prefix < 0)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": '", group < 0 ? "prefix_tokens" : "prefix_group",
                                                   "' needs '", group < 0 ? "prefix_group" : "prefix_tokens",
                                                   "' beside it"));
  }
  TraceEntry e;
  e.prompt_tokens = static_cast<int32_t>(prompt);
  e.output_tokens = static_cast<int32_t>(output);
  e.prefix_group = group;
  e.prefix_tokens = prefix < 0 ? 0 : static_cast<int32_t>(prefix);
  return e;
}

}  // namespace

absl::StatusOr<std::vector<TraceEntry>> ParseTraceJsonl(absl::string_view text, absl::string_view source) {
  std::vector<TraceEntry> entries;
  int64_t line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    absl::StatusOr<TraceEntry> e = ParseLine(line, absl::StrCat(source, " line ", line_number));
    if (!e.ok()) return e.status();
    entries.push_back(*e);
  }
  if (entries.empty()) return absl::InvalidArgumentError(absl::StrCat(source, ": no requests (empty trace)"));
  return entries;
}

absl::StatusOr<std::vector<TraceEntry>> ReadTraceFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat(path, ": cannot open the trace"));
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) return absl::NotFoundError(absl::StrCat(path, ": read failed"));
  return ParseTraceJsonl(text, path);
}

}  // namespace pdserve::pdctl
