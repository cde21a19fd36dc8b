// tools/epcomm/bench_plot.cc — hand-written SVG for `epcomm bench --plot`: no dependencies, fixed geometry,
// plain elements (text, line, polyline, circle, rect) that every browser and image viewer renders.
#include "bench_plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

namespace epcomm::cli {

namespace {

constexpr double kPanelW = 440, kPanelH = 300;                      // one panel, axes included
constexpr double kLeft = 62, kRight = 18, kTop = 34, kBottom = 48;  // plot area inside a panel
constexpr double kHeaderH = 120, kMargin = 16;                      // title, note and legend above
constexpr double kNoteCharW = 6.2, kNoteLineH = 14;                 // the note's 11 px text, wrapped

struct Series {
  const char* key;    // data-series
  const char* label;  // legend text
  const char* color;
  const char* dash;  // stroke-dasharray, "" for solid
};
const Series kSeries[] = {
    {"epcomm", "epcomm", "#1f5fbf", ""},
    {"baseline", "MPI_Alltoallv baseline (pack, alltoallv, unpack)", "#d9650b", ""},
    {"memcpy", "memcpy limit (each rank copies the same bytes)", "#6b6b6b", "6 4"},
};

std::string esc(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '&')
      out += "&amp;";
    else if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else if (c == '"')
      out += "&quot;";
    else
      out += c;
  }
  return out;
}

std::string num(double v, int decimals = 1) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

// 256, 1024, 16384, 128K, 1M: powers of two as people write token counts.
std::string tokens_label(double t) {
  const long long v = std::llround(t);
  if (v >= (1LL << 20) && v % (1LL << 20) == 0) return std::to_string(v >> 20) + "M";
  if (v >= (1LL << 17) && v % 1024 == 0) return std::to_string(v >> 10) + "K";
  return std::to_string(v);
}

// A step of 1, 2, 2.5 or 5 x 10^n giving about five ticks up to `top`.
double nice_step(double top) {
  if (!(top > 0)) return 1.0;
  const double raw = top / 5, mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (m * mag >= raw) return m * mag;
  return 10 * mag;
}

double value_of(const PlotPoint& p, const std::string& key) {
  if (key == "epcomm") return p.gbps;
  if (key == "memcpy") return p.memcpy_gbps;
  return p.baseline_gbps ? *p.baseline_gbps : NAN;
}

// Words of `text` in lines of at most `width` characters (a longer word gets a line of its own); at least
// one.
std::vector<std::string> wrap(const std::string& text, size_t width) {
  std::vector<std::string> lines(1);
  std::istringstream words(text);
  std::string w;
  while (words >> w) {
    if (!lines.back().empty() && lines.back().size() + 1 + w.size() > width) lines.emplace_back();
    lines.back() += (lines.back().empty() ? "" : " ") + w;
  }
  return lines;
}

// One panel with its origin at (ox, oy).
void panel(std::ostringstream& os, double ox, double oy, const std::string& name,
           std::vector<PlotPoint> pts) {
  std::sort(pts.begin(), pts.end(),
            [](const PlotPoint& a, const PlotPoint& b) { return a.tokens < b.tokens; });
  const double px = ox + kLeft, py = oy + kTop, pw = kPanelW - kLeft - kRight, ph = kPanelH - kTop - kBottom;
  double lo = INFINITY, hi = -INFINITY, ymax = 0;
  for (const PlotPoint& p : pts) {
    lo = std::min(lo, std::log2(static_cast<double>(p.tokens)));
    hi = std::max(hi, std::log2(static_cast<double>(p.tokens)));
    for (const Series& s : kSeries)
      if (std::isfinite(value_of(p, s.key))) ymax = std::max(ymax, value_of(p, s.key));
  }
  lo = std::floor(lo), hi = std::ceil(hi);
  if (hi - lo < 2) lo -= 1, hi += 1;  // a single size still gets an axis with neighbours
  const double step = nice_step(ymax * 1.05);
  const double ytop = std::max(step, std::ceil(ymax * 1.05 / step) * step);
  auto X = [&](double tokens) { return px + (std::log2(tokens) - lo) / (hi - lo) * pw; };
  auto Y = [&](double v) { return py + ph - v / ytop * ph; };

  os << "<g class=\"panel\" data-panel=\"" << esc(name) << "\">\n";
  os << "<text x=\"" << num(px + pw / 2) << "\" y=\"" << num(oy + 20)
     << "\" text-anchor=\"middle\" font-size=\"14\" font-weight=\"bold\">" << esc(name) << "</text>\n";
  os << "<rect x=\"" << num(px) << "\" y=\"" << num(py) << "\" width=\"" << num(pw) << "\" height=\""
     << num(ph) << "\" fill=\"#fbfbfb\" stroke=\"#444\" stroke-width=\"1\"/>\n";
  // y ticks and grid
  for (double v = 0; v <= ytop + step / 2; v += step) {
    const double y = Y(v);
    os << "<line x1=\"" << num(px) << "\" y1=\"" << num(y) << "\" x2=\"" << num(px + pw) << "\" y2=\""
       << num(y) << "\" stroke=\"#e2e2e2\"/>\n";
    os << "<line x1=\"" << num(px - 5) << "\" y1=\"" << num(y) << "\" x2=\"" << num(px) << "\" y2=\""
       << num(y) << "\" stroke=\"#444\"/>\n";
    os << "<text x=\"" << num(px - 8) << "\" y=\"" << num(y + 4) << "\" text-anchor=\"end\" font-size=\"11\">"
       << num(v, step < 1    ? 2
                 : step < 10 ? 1
                             : 0)
       << "</text>\n";
  }
  // x ticks at powers of two (every other one when there are many)
  const int every = hi - lo > 10 ? 2 : 1;
  for (int e = static_cast<int>(lo); e <= static_cast<int>(hi); e += every) {
    const double x = X(std::ldexp(1.0, e));
    os << "<line x1=\"" << num(x) << "\" y1=\"" << num(py) << "\" x2=\"" << num(x) << "\" y2=\""
       << num(py + ph) << "\" stroke=\"#ececec\"/>\n";
    os << "<line x1=\"" << num(x) << "\" y1=\"" << num(py + ph) << "\" x2=\"" << num(x) << "\" y2=\""
       << num(py + ph + 5) << "\" stroke=\"#444\"/>\n";
    os << "<text x=\"" << num(x) << "\" y=\"" << num(py + ph + 18)
       << "\" text-anchor=\"middle\" font-size=\"11\">" << tokens_label(std::ldexp(1.0, e)) << "</text>\n";
  }
  os << "<text x=\"" << num(px + pw / 2) << "\" y=\"" << num(py + ph + 38)
     << "\" text-anchor=\"middle\" font-size=\"12\">tokens per rank (log2 scale)</text>\n";
  os << "<text x=\"" << num(ox + 16) << "\" y=\"" << num(py + ph / 2)
     << "\" text-anchor=\"middle\" font-size=\"12\""
     << " transform=\"rotate(-90 " << num(ox + 16) << " " << num(py + ph / 2) << ")\">GB/s</text>\n";
  // series: a polyline through the measured points, a marker with a tooltip on each
  for (const Series& s : kSeries) {
    std::string line;
    std::ostringstream marks;
    for (const PlotPoint& p : pts) {
      const double v = value_of(p, s.key);
      if (!std::isfinite(v)) continue;
      const double x = X(static_cast<double>(p.tokens)), y = Y(v);
      line += num(x) + "," + num(y) + " ";
      marks << "<circle cx=\"" << num(x) << "\" cy=\"" << num(y) << "\" r=\"3.5\" fill=\""
            << (std::string(s.key) == "memcpy" ? "#fff" : s.color) << "\" stroke=\"" << s.color
            << "\"><title>" << s.key << ", " << p.tokens << " tokens per rank: " << num(v, 2)
            << " GB/s</title></circle>\n";
    }
    os << "<g class=\"series\" data-series=\"" << s.key << "\">\n";
    if (!line.empty()) {
      line.pop_back();
      os << "<polyline fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"2\""
         << (*s.dash ? std::string(" stroke-dasharray=\"") + s.dash + "\"" : std::string()) << " points=\""
         << line << "\"/>\n";
    }
    os << marks.str() << "</g>\n";
  }
  os << "</g>\n";
}

}  // namespace

std::string bench_svg(const std::string& title, const std::string& note,
                      const std::vector<PlotPoint>& points) {
  // Panels: rows by op, columns by order, in a fixed order; only the combinations present.
  const std::vector<std::string> ops = {"dispatch", "combine"}, orders = {"expert_major", "rank_major"};
  std::vector<std::string> col_orders, row_ops;
  for (const std::string& o : orders)
    if (std::any_of(points.begin(), points.end(), [&](const PlotPoint& p) { return p.order == o; }))
      col_orders.push_back(o);
  for (const std::string& o : ops)
    if (std::any_of(points.begin(), points.end(), [&](const PlotPoint& p) { return p.op == o; }))
      row_ops.push_back(o);
  const size_t cols = std::max<size_t>(1, col_orders.size()), rows = std::max<size_t>(1, row_ops.size());
  const double width = std::max(780.0, 2 * kMargin + kPanelW * static_cast<double>(cols));
  const std::vector<std::string> note_lines =
      wrap(note, static_cast<size_t>((width - 2 * kMargin) / kNoteCharW));
  const double extra = kNoteLineH * static_cast<double>(note_lines.size() - 1);  // lines beyond the first
  const double header = kHeaderH + extra;
  const double height = header + kMargin + kPanelH * static_cast<double>(rows);
  const bool any_baseline = std::any_of(points.begin(), points.end(),
                                        [](const PlotPoint& p) { return p.baseline_gbps.has_value(); });

  std::ostringstream os;
  os << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
     << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << num(width, 0) << "\" height=\""
     << num(height, 0) << "\" viewBox=\"0 0 " << num(width, 0) << " " << num(height, 0)
     << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n";
  os << "<title>" << esc(title) << "</title>\n";
  os << "<rect width=\"100%\" height=\"100%\" fill=\"#fff\"/>\n";
  os << "<text x=\"" << num(width / 2)
     << "\" y=\"26\" text-anchor=\"middle\" font-size=\"17\" font-weight=\"bold\">" << esc(title)
     << "</text>\n";
  for (size_t i = 0; i < note_lines.size(); ++i)
    os << "<text x=\"" << num(width / 2) << "\" y=\"" << num(46 + kNoteLineH * static_cast<double>(i))
       << "\" text-anchor=\"middle\" font-size=\"11\" fill=\"#444\">" << esc(note_lines[i]) << "</text>\n";
  // legend: one entry per line
  double ly = 66 + extra;
  os << "<g class=\"legend\">\n";
  for (const Series& s : kSeries) {
    std::string label = s.label;
    if (std::string(s.key) == "baseline" && !any_baseline)
      label += ": not measured (run under mpirun with --bootstrap mpi)";
    const double lx = kMargin + kLeft;
    os << "<line x1=\"" << num(lx) << "\" y1=\"" << num(ly) << "\" x2=\"" << num(lx + 26) << "\" y2=\""
       << num(ly) << "\" stroke=\"" << s.color << "\" stroke-width=\"2\""
       << (*s.dash ? std::string(" stroke-dasharray=\"") + s.dash + "\"" : std::string())
       << "/>\n<circle cx=\"" << num(lx + 13) << "\" cy=\"" << num(ly) << "\" r=\"3.5\" fill=\""
       << (std::string(s.key) == "memcpy" ? "#fff" : s.color) << "\" stroke=\"" << s.color << "\"/>\n";
    os << "<text x=\"" << num(lx + 34) << "\" y=\"" << num(ly + 4) << "\" font-size=\"12\">" << esc(label)
       << "</text>\n";
    ly += 17;
  }
  os << "</g>\n";
  for (size_t r = 0; r < row_ops.size(); ++r)
    for (size_t c = 0; c < col_orders.size(); ++c) {
      std::vector<PlotPoint> pts;
      for (const PlotPoint& p : points)
        if (p.op == row_ops[r] && p.order == col_orders[c] && p.tokens > 0) pts.push_back(p);
      if (pts.empty()) continue;
      panel(os, kMargin + kPanelW * static_cast<double>(c), header + kPanelH * static_cast<double>(r),
            row_ops[r] + ", " + col_orders[c], pts);
    }
  os << "</svg>\n";
  return os.str();
}

void write_bench_svg(const std::string& path, const std::string& title, const std::string& note,
                     const std::vector<PlotPoint>& points) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bench_svg(title, note, points);
  f.close();
  if (!f) throw std::runtime_error("--plot: cannot write '" + path + "'");
}

}  // namespace epcomm::cli
