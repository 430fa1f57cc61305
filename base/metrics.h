// Prometheus metrics: counters, gauges and histograms in one registry,
// rendered in the text exposition format (version 0.0.4), and a small HTTP
// server (libmicrohttpd) answering GET /metrics.
//
// Names follow Prometheus conventions: snake_case with the unit as suffix
// (`_seconds`, `_bytes`), `_total` for counters. Labels are fixed at
// registration (one series per label set).
//
// Thread safety: registration happens at start-up; updates and Render are
// thread-safe.
#ifndef PDSERVE_BASE_METRICS_H_
#define PDSERVE_BASE_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace pdserve {

class Counter {
 public:
  void Add(double v = 1) { value_.fetch_add(v, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // Per bound, then +Inf.
    double sum = 0;
    uint64_t count = 0;
  };
  Snapshot Read() const;

 private:
  const std::vector<double> bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // Per bucket, then +Inf.
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
};

// Bucket bounds for latencies: 100 µs to 60 s, roughly ×2.5 apart.
std::vector<double> LatencyBuckets();

class MetricsRegistry {
 public:
  // `labels` is a rendered label set such as `outcome="stop"` (or "").
  Counter* AddCounter(const std::string& name, const std::string& help, const std::string& labels = "");
  Histogram* AddHistogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                          const std::string& labels = "");
  // A value read at scrape time.
  void AddGauge(const std::string& name, const std::string& help, std::function<double()> read,
                const std::string& labels = "");
  // A value read at scrape time that may be unknown: no sample is exposed
  // while `read` gives none (a scraper sees the series absent, not NaN).
  void AddOptionalGauge(const std::string& name, const std::string& help,
                        std::function<std::optional<double>()> read, const std::string& labels = "");
  // A monotonic count kept elsewhere, read at scrape time.
  void AddCounterFunc(const std::string& name, const std::string& help, std::function<double()> read,
                      const std::string& labels = "");

  std::string Render() const;

 private:
  struct Series {
    std::string name, help, type, labels;
    std::unique_ptr<Counter> counter;
    std::unique_ptr<Histogram> histogram;
    std::function<std::optional<double>()> read;  // gauges and counter functions
  };
  void AddRead(const std::string& name, const std::string& help, const char* type,
               std::function<std::optional<double>()> read, const std::string& labels);
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Series>> series_ ABSL_GUARDED_BY(mu_);
};

// Serves GET /metrics (and 404 otherwise) on host:port (port 0: any free).
class MetricsHttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& host, int port,
                                                                   const MetricsRegistry* registry);
  ~MetricsHttpServer();
  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  void* daemon_ = nullptr;
  int port_ = 0;
};

}  // namespace pdserve

#endif  // PDSERVE_BASE_METRICS_H_
