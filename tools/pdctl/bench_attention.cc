#include "tools/pdctl/bench_attention.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/dtype.h"
#include "kv/kv_cache.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/isa.h"
#include "nlohmann/json.hpp"
#include "tools/pdctl/bench_stats.h"

namespace pdserve::pdctl {
namespace {

using kernels::AttentionSequence;
using kernels::KvLayerView;
using kernels::cpu::CpuBackend;
using kernels::cpu::CpuBackendOptions;

// The last-level cache of the CPU this runs on, as the kernel reports it
// (sysfs; in a VM glibc's sysconf may give the host package's instead:
// 256 MiB against the guest's 32 MiB L3 on a 2-vCPU cloud VM). 0 when
// unknown.
int64_t LastLevelCacheBytes() {
  int64_t best = 0;
  for (int i = 0; i < 8; ++i) {
    std::ifstream f(absl::StrCat("/sys/devices/system/cpu/cpu0/cache/index", i, "/size"));
    std::string text;
    if (!(f >> text) || text.empty()) continue;
    int64_t scale = 1;
    if (text.back() == 'K') scale = int64_t{1} << 10;
    if (text.back() == 'M') scale = int64_t{1} << 20;
    if (scale != 1) text.pop_back();
    int64_t n = 0;
    if (absl::SimpleAtoi(text, &n)) best = std::max(best, n * scale);
  }
  return best;
}

// Finite KV values of modest size (no NaN, no denormal), varied by a
// multiplicative hash; the timing does not depend on them. None is zero,
// so that two BF16 values read as one float (the block reader) are a
// normal float too.
void FillKv(char* base, size_t elems, bool f32) {
  auto value = [](size_t i) {
    const uint32_t h = static_cast<uint32_t>(i * 2654435761u) >> 16;
    const int v = static_cast<int>(h % 2001) - 1000;
    return static_cast<float>(v != 0 ? v : 1) / 4000;
  };
  if (f32) {
    float* f = reinterpret_cast<float*>(base);
    for (size_t i = 0; i < elems; ++i) f[i] = value(i);
  } else {
    uint16_t* h = reinterpret_cast<uint16_t*>(base);
    for (size_t i = 0; i < elems; ++i) h[i] = F32ToBf16(value(i));
  }
}

// One attention call of the options' geometry over the KV at `base`.
void CallAttention(CpuBackend& be, const BenchAttentionOptions& o, char* base, DType dtype,
                   int64_t block_elems, const std::vector<AttentionSequence>& seqs, const float* q, float* out,
                   int64_t* kv_read, bool again) {
  const KvLayerView view{.base = base,
                         .dtype = dtype,
                         .block_stride = block_elems,
                         .head_stride = int64_t{o.block_size} * o.head_dim,
                         .v_offset = block_elems / 2,
                         .block_size = o.block_size};
  be.Attention({.q = q,
                .out = out,
                .sequences = seqs,
                .kv = view,
                .num_heads = o.heads,
                .num_kv_heads = o.kv_heads,
                .head_dim = o.head_dim,
                .scale = 1.0f / std::sqrt(static_cast<float>(o.head_dim)),
                .kv_bytes_read = kv_read,
                .same_sequences_as_previous = again});
}

}  // namespace

absl::Status RunBenchAttention(const BenchAttentionOptions& o) {
  if (o.threads < 1 || o.heads < 1 || o.kv_heads < 1 || o.head_dim < 1 || o.block_size < 1) {
    return absl::InvalidArgumentError("--threads, --attention-heads, --kv-heads, --head-dim and --block-size must be positive");
  }
  if (o.heads % o.kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv-heads ", o.kv_heads, " must divide --attention-heads ", o.heads));
  }
  if (o.kv != "bf16" && o.kv != "f32") return absl::InvalidArgumentError("--kv must be bf16 or f32");
  for (int b : o.batches) {
    if (b < 1) return absl::InvalidArgumentError("batch sizes must be positive");
  }
  for (int h : o.histories) {
    if (h < 1) return absl::InvalidArgumentError("histories must be positive");
  }
  for (int s : o.prompts) {
    if (s < 1) return absl::InvalidArgumentError("prompt lengths must be positive");
  }
  if ((o.batches.empty() || o.histories.empty()) && o.prompts.empty()) {
    return absl::InvalidArgumentError(
        "nothing to time: give --decode_batch and --decode_history, or --prompts (or both)");
  }
  CpuBackendOptions bo;
  bo.num_threads = o.threads;
  bo.choose_matrix_path = true;
  if (!o.isa.empty()) {
    absl::StatusOr<kernels::cpu::Isa> isa = kernels::cpu::ParseIsa(o.isa);
    if (!isa.ok()) return isa.status();
    bo.isa = *isa;
  }
  absl::StatusOr<std::unique_ptr<CpuBackend>> made = CpuBackend::Create(bo);
  if (!made.ok()) return made.status();
  CpuBackend& be = **made;
  const bool f32 = o.kv == "f32";
  const DType dtype = f32 ? DType::kF32 : DType::kBF16;
  // The kernels' form over this KV: BF16 dot products on the bf16 matrix
  // path (BF16 KV, even blocks), else F32 multiply-adds; the prompt rows
  // are judged against that instruction's peak.
  const bool dot = be.Bf16DotAttention(dtype, o.block_size);
  const char* form = dot ? "bf16_dot" : "f32_fma";
  const size_t elem = f32 ? 4 : 2;
  const int64_t block_elems = int64_t{2} * o.kv_heads * o.block_size * o.head_dim;
  const size_t block_bytes = static_cast<size_t>(block_elems) * elem;
  CpuBackend::ReadProbe probe(&be, size_t{256} << 20);
  if (!o.json) {
    absl::PrintF("bench-attention: %s, %d thread(s), %s KV, %d heads / %d KV heads x %d, blocks of %d %s; "
                 "attention in %s\n",
                 be.Name(), o.threads, o.kv, o.heads, o.kv_heads, o.head_dim, o.block_size,
                 o.in_order_blocks ? "in order" : "scattered", dot ? "BF16 dot products" : "F32 multiply-adds");
  }
  if (!o.json && !o.batches.empty() && !o.histories.empty()) {
    absl::PrintF("%6s %7s %9s %12s %12s %12s %12s %10s %12s %10s\n", "batch", "history", "KV MB", "resident",
                 "streamed", "no-overlap", "read limit", "streamed/", "blocks read", "streamed/");
    absl::PrintF("%6s %7s %9s %12s %12s %12s %12s %10s %12s %10s\n", "", "", "", "GB/s (%)", "GB/s (%)", "GB/s",
                 "GB/s", "resident", "GB/s (%)", "blocks");
  }
  // A call whose KV takes more than half the last-level cache (shared with
  // everything else the call touches) is not resident: its "resident" rate
  // is marked, not a compute ceiling (0: size unknown).
  const int64_t llc = LastLevelCacheBytes();
  bool any_too_big = false;
  nlohmann::json rows = nlohmann::json::array();
  std::mt19937 rng(1);
  for (int B : o.batches) {
    for (int H : o.histories) {
      const int32_t nb = (H + o.block_size - 1) / o.block_size;
      const int64_t blocks = int64_t{B} * nb;
      const size_t pool_bytes = static_cast<size_t>(blocks) * block_bytes;
      // Copies: one for the resident rate; enough for stream_bytes (at
      // least two) for the streamed one. One region, allocated as the
      // engine's KV pool is (huge pages), copy c at c * pool_bytes.
      const int copies = std::max<int>(2, static_cast<int>(o.stream_bytes / static_cast<double>(pool_bytes)) + 1);
      absl::StatusOr<std::unique_ptr<KvRegion>> region = HostKvRegionAllocator().Allocate(copies * pool_bytes);
      if (!region.ok()) return region.status();
      char* const base = static_cast<char*>((*region)->data());
      FillKv(base, copies * pool_bytes / elem, f32);
      // Each sequence's blocks scattered over the pool.
      std::vector<int32_t> perm(blocks);
      std::iota(perm.begin(), perm.end(), 0);
      if (!o.in_order_blocks) std::shuffle(perm.begin(), perm.end(), rng);
      std::vector<std::vector<int32_t>> tables(B);
      std::vector<AttentionSequence> seqs;
      for (int b = 0; b < B; ++b) {
        tables[b].assign(perm.begin() + int64_t{b} * nb, perm.begin() + int64_t{b + 1} * nb);
        seqs.push_back({tables[b], H - 1, 1, b});
      }
      // The same blocks in the same order, each read whole by a reader
      // that does nothing else, the threads sharing the list: what this
      // placement allows (CpuBackend::ReadBlocks).
      std::vector<int64_t> offsets;
      for (const std::vector<int32_t>& t : tables) {
        for (int32_t blk : t) offsets.push_back(int64_t{blk} * static_cast<int64_t>(block_bytes));
      }
      const bool readable = block_bytes % 256 == 0;
      float sink = 0;
      std::vector<float> q(static_cast<size_t>(B) * o.heads * o.head_dim), out(q.size());
      for (float& x : q) x = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000;
      int64_t kv_read = 0;
      auto call = [&](int copy, bool again) {
        CallAttention(be, o, base + copy * pool_bytes, dtype, block_elems, seqs, q.data(), out.data(), &kv_read,
                      again);
      };
      call(0, false);
      const double bytes_per_call = static_cast<double>(kv_read);
      // Rounds of about 20 ms, `seconds` in all per rate, medians; the
      // limit sampled between them.
      const double reader_bytes = static_cast<double>(offsets.size() * block_bytes);
      std::vector<double> resident, streamed, limit, reader;
      const auto start = std::chrono::steady_clock::now();
      int next = 0, next_read = 0;
      while (Seconds(start, std::chrono::steady_clock::now()) < 2 * o.seconds || resident.size() < 3) {
        for (int mode = 0; mode < (readable ? 3 : 2); ++mode) {
          int calls = 0;
          const auto t0 = std::chrono::steady_clock::now();
          do {
            if (mode == 2) {
              sink += be.ReadBlocks(base + (1 + next_read) * pool_bytes, offsets, static_cast<int64_t>(block_bytes));
              next_read = (next_read + 1) % (copies - 1);
            } else {
              call(mode == 0 ? 0 : 1 + next, true);
              if (mode == 1) next = (next + 1) % (copies - 1);
            }
            ++calls;
          } while (Seconds(t0, std::chrono::steady_clock::now()) < 0.02);
          const double secs = Seconds(t0, std::chrono::steady_clock::now());
          if (mode == 2) {
            reader.push_back(reader_bytes * calls / secs);
          } else {
            (mode == 0 ? resident : streamed).push_back(bytes_per_call * calls / secs);
          }
        }
        limit.push_back(probe.Sample());
      }
      const double r = Median(resident), s = Median(streamed), l = Median(limit);
      const double rd = readable ? Median(reader) : 0;
      if (!std::isfinite(sink)) absl::PrintF("(reader sum %g)\n", sink);  // Keeps the reads.
      const double serial = 1 / (1 / r + 1 / l);
      const bool fits = llc <= 0 || 2 * bytes_per_call <= static_cast<double>(llc);
      any_too_big |= !fits;
      if (o.json) {
        rows.push_back({{"batch", B},
                        {"history", H},
                        {"kv_bytes_per_call", bytes_per_call},
                        {"resident_bytes_per_second", r},
                        {"streamed_bytes_per_second", s},
                        {"no_overlap_bytes_per_second", serial},
                        {"read_limit_bytes_per_second", l},
                        {"resident_fits_last_level_cache", fits},
                        {"resident_fraction_of_limit", r / l},
                        {"streamed_fraction_of_limit", s / l},
                        {"block_reader_bytes_per_second", rd},
                        {"streamed_fraction_of_block_reader", rd > 0 ? s / rd : 0}});
      } else {
        absl::PrintF("%6d %7d %9.1f %6.1f (%3.0f%%)%s%6.1f (%3.0f%%) %12.1f %12.1f %9.2fx %5.1f (%3.0f%%) %9.2fx\n",
                     B, H, bytes_per_call / 1e6, r / 1e9, 100 * r / l, fits ? " " : "*", s / 1e9, 100 * s / l,
                     serial / 1e9, l / 1e9, s / r, rd / 1e9, 100 * rd / l, rd > 0 ? s / rd : 0.0);
      }
    }
  }
  // Prompt rows: one sequence of S positions attends causally to itself
  // (row r to keys 0..r), the prefill's attention; its KV sits in the
  // caches at these lengths, so the figure is the kernels' compute rate.
  nlohmann::json prompt_rows = nlohmann::json::array();
  if (!o.prompts.empty() && !o.json) {
    absl::PrintF("\nprompt attention alone (one sequence, every row causal; FLOPs = 4 x head_dim x heads x "
                 "S(S+1)/2):\n%7s %9s %11s %10s %16s %9s\n", "prompt", "KV MB", "ms/call", "GFLOP/s",
                 dot ? "BF16 dot GFLOP/s" : "F32 FMA GFLOP/s", "of peak");
  }
  for (int S : o.prompts) {
    const int32_t nb = (S + o.block_size - 1) / o.block_size;
    const size_t pool_bytes = static_cast<size_t>(nb) * block_bytes;
    absl::StatusOr<std::unique_ptr<KvRegion>> region = HostKvRegionAllocator().Allocate(pool_bytes);
    if (!region.ok()) return region.status();
    char* const base = static_cast<char*>((*region)->data());
    FillKv(base, pool_bytes / elem, f32);
    std::vector<int32_t> table(nb);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    const std::vector<AttentionSequence> seqs = {{table, 0, S, 0}};
    std::vector<float> q(static_cast<size_t>(S) * o.heads * o.head_dim), out(q.size());
    for (float& x : q) x = static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000;
    int64_t kv_read = 0;
    auto call = [&](bool again) {
      CallAttention(be, o, base, dtype, block_elems, seqs, q.data(), out.data(), &kv_read, again);
    };
    call(false);
    const double flops = 4.0 * o.head_dim * o.heads * (static_cast<double>(S) * (S + 1) / 2);
    // Rounds of at least one call and about 20 ms, `seconds` in all; the
    // peak of the attention's instruction sampled between them.
    std::vector<double> per_call, peaks;
    const auto start = std::chrono::steady_clock::now();
    while (Seconds(start, std::chrono::steady_clock::now()) < o.seconds || per_call.size() < 3) {
      int calls = 0;
      const auto t0 = std::chrono::steady_clock::now();
      do {
        call(true);
        ++calls;
      } while (Seconds(t0, std::chrono::steady_clock::now()) < 0.02);
      per_call.push_back(Seconds(t0, std::chrono::steady_clock::now()) / calls);
      const auto mp = be.SampleMatrixPeaks();
      peaks.push_back(dot ? mp.bf16_dot : mp.f32_fma);
    }
    const double t = Median(per_call), peak = Median(peaks);
    if (o.json) {
      prompt_rows.push_back({{"tokens", S},
                             {"kv_bytes", static_cast<double>(pool_bytes)},
                             {"seconds_per_call", t},
                             {"flops", flops},
                             {"flops_per_second", flops / t},
                             {"peak_flops", peak},
                             {"fraction_of_peak", flops / t / peak}});
    } else {
      absl::PrintF("%7d %9.1f %11.3f %10.1f %16.1f %8.1f%%\n", S, pool_bytes / 1e6, 1e3 * t, flops / t / 1e9,
                   peak / 1e9, 100 * flops / t / peak);
    }
  }
  if (o.json) {
    const nlohmann::json j = {{"backend", be.Name()}, {"attention_form", form}, {"threads", o.threads},
                              {"kv", o.kv}, {"in_order_blocks", o.in_order_blocks}, {"rows", rows}, {"prompts", prompt_rows}};
    absl::PrintF("%s\n", j.dump());
  } else if (!rows.empty() || (!o.batches.empty() && !o.histories.empty())) {
    absl::PrintF(
        "resident: the same call's KV again (in the caches where it fits): the kernel's compute ceiling. "
        "streamed: %.0f MiB of copies cycled, read from DRAM. no-overlap: 1/(1/resident + 1/limit), the rate "
        "if compute and memory took turns. Limit: a sequential read of 256 MiB on the same threads. blocks "
        "read: the streamed call's blocks in its order, each read whole with no arithmetic, the threads sharing "
        "the list: the rate this placement of blocks allows a reader.\n",
        o.stream_bytes / (1 << 20));
    if (any_too_big) {
      absl::PrintF("*: the call's KV is over half the %.0f MiB last-level cache: not resident, not a ceiling.\n",
                   static_cast<double>(llc) / (1 << 20));
    }
  }
  return absl::OkStatus();
}

}  // namespace pdserve::pdctl
