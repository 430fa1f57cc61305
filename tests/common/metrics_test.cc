#include "base/metrics.h"

#include <cmath>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

TEST(MetricsTest, RendersTheTextExpositionFormat) {
  MetricsRegistry r;
  Counter* stop = r.AddCounter("pdserve_requests_total", "Requests by how they ended.", "outcome=\"stop\"");
  r.AddCounter("pdserve_requests_total", "Requests by how they ended.", "outcome=\"error\"");
  Histogram* h = r.AddHistogram("pdserve_ttft_seconds", "TTFT.", {0.1, 1});
  r.AddGauge("pdserve_in_flight", "In flight.", [] { return 3.0; });
  stop->Add();
  stop->Add();
  h->Observe(0.05);
  h->Observe(0.1);  // Bounds are inclusive (le).
  h->Observe(2.5);
  EXPECT_EQ(r.Render(),
            "# HELP pdserve_requests_total Requests by how they ended.\n"
            "# TYPE pdserve_requests_total counter\n"
            "pdserve_requests_total{outcome=\"stop\"} 2\n"
            "pdserve_requests_total{outcome=\"error\"} 0\n"
            "# HELP pdserve_ttft_seconds TTFT.\n"
            "# TYPE pdserve_ttft_seconds histogram\n"
            "pdserve_ttft_seconds_bucket{le=\"0.1\"} 2\n"
            "pdserve_ttft_seconds_bucket{le=\"1\"} 2\n"
            "pdserve_ttft_seconds_bucket{le=\"+Inf\"} 3\n"
            "pdserve_ttft_seconds_sum 2.65\n"
            "pdserve_ttft_seconds_count 3\n"
            "# HELP pdserve_in_flight In flight.\n"
            "# TYPE pdserve_in_flight gauge\n"
            "pdserve_in_flight 3\n");
}

TEST(MetricsTest, AGaugeWithNoValueIsNaNAsTheFormatSpellsIt) {
  MetricsRegistry r;
  r.AddGauge("pdserve_capacity", "No data yet.", [] { return std::nan(""); });
  EXPECT_NE(r.Render().find("\npdserve_capacity NaN\n"), std::string::npos) << r.Render();
}

}  // namespace
}  // namespace pdserve
