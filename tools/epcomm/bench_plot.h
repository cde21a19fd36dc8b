// tools/epcomm/bench_plot.h — `epcomm bench --plot FILE.svg`: GB/s against tokens per rank for epcomm, the
// MPI baseline and the memcpy limit, one panel per operation and receive order, as one self-contained SVG
// file.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace epcomm::cli {

// One JSON line of the bench, as the plot needs it.
struct PlotPoint {
  std::string op, order;  // "dispatch"|"combine", "expert_major"|"rank_major"
  int64_t tokens = 0;     // per rank
  double gbps = 0, memcpy_gbps = 0;
  std::optional<double> baseline_gbps;  // none: not measured
};

// The SVG text: `title` on top, a legend, then a grid of panels (rows: dispatch, combine; columns: the
// orders present), each with a log2 x axis (tokens per rank), a linear y axis (GB/s) from 0, ticks, labels
// and one polyline with markers per series (groups with class "series" and data-series="epcomm",
// "baseline" or "memcpy"). Points with tokens = 0 are left out (no place on a log axis). `note` is a smaller
// line under the title (how the numbers were made).
std::string bench_svg(const std::string& title, const std::string& note,
                      const std::vector<PlotPoint>& points);

// Writes bench_svg(...) to `path`; throws std::runtime_error naming the path when it cannot.
void write_bench_svg(const std::string& path, const std::string& title, const std::string& note,
                     const std::vector<PlotPoint>& points);

}  // namespace epcomm::cli
