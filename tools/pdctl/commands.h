// The engine commands of pdctl, callable from tests.
#ifndef PDSERVE_TOOLS_PDCTL_COMMANDS_H_
#define PDSERVE_TOOLS_PDCTL_COMMANDS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "engine/sampling.h"
#include "text/tokenizer.h"
#include "engine/model_stack.h"

namespace pdserve::pdctl {

// Prints one JSON array of logits per line: every position of `ids` with
// `all_positions`, else the last one.
absl::Status PrintLogits(const ModelStackOptions& options, const std::vector<int32_t>& ids,
                         bool all_positions);

// Generates with `params` (greedy when temperature is 0; a seed is assigned
// when none is given). Prints the generated ids, comma-separated, on one
// line; with logprobs, then one JSON object per token. The seed and the
// finish reason go to stderr.
// With a tokenizer, the text streams to stdout as it is generated (stop
// strings end it without being printed) instead of the ids.
struct TextOutput {
  const tok::Tokenizer* tokenizer = nullptr;
  std::vector<std::string> stop_strings;
};
absl::Status Generate(const ModelStackOptions& options, const std::vector<int32_t>& prompt,
                      SamplingParams params, const TextOutput& text = {});

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_COMMANDS_H_
