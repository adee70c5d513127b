// SPDX-License-Identifier: Apache-2.0
#include "wbbench/svg.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace weightbus::bench {
namespace {

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
      default:
        out += c;
    }
  }
  return out;
}

std::string Ms(double s) {
  const double ms = s * 1e3;
  if (ms >= 100) return absl::StrFormat("%.0f ms", ms);
  if (ms >= 10) return absl::StrFormat("%.1f ms", ms);
  return absl::StrFormat("%.2f ms", ms);
}

}  // namespace

std::vector<Bar> BarsOf(const RunResult& r) {
  std::vector<Bar> bars;
  for (const TransportResult& t : r.transports) {
    if (t.last.count == 0) continue;
    bars.push_back({t.name, false, t.last.median, t.last.p99});
  }
  for (const BaselineResult& b : r.baselines) {
    if (!b.ran || b.last.count == 0) continue;
    bars.push_back({b.name, true, b.last.median, b.last.count > 1 ? b.last.p99 : 0});
  }
  return bars;
}

std::string BarChartSvg(const std::string& title, const std::vector<Bar>& bars) {
  const int left = 190, right = 110, top = 58, row = 28, bottom = 46, plot_w = 560;
  const int height = top + row * std::max<int>(1, bars.size()) + bottom;
  const int width = left + plot_w + right;
  double lo = INFINITY, hi = 0;
  for (const Bar& b : bars) {
    if (b.median_s > 0) lo = std::min(lo, b.median_s);
    hi = std::max({hi, b.median_s, b.p99_s});
  }
  if (!(hi > 0)) hi = 1e-3;
  if (!(lo < INFINITY)) lo = hi;
  const bool log_scale = hi / lo > 30;
  double axis_lo = 0, axis_hi = hi * 1.05;
  if (log_scale) {
    axis_lo = std::pow(10, std::floor(std::log10(lo)));
    axis_hi = std::pow(10, std::ceil(std::log10(hi)));
  }
  auto x = [&](double v) {
    if (log_scale) {
      v = std::max(v, axis_lo);
      return left + plot_w * (std::log10(v) - std::log10(axis_lo)) /
                        (std::log10(axis_hi) - std::log10(axis_lo));
    }
    return left + plot_w * v / axis_hi;
  };
  std::string s;
  absl::StrAppendFormat(&s,
                        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
                        "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n",
                        width, height, width, height);
  absl::StrAppendFormat(&s, "<rect width=\"%d\" height=\"%d\" fill=\"white\"/>\n", width, height);
  absl::StrAppendFormat(&s,
                        "<text x=\"%d\" y=\"22\" font-size=\"15\" font-weight=\"bold\">%s</text>\n",
                        left - 170, Escape(title));
  absl::StrAppendFormat(&s,
                        "<text x=\"%d\" y=\"40\" fill=\"#444\">time until the last replica holds "
                        "the verified version: median (bar), p99 (whisker)%s</text>\n",
                        left - 170, log_scale ? "; log scale" : "");
  // Grid and axis labels.
  std::vector<double> ticks;
  if (log_scale) {
    for (double t = axis_lo; t <= axis_hi * 1.0001; t *= 10) ticks.push_back(t);
  } else {
    const double step = std::pow(10, std::floor(std::log10(axis_hi / 5)));
    const double nice = axis_hi / step > 25 ? step * 5 : axis_hi / step > 10 ? step * 2 : step;
    for (double t = 0; t <= axis_hi; t += nice) ticks.push_back(t);
  }
  const int grid_bottom = top + row * static_cast<int>(bars.size());
  for (double t : ticks) {
    absl::StrAppendFormat(&s,
                          "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#ddd\"/>\n"
                          "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\" fill=\"#444\">%s"
                          "</text>\n",
                          x(t), top - 4, x(t), grid_bottom, x(t), grid_bottom + 16, Ms(t));
  }
  for (size_t i = 0; i < bars.size(); ++i) {
    const Bar& b = bars[i];
    const int y = top + row * static_cast<int>(i);
    const char* fill = b.baseline ? "#a0a0a0" : "#2b6cb0";
    const double x0 = log_scale ? x(axis_lo) : left;
    absl::StrAppendFormat(&s, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%s%s</text>\n", left - 8,
                          y + 18, Escape(b.label), b.baseline ? " (baseline)" : "");
    absl::StrAppendFormat(&s,
                          "<rect x=\"%.1f\" y=\"%d\" width=\"%.1f\" height=\"%d\" fill=\"%s\">"
                          "<title>%s: %s</title></rect>\n",
                          x0, y + 5, std::max(1.0, x(b.median_s) - x0), row - 10, fill,
                          Escape(b.label), Ms(b.median_s));
    double label_x = x(b.median_s);
    if (b.p99_s > b.median_s) {
      absl::StrAppendFormat(&s,
                            "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#222\"/>\n"
                            "<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" stroke=\"#222\"/>\n",
                            x(b.median_s), y + row / 2, x(b.p99_s), y + row / 2, x(b.p99_s), y + 8,
                            x(b.p99_s), y + row - 8);
      label_x = x(b.p99_s);
    }
    absl::StrAppendFormat(&s, "<text x=\"%.1f\" y=\"%d\" fill=\"#222\">%s</text>\n", label_x + 6,
                          y + 18, Ms(b.median_s));
  }
  absl::StrAppendFormat(&s,
                        "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"#2b6cb0\"/>"
                        "<text x=\"%d\" y=\"%d\">weightbus</text>\n"
                        "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"#a0a0a0\"/>"
                        "<text x=\"%d\" y=\"%d\">baseline (same bytes, no weightbus)</text>\n",
                        left, height - 18, left + 16, height - 8, left + 110, height - 18,
                        left + 126, height - 8);
  s += "</svg>\n";
  return s;
}

}  // namespace weightbus::bench
