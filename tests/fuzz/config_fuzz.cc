// libFuzzer target: ParseModelConfig and ApplyGenerationConfig on arbitrary
// bytes (the same bytes are offered as both files).
//
// A refused input must get an error naming its file; an accepted config.json
// must satisfy what the rest of the engine relies on (positive sizes, heads
// divisible by KV heads, even head_dim, valid token ids, sizes derived
// without overflow).
//
// The entry point is LLVMFuzzerTestOneInput for the fuzzer; the corpus replay
// test compiles this file with -DPDSERVE_FUZZ_ENTRY=<name> so that it can link
// both targets into one binary.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "model/model_config.h"

#ifndef PDSERVE_FUZZ_ENTRY
#define PDSERVE_FUZZ_ENTRY LLVMFuzzerTestOneInput
#endif

namespace {

constexpr absl::string_view kConfigSource = "fuzz/config.json";
constexpr absl::string_view kGenerationSource = "fuzz/generation_config.json";

// Keeps the derived sizes observable so they are not optimised away.
volatile int64_t g_derived_sink = 0;

// A broken promise of the parser: say which, then crash for the fuzzer.
[[noreturn]] void Fail(const char* what, absl::string_view detail) {
  std::fprintf(stderr, "config_fuzz: %s%.*s\n", what, static_cast<int>(detail.size()),
               detail.data());
  std::abort();
}

#define REQUIRE(condition)                                             \
  do {                                                                 \
    if (!(condition)) Fail("accepted config breaks: " #condition, ""); \
  } while (false)

void RequireNamed(const absl::Status& status, absl::string_view source) {
  if (!status.ok() && !absl::StartsWith(status.message(), source)) {
    Fail("error does not name the file: ", status.message());
  }
}

bool PositiveFinite(double v) { return v > 0 && std::isfinite(v); }

void CheckTokenIds(const pdserve::ModelConfig& c) {
  if (c.bos_token_id.has_value()) REQUIRE(*c.bos_token_id >= 0);
  for (int32_t id : c.eos_token_ids) REQUIRE(id >= 0);
}

void CheckAccepted(const pdserve::ModelConfig& c) {
  REQUIRE(c.vocab_size > 0 && c.vocab_size <= INT32_MAX);
  REQUIRE(c.hidden_size > 0 && c.intermediate_size > 0 && c.num_layers > 0);
  REQUIRE(c.num_heads > 0 && c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads == 0);
  REQUIRE(c.head_dim > 0 && c.head_dim % 2 == 0);
  REQUIRE(c.max_position_embeddings > 0);
  REQUIRE(PositiveFinite(c.rms_norm_eps) && PositiveFinite(c.rope_theta));
  if (c.rope_scaling.has_value()) {
    const pdserve::Llama3RopeScaling& s = *c.rope_scaling;
    REQUIRE(PositiveFinite(s.factor) && PositiveFinite(s.low_freq_factor));
    REQUIRE(PositiveFinite(s.high_freq_factor) && s.high_freq_factor > s.low_freq_factor);
    REQUIRE(s.original_max_position_embeddings > 0);
  }
  REQUIRE(c.qkv_bias == (c.architecture == pdserve::Architecture::kQwen2));
  REQUIRE(!c.architecture_name.empty());
  CheckTokenIds(c);
  // The engine derives these from any accepted config (Model::Load, pdctl);
  // UBSan flags an overflow.
  for (int64_t v : {c.GroupSize(), c.QDim(), c.KvDim(), c.NumParameters()}) g_derived_sink = v;
}

}  // namespace

extern "C" int PDSERVE_FUZZ_ENTRY(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<pdserve::ModelConfig> parsed = pdserve::ParseModelConfig(text, kConfigSource);
  RequireNamed(parsed.status(), kConfigSource);
  pdserve::ModelConfig config;
  if (parsed.ok()) {
    CheckAccepted(*parsed);
    config = *std::move(parsed);
  }
  const absl::Status applied = pdserve::ApplyGenerationConfig(text, kGenerationSource, config);
  RequireNamed(applied, kGenerationSource);
  if (applied.ok()) CheckTokenIds(config);
  return 0;
}
