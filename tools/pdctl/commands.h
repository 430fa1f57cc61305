// The engine commands of pdctl, callable from tests.
#ifndef PDSERVE_TOOLS_PDCTL_COMMANDS_H_
#define PDSERVE_TOOLS_PDCTL_COMMANDS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "tools/pdctl/engine_setup.h"

namespace pdserve::pdctl {

// Prints one JSON array of logits per line: every position of `ids` with
// `all_positions`, else the last one.
absl::Status PrintLogits(const EngineOptions& options, const std::vector<int32_t>& ids,
                         bool all_positions);

// Greedy decoding (argmax, ties to the lower id); prints the generated ids,
// comma-separated, on one line. Stops early at an EOS id of the config.
absl::Status GenerateGreedy(const EngineOptions& options, const std::vector<int32_t>& prompt,
                            int max_tokens);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_COMMANDS_H_
