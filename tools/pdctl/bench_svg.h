// The picture of `pdctl bench --svg FILE`: a standalone SVG 1.1 document
// (no scripts, fonts or external references) with four panels:
//   TTFT CDF and ITL CDF: one step line per row (x: milliseconds, y: the
//     fraction of requests, or of inter-token gaps, at or below x; the x
//     axis ends at the largest row p99 and the rarer tail runs up the right
//     edge);
//   throughput and goodput against the offered rate: requests/s and output
//     tokens/s, one line per target and measure, over the rows with a
//     Poisson rate (closed-loop rows have no rate to plot against).
// Every series is a <polyline class="series" data-panel=P data-series=S>,
// P in {ttft-cdf, itl-cdf, requests-rate, tokens-rate}, with a <title>;
// the legend names each row. Pure function; thread-safe.
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_SVG_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_SVG_H_

#include <string>
#include <vector>

#include "tools/pdctl/bench_results.h"

namespace pdserve::pdctl {

// `title` heads the picture (XML-escaped, like every label).
std::string RenderBenchSvg(const std::vector<BenchRow>& rows, const std::string& title);

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_SVG_H_
