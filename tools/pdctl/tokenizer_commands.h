// pdctl's text commands: tokenize, detokenize, chat-template,
// bench-tokenizer. They need only the tokenizer files of a model directory.
#ifndef PDSERVE_TOOLS_PDCTL_TOKENIZER_COMMANDS_H_
#define PDSERVE_TOOLS_PDCTL_TOKENIZER_COMMANDS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace pdserve::pdctl {

// Prints the ids of `text` as a JSON array.
absl::Status Tokenize(const std::string& model_dir, const std::string& text, bool add_special);
// One JSON array per line of `path` (lines split on '\n' only).
absl::Status TokenizeFileJsonl(const std::string& model_dir, const std::string& path,
                               bool add_special);
// Prints the decoded text of `ids` (no trailing newline is added).
absl::Status Detokenize(const std::string& model_dir, const std::vector<int32_t>& ids,
                        bool skip_special);

// Renders a messages file with the model's chat template (or `family` when
// not empty) and returns the text.
absl::StatusOr<std::string> RenderChatFile(const tok::Tokenizer& tokenizer,
                                           const std::string& messages_path,
                                           bool add_generation_prompt, const std::string& family);
// Prints {"text": ..., "ids": [...]}.
absl::Status ChatTemplate(const std::string& model_dir, const std::string& messages_path,
                          bool add_generation_prompt, const std::string& family);

// Encode and decode MB/s on a ~1 MiB text made by repeating the lines of a
// JSONL corpus of strings; then, when `reference_dir` holds the npm
// reference (node_modules/tokenizers), runs its bench_reference.mjs.
absl::Status BenchTokenizer(const std::string& model_dir, const std::string& corpus_path,
                            const std::string& reference_dir);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_TOKENIZER_COMMANDS_H_
