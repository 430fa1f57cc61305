// `pdctl bench --router ADDR`: a serving benchmark against a running
// cluster, optionally beside the in-process engine on the same workload in
// the same run (--in-process-model DIR), so the cluster's overheads are
// measured against what the engine alone does.
//
// A drain (--drain-at S --drain-pid PID): S seconds after every stream of
// the run is decoding, the decode worker PID gets SIGTERM; the row reports
// each stream's largest gap (the switch stall of those that moved), the
// moves, replays and context positions prefilled again, and the stall
// bound a move should meet: 3 decode steps plus its KV transfer at the
// bandwidth the moves measured.
//
// Sweeps and SLOs: --rates runs the workload once per Poisson rate (the same
// requests each time, arrivals scaled), lengths may come from a trace or a
// shared-prefix recipe (bench_workload.h), requests are judged against TTFT
// and ITL targets for goodput (bench_results.h), and --svg draws the rows
// (bench_svg.h). With none of those options the report is the single-run
// table or JSON it always was.
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_SERVING_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_SERVING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pdserve::pdctl {

struct ServingBenchOptions {
  std::string router;            // host:port (gRPC; "" = no gRPC row)
  // The router's OpenAI HTTP API, http://host:port[/v1] ("" = no "http"
  // row); with --router too, both rows come from the same run.
  std::string openai;
  std::string tls_ca;  // the CA an https --openai URL is checked against
  std::string in_process_model;  // Also run the workload in-process ("" = no).
  int in_process_threads = 1;
  int requests = 64;
  int concurrency = 8;           // Closed loop (used when rate == 0).
  // A burst: every request sent at once (requests and concurrency set to
  // it); with a router, each cluster row also reports the router's side
  // (ejections, queue refusals, prefill tokens discarded, peak memory).
  int burst = 0;
  double rate = 0;               // Poisson arrivals per second (0 = closed loop).
  int prompt_min = 128, prompt_max = 128;  // Uniform in [min, max].
  int output_min = 64, output_max = 64;
  uint64_t seed = 1;
  bool json = false;
  // Sweep and SLO options; any of them selects the per-row report.
  std::vector<double> rates;  // Poisson rates, one row each (REQUIRES: > 0).
  std::string trace_file;     // JSONL lengths (bench_trace.h), "" = random.
  int shared_prefix_groups = 0, shared_prefix_tokens = 0;  // 0 groups = off.
  // Multi-turn chat (bench_workload.h's WorkloadOptions): TURNS per
  // conversation over SYSTEM_TOKENS-token system prompts (as many as
  // shared_prefix_groups, 64 by default). 0 turns = off.
  int multi_turn_turns = 0, multi_turn_system_tokens = 0;
  double ttft_target_ms = 0, itl_target_ms = 0;            // 0 = no target.
  std::string svg_file;       // Where to write the picture ("" = none).
  // A drain mid-run (cluster rows): drain_at seconds after the decode pool
  // runs every stream of the run (as many as the concurrency), SIGTERM to
  // decode worker drain_pid; the row then reports each stream's largest
  // inter-token gap and what the router moved, replayed and recomputed.
  double drain_at = -1;  // < 0: no drain.
  int drain_pid = 0;
  bool PerRowReport() const {
    return !rates.empty() || !trace_file.empty() || shared_prefix_groups > 0 || multi_turn_turns > 0 ||
           ttft_target_ms > 0 ||
           itl_target_ms > 0 || !svg_file.empty();
  }
};

absl::Status RunServingBench(const ServingBenchOptions& options);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_SERVING_H_
