// A deliberately naive, double-precision forward of a Llama-family model,
// written independently of the engine (no paging, no packing, no SIMD), for
// invariance tests and their negative controls.
#ifndef PDSERVE_TESTS_SUPPORT_REFERENCE_FORWARD_H_
#define PDSERVE_TESTS_SUPPORT_REFERENCE_FORWARD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "model/model_config.h"

namespace pdserve::testing {

struct ReferenceOptions {
  // Negative controls (deliberately wrong variants):
  // restart RoPE positions every `rope_restart_every` tokens (0 = never);
  int rope_restart_every = 0;
  // map query head h to KV head h % N_kv instead of h / g.
  bool wrong_gqa_mapping = false;
};

// Logits [positions][vocab] for every position of `tokens`.
absl::StatusOr<std::vector<std::vector<double>>> ReferenceLogits(
    const std::string& model_dir, const std::vector<int32_t>& tokens,
    const ReferenceOptions& options = {});

}  // namespace pdserve::testing

#endif  // PDSERVE_TESTS_SUPPORT_REFERENCE_FORWARD_H_
