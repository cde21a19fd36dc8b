// tools/epcomm/report.cc — statistics, bar charts, sizes and JSON lines for the tool's output.
// Pure formatting: no I/O except into the returned strings.
#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>

namespace epcomm::cli {

std::vector<double> max_over_ranks(const std::vector<double>& per_rank, int ranks, int iters) {
  std::vector<double> out(static_cast<size_t>(iters), 0.0);
  for (int r = 0; r < ranks; ++r)
    for (int i = 0; i < iters; ++i) out[i] = std::max(out[i], per_rank[static_cast<size_t>(r) * iters + i]);
  return out;
}

std::vector<double> span_over_ranks(const std::vector<double>& starts, const std::vector<double>& durations,
                                    int ranks, int iters) {
  std::vector<double> out(static_cast<size_t>(iters), 0.0);
  for (int i = 0; i < iters; ++i) {
    double last_start = starts[static_cast<size_t>(i)],
           last_end = last_start + durations[static_cast<size_t>(i)];
    for (int r = 1; r < ranks; ++r) {
      const size_t at = static_cast<size_t>(r) * iters + i;
      last_start = std::max(last_start, starts[at]);
      last_end = std::max(last_end, starts[at] + durations[at]);
    }
    out[i] = last_end - last_start;
  }
  return out;
}

std::vector<double> start_skew(const std::vector<double>& starts, int ranks, int iters) {
  std::vector<double> out(static_cast<size_t>(iters), 0.0);
  for (int i = 0; i < iters; ++i) {
    double lo = starts[static_cast<size_t>(i)], hi = lo;
    for (int r = 1; r < ranks; ++r) {
      lo = std::min(lo, starts[static_cast<size_t>(r) * iters + i]);
      hi = std::max(hi, starts[static_cast<size_t>(r) * iters + i]);
    }
    out[i] = hi - lo;
  }
  return out;
}

std::vector<double> op_slice(const std::vector<double>& all, int ranks, int ops, int iters, int op) {
  std::vector<double> out;
  out.reserve(static_cast<size_t>(ranks) * iters);
  for (int r = 0; r < ranks; ++r) {
    const auto at = all.begin() + (static_cast<ptrdiff_t>(r) * ops + op) * iters;
    out.insert(out.end(), at, at + iters);
  }
  return out;
}

bool one_host(const std::vector<std::string>& hosts) {
  return std::all_of(hosts.begin(), hosts.end(), [&](const std::string& h) { return h == hosts.front(); });
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

Timing collective_timing(const std::vector<double>& starts, const std::vector<double>& durations, int ranks,
                         int iters, bool one_clock) {
  if (iters <= 0) return {};
  const std::vector<double> slowest = max_over_ranks(durations, ranks, iters);
  std::vector<double> us = one_clock ? span_over_ranks(starts, durations, ranks, iters) : slowest;
  for (double& v : us) v *= 1e6;
  Timing t;
  t.median = median(us);
  t.min = *std::min_element(us.begin(), us.end());
  t.p99 = percentile(us, 0.99);
  t.max = *std::max_element(us.begin(), us.end());
  t.rank_median = median(slowest) * 1e6;
  t.skew_median = one_clock ? median(start_skew(starts, ranks, iters)) * 1e6 : 0.0;
  return t;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), u ? "%.2f %s" : "%.0f %s", bytes, units[u]);
  return buf;
}

std::string format_seconds(double s) {
  char buf[32];
  if (s < 1e-3)
    std::snprintf(buf, sizeof(buf), "%.1f us", s * 1e6);
  else if (s < 1.0)
    std::snprintf(buf, sizeof(buf), "%.3f ms", s * 1e3);
  else
    std::snprintf(buf, sizeof(buf), "%.3f s", s);
  return buf;
}

std::string bar_chart(const std::string& title, const std::vector<std::pair<std::string, int64_t>>& rows,
                      int width) {
  int64_t mx = 0, sum = 0;
  size_t label_width = 0;
  for (const auto& [label, v] : rows) {
    mx = std::max(mx, v);
    sum += v;
    label_width = std::max(label_width, label.size());
  }
  const double mean = rows.empty() ? 0.0 : static_cast<double>(sum) / static_cast<double>(rows.size());
  char head[160];
  std::snprintf(head, sizeof(head), " (mean %.1f, max/mean %.2f)\n", mean,
                mean > 0 ? static_cast<double>(mx) / mean : 0.0);
  std::string out = title + head;
  for (const auto& [label, v] : rows) {
    int n =
        mx > 0 ? static_cast<int>(std::lround(static_cast<double>(v) * width / static_cast<double>(mx))) : 0;
    out += "  " + label + std::string(label_width - label.size(), ' ') + " |" + std::string(n, '#') +
           std::string(width - n, ' ') + "| " + std::to_string(v) + "\n";
  }
  return out;
}

void JsonLine::key(const std::string& k) {
  if (!body_.empty()) body_ += ", ";
  body_ += "\"" + k + "\": ";
}

JsonLine& JsonLine::add(const std::string& k, const std::string& value) {
  key(k);
  body_ += '"';
  for (char c : value) {
    if (c == '"' || c == '\\') body_ += '\\';
    if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      body_ += buf;
      continue;
    }
    body_ += c;
  }
  body_ += '"';
  return *this;
}

JsonLine& JsonLine::add(const std::string& k, int64_t value) {
  key(k);
  body_ += std::to_string(value);
  return *this;
}

namespace {

std::string json_number(double value, int decimals) {
  if (!std::isfinite(value)) return "null";
  char buf[64];
  if (decimals < 0 || std::fabs(value) >= 1e15)
    std::snprintf(buf, sizeof(buf), "%.6g", value);
  else
    std::snprintf(buf, sizeof(buf), "%.*f", decimals, value);
  return buf;
}

}  // namespace

JsonLine& JsonLine::add(const std::string& k, double value, int decimals) {
  key(k);
  body_ += json_number(value, decimals);
  return *this;
}

JsonLine& JsonLine::add(const std::string& k, const std::vector<double>& values, int decimals) {
  key(k);
  body_ += '[';
  for (size_t i = 0; i < values.size(); ++i) body_ += (i ? ", " : "") + json_number(values[i], decimals);
  body_ += ']';
  return *this;
}

JsonLine& JsonLine::add_null(const std::string& k) {
  key(k);
  body_ += "null";
  return *this;
}

JsonLine& JsonLine::add(const std::string& k, bool value) {
  key(k);
  body_ += value ? "true" : "false";
  return *this;
}

}  // namespace epcomm::cli
