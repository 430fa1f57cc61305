// pdctl: the project's command-line tool.
//
//   pdctl logits   --model DIR --token-ids 1,2,3 [--all-positions]
//                  [--weights f32|bf16] [--kv f32|bf16] [--threads N]
//   pdctl generate --model DIR --prompt-ids 1,2,3 --max-tokens N
//
// Run `pdctl help` for the list.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "model/synthetic_model.h"
#include "tools/pdctl/bench_attention.h"
#include "tools/pdctl/bench_engine.h"
#include "tools/pdctl/bench_tp.h"
#include "tools/pdctl/bench_kv.h"
#include "tools/pdctl/bench_tier2.h"
#include "tools/pdctl/bench_serving.h"
#include "base/tls_flags.h"
#include "tools/pdctl/cluster_commands.h"
#include "tools/pdctl/commands.h"
#include "tools/pdctl/plan_command.h"
#include "tools/pdctl/tokenizer_commands.h"
#include "model/model_config.h"

ABSL_FLAG(std::string, model, "",
          "Hugging Face model directory (default: $PDSERVE_MODEL, else the shipped deploy/models/kjv-tiny)");
ABSL_FLAG(std::string, token_ids, "", "logits: comma-separated token ids");
ABSL_FLAG(std::string, prompt_ids, "", "generate: comma-separated prompt token ids");
ABSL_FLAG(bool, all_positions, false, "logits: print every position, not only the last");
ABSL_FLAG(std::string, weights, "", "in-memory weight format: f32 or bf16 (default: as stored)");
ABSL_FLAG(std::string, kv, "", "KV cache format: f32 or bf16 (default: the weight format)");
ABSL_FLAG(int, threads, 1, "compute threads (per tensor-parallel rank)");
ABSL_FLAG(std::string, backend, "cpu", "in-process model's backend: cpu or cuda (NVIDIA GPU, builds with nvcc)");
ABSL_FLAG(int, cuda_device, 0, "--backend=cuda: the GPU to run on");
ABSL_FLAG(int, tp, 1, "tensor-parallel ranks of the in-process model (threads, each with --threads)");
ABSL_FLAG(std::string, isa, "", "CPU kernel path: scalar, avx2 or avx512 (default: best)");
ABSL_FLAG(std::string, matrix_path, "",
          "matrix path of BF16 weights: f32, fp16, bf16 or amx (default: $PDSERVE_MATRIX_PATH, else the faster by a probe)");
ABSL_FLAG(int, max_tokens, 16, "generate: tokens to generate");
ABSL_FLAG(int, block_size, 16, "KV block size in positions");
ABSL_FLAG(std::string, out, "", "make-model: output directory");
ABSL_FLAG(std::string, shape, "125m", "make-model: 125m (the benchmark shape) or tiny");
ABSL_FLAG(std::string, dtype, "bf16", "make-model: file dtype, f32 or bf16");
ABSL_FLAG(std::string, seed, "",
          "generate: sampling seed (default: one is assigned and printed); make-model: weights seed (default 1)");
ABSL_FLAG(float, temperature, 0.0f, "generate: sampling temperature (0 = greedy)");
ABSL_FLAG(int, top_k, 0, "generate: keep the k most likely tokens (0 = all)");
ABSL_FLAG(float, top_p, 1.0f, "generate: nucleus sampling mass");
ABSL_FLAG(float, min_p, 0.0f, "generate: drop tokens below min_p x the best probability");
ABSL_FLAG(float, repetition_penalty, 1.0f, "generate: repetition penalty (1 = off)");
ABSL_FLAG(float, presence_penalty, 0.0f, "generate: presence penalty (0 = off)");
ABSL_FLAG(float, frequency_penalty, 0.0f, "generate: frequency penalty, per occurrence in the output (0 = off)");
ABSL_FLAG(std::string, stop_token_ids, "", "generate: extra comma-separated stop token ids");
ABSL_FLAG(bool, ignore_eos, false, "generate: do not stop at the model's EOS ids");
ABSL_FLAG(int, logprobs, 0, "generate: also print the chosen token's logprob and the top-n");
ABSL_FLAG(std::string, text, "", "tokenize: the text");
ABSL_FLAG(std::string, text_file, "", "tokenize: read the text from this file");
ABSL_FLAG(bool, jsonl, false, "tokenize --text-file: one JSON array per line (split on \\n only)");
ABSL_FLAG(bool, add_special_tokens, false, "tokenize: add BOS/EOS as the tokenizer's post-processor says");
ABSL_FLAG(std::string, ids, "", "detokenize: comma-separated token ids");
ABSL_FLAG(bool, skip_special_tokens, false, "detokenize: drop special tokens");
ABSL_FLAG(std::string, messages_file, "", "chat-template: JSON list of {role, content}");
ABSL_FLAG(bool, add_generation_prompt, false, "chat-template: end with the assistant prompt");
ABSL_FLAG(std::string, chat_template_family, "",
          "chat-template / generate: override the recognised family (chatml, qwen3, qwen2.5, llama3, llama3.1, llama2, zephyr)");
ABSL_FLAG(std::string, prompt, "", "generate: prompt text (encoded with the tokenizer's special tokens)");
ABSL_FLAG(std::string, chat_json, "", "generate: chat messages file, rendered with the chat template");
ABSL_FLAG(std::string, router, "", "generate / status / bench: a router's address (host:port) instead of in-process");
ABSL_FLAG(std::string, openai, "",
          "bench: the router's OpenAI HTTP API (http://HOST:PORT); with --router too, gRPC and HTTP rows from the "
          "same run");
ABSL_FLAG(double, timeout, 0, "generate --router: deadline in seconds (0: none); probe: (0: 1 s)");
ABSL_FLAG(std::string, addr, "", "probe: a server's plaintext health address (host:port)");
ABSL_FLAG(std::string, service, "", "probe: the health service to ask (\"\": the whole server, readiness; "
          "\"liveness\")");
ABSL_FLAG(int, requests, 64, "bench: requests to send");
ABSL_FLAG(int, concurrency, 8, "bench: requests in flight (closed loop, when --rate is 0)");
ABSL_FLAG(int, burst, 0,
          "bench: send this many requests at once (sets --requests and --concurrency to it); with --router each "
          "cluster row also reports the router's side: workers ejected, requests queued and refused, prefill tokens "
          "discarded, the router's peak memory");
ABSL_FLAG(double, rate, 0, "bench: Poisson arrivals per second (0: closed loop at --concurrency)");
ABSL_FLAG(std::string, prompt_tokens, "128", "bench: prompt length, N or MIN:MAX (uniform)");
ABSL_FLAG(std::string, output_tokens, "64", "bench: output length, N or MIN:MAX (uniform)");
ABSL_FLAG(std::string, rates, "",
          "bench: comma-separated Poisson rates (req/s), the same requests once per rate, a row each");
ABSL_FLAG(std::string, trace, "",
          "bench: JSONL of request lengths, one {\"prompt_tokens\", \"output_tokens\"[, \"prefix_group\", "
          "\"prefix_tokens\"]} a line (instead of --requests, --prompt-tokens, --output-tokens)");
ABSL_FLAG(double, ttft_target_ms, 0, "bench: goodput counts requests with TTFT at most this (0: no target)");
ABSL_FLAG(double, itl_target_ms, 0,
          "bench: goodput counts requests whose own p99 inter-token latency is at most this (0: no target)");
ABSL_FLAG(std::string, svg, "", "bench: write latency CDFs and throughput/goodput against rate to this SVG file");
ABSL_FLAG(std::string, in_process_model, "",
          "bench: also run the workload through the in-process engine on this model, in the same run");
ABSL_FLAG(std::vector<std::string>, stop, {}, "generate: comma-separated stop strings");
ABSL_FLAG(std::string, corpus, "tests/fixtures/tokenizers/corpus.jsonl",
          "bench-tokenizer: JSONL corpus of strings");
ABSL_FLAG(std::string, reference_dir, "tests/fixtures/tokenizers",
          "bench-tokenizer: where the npm reference is installed");
ABSL_FLAG(double, drain_at, -1,
          "bench: S seconds after the decode pool runs all but one stream of the run, SIGTERM --drain-pid (a decode "
          "worker) and report each stream's stall and what was recomputed");
ABSL_FLAG(int, drain_pid, 0, "bench --drain-at: the decode worker's process id");
ABSL_FLAG(std::string, multi_turn, "",
          "bench: TURNS:SYSTEM_TOKENS multi-turn chat, each turn resending its conversation's history over one of "
          "64 (or --shared-prefix's GROUPS) system prompts; --prompt-tokens is each user turn, --output-tokens each "
          "reply");
ABSL_FLAG(std::string, shared_prefix, "8:2048:64",
          "bench-engine: REQUESTS:SHARED:PRIVATE shared-prefix decode scenario (empty = skip); "
          "bench: GROUPS:PREFIX_TOKENS, requests in groups (each drawn at random) sharing a prefix of that many tokens, "
          "each then adding --prompt-tokens of its own (default for bench: no shared prefixes)");
ABSL_FLAG(std::string, prefix_hit, "2048:64",
          "bench-engine: CACHED:NEW prefix-hit prefill scenario (empty = skip)");
ABSL_FLAG(std::string, prefill, "128,512,2048", "bench-engine: prompt lengths");
ABSL_FLAG(std::string, decode_batch, "1,8,32", "bench-engine / bench-attention: decode batch sizes");
ABSL_FLAG(std::string, decode_history, "128,512,4096", "bench-engine / bench-attention: decode history lengths");
// bench-kv's (tools/pdctl/bench_kv.cc), also bench-attention's geometry.
ABSL_DECLARE_FLAG(int, kv_heads);
ABSL_DECLARE_FLAG(int, head_dim);
ABSL_FLAG(std::string, prompts, "",
          "bench-attention: prompt lengths whose causal attention is timed alone against the peak of the "
          "attention's instruction (BF16 dot on the bf16 matrix path, else F32 FMA; e.g. 512,2048; with "
          "--decode_batch \"\" for those alone)");
ABSL_FLAG(int, attention_heads, 12, "bench-attention: query heads (the 125M shape's)");
ABSL_FLAG(bool, in_order_blocks, false,
          "bench-attention: each sequence's KV blocks one after another (as a fresh pool hands them out), not "
          "scattered over the pool (as a serving worker's are)");
ABSL_FLAG(int, stream_mib, 512,
          "bench-attention: MiB of KV copies the streamed rate cycles through (well above the last-level cache)");
ABSL_FLAG(int, steps, 16, "bench-engine: timed decode steps per scenario");
ABSL_FLAG(std::vector<std::string>, mask_tokenizers, {},
          "bench-engine: tokenizer directories whose vocabularies the response-format mask cost is measured at "
          "(default: the model's)");
ABSL_FLAG(bool, json, false, "print JSON instead of a table");
ABSL_FLAG(std::string, config, "", "plan: the deployment config (.json, .yaml or .yml)");

namespace pdserve::pdctl {
namespace {

// --model, else $PDSERVE_MODEL, else the model the repository ships.
std::string ModelDir() {
  std::string dir = absl::GetFlag(FLAGS_model);
  if (dir.empty()) {
    const char* env = std::getenv("PDSERVE_MODEL");
    dir = env != nullptr && *env != '\0' ? env : PDSERVE_DEFAULT_MODEL_DIR;
  }
  return dir;
}

absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& flag, const std::string& text) {
  std::vector<int32_t> ids;
  if (text.empty()) return absl::InvalidArgumentError(absl::StrCat("--", flag, " is required"));
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t v;
    if (!absl::SimpleAtoi(part, &v) || v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", part, "' is not a non-negative integer"));
    }
    ids.push_back(v);
  }
  return ids;
}

ModelStackOptions EngineFlags() {
  ModelStackOptions o;
  o.model_dir = ModelDir();
  o.weights = absl::GetFlag(FLAGS_weights);
  o.kv = absl::GetFlag(FLAGS_kv);
  o.isa = absl::GetFlag(FLAGS_isa);
  o.matrix_path = absl::GetFlag(FLAGS_matrix_path);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.tp = absl::GetFlag(FLAGS_tp);
  o.block_size = absl::GetFlag(FLAGS_block_size);
  o.backend = absl::GetFlag(FLAGS_backend);
  o.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  return o;
}

absl::Status RunLogits() {
  absl::StatusOr<std::vector<int32_t>> ids = ParseIds("token-ids", absl::GetFlag(FLAGS_token_ids));
  if (!ids.ok()) return ids.status();
  ModelStackOptions o = EngineFlags();
  o.kv_positions = static_cast<int64_t>(ids->size());
  return PrintLogits(o, *ids, absl::GetFlag(FLAGS_all_positions));
}

absl::StatusOr<std::optional<uint64_t>> SeedFlag() {
  const std::string s = absl::GetFlag(FLAGS_seed);
  if (s.empty()) return std::optional<uint64_t>();
  uint64_t v;
  if (!absl::SimpleAtoi(s, &v)) {
    return absl::InvalidArgumentError(absl::StrCat("--seed: '", s, "' is not a non-negative integer"));
  }
  return std::optional<uint64_t>(v);
}

// `pdctl generate --router ADDR`: the same request, served by a cluster.
absl::Status RunRemoteGenerate(const std::string& prompt, const std::string& chat, const std::string& prompt_ids) {
  v1::GenerateRequest r;
  if (!prompt_ids.empty()) {
    absl::StatusOr<std::vector<int32_t>> ids = ParseIds("prompt-ids", prompt_ids);
    if (!ids.ok()) return ids.status();
    r.mutable_token_ids()->mutable_ids()->Assign(ids->begin(), ids->end());
  } else if (!prompt.empty()) {
    r.set_text(prompt);
  } else {
    absl::StatusOr<std::string> json = ReadFileToString(chat);
    if (!json.ok()) return json.status();
    auto messages = tok::ParseChatMessages(*json);
    if (!messages.ok()) return absl::InvalidArgumentError(absl::StrCat(chat, ": ", messages.status().message()));
    for (const auto& m : *messages) {
      v1::ChatMessage* cm = r.mutable_chat()->add_messages();
      cm->set_role(m.role);
      cm->set_content(m.content);
    }
  }
  r.set_max_tokens(absl::GetFlag(FLAGS_max_tokens));
  v1::SamplingParams* s = r.mutable_sampling();
  s->set_temperature(absl::GetFlag(FLAGS_temperature));
  s->set_top_k(absl::GetFlag(FLAGS_top_k));
  s->set_top_p(absl::GetFlag(FLAGS_top_p));
  s->set_min_p(absl::GetFlag(FLAGS_min_p));
  s->set_repetition_penalty(absl::GetFlag(FLAGS_repetition_penalty));
  s->set_presence_penalty(absl::GetFlag(FLAGS_presence_penalty));
  s->set_frequency_penalty(absl::GetFlag(FLAGS_frequency_penalty));
  absl::StatusOr<std::optional<uint64_t>> seed = SeedFlag();
  if (!seed.ok()) return seed.status();
  if (seed->has_value()) s->set_seed(**seed);
  for (const std::string& stop : absl::GetFlag(FLAGS_stop)) r.add_stop(stop);
  const std::string stops = absl::GetFlag(FLAGS_stop_token_ids);
  if (!stops.empty()) {
    absl::StatusOr<std::vector<int32_t>> ids = ParseIds("stop-token-ids", stops);
    if (!ids.ok()) return ids.status();
    r.mutable_stop_token_ids()->Assign(ids->begin(), ids->end());
  }
  r.set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  r.set_logprobs(absl::GetFlag(FLAGS_logprobs));
  return RemoteGenerate(absl::GetFlag(FLAGS_router), r, !prompt_ids.empty(), absl::GetFlag(FLAGS_timeout));
}

absl::Status RunGenerate() {
  const std::string prompt = absl::GetFlag(FLAGS_prompt);
  const std::string chat = absl::GetFlag(FLAGS_chat_json);
  const std::string prompt_ids = absl::GetFlag(FLAGS_prompt_ids);
  if ((!prompt.empty()) + (!chat.empty()) + (!prompt_ids.empty()) != 1) {
    return absl::InvalidArgumentError("give exactly one of --prompt, --chat-json, --prompt-ids");
  }
  if (!absl::GetFlag(FLAGS_router).empty()) return RunRemoteGenerate(prompt, chat, prompt_ids);
  TextOutput text;
  std::unique_ptr<tok::Tokenizer> tokenizer;
  absl::StatusOr<std::vector<int32_t>> ids;
  if (!prompt_ids.empty()) {
    ids = ParseIds("prompt-ids", prompt_ids);
  } else {
    auto t = tok::Tokenizer::Load(ModelDir());
    if (!t.ok()) return t.status();
    tokenizer = *std::move(t);
    if (!prompt.empty()) {
      ids = tokenizer->Encode(prompt, /*add_special_tokens=*/true);
    } else {
      auto rendered = RenderChatFile(*tokenizer, chat, /*add_generation_prompt=*/true,
                                     absl::GetFlag(FLAGS_chat_template_family));
      if (!rendered.ok()) return rendered.status();
      ids = tokenizer->Encode(*rendered, /*add_special_tokens=*/false);
    }
    text.tokenizer = tokenizer.get();
    text.stop_strings = absl::GetFlag(FLAGS_stop);
  }
  if (!ids.ok()) return ids.status();
  if (ids->empty()) return absl::InvalidArgumentError("the prompt is empty");
  const int max_tokens = absl::GetFlag(FLAGS_max_tokens);
  if (max_tokens < 1) return absl::InvalidArgumentError("--max-tokens must be at least 1");
  ModelStackOptions o = EngineFlags();
  o.kv_positions = static_cast<int64_t>(ids->size()) + max_tokens;
  SamplingParams p;
  p.max_tokens = max_tokens;
  p.temperature = absl::GetFlag(FLAGS_temperature);
  p.top_k = absl::GetFlag(FLAGS_top_k);
  p.top_p = absl::GetFlag(FLAGS_top_p);
  p.min_p = absl::GetFlag(FLAGS_min_p);
  p.repetition_penalty = absl::GetFlag(FLAGS_repetition_penalty);
  p.presence_penalty = absl::GetFlag(FLAGS_presence_penalty);
  p.frequency_penalty = absl::GetFlag(FLAGS_frequency_penalty);
  p.ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
  p.logprobs = absl::GetFlag(FLAGS_logprobs);
  const std::string stops = absl::GetFlag(FLAGS_stop_token_ids);
  if (!stops.empty()) {
    absl::StatusOr<std::vector<int32_t>> s = ParseIds("stop-token-ids", stops);
    if (!s.ok()) return s.status();
    p.stop_token_ids = *s;
  }
  absl::StatusOr<std::optional<uint64_t>> seed = SeedFlag();
  if (!seed.ok()) return seed.status();
  p.seed = *seed;
  return Generate(o, *ids, p, text);
}

absl::StatusOr<std::vector<int>> ParseInts(const std::string& flag, const std::string& text) {
  std::vector<int> out;
  if (text.empty()) return out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int v;
    if (!absl::SimpleAtoi(part, &v) || v <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", part, "' is not a positive integer"));
    }
    out.push_back(v);
  }
  return out;
}

absl::Status RunMakeModel() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return absl::InvalidArgumentError("--out is required");
  RandomModelSpec spec;
  const std::string shape = absl::GetFlag(FLAGS_shape);
  if (shape == "125m") {
    spec = Llama125MSpec();
  } else if (shape != "tiny") {
    return absl::InvalidArgumentError(absl::StrCat("--shape: unknown shape '", shape, "' (125m, tiny)"));
  }
  absl::StatusOr<DType> dtype = ParseDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok() || *dtype == DType::kF16) {
    return absl::InvalidArgumentError("--dtype must be f32 or bf16");
  }
  spec.dtype = *dtype;
  absl::StatusOr<std::optional<uint64_t>> seed = SeedFlag();
  if (!seed.ok()) return seed.status();
  spec.seed = seed->value_or(1);
  if (absl::Status s = WriteRandomModel(out, spec); !s.ok()) return s;
  std::printf("wrote %s (%s, random weights)\n", out.c_str(), shape.c_str());
  return absl::OkStatus();
}

absl::Status RunBenchEngineCommand() {
  BenchEngineOptions o;
  o.engine = EngineFlags();
  auto prefill = ParseInts("prefill", absl::GetFlag(FLAGS_prefill));
  auto batches = ParseInts("decode-batch", absl::GetFlag(FLAGS_decode_batch));
  auto histories = ParseInts("decode-history", absl::GetFlag(FLAGS_decode_history));
  for (const auto* p : {&prefill, &batches, &histories}) {
    if (!p->ok()) return p->status();
  }
  o.prefill_lengths = *prefill;
  o.decode_batches = *batches;
  o.decode_histories = *histories;
  o.decode_steps = absl::GetFlag(FLAGS_steps);
  if (o.decode_steps < 1) return absl::InvalidArgumentError("--steps must be at least 1");
  o.json = absl::GetFlag(FLAGS_json);
  o.mask_tokenizers = absl::GetFlag(FLAGS_mask_tokenizers);
  const std::string hit = absl::GetFlag(FLAGS_prefix_hit);
  o.prefix_hit_cached = 0;
  if (!hit.empty()) {
    std::vector<std::string> parts = absl::StrSplit(hit, ':');
    int cached = 0, fresh = 0;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &cached) ||
        !absl::SimpleAtoi(parts[1], &fresh) || cached <= 0 || fresh <= 0) {
      return absl::InvalidArgumentError("--prefix-hit must be CACHED:NEW, e.g. 2048:64");
    }
    o.prefix_hit_cached = cached;
    o.prefix_hit_new = fresh;
  }
  const std::string shared = absl::GetFlag(FLAGS_shared_prefix);
  o.shared_requests = 0;
  if (!shared.empty()) {
    std::vector<std::string> parts = absl::StrSplit(shared, ':');
    int n = 0, pre = 0, own = 0;
    if (parts.size() != 3 || !absl::SimpleAtoi(parts[0], &n) || !absl::SimpleAtoi(parts[1], &pre) ||
        !absl::SimpleAtoi(parts[2], &own) || n <= 1 || pre <= 0 || own <= 0) {
      return absl::InvalidArgumentError(
          "--shared-prefix must be REQUESTS:SHARED:PRIVATE with at least 2 requests, e.g. 8:2048:64");
    }
    o.shared_requests = n;
    o.shared_prefix = pre;
    o.shared_private = own;
  }
  if (o.engine.tp > 1) return RunBenchTp(o);
  return RunBenchEngine(o);
}

absl::Status RunBenchAttentionCommand() {
  BenchAttentionOptions o;
  auto batches = ParseInts("decode-batch", absl::GetFlag(FLAGS_decode_batch));
  auto histories = ParseInts("decode-history", absl::GetFlag(FLAGS_decode_history));
  for (const auto* p : {&batches, &histories}) {
    if (!p->ok()) return p->status();
  }
  o.batches = *batches;
  o.histories = *histories;
  auto prompts = ParseInts("prompts", absl::GetFlag(FLAGS_prompts));
  if (!prompts.ok()) return prompts.status();
  o.prompts = *prompts;
  o.threads = absl::GetFlag(FLAGS_threads);
  o.isa = absl::GetFlag(FLAGS_isa);
  if (!absl::GetFlag(FLAGS_kv).empty()) o.kv = absl::GetFlag(FLAGS_kv);
  o.heads = absl::GetFlag(FLAGS_attention_heads);
  o.in_order_blocks = absl::GetFlag(FLAGS_in_order_blocks);
  o.kv_heads = absl::GetFlag(FLAGS_kv_heads);
  o.head_dim = absl::GetFlag(FLAGS_head_dim);
  o.block_size = absl::GetFlag(FLAGS_block_size);
  o.stream_bytes = absl::GetFlag(FLAGS_stream_mib) * double{1 << 20};
  if (o.stream_bytes <= 0) return absl::InvalidArgumentError("--stream-mib must be positive");
  o.json = absl::GetFlag(FLAGS_json);
  return RunBenchAttention(o);
}

absl::Status RunTokenize() {
  const bool special = absl::GetFlag(FLAGS_add_special_tokens);
  const std::string file = absl::GetFlag(FLAGS_text_file);
  if (!file.empty()) {
    if (absl::GetFlag(FLAGS_jsonl)) return TokenizeFileJsonl(ModelDir(), file, special);
    absl::StatusOr<std::string> text = ReadFileToString(file);
    if (!text.ok()) return text.status();
    return Tokenize(ModelDir(), *text, special);
  }
  return Tokenize(ModelDir(), absl::GetFlag(FLAGS_text), special);
}

absl::Status RunDetokenize() {
  absl::StatusOr<std::vector<int32_t>> ids = ParseIds("ids", absl::GetFlag(FLAGS_ids));
  if (!ids.ok()) return ids.status();
  return Detokenize(ModelDir(), *ids, absl::GetFlag(FLAGS_skip_special_tokens));
}

absl::Status RunChatTemplate() {
  if (absl::GetFlag(FLAGS_messages_file).empty()) {
    return absl::InvalidArgumentError("--messages-file is required");
  }
  return ChatTemplate(ModelDir(), absl::GetFlag(FLAGS_messages_file),
                      absl::GetFlag(FLAGS_add_generation_prompt),
                      absl::GetFlag(FLAGS_chat_template_family));
}

absl::Status ParseRange(const std::string& flag, const std::string& text, int* lo, int* hi) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.size() > 2 || !absl::SimpleAtoi(parts[0], lo) ||
      !absl::SimpleAtoi(parts.size() == 2 ? parts[1] : parts[0], hi)) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": expected N or MIN:MAX, got '", text, "'"));
  }
  return absl::OkStatus();
}

absl::Status RunServingBenchCommand() {
  ServingBenchOptions o;
  o.router = absl::GetFlag(FLAGS_router);
  o.openai = absl::GetFlag(FLAGS_openai);
  o.tls_ca = absl::GetFlag(FLAGS_tls_ca);
  o.in_process_model = absl::GetFlag(FLAGS_in_process_model);
  o.in_process_threads = absl::GetFlag(FLAGS_threads);
  o.requests = absl::GetFlag(FLAGS_requests);
  o.concurrency = absl::GetFlag(FLAGS_concurrency);
  if (const int burst = absl::GetFlag(FLAGS_burst); burst != 0) {
    if (burst < 1) return absl::InvalidArgumentError("--burst must be at least 1");
    if (absl::GetFlag(FLAGS_rate) > 0 || !absl::GetFlag(FLAGS_rates).empty()) {
      return absl::InvalidArgumentError("--burst sends every request at once: no --rate or --rates with it");
    }
    o.burst = o.requests = o.concurrency = burst;
  }
  o.rate = absl::GetFlag(FLAGS_rate);
  o.json = absl::GetFlag(FLAGS_json);
  if (absl::Status s = ParseRange("prompt-tokens", absl::GetFlag(FLAGS_prompt_tokens), &o.prompt_min, &o.prompt_max);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ParseRange("output-tokens", absl::GetFlag(FLAGS_output_tokens), &o.output_min, &o.output_max);
      !s.ok()) {
    return s;
  }
  const std::string rates = absl::GetFlag(FLAGS_rates);
  if (!rates.empty()) {
    for (absl::string_view part : absl::StrSplit(rates, ',')) {
      double r = 0;
      if (!absl::SimpleAtod(part, &r) || !(r > 0) || !std::isfinite(r)) {
        return absl::InvalidArgumentError(absl::StrCat("--rates: '", part, "' is not a positive number"));
      }
      o.rates.push_back(r);
    }
  }
  o.trace_file = absl::GetFlag(FLAGS_trace);
  o.ttft_target_ms = absl::GetFlag(FLAGS_ttft_target_ms);
  o.itl_target_ms = absl::GetFlag(FLAGS_itl_target_ms);
  o.svg_file = absl::GetFlag(FLAGS_svg);
  // --shared-prefix is shared with bench-engine, whose default means "not
  // given" here.
  const std::string shared = absl::GetFlag(FLAGS_shared_prefix);
  if (!shared.empty() && shared != absl::GetFlagReflectionHandle(FLAGS_shared_prefix).DefaultValue()) {
    std::vector<std::string> parts = absl::StrSplit(shared, ':');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &o.shared_prefix_groups) ||
        !absl::SimpleAtoi(parts[1], &o.shared_prefix_tokens) || o.shared_prefix_groups < 1 ||
        o.shared_prefix_tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--shared-prefix: bench expects GROUPS:PREFIX_TOKENS, both at least 1, got '", shared, "'"));
    }
  }
  if (const std::string mt = absl::GetFlag(FLAGS_multi_turn); !mt.empty()) {
    std::vector<std::string> parts = absl::StrSplit(mt, ':');
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &o.multi_turn_turns) ||
        !absl::SimpleAtoi(parts[1], &o.multi_turn_system_tokens) || o.multi_turn_turns < 1 ||
        o.multi_turn_system_tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--multi-turn: expected TURNS:SYSTEM_TOKENS, both at least 1, got '", mt, "'"));
    }
  }
  o.drain_at = absl::GetFlag(FLAGS_drain_at);
  o.drain_pid = absl::GetFlag(FLAGS_drain_pid);
  return RunServingBench(o);
}

constexpr char kUsage[] =
    "pdctl COMMAND [flags]\n"
    "commands:\n"
    "  logits    print logits (one JSON array per position) for --token-ids\n"
    "  generate  generation from --prompt, --chat-json or --prompt-ids (greedy unless --temperature > 0);\n"
    "            in-process, or through a cluster with --router HOST:PORT\n"
    "  status    a cluster's pools, workers and load (--router HOST:PORT)\n"
    "  probe     gRPC health check of a server's plaintext health port (--addr HOST:PORT\n"
    "            [--service liveness] [--timeout S]); exit 0 only when it answers SERVING\n"
    "  bench     serving benchmark against a cluster (--router and/or --openai URL; --concurrency or --rate,\n"
    "            --requests,\n"
    "            --prompt-tokens, --output-tokens, --in-process-model DIR for the engine alone; --json);\n"
    "            sweeps and SLOs: --rates 2,4,8 --trace FILE.jsonl --shared-prefix GROUPS:PREFIX_TOKENS\n"
    "            --multi-turn TURNS:SYSTEM_TOKENS\n"
    "            --ttft-target-ms --itl-target-ms (goodput) --svg FILE\n"
    "  tokenize      ids of --text (or --text-file [--jsonl]) as JSON [--add-special-tokens]\n"
    "  detokenize    text of --ids [--skip-special-tokens]\n"
    "  chat-template render --messages-file with the model's chat template, print text and ids\n"
    "  bench-tokenizer  encode/decode MB/s beside the npm reference when installed\n"
    "  make-model    write a random-weight model (--shape 125m|tiny --dtype f32|bf16 --out DIR)\n"
    "  bench-engine  prefill and decode speed beside the machine's measured limits\n"
    "  bench-attention  decode attention alone: KV cache-resident and from DRAM beside the read limit\n"
    "            (--decode-batch, --decode-history, --threads, --kv bf16|f32, --attention-heads, --kv-heads, --head-dim, --stream-mib);\n"
    "            --prompts 512,2048: a prompt's causal attention alone, in FLOP/s beside its instruction's peak\n"
    "  bench-kv      KV handoff between two processes beside raw puts on the same connection [--with-prefill]\n"
    "  bench-tier2   the prefix cache's second tier: writes and checked restores beside the disk's read rate\n"
    "  plan          capacity model of a deployment from --config FILE [--json]\n"
    "  help      this text; `pdctl COMMAND --help` lists the flags\n";

// `pdctl COMMAND --help`: the flags COMMAND reads. A flag belongs to a
// command when its help text is tagged with the command's name, at its start
// or after "; " ("bench-kv: ...", "generate / status / bench --router: ...",
// "...; probe: ..."), whichever file defines it; the untagged flags a
// command reads (engine, output and TLS flags shared by several commands)
// are named in kUntaggedFlags. tools/reference/gen_reference.py checks that
// every tagged flag is listed under its commands and that every flag pdctl
// defines is listed under at least one.
constexpr const char* kCommands[] = {"logits",     "generate",        "status",       "probe",
                                     "bench",      "tokenize",        "detokenize",   "chat-template",
                                     "bench-tokenizer", "make-model",   "bench-engine", "bench-attention",
                                     "bench-kv",   "bench-tier2", "plan"};

bool IsCommand(absl::string_view name) {
  for (const char* c : kCommands) {
    if (name == c) return true;
  }
  return false;
}

// The in-process model's flags (EngineFlags()).
#define PDCTL_ENGINE_FLAGS \
  "model", "weights", "kv", "threads", "backend", "cuda_device", "tp", "isa", "matrix_path", "block_size"

const std::map<std::string, std::vector<std::string>>& UntaggedFlags() {
  static const auto* m = new std::map<std::string, std::vector<std::string>>{
      {"logits", {PDCTL_ENGINE_FLAGS}},
      {"generate", {PDCTL_ENGINE_FLAGS, "tls_ca"}},
      {"status", {"json", "tls_ca"}},
      {"probe", {}},
      {"bench", {"json", "threads", "tls_ca"}},
      {"tokenize", {"model"}},
      {"detokenize", {"model"}},
      {"chat-template", {"model"}},
      {"bench-tokenizer", {"model"}},
      {"make-model", {}},
      {"bench-engine", {PDCTL_ENGINE_FLAGS, "json", "mask_tokenizers"}},
      {"bench-attention", {"threads", "isa", "kv", "block_size", "json"}},
      {"bench-kv", {"model", "kv", "block_size", "threads", "json"}},
      {"bench-tier2", {"json"}},
      {"plan", {"json"}},
  };
  return *m;
}
#undef PDCTL_ENGINE_FLAGS

// The commands a help text is tagged with.
std::vector<std::string> HelpTags(absl::string_view help) {
  std::vector<std::string> tags;
  for (absl::string_view segment : absl::StrSplit(help, "; ")) {
    const size_t colon = segment.find(':');
    if (colon == absl::string_view::npos) continue;
    absl::string_view head = segment.substr(0, colon);
    if (const size_t dashes = head.find(" --"); dashes != absl::string_view::npos) head = head.substr(0, dashes);
    std::vector<std::string> names = absl::StrSplit(head, " / ");
    bool all = !names.empty();
    for (const std::string& n : names) all = all && IsCommand(n);
    if (all) tags.insert(tags.end(), names.begin(), names.end());
  }
  return tags;
}

std::string Dashed(absl::string_view name) {
  std::string s(name);
  std::replace(s.begin(), s.end(), '_', '-');
  return s;
}

void PrintCommandHelp(const std::string& command) {
  std::map<std::string, const absl::CommandLineFlag*> flags;
  const auto all = absl::GetAllFlags();
  if (auto untagged = UntaggedFlags().find(command); untagged != UntaggedFlags().end()) {
    for (const std::string& name : untagged->second) {
      if (auto it = all.find(name); it != all.end()) flags[name] = it->second;
    }
  }
  for (const auto& [name, flag] : all) {
    for (const std::string& tag : HelpTags(flag->Help())) {
      if (tag == command) flags[std::string(name)] = flag;
    }
  }
  std::printf("pdctl %s [flags]\n\nFlags of pdctl %s (--name-with-dashes or --name_with_underscores):\n",
              command.c_str(), command.c_str());
  for (const auto& [name, flag] : flags) {
    const std::string def = flag->DefaultValue();
    std::printf("    --%s (%s); default: %s;\n", Dashed(name).c_str(), flag->Help().c_str(),
                flag->IsOfType<std::string>() ? absl::StrCat("\"", def, "\"").c_str() : def.c_str());
  }
}

}  // namespace
}  // namespace pdserve::pdctl

int main(int argc, char** argv) {
  using namespace pdserve::pdctl;
  absl::SetProgramUsageMessage(kUsage);
  if (argc < 2 || std::strcmp(argv[1], "help") == 0 || std::strcmp(argv[1], "--help") == 0) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  // Flags come after the command; abseil parses them with argv[0] kept.
  // Flags are spelled with dashes (--token-ids); abseil names them with
  // underscores, so the name part of each flag is translated.
  std::vector<std::string> storage;
  storage.reserve(argc);
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) == 0) {
      const size_t end = std::min(a.find('='), a.size());
      std::replace(a.begin() + 2, a.begin() + static_cast<std::ptrdiff_t>(end), '-', '_');
    }
    storage.push_back(std::move(a));
  }
  if (IsCommand(command)) {
    for (const std::string& a : storage) {
      if (a == "--help" || a == "-help") {
        PrintCommandHelp(command);
        return 0;
      }
    }
  }
  std::vector<char*> args;
  args.push_back(argv[0]);
  for (std::string& a : storage) args.push_back(a.data());
  std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (rest.size() > 1) {
    std::fprintf(stderr, "pdctl %s: unexpected argument '%s'\n", command.c_str(), rest[1]);
    return 2;
  }
  absl::Status status;
  if (command == "logits") {
    status = RunLogits();
  } else if (command == "bench") {
    status = RunServingBenchCommand();
  } else if (command == "status") {
    status = absl::GetFlag(FLAGS_router).empty()
                 ? absl::InvalidArgumentError("status needs --router HOST:PORT")
                 : RemoteStatus(absl::GetFlag(FLAGS_router), absl::GetFlag(FLAGS_json));
  } else if (command == "probe") {
    status = absl::GetFlag(FLAGS_addr).empty() ? absl::InvalidArgumentError("probe needs --addr HOST:PORT")
                                                : Probe(absl::GetFlag(FLAGS_addr), absl::GetFlag(FLAGS_service),
                                                        absl::GetFlag(FLAGS_timeout));
  } else if (command == "generate") {
    status = RunGenerate();
  } else if (command == "tokenize") {
    status = RunTokenize();
  } else if (command == "detokenize") {
    status = RunDetokenize();
  } else if (command == "chat-template") {
    status = RunChatTemplate();
  } else if (command == "bench-tokenizer") {
    status = BenchTokenizer(ModelDir(), absl::GetFlag(FLAGS_corpus),
                            absl::GetFlag(FLAGS_reference_dir));
  } else if (command == "make-model") {
    status = RunMakeModel();
  } else if (command == "bench-engine") {
    status = RunBenchEngineCommand();
  } else if (command == "bench-attention") {
    status = RunBenchAttentionCommand();
  } else if (command == "bench-kv") {
    BenchKvCommon kv;
    kv.model_dir = absl::GetFlag(FLAGS_model);
    if (!absl::GetFlag(FLAGS_kv).empty()) kv.kv = absl::GetFlag(FLAGS_kv);
    kv.block_size = absl::GetFlag(FLAGS_block_size);
    kv.threads = absl::GetFlag(FLAGS_threads);
    kv.json = absl::GetFlag(FLAGS_json);
    status = RunBenchKv(kv);
  } else if (command == "bench-tier2") {
    status = RunBenchTier2(absl::GetFlag(FLAGS_json));
  } else if (command == "plan") {
    status = RunPlan(absl::GetFlag(FLAGS_config), absl::GetFlag(FLAGS_json));
  } else {
    std::fprintf(stderr, "pdctl: unknown command '%s'\n%s", command.c_str(), kUsage);
    return 2;
  }
  if (!status.ok()) {
    std::fprintf(stderr, "pdctl %s: %s\n", command.c_str(), std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
