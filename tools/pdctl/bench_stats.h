// Small helpers shared by pdctl's benchmarks.
#ifndef PDSERVE_TOOLS_PDCTL_BENCH_STATS_H_
#define PDSERVE_TOOLS_PDCTL_BENCH_STATS_H_

#include <algorithm>
#include <chrono>
#include <vector>

namespace pdserve::pdctl {

// The median (upper median for an even count). REQUIRES: !v.empty().
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds from a to b.
inline double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace pdserve::pdctl

#endif  // PDSERVE_TOOLS_PDCTL_BENCH_STATS_H_
