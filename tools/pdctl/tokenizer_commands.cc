#include "tools/pdctl/tokenizer_commands.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "model/model_config.h"
#include "nlohmann/json.hpp"
#include "tools/pdctl/bench_stats.h"

namespace pdserve::pdctl {
namespace {

absl::StatusOr<std::unique_ptr<tok::Tokenizer>> LoadTokenizer(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("--model is required");
  return tok::Tokenizer::Load(dir);
}

}  // namespace

absl::Status Tokenize(const std::string& model_dir, const std::string& text, bool add_special) {
  auto t = LoadTokenizer(model_dir);
  if (!t.ok()) return t.status();
  auto ids = (*t)->Encode(text, add_special);
  if (!ids.ok()) return ids.status();
  std::printf("[%s]\n", absl::StrJoin(*ids, ",").c_str());
  return absl::OkStatus();
}

absl::Status TokenizeFileJsonl(const std::string& model_dir, const std::string& path,
                               bool add_special) {
  auto t = LoadTokenizer(model_dir);
  if (!t.ok()) return t.status();
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return text.status();
  size_t start = 0;
  std::string out;
  while (start <= text->size()) {
    size_t end = text->find('\n', start);
    if (end == std::string::npos) end = text->size();
    if (end == text->size() && start == end) break;  // No empty line after a final '\n'.
    auto ids = (*t)->Encode(absl::string_view(*text).substr(start, end - start), add_special);
    if (!ids.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", ids.status().message()));
    absl::StrAppend(&out, "[", absl::StrJoin(*ids, ","), "]\n");
    start = end + 1;
  }
  std::fputs(out.c_str(), stdout);
  return absl::OkStatus();
}

absl::Status Detokenize(const std::string& model_dir, const std::vector<int32_t>& ids,
                        bool skip_special) {
  auto t = LoadTokenizer(model_dir);
  if (!t.ok()) return t.status();
  auto text = (*t)->Decode(ids, skip_special);
  if (!text.ok()) return text.status();
  std::fwrite(text->data(), 1, text->size(), stdout);
  std::fputc('\n', stdout);
  return absl::OkStatus();
}

absl::StatusOr<std::string> RenderChatFile(const tok::Tokenizer& tokenizer,
                                           const std::string& messages_path,
                                           bool add_generation_prompt, const std::string& family) {
  absl::StatusOr<std::string> json = ReadFileToString(messages_path);
  if (!json.ok()) return json.status();
  auto messages = tok::ParseChatMessages(*json);
  if (!messages.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(messages_path, ": ", messages.status().message()));
  }
  tok::ChatFormat format;
  if (!family.empty()) {
    auto f = tok::ParseChatFamily(family);
    if (!f.ok()) return f.status();
    format.family = *f;
  } else {
    auto f = tok::DetectChatFormat(tokenizer.chat_template());
    if (!f.ok()) return f.status();
    format = *f;
  }
  return tok::RenderChat(format, *messages, add_generation_prompt, tokenizer.bos_token(),
                         tokenizer.eos_token());
}

absl::Status ChatTemplate(const std::string& model_dir, const std::string& messages_path,
                          bool add_generation_prompt, const std::string& family) {
  auto t = LoadTokenizer(model_dir);
  if (!t.ok()) return t.status();
  auto text = RenderChatFile(**t, messages_path, add_generation_prompt, family);
  if (!text.ok()) return text.status();
  auto ids = (*t)->Encode(*text, false);
  if (!ids.ok()) return ids.status();
  nlohmann::ordered_json out = {{"text", *text}, {"ids", *ids}};
  std::printf("%s\n", out.dump().c_str());
  return absl::OkStatus();
}

absl::Status BenchTokenizer(const std::string& model_dir, const std::string& corpus_path,
                            const std::string& reference_dir) {
  auto t = LoadTokenizer(model_dir);
  if (!t.ok()) return t.status();
  absl::StatusOr<std::string> corpus = ReadFileToString(corpus_path);
  if (!corpus.ok()) return corpus.status();
  std::vector<std::string> entries;
  std::istringstream lines(*corpus);
  std::string line;
  while (std::getline(lines, line)) {
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_string() && !j.get<std::string>().empty()) entries.push_back(j.get<std::string>());
  }
  if (entries.empty()) return absl::InvalidArgumentError(absl::StrCat(corpus_path, ": no strings"));
  std::string whole;
  for (size_t i = 0; whole.size() < (1u << 20); i = (i + 1) % entries.size()) {
    if (!whole.empty()) whole.push_back('\n');
    whole += entries[i];
  }
  using Clock = std::chrono::steady_clock;
  std::vector<int32_t> ids;
  std::vector<double> enc, dec;
  for (int rep = 0; rep < 6; ++rep) {
    const auto t0 = Clock::now();
    auto e = (*t)->Encode(whole, false);
    const auto t1 = Clock::now();
    if (!e.ok()) return e.status();
    ids = *std::move(e);
    auto d = (*t)->Decode(ids, false);
    const auto t2 = Clock::now();
    if (!d.ok()) return d.status();
    if (rep == 0) continue;  // Warm-up (fills the BPE word cache, as in steady state).
    enc.push_back(std::chrono::duration<double>(t1 - t0).count());
    dec.push_back(std::chrono::duration<double>(t2 - t1).count());
  }
  std::printf("pdserve  %s: %zu bytes, %zu tokens; encode %.2f MB/s, decode %.2f MB/s (median of 5, 1 thread)\n",
              model_dir.c_str(), whole.size(), ids.size(), whole.size() / Median(enc) / 1e6,
              whole.size() / Median(dec) / 1e6);
  std::fflush(stdout);
  if (!reference_dir.empty() &&
      std::filesystem::exists(reference_dir + "/node_modules/tokenizers") &&
      std::filesystem::exists(reference_dir + "/bench_reference.mjs")) {
    std::printf("npm reference (HF tokenizers, Rust) measured now:\n");
    std::fflush(stdout);
    const std::string cmd = absl::StrCat("cd '", reference_dir, "' && node bench_reference.mjs");
    if (std::system(cmd.c_str()) != 0) std::printf("(the reference run failed)\n");
  } else {
    std::printf("npm reference not installed (cd %s && npm install)\n",
                reference_dir.empty() ? "tests/fixtures/tokenizers" : reference_dir.c_str());
  }
  return absl::OkStatus();
}

}  // namespace pdserve::pdctl
