// The cost of response formats in `pdctl bench-engine`: per sampled token,
// the time Generation::Accept takes under a JSON Schema beyond the same
// Accept unconstrained (the mask lookup or computation, and the filter),
// at each vocabulary given, beside the engine's batch-1 decode step.
//
// Each vocabulary runs the same schema (bounded strings, an enum, numbers,
// a nested object and an array) for `generations` outputs of random logits
// (seeded), so the walk visits the states a real output does. Reported:
// the median warm token (mask from the cache), the mean cold mask (a trie
// walk, the first time a state is seen), the mean over every token, and
// that mean as a fraction of the step.
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_GRAMMAR_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_GRAMMAR_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace pdserve::pdctl {

struct BenchMaskOptions {
  std::vector<std::string> tokenizer_dirs;  // One row each.
  int generations = 20;
  int max_tokens = 200;
  double step_seconds = 0;  // The batch-1 decode step to compare with (0: none).
};

absl::StatusOr<nlohmann::ordered_json> BenchMasks(const BenchMaskOptions& options);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_GRAMMAR_H_
