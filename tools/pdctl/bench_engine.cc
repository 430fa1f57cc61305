#include "tools/pdctl/bench_engine.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kv/block_hash.h"
#include "kv/prefix_cache.h"
#include "nlohmann/json.hpp"
#include "tools/pdctl/bench_grammar.h"
#include "tools/pdctl/bench_stats.h"

namespace pdserve::pdctl {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<int32_t> RandomTokens(int n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

void Progress(const std::string& what) { std::fprintf(stderr, "bench-engine: %s\n", what.c_str()); }

}  // namespace

absl::Status CopyHistory(KvManager& kv, const SequenceKv& proto, SequenceKv& seq, int32_t positions) {
  if (absl::Status s = kv.Grow(seq, positions); !s.ok()) return s;
  const KvCacheSpec& spec = kv.spec();
  for (size_t b = 0; b < seq.block_table().size(); ++b) {
    for (int32_t l = 0; l < spec.num_layers; ++l) {
      for (int32_t r = 0; r < spec.num_ranks; ++r) {
        std::memcpy(kv.storage().BlockData(l, BlockId{seq.block_table()[b]}, r),
                    kv.storage().BlockData(l, BlockId{proto.block_table()[b]}, r), spec.LayerBlockBytes());
      }
    }
  }
  seq.SetNumPositions(positions);
  return absl::OkStatus();
}

absl::Status RunBenchEngine(const BenchEngineOptions& o) {
  // Pool sized for the largest decode scenario (+ steps) and prefill.
  const int eo_block = o.engine.block_size;
  int64_t positions = 0;
  for (int b : o.decode_batches) {
    for (int h : o.decode_histories) {
      // B sequences plus the prefilled prototype, each with slack for the
      // steps and a partial block.
      positions = std::max<int64_t>(
          positions, static_cast<int64_t>(b + 1) * (h + o.decode_steps + 2 * eo_block + 8));
    }
  }
  for (int s : o.prefill_lengths) positions = std::max<int64_t>(positions, s + 2 * eo_block);
  if (o.shared_requests > 0) {
    positions = std::max<int64_t>(
        positions, o.shared_prefix + static_cast<int64_t>(o.shared_requests) *
                                         (o.shared_private + o.decode_steps + 2 * eo_block + 8));
  }
  if (o.prefix_hit_cached > 0) {
    positions = std::max<int64_t>(
        positions, 2 * (o.prefix_hit_cached + o.prefix_hit_new + 2 * eo_block));
  }
  if (o.engine.backend != "cpu") {
    return absl::InvalidArgumentError(
        "this benchmark measures the CPU backend against the CPU's limits; the GPU's is deploy/gpu/check.sh "
        "(pdserve-gpu-bench)");
  }
  ModelStackOptions eo = o.engine;
  eo.kv_positions = positions;
  Progress(absl::StrCat("loading ", eo.model_dir));
  absl::StatusOr<ModelStack> engine = LoadModelStack(eo);
  if (!engine.ok()) return engine.status();
  Model& model = *engine->model;
  KvManager& kv = *engine->kv;
  kernels::cpu::CpuBackend& backend = *engine->backend;
  const ModelConfig& c = model.config();

  nlohmann::ordered_json out;
  out["model"] = eo.model_dir;
  out["backend"] = backend.Name();
  out["matrix_path"] = std::string(kernels::cpu::MatrixPathName(backend.matrix_path()));
  out["matrix_path_reason"] = backend.matrix_path_reason();
  out["kv_prefetch"] = backend.kv_prefetch();
  const bool dot_attention = backend.Bf16DotAttention(kv.spec().dtype, kv.spec().block_size);
  out["attention_form"] = dot_attention ? "bf16_dot" : "f32_fma";
  out["threads"] = backend.num_threads();
  out["weights"] = std::string(DTypeName(model.weight_dtype()));
  out["kv"] = std::string(DTypeName(kv.spec().dtype));
  out["parameters"] = c.NumParameters();
  out["weight_bytes"] = model.WeightBytes();

  // Every limit is sampled between the runs it judges, and both are quoted
  // as medians: these machines are shared and noisy.
  std::vector<double> peak_samples;

  const double linear_params =
      static_cast<double>(c.NumParameters() - c.vocab_size * c.hidden_size * (c.tie_word_embeddings ? 1 : 2) -
                          c.hidden_size);
  nlohmann::ordered_json prefill = nlohmann::ordered_json::array();
  for (int S : o.prefill_lengths) {
    Progress(absl::StrCat("prefill ", S, " tokens"));
    const std::vector<int32_t> tokens = RandomTokens(S, c.vocab_size, S);
    std::vector<double> times, peaks;
    const int reps = S >= 2048 ? 3 : 5;
    for (int r = 0; r < reps; ++r) {
      peaks.push_back(backend.SamplePeakFlops());
      SequenceKv seq = kv.NewSequence();
      ForwardSequence fs{&seq, tokens, LogitsMode::kLast};
      const auto t0 = Clock::now();
      absl::StatusOr<ForwardResult> res = ForwardGrowing(model, kv, {&fs, 1});
      const auto t1 = Clock::now();
      seq.Release();
      if (!res.ok()) return res.status();
      times.push_back(Seconds(t0, t1));
    }
    const double t = Median(times);
    const double peak = Median(peaks);
    peak_samples.insert(peak_samples.end(), peaks.begin(), peaks.end());
    const double attention_flops = 4.0 * c.head_dim * c.num_heads * c.num_layers * S * (S + 1.0) / 2.0;
    const double flops = 2.0 * linear_params * S + 2.0 * c.hidden_size * c.vocab_size + attention_flops;
    prefill.push_back({{"tokens", S},
                       {"seconds", t},
                       {"tokens_per_second", S / t},
                       {"flops", flops},
                       {"attention_flops", attention_flops},
                       {"flops_per_second", flops / t},
                       {"peak_flops", peak},
                       {"fraction_of_peak", flops / t / peak}});
  }
  {
    // Every matrix instruction of this CPU, beside the path taken: the
    // fastest one is the limit a prefill is judged against.
    std::vector<double> bf16, fp16, f32, amx;
    for (int i = 0; i < 3; ++i) {
      const auto p = backend.SampleMatrixPeaks();
      bf16.push_back(p.bf16_dot);
      fp16.push_back(p.fp16_fma);
      f32.push_back(p.f32_fma);
      amx.push_back(p.amx_bf16);
    }
    const double fastest = std::max({Median(f32), Median(bf16), Median(fp16), Median(amx)});
    out["matrix_peaks"] = {{"f32_fma", Median(f32)},
                           {"bf16_dot", Median(bf16)},
                           {"fp16_fma", Median(fp16)},
                           {"amx_bf16", Median(amx)},
                           {"fastest", fastest}};
    // The attention runs on F32 FMA on every path but the bf16 one over
    // BF16 KV (VDPBF16PS, attention_form): its form is the same for a
    // prompt's rows and the decode steps (recompute after migration relies
    // on their bits being equal), and the KV format has no tile layout. So
    // a prefill can reach at most its FLOPs over (attention at its
    // instruction's peak + the rest at the fastest peak), as a fraction of
    // the fastest peak.
    const double attention_peak = dot_attention ? Median(bf16) : Median(f32);
    out["attention_peak_flops"] = attention_peak;
    for (auto& p : prefill) {
      const double total = p["flops"].get<double>(), attn = p["attention_flops"].get<double>();
      const double best_seconds = attn / attention_peak + (total - attn) / fastest;
      p["fraction_of_fastest_attention_at_its_peak"] = total / best_seconds / fastest;
    }
    out["prefill"] = prefill;
  }

  if (o.prefix_hit_cached > 0) {
    // A request whose first `cached` tokens hit the prefix cache: only the
    // new tokens are projected; their queries read the cached history.
    const int cached = o.prefix_hit_cached / eo_block * eo_block;
    const int fresh = o.prefix_hit_new;
    Progress(absl::StrCat("prefix hit: ", fresh, " new tokens after ", cached, " cached"));
    const BlockHasher hasher(model.identity(), kv.spec().dtype, eo_block);
    std::vector<int32_t> prompt = RandomTokens(cached + fresh, c.vocab_size, 77);
    {
      SequenceKv warm = kv.NewSequence();
      const std::vector<int32_t> prefix(prompt.begin(), prompt.begin() + cached);
      ForwardSequence fs{&warm, prefix, LogitsMode::kNone};
      absl::StatusOr<ForwardResult> res = ForwardGrowing(model, kv, {&fs, 1});
      if (!res.ok()) return res.status();
      PublishFullBlocks(kv, hasher, prefix, warm);
      warm.Release();
    }
    std::vector<double> times, peaks;
    int32_t reused = 0;
    for (int r = 0; r < 5; ++r) {
      peaks.push_back(backend.SamplePeakFlops());
      SequenceKv seq = kv.NewSequence();
      reused = AttachCachedPrefix(kv, hasher, prompt, seq);
      const auto t0 = Clock::now();
      ForwardSequence fs{&seq, absl::MakeConstSpan(prompt).subspan(reused), LogitsMode::kLast};
      absl::StatusOr<ForwardResult> res = ForwardGrowing(model, kv, {&fs, 1});
      const auto t1 = Clock::now();
      seq.Release();
      if (!res.ok()) return res.status();
      times.push_back(Seconds(t0, t1));
    }
    const int computed = cached + fresh - reused;
    const double t = Median(times);
    const double peak = Median(peaks);
    // Attention: each new row i reads reused + i + 1 keys.
    const double pairs = static_cast<double>(computed) * reused + computed * (computed + 1.0) / 2.0;
    const double flops = 2.0 * linear_params * computed + 2.0 * c.hidden_size * c.vocab_size +
                         4.0 * c.head_dim * c.num_heads * c.num_layers * pairs;
    out["prefix_hit"] = {{"cached_tokens", reused},
                         {"new_tokens", computed},
                         {"seconds", t},
                         {"new_tokens_per_second", computed / t},
                         {"flops", flops},
                         {"flops_per_second", flops / t},
                         {"peak_flops", peak},
                         {"fraction_of_peak", flops / t / peak}};
  }
  out["peak_flops"] = peak_samples.empty() ? backend.SamplePeakFlops() : Median(peak_samples);

  nlohmann::ordered_json decode = nlohmann::ordered_json::array();
  const int64_t c_kv = kv.spec().BytesPerPosition();
  // No batches (`--decode_batch ""`): no history is prepared either (the
  // pool is sized for none).
  for (int H : o.decode_batches.empty() ? std::vector<int>{} : o.decode_histories) {
    // Prefill one sequence to H positions; the others copy its blocks.
    Progress(absl::StrCat("decode: preparing history ", H));
    SequenceKv proto = kv.NewSequence();
    {
      const std::vector<int32_t> tokens = RandomTokens(H, c.vocab_size, 1000 + H);
      ForwardSequence fs{&proto, tokens, LogitsMode::kNone};
      absl::StatusOr<ForwardResult> res = ForwardGrowing(model, kv, {&fs, 1});
      if (!res.ok()) return res.status();
    }
    for (int B : o.decode_batches) {
      Progress(absl::StrCat("decode batch ", B, " at history ", H));
      std::vector<SequenceKv> seqs;
      for (int b = 0; b < B; ++b) seqs.push_back(kv.NewSequence());
      for (SequenceKv& s : seqs) {
        if (absl::Status st = CopyHistory(kv, proto, s, H); !st.ok()) return st;
      }
      // The probe is sized from the expected reads; the bytes reported are
      // the weights plus the KV bytes the attention kernels counted.
      const double expected_kv = B * (H + o.decode_steps / 2.0 + 1) * c_kv;
      kernels::cpu::CpuBackend::ReadProbe probe(
          &backend, static_cast<size_t>(static_cast<double>(model.WeightBytesPerStep()) + expected_kv));
      std::vector<int32_t> next(B, 1);
      std::vector<double> times, attention_times, bandwidths;
      double counted_kv = 0, prefetched_kv = 0;
      for (int step = 0; step < o.decode_steps + 2; ++step) {
        if (step % 4 == 2) bandwidths.push_back(probe.Sample());
        std::vector<ForwardSequence> batch;
        for (int b = 0; b < B; ++b) {
          batch.push_back({&seqs[b], absl::MakeConstSpan(&next[b], 1), LogitsMode::kLast});
        }
        const int64_t prefetched0 = backend.kv_prefetched_bytes();
        const auto t0 = Clock::now();
        absl::StatusOr<ForwardResult> res = ForwardGrowing(model, kv, batch);
        const auto t1 = Clock::now();
        if (!res.ok()) return res.status();
        if (step >= 2) {
          times.push_back(Seconds(t0, t1));
          attention_times.push_back(res->attention_seconds);
          counted_kv += static_cast<double>(res->kv_bytes_read);
          prefetched_kv += static_cast<double>(backend.kv_prefetched_bytes() - prefetched0);
        }
        for (int b = 0; b < B; ++b) {
          absl::Span<const float> l = res->Last(b);
          next[b] = static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
        }
      }
      bandwidths.push_back(probe.Sample());
      const double t = Median(times);
      const double bw = Median(bandwidths);
      const double kv_bytes = counted_kv / static_cast<double>(times.size());
      // The part of the KV handed to the products to prefetch for the
      // attention (CpuBackend::PrefetchKv): the attention finds it in cache.
      const double kv_prefetched = prefetched_kv / static_cast<double>(times.size());
      const double bytes = static_cast<double>(model.WeightBytesPerStep()) + kv_bytes;
      // The attention kernels alone: their share of the step, and the KV
      // bytes they counted over their own time, against the same limit.
      const double t_attn = Median(attention_times);
      // The roofline limit of a decode step: the slower of moving its bytes
      // at the read limit and doing its FLOPs (projections, LM head and
      // attention over the mean history of the timed steps) at the fastest
      // matrix instruction's measured peak.
      const double mean_keys = H + o.decode_steps / 2.0 + 1;
      const double step_flops = B * (2.0 * linear_params + 2.0 * c.hidden_size * c.vocab_size +
                                     4.0 * c.head_dim * c.num_heads * c.num_layers * mean_keys);
      const double fastest = out["matrix_peaks"]["fastest"].get<double>();
      const double limit = std::max(bytes / bw, step_flops / fastest);
      // The same with the step's two kinds of work taking turns, as this
      // engine runs them (every thread on the products, then every thread
      // on the attention): each at its own limit, added. The roofline limit
      // assumes they overlap; a ratio to this one says how far the kernels
      // are from the best the step's structure allows.
      const double product_flops = B * (2.0 * linear_params + 2.0 * c.hidden_size * c.vocab_size);
      const double serial_limit =
          std::max(static_cast<double>(model.WeightBytesPerStep()) / bw, product_flops / fastest) +
          std::max(kv_bytes / bw, (step_flops - product_flops) / fastest);
      decode.push_back({{"batch", B},
                        {"history", H},
                        {"step_seconds", t},
                        {"tokens_per_second", B / t},
                        {"bytes_per_step", bytes},
                        {"kv_bytes_per_step", kv_bytes},
                        {"kv_prefetched_bytes_per_step", kv_prefetched},
                        {"bytes_per_second", bytes / t},
                        {"read_bandwidth", bw},
                        {"fraction_of_bandwidth", bytes / t / bw},
                        {"attention_seconds", t_attn},
                        {"attention_share", t_attn / t},
                        {"attention_kv_bytes_per_second", kv_bytes / t_attn},
                        {"attention_fraction_of_bandwidth", kv_bytes / t_attn / bw},
                        {"flops_per_step", step_flops},
                        {"limit_seconds", limit},
                        {"step_over_limit", t / limit},
                        {"serial_limit_seconds", serial_limit},
                        {"step_over_serial_limit", t / serial_limit}});
      for (SequenceKv& s : seqs) s.Release();
    }
    proto.Release();
  }
  out["decode"] = decode;

  if (o.shared_requests > 0) {
    Progress(absl::StrCat("shared-prefix decode: ", o.shared_requests, " requests sharing ",
                          o.shared_prefix, " tokens, ", o.shared_private, " private each"));
    const int prefix_len = o.shared_prefix / eo_block * eo_block;
    const BlockHasher hasher(model.identity(), kv.spec().dtype, eo_block);
    const std::vector<int32_t> prefix = RandomTokens(prefix_len, c.vocab_size, 555);
    {
      SequenceKv warm = kv.NewSequence();
      ForwardSequence fs{&warm, prefix, LogitsMode::kNone};
      absl::StatusOr<ForwardResult> res = ForwardGrowing(model, kv, {&fs, 1});
      if (!res.ok()) return res.status();
      PublishFullBlocks(kv, hasher, prefix, warm);
      warm.Release();
    }
    std::vector<SequenceKv> seqs;
    for (int r = 0; r < o.shared_requests; ++r) seqs.push_back(kv.NewSequence());
    int64_t unique_positions = prefix_len;
    for (int r = 0; r < o.shared_requests; ++r) {
      std::vector<int32_t> p = prefix;
      const std::vector<int32_t> own = RandomTokens(o.shared_private, c.vocab_size, 600 + r);
      p.insert(p.end(), own.begin(), own.end());
      const int32_t reused = AttachCachedPrefix(kv, hasher, p, seqs[r]);
      ForwardSequence fs{&seqs[r], absl::MakeConstSpan(p).subspan(reused), LogitsMode::kNone};
      absl::StatusOr<ForwardResult> res = ForwardGrowing(model, kv, {&fs, 1});
      if (!res.ok()) return res.status();
      unique_positions += o.shared_private + 1;
    }
    nlohmann::ordered_json shared = nlohmann::ordered_json::array();
    std::vector<int32_t> next(o.shared_requests, 1);
    for (bool group : {true, false}) {
      std::vector<double> times;
      int64_t bytes = 0;
      for (int step = 0; step < o.decode_steps + 2; ++step) {
        std::vector<ForwardSequence> batch;
        for (int r = 0; r < o.shared_requests; ++r) {
          batch.push_back({&seqs[r], absl::MakeConstSpan(&next[r], 1), LogitsMode::kLast});
        }
        const auto t0 = Clock::now();
        absl::StatusOr<ForwardResult> res = ForwardGrowing(model, kv, batch, {.group_shared_kv = group});
        const auto t1 = Clock::now();
        if (!res.ok()) return res.status();
        if (step >= 2) times.push_back(Seconds(t0, t1));
        bytes = res->kv_bytes_read;
        // Re-run the same step (same positions), so both settings see equal histories.
        for (SequenceKv& s : seqs) s.SetNumPositions(s.num_positions() - 1);
      }
      const double unique = static_cast<double>(unique_positions) * c_kv;
      shared.push_back({{"cascade", group},
                        {"step_seconds", Median(times)},
                        {"kv_bytes_read_per_step", bytes},
                        {"unique_kv_bytes", unique},
                        {"read_over_unique", bytes / unique}});
    }
    for (SequenceKv& s : seqs) s.Release();
    out["shared_prefix_decode"] = {{"requests", o.shared_requests},
                                   {"shared_tokens", prefix_len},
                                   {"private_tokens", o.shared_private},
                                   {"runs", shared}};
  }
  {
    // Response formats: the mask's cost per token against the batch-1
    // step (the smallest history measured).
    BenchMaskOptions mo;
    // A model without a tokenizer (a shape-only random model) has no
    // vocabulary to measure unless one is named.
    mo.tokenizer_dirs = o.mask_tokenizers;
    if (mo.tokenizer_dirs.empty() && std::filesystem::exists(eo.model_dir + "/tokenizer.json")) {
      mo.tokenizer_dirs.push_back(eo.model_dir);
    }
    for (const auto& d : decode) {
      if (d["batch"].get<int>() == 1 && mo.step_seconds == 0) mo.step_seconds = d["step_seconds"].get<double>();
    }
    absl::StatusOr<nlohmann::ordered_json> masks = BenchMasks(mo);
    if (!masks.ok()) return masks.status();
    out["response_format_masks"] = *std::move(masks);
  }
  {
    // For reference: DRAM read bandwidth on a buffer far larger than any cache.
    Progress("measuring DRAM read bandwidth (1 GiB buffer)");
    kernels::cpu::CpuBackend::ReadProbe dram(&backend, size_t{1} << 30);
    std::vector<double> s;
    for (int i = 0; i < 5; ++i) s.push_back(dram.Sample());
    out["dram_read_bandwidth"] = Median(s);
  }

  if (o.json) {
    std::printf("%s\n", out.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf("model %s: %.1fM parameters, weights %s (%.1f MB), KV %s, %s, %d threads\n",
              eo.model_dir.c_str(), c.NumParameters() / 1e6, DTypeName(model.weight_dtype()).data(),
              model.WeightBytes() / 1e6, DTypeName(kv.spec().dtype).data(), backend.Name().c_str(),
              backend.num_threads());
  std::printf("limits are medians of samples taken between the timed runs they judge\n\n");
  std::printf("%-8s %10s %12s %12s %12s %9s\n", "prefill", "seconds", "tokens/s", "GFLOP/s",
              "peak GFLOP/s", "of peak");
  for (const auto& p : prefill) {
    std::printf("%-8d %10.4f %12.1f %12.1f %12.1f %8.1f%%\n", p["tokens"].get<int>(),
                p["seconds"].get<double>(), p["tokens_per_second"].get<double>(),
                p["flops_per_second"].get<double>() / 1e9, p["peak_flops"].get<double>() / 1e9,
                100 * p["fraction_of_peak"].get<double>());
  }
  {
    const auto& mp = out["matrix_peaks"];
    const double f32 = mp["f32_fma"].get<double>();
    const double fastest = mp["fastest"].get<double>();
    std::printf("matrix path: %s (%s)\n", out["matrix_path"].get<std::string>().c_str(),
                out["matrix_path_reason"].get<std::string>().c_str());
    std::printf("attention: %s\n", out["attention_form"] == "bf16_dot"
                                        ? "BF16 dot products (queries and softmax weights rounded to BF16)"
                                        : "F32 multiply-adds");
    std::printf("instruction peaks, all threads: f32 FMA %.1f GFLOP/s, AVX512-BF16 dot %.1f (%.2fx), "
                "AVX512-FP16 FMA %.1f (%.2fx), AMX-BF16 %.1f (%.2fx)\n",
                f32 / 1e9, mp["bf16_dot"].get<double>() / 1e9, mp["bf16_dot"].get<double>() / f32,
                mp["fp16_fma"].get<double>() / 1e9, mp["fp16_fma"].get<double>() / f32,
                mp["amx_bf16"].get<double>() / 1e9, mp["amx_bf16"].get<double>() / f32);
    for (const auto& p : prefill) {
      const double ceiling = p["tokens"].get<double>() * fastest / p["flops"].get<double>();
      const double best = p["fraction_of_fastest_attention_at_its_peak"].get<double>();
      std::printf("  prefill %d: %.1f%% of the fastest instruction's peak (%.0f tokens/s at 100%%); "
                  "with its attention (%.1f%% of the FLOPs) at the %s peak, at most %.1f%% "
                  "(this run: %.1f%% of that)\n",
                  p["tokens"].get<int>(), 100 * p["tokens_per_second"].get<double>() / ceiling, ceiling,
                  100 * p["attention_flops"].get<double>() / p["flops"].get<double>(),
                  out["attention_form"] == "bf16_dot" ? "BF16 dot" : "F32 FMA", 100 * best,
                  100 * p["tokens_per_second"].get<double>() / ceiling / best);
    }
  }
  if (out.contains("prefix_hit")) {
    const auto& p = out["prefix_hit"];
    std::printf("prefix hit: %d new tokens after %d cached: %.4f s, %.1f new tokens/s, %.1f GFLOP/s, "
                "%.1f%% of peak\n",
                p["new_tokens"].get<int>(), p["cached_tokens"].get<int>(), p["seconds"].get<double>(),
                p["new_tokens_per_second"].get<double>(), p["flops_per_second"].get<double>() / 1e9,
                100 * p["fraction_of_peak"].get<double>());
  }
  std::printf("\n%-6s %8s %10s %10s %12s %12s %12s %9s %9s %8s %7s %10s %9s %9s %8s\n", "batch", "history",
              "step ms", "tokens/s", "MB/step", "GB/s", "limit GB/s", "of limit", "limit ms", "x limit", "attn",
              "attn KV GB/s", "of limit", "serial ms", "x serial");
  for (const auto& d : decode) {
    std::printf("%-6d %8d %10.3f %10.1f %12.1f %12.1f %12.1f %8.1f%% %9.3f %7.2fx %6.1f%% %10.1f %8.1f%% %9.3f %7.2fx\n",
                d["batch"].get<int>(), d["history"].get<int>(), 1e3 * d["step_seconds"].get<double>(),
                d["tokens_per_second"].get<double>(), d["bytes_per_step"].get<double>() / 1e6,
                d["bytes_per_second"].get<double>() / 1e9, d["read_bandwidth"].get<double>() / 1e9,
                100 * d["fraction_of_bandwidth"].get<double>(), 1e3 * d["limit_seconds"].get<double>(),
                d["step_over_limit"].get<double>(), 100 * d["attention_share"].get<double>(),
                d["attention_kv_bytes_per_second"].get<double>() / 1e9,
                100 * d["attention_fraction_of_bandwidth"].get<double>(),
                1e3 * d["serial_limit_seconds"].get<double>(), d["step_over_serial_limit"].get<double>());
  }
  // On, but taken by no product of this run (CpuBackend::PrefetchKv: only
  // the F32 path's products, at the rows its kernels take it at): say so,
  // with those rows, rather than let "on" suggest it shaped these figures.
  bool handed = false;
  for (const auto& d : decode) handed = handed || d["kv_prefetched_bytes_per_step"].get<double>() > 0;
  const bool kv_prefetch = out["kv_prefetch"].get<bool>();
  const auto [first_rows, last_rows] = backend.kv_prefetch_rows();
  const std::string taken_by =
      first_rows > last_rows ? "no product of this kernel path takes it"
                             : absl::StrCat("only the f32 matrix path's products of ", first_rows, "-", last_rows,
                                            " rows take it");
  std::printf("KV prefetch inside the batched-decode products: %s (PDSERVE_KV_PREFETCH=%d to compare)\n",
              !kv_prefetch ? (kernels::cpu::KvPrefetchByDefault() ? "off" : "off (the default on CPUs other than AMD)")
              : handed     ? "on"
                           : absl::StrCat("on, but no product of this run took it (", taken_by, ")").c_str(),
              kv_prefetch ? 0 : 1);
  for (const auto& d : decode) {
    const double pf = d["kv_prefetched_bytes_per_step"].get<double>();
    if (pf <= 0) continue;
    std::printf("  batch %d history %d: the products were handed %.1f MB/step of the KV to prefetch for the "
                "attention (%.0f%% of what it read; its \"attn KV GB/s\" is partly from cache)\n",
                d["batch"].get<int>(), d["history"].get<int>(), pf / 1e6,
                100 * pf / d["kv_bytes_per_step"].get<double>());
  }
  if (out.contains("shared_prefix_decode")) {
    const auto& sp = out["shared_prefix_decode"];
    std::printf("\nshared-prefix decode: %d requests sharing %d tokens (same blocks), %d private each\n",
                sp["requests"].get<int>(), sp["shared_tokens"].get<int>(), sp["private_tokens"].get<int>());
    for (const auto& r : sp["runs"]) {
      std::printf("  cascade %-3s step %8.3f ms   KV read/step %8.1f MB = %.2f x unique\n",
                  r["cascade"].get<bool>() ? "on" : "off", 1e3 * r["step_seconds"].get<double>(),
                  r["kv_bytes_read_per_step"].get<double>() / 1e6, r["read_over_unique"].get<double>());
    }
  }
  std::printf("\nresponse format (a JSON Schema; random logits, %d outputs each): cost per token beyond "
              "unconstrained sampling\n",
              BenchMaskOptions{}.generations);
  if (out["response_format_masks"].empty()) std::printf("  none: the model has no tokenizer (--mask_tokenizers)\n");
  for (const auto& m : out["response_format_masks"]) {
    std::printf("  vocab %6d: warm %.3f ms (median), cold mask %.2f ms (%lld states), mean %.3f ms/token",
                m["vocab"].get<int>(), 1e3 * m["warm_token_seconds"].get<double>(),
                1e3 * m["cold_mask_seconds"].get<double>(), static_cast<long long>(m["cold_masks"].get<int64_t>()),
                1e3 * m["mean_token_seconds"].get<double>());
    if (m.contains("mean_fraction_of_step")) {
      std::printf(" = %.1f%% of the batch-1 step (%.2f ms; warm %.1f%%)", 100 * m["mean_fraction_of_step"].get<double>(),
                  1e3 * m["step_seconds"].get<double>(), 100 * m["warm_fraction_of_step"].get<double>());
    }
    std::printf("  [%s]\n", m["tokenizer"].get<std::string>().c_str());
  }
  std::printf("\nDRAM read bandwidth (1 GiB buffer, same threads): %.1f GB/s\n",
              out["dram_read_bandwidth"].get<double>() / 1e9);
  return absl::OkStatus();
}

}  // namespace pdserve::pdctl
