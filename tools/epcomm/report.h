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
// Per iteration, the time from the last rank's call to the last rank's return: `starts` and `durations` are
// rank-major (`iters` values per rank), the starts read from one clock on every rank (steady_clock of one
// host). A collective cannot return on any rank before every rank has called it, so this is its own time,
// without the skew with which whatever came before (a barrier) released the ranks.
std::vector<double> span_over_ranks(const std::vector<double>& starts, const std::vector<double>& durations,
                                    int ranks, int iters);
// Per iteration, the last rank's start minus the first rank's.
std::vector<double> start_skew(const std::vector<double>& starts, int ranks, int iters);
// Values [iters * op, iters * (op + 1)) of every rank, from `all` laid out rank-major with `ops * iters`
// values per rank (the benches record dispatch, then combine).
std::vector<double> op_slice(const std::vector<double>& all, int ranks, int ops, int iters, int op);

// A collective's iteration times in microseconds: median, min, p99 and max of span_over_ranks (one_clock) or
// else of the slowest rank's own time; the median of the slowest rank's own time, and of start_skew (0
// without one clock). `durations` and `starts` (seconds) as span_over_ranks takes them.
struct Timing {
  double median = 0, min = 0, p99 = 0, max = 0;
  double rank_median = 0, skew_median = 0;
};
Timing collective_timing(const std::vector<double>& starts, const std::vector<double>& durations, int ranks,
                         int iters, bool one_clock);
// True when every name is the first: ranks on one host read one steady clock.
bool one_host(const std::vector<std::string>& hosts);

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
