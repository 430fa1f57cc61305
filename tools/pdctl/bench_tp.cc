#include "tools/pdctl/bench_tp.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "tools/pdctl/bench_stats.h"

namespace pdserve::pdctl {
namespace {

using Clock = std::chrono::steady_clock;

void Progress(const std::string& what) { std::fprintf(stderr, "bench-engine --tp: %s\n", what.c_str()); }

std::vector<int32_t> RandomTokens(int n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// Median step and collective seconds of one configuration on one stack.
struct Timing {
  double step_s = 0;
  double collective_s = 0;
};

class Runner {
 public:
  explicit Runner(ModelStack& stack) : stack_(stack) {}

  double CollectiveSeconds() {
    kernels::cpu::ThreadCollectiveGroup* g = stack_.model->tp_group();
    return g == nullptr ? 0.0 : g->stats(0).seconds;
  }

  // One timed forward of `batch`.
  absl::StatusOr<std::pair<double, double>> Time(std::vector<ForwardSequence>& batch) {
    const double c0 = CollectiveSeconds();
    const auto t0 = Clock::now();
    absl::StatusOr<ForwardResult> r = ForwardGrowing(*stack_.model, *stack_.kv, batch);
    const auto t1 = Clock::now();
    if (!r.ok()) return r.status();
    return std::make_pair(std::chrono::duration<double>(t1 - t0).count(), CollectiveSeconds() - c0);
  }

  absl::StatusOr<Timing> Prefill(int S, int reps) {
    const std::vector<int32_t> tokens = RandomTokens(S, stack_.model->config().vocab_size, S);
    std::vector<double> steps, coll;
    for (int r = 0; r < reps; ++r) {
      SequenceKv seq = stack_.kv->NewSequence();
      std::vector<ForwardSequence> batch = {{&seq, tokens, LogitsMode::kLast}};
      absl::StatusOr<std::pair<double, double>> t = Time(batch);
      if (!t.ok()) return t.status();
      steps.push_back(t->first);
      coll.push_back(t->second);
    }
    return Timing{Median(steps), Median(coll)};
  }

  absl::StatusOr<Timing> Decode(int B, int H, int steps) {
    KvManager& kv = *stack_.kv;
    const ModelConfig& c = stack_.model->config();
    SequenceKv proto = kv.NewSequence();
    {
      const std::vector<int32_t> tokens = RandomTokens(H, c.vocab_size, 1000 + H);
      std::vector<ForwardSequence> batch = {{&proto, tokens, LogitsMode::kNone}};
      absl::StatusOr<ForwardResult> r = ForwardGrowing(*stack_.model, kv, batch);
      if (!r.ok()) return r.status();
    }
    std::vector<SequenceKv> seqs;
    for (int b = 0; b < B; ++b) seqs.push_back(kv.NewSequence());
    for (SequenceKv& s : seqs) {
      if (absl::Status st = CopyHistory(kv, proto, s, H); !st.ok()) return st;
    }
    std::vector<int32_t> next(B, 1);
    std::vector<double> step_s, coll;
    for (int step = 0; step < steps + 2; ++step) {
      std::vector<ForwardSequence> batch;
      for (int b = 0; b < B; ++b) batch.push_back({&seqs[b], absl::MakeConstSpan(&next[b], 1), LogitsMode::kLast});
      absl::StatusOr<std::pair<double, double>> t = Time(batch);
      if (!t.ok()) return t.status();
      if (step >= 2) {  // Two warm-up steps.
        step_s.push_back(t->first);
        coll.push_back(t->second);
      }
    }
    return Timing{Median(step_s), Median(coll)};
  }

 private:
  ModelStack& stack_;
};

}  // namespace

absl::Status RunBenchTp(const BenchEngineOptions& o) {
  const int tp = o.engine.tp;
  int64_t positions = 0;
  for (int b : o.decode_batches) {
    for (int h : o.decode_histories) {
      positions = std::max<int64_t>(positions, static_cast<int64_t>(b + 1) * (h + o.decode_steps + 2 * o.engine.block_size + 8));
    }
  }
  for (int s : o.prefill_lengths) positions = std::max<int64_t>(positions, s + 2 * o.engine.block_size);

  if (o.engine.backend != "cpu") {
    return absl::InvalidArgumentError(
        "this benchmark measures the CPU backend against the CPU's limits; the GPU's is deploy/gpu/check.sh "
        "(pdserve-gpu-bench)");
  }
  ModelStackOptions sharded_options = o.engine;
  sharded_options.kv_positions = positions;
  ModelStackOptions single_options = sharded_options;
  single_options.tp = 1;
  single_options.threads = o.engine.threads * tp;
  Progress(absl::StrCat("loading ", o.engine.model_dir, " over ", tp, " ranks of ", o.engine.threads, " thread(s)"));
  absl::StatusOr<ModelStack> sharded = LoadModelStack(sharded_options);
  if (!sharded.ok()) return sharded.status();
  // The single rank runs the kernels rank 0 chose.
  single_options.isa = std::string(kernels::cpu::IsaName(sharded->backend->isa()));
  single_options.matrix_path = std::string(kernels::cpu::MatrixPathName(sharded->backend->matrix_path()));
  Progress(absl::StrCat("loading it again as one rank of ", single_options.threads, " threads"));
  absl::StatusOr<ModelStack> single = LoadModelStack(single_options);
  if (!single.ok()) return single.status();
  Runner tp_runner(*sharded), one_runner(*single);
  const int layers = static_cast<int>(sharded->model->config().num_layers);

  nlohmann::ordered_json out;
  out["model"] = o.engine.model_dir;
  out["backend"] = sharded->backend->Name();
  out["tp"] = tp;
  out["threads_per_rank"] = o.engine.threads;
  out["single_rank_threads"] = single_options.threads;
  out["kv_bytes_per_position_per_rank"] = sharded->kv->spec().BytesPerPosition();
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  auto add = [&](const std::string& what, const Timing& t, const Timing& one) {
    rows.push_back({{"run", what},
                    {"step_seconds", t.step_s},
                    {"collective_seconds", t.collective_s},
                    {"compute_seconds", t.step_s - t.collective_s},
                    {"single_rank_step_seconds", one.step_s}});
  };
  for (int S : o.prefill_lengths) {
    Progress(absl::StrCat("prefill ", S, " tokens"));
    const int reps = S >= 2048 ? 3 : 5;
    absl::StatusOr<Timing> t = tp_runner.Prefill(S, reps);
    if (!t.ok()) return t.status();
    absl::StatusOr<Timing> one = one_runner.Prefill(S, reps);
    if (!one.ok()) return one.status();
    add(absl::StrCat("prefill ", S), *t, *one);
  }
  for (int H : o.decode_histories) {
    for (int B : o.decode_batches) {
      Progress(absl::StrCat("decode batch ", B, " at history ", H));
      absl::StatusOr<Timing> t = tp_runner.Decode(B, H, o.decode_steps);
      if (!t.ok()) return t.status();
      absl::StatusOr<Timing> one = one_runner.Decode(B, H, o.decode_steps);
      if (!one.ok()) return one.status();
      add(absl::StrCat("decode b=", B, " h=", H), *t, *one);
    }
  }
  out["runs"] = rows;
  if (o.json) {
    std::printf("%s\n", out.dump(2).c_str());
    return absl::OkStatus();
  }
  std::printf("model %s, %s: %d ranks x %d thread(s) against 1 rank x %d threads (same cores)\n",
              o.engine.model_dir.c_str(), sharded->backend->Name().c_str(), tp, o.engine.threads,
              single_options.threads);
  std::printf("KV per position per rank: %lld B (one rank alone: %lld B)\n",
              static_cast<long long>(sharded->kv->spec().BytesPerPosition()),
              static_cast<long long>(single->kv->spec().BytesPerPosition()));
  std::printf("collective: rank 0's time inside all-reduces and gathers (the exchange and the wait for other ranks)\n\n");
  std::printf("%-20s %10s %12s %12s %14s %14s %8s\n", "run", "step ms", "compute ms", "collect. ms",
              "per layer c/x", "1-rank step ms", "tp/1");
  for (const auto& r : rows) {
    const double step = r["step_seconds"].get<double>(), coll = r["collective_seconds"].get<double>();
    const double one = r["single_rank_step_seconds"].get<double>();
    std::printf("%-20s %10.3f %12.3f %12.3f %6.3f/%-7.3f %14.3f %7.2fx\n", r["run"].get<std::string>().c_str(),
                1e3 * step, 1e3 * (step - coll), 1e3 * coll, 1e3 * (step - coll) / layers, 1e3 * coll / layers,
                1e3 * one, step / one);
  }
  return absl::OkStatus();
}

}  // namespace pdserve::pdctl
