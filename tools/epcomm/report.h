// tools/epcomm/report.h — small formatting helpers of the tool's output: statistics over timings, text bar
// charts, human-readable sizes and one-line JSON objects.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace epcomm::cli {

// Per-iteration maximum over ranks of `per_rank` (rank-major, `iters` values per rank).
std::vector<double> max_over_ranks(const std::vector<double>& per_rank, int ranks, int iters);

double median(std::vector<double> v);
// Nearest-rank percentile (q in (0, 1]) of a non-empty vector.
double percentile(std::vector<double> v, double q);

// "12.3 MiB" style sizes; "1.23 ms" style durations.
std::string format_bytes(double bytes);
std::string format_seconds(double s);

// One labelled horizontal bar per value, scaled to the largest, with a title line giving mean and max/mean.
std::string bar_chart(const std::string& title, const std::vector<std::pair<std::string, int64_t>>& rows,
                      int width = 40);

// Builds {"key": value, ...} in insertion order, on one line.
class JsonLine {
 public:
  JsonLine& add(const std::string& key, const std::string& value);  // a JSON string (escaped)
  JsonLine& add(const std::string& key, const char* value) { return add(key, std::string(value)); }
  JsonLine& add(const std::string& key, int64_t value);
  JsonLine& add(const std::string& key, int value) { return add(key, static_cast<int64_t>(value)); }
  // Non-finite values become null. decimals < 0: "%.6g"; else fixed-point with that many decimals.
  JsonLine& add(const std::string& key, double value, int decimals = -1);
  JsonLine& add(const std::string& key, bool value);
  JsonLine& add_null(const std::string& key);
  // A JSON array of numbers, each formatted as add(key, double, decimals) formats one.
  JsonLine& add(const std::string& key, const std::vector<double>& values, int decimals = -1);
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void key(const std::string& k);
  std::string body_;
};

}  // namespace epcomm::cli
