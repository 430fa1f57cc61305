// `pdctl bench-engine --tp N` (N > 1): the tensor-parallel engine beside the
// single-rank one on the same cores (N ranks x T threads against 1 rank x
// N*T threads), for the same prefill lengths and decode batches as
// bench-engine. Each step splits into collective time (rank 0's time inside
// the collectives: the exchange itself and the wait for slower ranks) and
// compute time (the rest), shown per layer. Medians of the timed runs.
//
// The machine limits of bench-engine are not repeated here: its probes run
// on one backend's threads, which is one rank's share under TP.
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_TP_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_TP_H_

#include "absl/status/status.h"
#include "tools/pdctl/bench_engine.h"

namespace pdserve::pdctl {

// REQUIRES: options.engine.tp > 1.
absl::Status RunBenchTp(const BenchEngineOptions& options);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_TP_H_
