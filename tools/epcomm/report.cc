// tools/epcomm/report.cc — statistics, bar charts, sizes and JSON lines for the tool's output.
// Pure formatting: no I/O except into the returned strings.
#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace epcomm::cli {

std::vector<double> max_over_ranks(const std::vector<double>& per_rank, int ranks, int iters) {
  std::vector<double> out(static_cast<size_t>(iters), 0.0);
  for (int r = 0; r < ranks; ++r)
    for (int i = 0; i < iters; ++i) out[i] = std::max(out[i], per_rank[static_cast<size_t>(r) * iters + i]);
  return out;
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
