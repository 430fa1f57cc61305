#include "base/metrics.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <netinet/in.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve {
namespace {

std::string Num(double v) {
  if (std::isnan(v)) return "NaN";  // The exposition format's spelling.
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::abs(v) < 1e15) return absl::StrFormat("%.0f", v);
  return absl::StrFormat("%.9g", v);
}

std::string WithLabels(const std::string& name, const std::string& labels, const std::string& extra = "") {
  std::string all = labels;
  if (!extra.empty()) all = all.empty() ? extra : absl::StrCat(all, ",", extra);
  return all.empty() ? name : absl::StrCat(name, "{", all, "}");
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}

void Histogram::Observe(double v) {
  const size_t i = std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin();
  absl::MutexLock lock(&mu_);
  ++counts_[i];
  sum_ += v;
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.bounds = bounds_;
  absl::MutexLock lock(&mu_);
  uint64_t acc = 0;
  for (uint64_t c : counts_) {
    acc += c;
    s.cumulative.push_back(acc);
  }
  s.count = acc;
  s.sum = sum_;
  return s;
}

std::vector<double> LatencyBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
}

Counter* MetricsRegistry::AddCounter(const std::string& name, const std::string& help, const std::string& labels) {
  auto s = std::make_unique<Series>();
  s->name = name;
  s->help = help;
  s->type = "counter";
  s->labels = labels;
  s->counter = std::make_unique<Counter>();
  Counter* c = s->counter.get();
  absl::MutexLock lock(&mu_);
  series_.push_back(std::move(s));
  return c;
}

Histogram* MetricsRegistry::AddHistogram(const std::string& name, const std::string& help, std::vector<double> bounds,
                                         const std::string& labels) {
  auto s = std::make_unique<Series>();
  s->name = name;
  s->help = help;
  s->type = "histogram";
  s->labels = labels;
  s->histogram = std::make_unique<Histogram>(std::move(bounds));
  Histogram* h = s->histogram.get();
  absl::MutexLock lock(&mu_);
  series_.push_back(std::move(s));
  return h;
}

void MetricsRegistry::AddRead(const std::string& name, const std::string& help, const char* type,
                              std::function<std::optional<double>()> read, const std::string& labels) {
  auto s = std::make_unique<Series>();
  s->name = name;
  s->help = help;
  s->type = type;
  s->labels = labels;
  s->read = std::move(read);
  absl::MutexLock lock(&mu_);
  series_.push_back(std::move(s));
}

void MetricsRegistry::AddGauge(const std::string& name, const std::string& help, std::function<double()> read,
                               const std::string& labels) {
  AddRead(name, help, "gauge", [read = std::move(read)] { return std::optional<double>(read()); }, labels);
}

void MetricsRegistry::AddOptionalGauge(const std::string& name, const std::string& help,
                                       std::function<std::optional<double>()> read, const std::string& labels) {
  AddRead(name, help, "gauge", std::move(read), labels);
}

void MetricsRegistry::AddCounterFunc(const std::string& name, const std::string& help, std::function<double()> read,
                                     const std::string& labels) {
  AddRead(name, help, "counter", [read = std::move(read)] { return std::optional<double>(read()); }, labels);
}

std::string MetricsRegistry::Render() const {
  absl::MutexLock lock(&mu_);
  // Group the series of one name under one HELP/TYPE header.
  std::map<std::string, std::vector<const Series*>> by_name;
  std::vector<std::string> order;
  for (const auto& s : series_) {
    if (!by_name.contains(s->name)) order.push_back(s->name);
    by_name[s->name].push_back(s.get());
  }
  std::string out;
  for (const std::string& name : order) {
    const auto& group = by_name[name];
    absl::StrAppend(&out, "# HELP ", name, " ", group[0]->help, "\n# TYPE ", name, " ", group[0]->type, "\n");
    for (const Series* s : group) {
      if (s->counter) {
        absl::StrAppend(&out, WithLabels(name, s->labels), " ", Num(s->counter->value()), "\n");
      } else if (s->read) {
        if (const std::optional<double> v = s->read(); v.has_value()) {
          absl::StrAppend(&out, WithLabels(name, s->labels), " ", Num(*v), "\n");
        }
      } else {
        const Histogram::Snapshot h = s->histogram->Read();
        for (size_t i = 0; i < h.bounds.size(); ++i) {
          absl::StrAppend(&out, WithLabels(name + "_bucket", s->labels, absl::StrCat("le=\"", Num(h.bounds[i]), "\"")),
                          " ", h.cumulative[i], "\n");
        }
        absl::StrAppend(&out, WithLabels(name + "_bucket", s->labels, "le=\"+Inf\""), " ", h.count, "\n");
        absl::StrAppend(&out, WithLabels(name + "_sum", s->labels), " ", Num(h.sum), "\n");
        absl::StrAppend(&out, WithLabels(name + "_count", s->labels), " ", h.count, "\n");
      }
    }
  }
  return out;
}

namespace {

MHD_Result Answer(void* cls, MHD_Connection* connection, const char* url, const char* method, const char*,
                  const char*, size_t*, void**) {
  const auto* registry = static_cast<const MetricsRegistry*>(cls);
  const bool ok = std::strcmp(method, "GET") == 0 && std::strcmp(url, "/metrics") == 0;
  const std::string body = ok ? registry->Render() : std::string("not found: GET /metrics\n");
  MHD_Response* r = MHD_create_response_from_buffer(body.size(), const_cast<char*>(body.data()), MHD_RESPMEM_MUST_COPY);
  MHD_add_response_header(r, "Content-Type", ok ? "text/plain; version=0.0.4; charset=utf-8" : "text/plain");
  const MHD_Result res = MHD_queue_response(connection, ok ? MHD_HTTP_OK : MHD_HTTP_NOT_FOUND, r);
  MHD_destroy_response(r);
  return res;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(const std::string& host, int port,
                                                                             const MetricsRegistry* registry) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address: '", host, "' is not an IPv4 address"));
  }
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer());
  s->daemon_ = MHD_start_daemon(MHD_USE_INTERNAL_POLLING_THREAD, 0, nullptr, nullptr, &Answer,
                                const_cast<MetricsRegistry*>(registry), MHD_OPTION_SOCK_ADDR, &addr, MHD_OPTION_END);
  if (s->daemon_ == nullptr) return absl::UnavailableError(absl::StrCat("metrics: cannot listen on ", host, ":", port));
  const MHD_DaemonInfo* info = MHD_get_daemon_info(static_cast<MHD_Daemon*>(s->daemon_), MHD_DAEMON_INFO_BIND_PORT);
  s->port_ = info != nullptr ? info->port : port;
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (daemon_ != nullptr) MHD_stop_daemon(static_cast<MHD_Daemon*>(daemon_));
}

}  // namespace pdserve
