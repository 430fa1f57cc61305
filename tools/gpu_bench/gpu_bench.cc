// pdserve-gpu-bench: the CUDA backend beside the GPU's measured limits, on
// a Llama-3-8B-shaped model with random BF16 weights made on the device
// (32 layers, hidden 4096, 32/8 heads of 128, FFN 14336, vocab 128256).
//
// Prints, and appends to OUT/results.jsonl as it goes (so a run cut short
// by its time limit keeps what it measured):
//   - the limits: read bandwidth of a read-only kernel over --read_gib GiB,
//     cuBLAS's BF16 GEMM rate at 8192^3;
//   - decode step time at each batch x history beside the memory roofline
//     (weight + KV bytes / read bandwidth); cells whose KV does not fit say so;
//   - prefill tokens/s at each length beside the GEMM rate;
//   - the paged attention kernel alone on decode and prefill shapes (for
//     deploy/gpu/sdpa_bench.py to compare PyTorch's SDPA on the same shapes).
// Stops starting new cells after --budget_s seconds.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kv/kv_manager.h"
#include "model/model.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/device_array.h"

ABSL_FLAG(std::string, out, "", "directory for results.jsonl (written as the run goes); empty: stdout only");
ABSL_FLAG(std::string, shape, "8b", "model shape: 8b (Llama-3-8B) or 1b (a quick check: 16 layers, hidden 2048)");
ABSL_FLAG(std::string, batches, "1,8,32,128", "decode batch sizes");
ABSL_FLAG(std::string, histories, "1024,4096,16384", "decode histories (positions already in the KV)");
ABSL_FLAG(std::string, prefill, "512,2048,8192", "prefill lengths");
ABSL_FLAG(int, steps, 8, "timed decode steps per cell (after 2 untimed)");
ABSL_FLAG(double, read_gib, 8, "size of the read-bandwidth probe's buffer");
ABSL_FLAG(double, gpu_memory_fraction, 0.9, "fraction of GPU memory for weights + KV pool + workspace");
ABSL_FLAG(double, budget_s, 240, "start no new cell after this many seconds");
ABSL_FLAG(int, device, 0, "GPU");

namespace pdserve {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<int> Ints(const std::string& s) {
  std::vector<int> v;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int x;
    if (absl::SimpleAtoi(p, &x)) v.push_back(x);
  }
  return v;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

class Results {
 public:
  explicit Results(const std::string& dir) {
    if (!dir.empty()) file_.open(dir + "/results.jsonl", std::ios::app);
  }
  // One JSON object (already formatted) and its human line.
  void Add(const std::string& json, const std::string& line) {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    if (file_.is_open()) {
      file_ << json << "\n";
      file_.flush();
    }
  }

 private:
  std::ofstream file_;
};

ModelConfig Shape(const std::string& name) {
  ModelConfig c;
  c.vocab_size = 128256;
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_layers = 32;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 131072;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000;
  c.rope_scaling = Llama3RopeScaling{};
  if (name == "1b") {
    c.num_layers = 16;
    c.hidden_size = 2048;
    c.intermediate_size = 8192;
    c.num_heads = 16;
    c.num_kv_heads = 4;
  }
  return c;
}

int Run() {
  const absl::Time start = absl::Now();
  const double budget = absl::GetFlag(FLAGS_budget_s);
  auto over_budget = [&] { return absl::ToDoubleSeconds(absl::Now() - start) > budget; };
  Results out(absl::GetFlag(FLAGS_out));

  auto made = kernels::cuda::CudaBackend::Create({.device = absl::GetFlag(FLAGS_device)});
  if (!made.ok()) {
    std::fprintf(stderr, "pdserve-gpu-bench: %s\n", std::string(made.status().message()).c_str());
    return 2;
  }
  kernels::cuda::CudaBackend& gpu = **made;
  auto mem0 = gpu.MemoryInfo();
  out.Add(absl::StrFormat(R"({"device":"%s","total_gib":%.1f})", gpu.Name(), mem0->total_bytes / 1073741824.0),
          absl::StrFormat("device: %s, %.1f GiB", gpu.Name(), mem0->total_bytes / 1073741824.0));

  // Limits.
  auto bw = gpu.ReadBandwidth(static_cast<size_t>(absl::GetFlag(FLAGS_read_gib) * 1073741824.0));
  auto peak = gpu.Bf16GemmRate(8192, 8192, 8192);
  if (!bw.ok() || !peak.ok()) {
    std::fprintf(stderr, "limits: %s %s\n", std::string(bw.status().message()).c_str(),
                 std::string(peak.status().message()).c_str());
    return 1;
  }
  out.Add(absl::StrFormat(R"({"limit":"read_bandwidth","gb_s":%.1f,"buffer_gib":%.1f})", *bw / 1e9,
                          absl::GetFlag(FLAGS_read_gib)),
          absl::StrFormat("read bandwidth (read-only kernel, %.0f GiB): %.1f GB/s", absl::GetFlag(FLAGS_read_gib),
                          *bw / 1e9));
  out.Add(absl::StrFormat(R"({"limit":"bf16_gemm","tflop_s":%.1f,"shape":"8192^3"})", *peak / 1e12),
          absl::StrFormat("cuBLAS BF16 GEMM 8192^3 (F32 accumulate): %.1f TFLOP/s", *peak / 1e12));

  // The model, made on the device.
  const ModelConfig config = Shape(absl::GetFlag(FLAGS_shape));
  const absl::Time t0 = absl::Now();
  auto model = Model::CreateRandom(config, DType::kBF16, 1, &gpu);
  if (!model.ok()) {
    std::fprintf(stderr, "model: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  out.Add(absl::StrFormat(R"({"model":"%s","weight_gib":%.2f,"made_s":%.1f})", absl::GetFlag(FLAGS_shape),
                          (*model)->WeightBytes() / 1073741824.0, absl::ToDoubleSeconds(absl::Now() - t0)),
          absl::StrFormat("model %s: %.2f GiB of BF16 weights made on the device in %.1f s",
                          absl::GetFlag(FLAGS_shape), (*model)->WeightBytes() / 1073741824.0,
                          absl::ToDoubleSeconds(absl::Now() - t0)));

  // The KV pool: what the fraction leaves after the weights and 2 GiB of workspace.
  const int32_t bs = 16;
  auto mem = gpu.MemoryInfo();
  const double used = static_cast<double>(mem->total_bytes - mem->free_bytes);
  const double pool_bytes =
      absl::GetFlag(FLAGS_gpu_memory_fraction) * static_cast<double>(mem->total_bytes) - used - 2.0 * 1073741824.0;
  const int64_t per_block = (*model)->MakeKvSpec(DType::kBF16, bs, 1).TotalBytes();
  const int32_t blocks = static_cast<int32_t>(std::max(1.0, pool_bytes / static_cast<double>(per_block)));
  BackendKvRegionAllocator on_gpu(&gpu);
  auto kv = KvManager::Create((*model)->MakeKvSpec(DType::kBF16, bs, blocks), &on_gpu);
  if (!kv.ok()) {
    std::fprintf(stderr, "KV pool: %s\n", std::string(kv.status().message()).c_str());
    return 1;
  }
  const double kv_per_pos = static_cast<double>(per_block) / bs;
  out.Add(absl::StrFormat(R"({"kv_pool_gib":%.1f,"positions":%d})", blocks * static_cast<double>(per_block) / 1073741824.0,
                          blocks * bs),
          absl::StrFormat("KV pool: %.1f GiB, %d positions (%.0f KiB a position)",
                          blocks * static_cast<double>(per_block) / 1073741824.0, blocks * bs, kv_per_pos / 1024));

  // Decode.
  const int steps = absl::GetFlag(FLAGS_steps);
  std::printf("\n%6s %8s %10s %12s %10s %8s\n", "batch", "history", "step ms", "roofline ms", "x roofline",
              "tok/s");
  for (int h : Ints(absl::GetFlag(FLAGS_histories))) {
    for (int b : Ints(absl::GetFlag(FLAGS_batches))) {
      const std::string cell = absl::StrFormat(R"("batch":%d,"history":%d)", b, h);
      if (over_budget()) {
        out.Add(absl::StrCat("{", cell, R"(,"skipped":"time budget"})"),
                absl::StrFormat("%6d %8d  skipped: time budget", b, h));
        continue;
      }
      const int64_t need_blocks = static_cast<int64_t>(b) * ((h + steps + 2 + bs) / bs + 1);
      if (need_blocks > (*kv)->Counts().free) {
        out.Add(absl::StrCat("{", cell, R"(,"fits":false,"kv_gib_needed":)",
                             absl::StrFormat("%.1f", need_blocks * static_cast<double>(per_block) / 1073741824.0),
                             "}"),
                absl::StrFormat("%6d %8d  does not fit: %.1f GiB of KV, the pool has %.1f", b, h,
                                need_blocks * static_cast<double>(per_block) / 1073741824.0,
                                blocks * static_cast<double>(per_block) / 1073741824.0));
        continue;
      }
      std::vector<SequenceKv> seqs;
      std::vector<KvManager::GrowRequest> grow;
      seqs.reserve(b);
      for (int i = 0; i < b; ++i) seqs.push_back((*kv)->NewSequence());
      for (auto& s : seqs) grow.push_back({&s, h + steps + 3});
      if (absl::Status s = (*kv)->GrowAll(grow); !s.ok()) {
        out.Add(absl::StrCat("{", cell, R"(,"error":"grow"})"), absl::StrCat("grow: ", s.message()));
        continue;
      }
      // The history's KV is the pool's (zeroed) bytes: attention reads
      // every one of them as it would real ones.
      for (auto& s : seqs) s.SetNumPositions(h);
      const std::vector<int32_t> token = {1};
      std::vector<ForwardSequence> batch;
      for (auto& s : seqs) batch.push_back({&s, token, LogitsMode::kLast});
      std::vector<double> times;
      bool failed = false;
      for (int step = 0; step < steps + 2 && !failed; ++step) {
        const auto a = Clock::now();
        auto r = (*model)->Forward((*kv)->storage(), batch);
        const double t = std::chrono::duration<double>(Clock::now() - a).count();
        if (!r.ok()) {
          out.Add(absl::StrCat("{", cell, R"(,"error":"forward"})"), absl::StrCat("forward: ", r.status().message()));
          failed = true;
        }
        if (step >= 2) times.push_back(t);
      }
      for (auto& s : seqs) s.Release();
      if (failed) continue;
      const double step_s = Median(times);
      const double bytes = static_cast<double>((*model)->WeightBytesPerStep()) +
                           static_cast<double>(b) * (h + steps / 2.0) * kv_per_pos;
      const double roof = bytes / *bw;
      out.Add(absl::StrCat("{", cell,
                           absl::StrFormat(R"(,"step_ms":%.3f,"roofline_ms":%.3f,"ratio":%.2f,"tok_s":%.0f})",
                                           step_s * 1e3, roof * 1e3, step_s / roof, b / step_s)),
              absl::StrFormat("%6d %8d %10.3f %12.3f %10.2f %8.0f", b, h, step_s * 1e3, roof * 1e3, step_s / roof,
                              b / step_s));
    }
  }

  // Prefill.
  std::printf("\n%8s %10s %10s %12s\n", "tokens", "seconds", "tok/s", "of GEMM peak");
  const double matrix_params = static_cast<double>(config.num_layers) *
                                   (config.hidden_size * (config.QDim() + 2 * config.KvDim()) +
                                    config.QDim() * config.hidden_size + 3.0 * config.hidden_size * config.intermediate_size);
  for (int n : Ints(absl::GetFlag(FLAGS_prefill))) {
    if (over_budget()) {
      out.Add(absl::StrFormat(R"({"prefill":%d,"skipped":"time budget"})", n),
              absl::StrFormat("%8d  skipped: time budget", n));
      continue;
    }
    std::vector<int32_t> tokens(n);
    for (int i = 0; i < n; ++i) tokens[i] = 1 + (i * 7919) % static_cast<int>(config.vocab_size - 1);
    std::vector<double> times;
    bool failed = false;
    for (int run = 0; run < 3 && !failed; ++run) {
      SequenceKv seq = (*kv)->NewSequence();
      ForwardSequence fs{&seq, tokens, LogitsMode::kLast};
      const auto a = Clock::now();
      auto r = ForwardGrowing(**model, **kv, {&fs, 1});
      const double t = std::chrono::duration<double>(Clock::now() - a).count();
      if (!r.ok()) {
        out.Add(absl::StrFormat(R"({"prefill":%d,"error":"forward"})", n),
                absl::StrCat("prefill: ", r.status().message()));
        failed = true;
      }
      if (run > 0) times.push_back(t);
    }
    if (failed) continue;
    const double s = Median(times);
    // Matrices, the last row's LM head, and causal attention (QK^T and PV).
    const double flops = 2.0 * matrix_params * n + 2.0 * config.vocab_size * config.hidden_size +
                         2.0 * 2.0 * config.num_layers * config.num_heads * config.head_dim * (n * (n + 1) / 2.0);
    out.Add(absl::StrFormat(R"({"prefill":%d,"seconds":%.4f,"tok_s":%.0f,"of_peak":%.3f})", n, s, n / s,
                            flops / s / *peak),
            absl::StrFormat("%8d %10.4f %10.0f %11.1f%%", n, s, n / s, 100 * flops / s / *peak));
  }

  // The attention kernel alone: one layer, BF16 KV, the model's heads.
  std::printf("\nattention kernel alone (one layer; compare deploy/gpu/sdpa_bench.py):\n");
  struct AttnShape {
    int batch, history, new_tokens;
  };
  for (const AttnShape a : {AttnShape{1, 4096, 1}, AttnShape{32, 4096, 1}, AttnShape{128, 1024, 1},
                            AttnShape{1, 0, 2048}, AttnShape{1, 0, 8192}}) {
    if (over_budget()) break;
    const int64_t positions = static_cast<int64_t>(a.batch) * (a.history + a.new_tokens);
    if ((positions / bs + a.batch * 2) > (*kv)->Counts().free) continue;
    std::vector<SequenceKv> seqs;
    std::vector<KvManager::GrowRequest> grow;
    for (int i = 0; i < a.batch; ++i) seqs.push_back((*kv)->NewSequence());
    for (auto& s : seqs) grow.push_back({&s, a.history + a.new_tokens});
    if (!(*kv)->GrowAll(grow).ok()) continue;
    std::vector<kernels::AttentionSequence> as;
    for (int i = 0; i < a.batch; ++i) {
      as.push_back({absl::MakeConstSpan(seqs[i].block_table()), a.history, a.new_tokens, i * a.new_tokens});
    }
    const int64_t rows = static_cast<int64_t>(a.batch) * a.new_tokens;
    kernels::DeviceArray<float> q(&gpu), o(&gpu);
    if (!q.Grow(rows * config.QDim()).ok() || !o.Grow(rows * config.QDim()).ok()) continue;
    gpu.Zero(q.data(), rows * config.QDim() * sizeof(float));
    const KvStorage storage = (*kv)->storage().Rank(0);
    const kernels::AttentionBatch batch{.q = q.data(),
                                        .out = o.data(),
                                        .sequences = as,
                                        .kv = storage.LayerView(0),
                                        .num_heads = static_cast<int32_t>(config.num_heads),
                                        .num_kv_heads = static_cast<int32_t>(config.num_kv_heads),
                                        .head_dim = static_cast<int32_t>(config.head_dim),
                                        .scale = 1.0f / std::sqrt(static_cast<float>(config.head_dim))};
    std::vector<double> times;
    for (int run = 0; run < 6; ++run) {
      gpu.Synchronize();
      const auto t = Clock::now();
      gpu.Attention(batch);
      gpu.Synchronize();
      if (run > 0) times.push_back(std::chrono::duration<double>(Clock::now() - t).count());
    }
    for (auto& s : seqs) s.Release();
    const double ms = Median(times) * 1e3;
    const double kv_bytes = static_cast<double>(a.batch) * (a.history + a.new_tokens) * config.num_kv_heads *
                            config.head_dim * 2 * 2;
    out.Add(absl::StrFormat(R"({"attention":{"batch":%d,"history":%d,"new":%d},"ms":%.3f,"kv_gb_s":%.1f})", a.batch,
                            a.history, a.new_tokens, ms, kv_bytes / (ms / 1e3) / 1e9),
            absl::StrFormat("  batch %4d history %6d new %5d: %8.3f ms (KV read once at %.1f GB/s = %.0f%% of the "
                            "read bandwidth)",
                            a.batch, a.history, a.new_tokens, ms, kv_bytes / (ms / 1e3) / 1e9,
                            100 * kv_bytes / (ms / 1e3) / *bw));
  }
  out.Add(R"({"cascade":"not implemented"})",
          "cascade (shared-prefix) attention: not implemented on the GPU yet; nothing to compare");
  if (!gpu.status().ok()) {
    std::fprintf(stderr, "backend error: %s\n", std::string(gpu.status().message()).c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pdserve::Run();
}
