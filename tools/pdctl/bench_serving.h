// `pdctl bench --router ADDR`: a serving benchmark against a running
// cluster, optionally beside the in-process engine on the same workload in
// the same run (--in-process-model DIR), so the cluster's overheads are
// measured against what the engine alone does.
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_SERVING_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_SERVING_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace pdserve::pdctl {

struct ServingBenchOptions {
  std::string router;            // host:port
  std::string in_process_model;  // Also run the workload in-process ("" = no).
  int in_process_threads = 1;
  int requests = 64;
  int concurrency = 8;           // Closed loop (used when rate == 0).
  double rate = 0;               // Poisson arrivals per second (0 = closed loop).
  int prompt_min = 128, prompt_max = 128;  // Uniform in [min, max].
  int output_min = 64, output_max = 64;
  uint64_t seed = 1;
  bool json = false;
};

absl::Status RunServingBench(const ServingBenchOptions& options);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_SERVING_H_
