#include "tools/pdctl/bench_svg.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pdserve::pdctl {
namespace {

constexpr int kWidth = 1000, kHeight = 780;
constexpr size_t kMaxCdfPoints = 400;  // Per series; keeps the file small.
constexpr const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                    "#9467bd", "#8c564b", "#e377c2", "#17becf"};

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

const char* Color(size_t i) { return kPalette[i % (sizeof(kPalette) / sizeof(kPalette[0]))]; }

// A tick step of 1, 2 or 5 x 10^k giving about five ticks up to `max`.
double TickStep(double max) {
  const double raw = max / 5;
  const double unit = std::pow(10, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0}) {
    if (m * unit >= raw) return m * unit;
  }
  return 10 * unit;
}

struct Axis {
  double max = 1, step = 0.2;
};

Axis NiceAxis(double data_max) {
  if (!(data_max > 0) || !std::isfinite(data_max)) return {};
  Axis a;
  a.step = TickStep(data_max);
  a.max = std::ceil(data_max / a.step - 1e-9) * a.step;
  return a;
}

// One panel: a plot area at (left, top) of w x h pixels over [0, x.max] x
// [0, y.max].
struct Panel {
  std::string id, title, x_label, y_label;
  double left = 0, top = 0, w = 0, h = 0;
  Axis x, y;
  double Px(double v) const { return left + std::min(v / x.max, 1.0) * w; }
  double Py(double v) const { return top + h - std::min(v / y.max, 1.0) * h; }
};

void DrawFrame(const Panel& p, std::string& out) {
  absl::StrAppendFormat(&out, "<g id=\"%s\">\n", p.id);
  absl::StrAppendFormat(&out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-weight=\"bold\">%s</text>\n",
                        p.left + p.w / 2, p.top - 10, Escape(p.title));
  for (int i = 0; i * p.x.step <= p.x.max + 1e-9 * p.x.max; ++i) {
    const double v = i * p.x.step, px = p.Px(v);
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%g</text>\n",
                          px, p.top, px, p.top + p.h, px, p.top + p.h + 15, v);
  }
  for (int i = 0; i * p.y.step <= p.y.max + 1e-9 * p.y.max; ++i) {
    const double v = i * p.y.step, py = p.Py(v);
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#e4e4e4\"/>"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%g</text>\n",
                          p.left, py, p.left + p.w, py, p.left - 5, py + 4, v);
  }
  absl::StrAppendFormat(&out,
                        "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#333\"/>\n",
                        p.left, p.top, p.w, p.h);
  absl::StrAppendFormat(&out, "<text class=\"axis-label\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                        p.left + p.w / 2, p.top + p.h + 34, Escape(p.x_label));
  const double ly = p.top + p.h / 2, lx = p.left - 48;
  absl::StrAppendFormat(&out,
                        "<text class=\"axis-label\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" "
                        "transform=\"rotate(-90 %.1f %.1f)\">%s</text>\n",
                        lx, ly, lx, ly, Escape(p.y_label));
}

struct Series {
  std::string name;
  const char* color;
  bool dashed = false;
  std::vector<std::pair<double, double>> points;  // Data coordinates.
};

void DrawSeries(const Panel& p, const Series& s, bool markers, std::string& out) {
  std::string pts;
  for (const auto& [x, y] : s.points)
    absl::StrAppendFormat(&pts, "%s%.1f,%.1f", pts.empty() ? "" : " ", p.Px(x), p.Py(y));
  absl::StrAppendFormat(&out,
                        "<polyline class=\"series\" data-panel=\"%s\" data-series=\"%s\" points=\"%s\" fill=\"none\" "
                        "stroke=\"%s\" stroke-width=\"1.8\"%s><title>%s</title></polyline>\n",
                        p.id, Escape(s.name), pts, s.color, s.dashed ? " stroke-dasharray=\"6 4\"" : "",
                        Escape(s.name));
  if (!markers) return;
  for (const auto& [x, y] : s.points) {
    absl::StrAppendFormat(&out, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", p.Px(x), p.Py(y), s.color);
  }
}

// The legend in the panel's corner: bottom right, or top left.
void DrawLegend(const Panel& p, const std::vector<Series>& series, bool bottom_right, std::string& out) {
  const double line = 16, width = 190;
  const double x = bottom_right ? p.left + p.w - width - 8 : p.left + 8;
  double y = bottom_right ? p.top + p.h - 8 - line * static_cast<double>(series.size()) : p.top + 8;
  absl::StrAppendFormat(&out, "<g class=\"legend\">\n");
  for (const Series& s : series) {
    absl::StrAppendFormat(&out,
                          "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"%s/>"
                          "<text x=\"%.1f\" y=\"%.1f\">%s</text>\n",
                          x, y + line / 2, x + 22, y + line / 2, s.color, s.dashed ? " stroke-dasharray=\"6 4\"" : "",
                          x + 28, y + line / 2 + 4, Escape(s.name));
    y += line;
  }
  out += "</g>\n";
}

// A step CDF of `sorted` seconds, in milliseconds, thinned to at most
// kMaxCdfPoints ranks (the first and the last kept).
std::vector<std::pair<double, double>> CdfPoints(const std::vector<double>& sorted) {
  std::vector<std::pair<double, double>> pts;
  const size_t n = sorted.size();
  if (n == 0) return pts;
  const size_t keep = std::min(n, kMaxCdfPoints);
  double last_y = 0;
  for (size_t k = 0; k < keep; ++k) {
    const size_t i = keep == 1 ? n - 1 : k * (n - 1) / (keep - 1);
    const double x = 1e3 * sorted[i], y = static_cast<double>(i + 1) / static_cast<double>(n);
    pts.emplace_back(x, last_y);
    pts.emplace_back(x, y);
    last_y = y;
  }
  return pts;
}

void DrawCdfPanel(Panel p, const std::vector<BenchRow>& rows, const Distribution BenchRow::*which, std::string& out) {
  // The x axis ends at the largest row p99, so that a few stalls do not
  // squash every curve against the left edge; the rarer tail runs up the
  // right edge.
  double max = 0;
  for (const BenchRow& r : rows) max = std::max(max, 1e3 * (r.*which).p99);
  p.x = NiceAxis(max);
  p.y = Axis{1, 0.2};
  DrawFrame(p, out);
  std::vector<Series> legend;
  for (size_t i = 0; i < rows.size(); ++i) {
    Series s{rows[i].Label(), Color(i), false, CdfPoints((rows[i].*which).sorted)};
    if (s.points.empty()) {
      s.name += " (no data)";
    } else {
      DrawSeries(p, s, false, out);
    }
    legend.push_back(std::move(s));
  }
  DrawLegend(p, legend, true, out);
  out += "</g>\n";
}

void DrawRatePanel(Panel p, const std::vector<BenchRow>& rows, double BenchRow::*throughput, double BenchRow::*goodput,
                   std::string& out) {
  std::map<std::string, std::vector<const BenchRow*>> by_target;
  double max_rate = 0, max_y = 0;
  for (const BenchRow& r : rows) {
    if (r.rate <= 0) continue;
    by_target[r.target].push_back(&r);
    max_rate = std::max(max_rate, r.rate);
    max_y = std::max(max_y, r.*throughput);
  }
  const bool requests_panel = throughput == &BenchRow::requests_per_second;
  if (requests_panel) max_y = std::max(max_y, max_rate);
  p.x = NiceAxis(max_rate);
  p.y = NiceAxis(max_y);
  DrawFrame(p, out);
  if (by_target.empty()) {
    absl::StrAppendFormat(
        &out, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">no Poisson-rate rows (closed loop)</text>\n",
        p.left + p.w / 2, p.top + p.h / 2);
    out += "</g>\n";
    return;
  }
  if (requests_panel) {
    absl::StrAppendFormat(&out,
                          "<line class=\"reference\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#999\" "
                          "stroke-dasharray=\"2 3\"><title>offered rate</title></line>\n",
                          p.Px(0), p.Py(0), p.Px(max_rate), p.Py(max_rate));
  }
  std::vector<Series> legend;
  size_t color = 0;
  for (auto& [target, target_rows] : by_target) {
    std::sort(target_rows.begin(), target_rows.end(),
              [](const BenchRow* a, const BenchRow* b) { return a->rate < b->rate; });
    Series thr{absl::StrCat(target, " throughput"), Color(color), false, {}};
    Series good{absl::StrCat(target, " goodput"), Color(color), true, {}};
    for (const BenchRow* r : target_rows) {
      thr.points.emplace_back(r->rate, r->*throughput);
      good.points.emplace_back(r->rate, r->*goodput);
    }
    DrawSeries(p, thr, true, out);
    DrawSeries(p, good, true, out);
    legend.push_back(std::move(thr));
    legend.push_back(std::move(good));
    ++color;
  }
  DrawLegend(p, legend, false, out);
  out += "</g>\n";
}

}  // namespace

std::string RenderBenchSvg(const std::vector<BenchRow>& rows, const std::string& title) {
  std::string out;
  absl::StrAppendFormat(
      &out,
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"%d\" height=\"%d\" "
      "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%d\" y=\"24\" text-anchor=\"middle\" font-size=\"15\" font-weight=\"bold\">%s</text>\n",
      kWidth, kHeight, kWidth, kHeight, kWidth / 2, Escape(title));
  const double w = 400, h = 270, left1 = 80, left2 = 580, top1 = 60, top2 = 440;
  DrawCdfPanel({"ttft-cdf",
                "Time to first token (CDF, to the largest p99)",
                "TTFT (ms)",
                "fraction of requests",
                left1,
                top1,
                w,
                h,
                {},
                {}},
               rows, &BenchRow::ttft, out);
  DrawCdfPanel({"itl-cdf",
                "Inter-token latency (CDF, to the largest p99)",
                "ITL (ms)",
                "fraction of inter-token gaps",
                left2,
                top1,
                w,
                h,
                {},
                {}},
               rows, &BenchRow::itl, out);
  DrawRatePanel({"requests-rate",
                 "Throughput and goodput (requests)",
                 "offered rate (requests/s)",
                 "completed requests/s",
                 left1,
                 top2,
                 w,
                 h,
                 {},
                 {}},
                rows, &BenchRow::requests_per_second, &BenchRow::good_requests_per_second, out);
  DrawRatePanel({"tokens-rate",
                 "Throughput and goodput (tokens)",
                 "offered rate (requests/s)",
                 "output tokens/s",
                 left2,
                 top2,
                 w,
                 h,
                 {},
                 {}},
                rows, &BenchRow::tokens_per_second, &BenchRow::good_tokens_per_second, out);
  out += "</svg>\n";
  return out;
}

}  // namespace pdserve::pdctl
