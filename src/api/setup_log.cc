// api/setup_log.cc — formatting of the EPCOMM_LOG set-up and call lines.
#include "api/setup_log.h"

#include <algorithm>
#include <cstdio>

#include "common/check.h"

namespace epcomm::detail {

std::string bytes_str(int64_t bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0 || v == static_cast<double>(static_cast<int64_t>(v)))
    std::snprintf(buf, sizeof buf, "%lld %s", static_cast<long long>(v), kUnits[u]);
  else
    std::snprintf(buf, sizeof buf, "%.1f %s", v, kUnits[u]);
  return buf;
}

std::string rank_list(const std::vector<int>& ranks) {
  if (ranks.empty()) return "none";
  bool consecutive = true;
  for (size_t i = 1; i < ranks.size(); ++i) consecutive &= ranks[i] == ranks[i - 1] + 1;
  if (consecutive && ranks.size() > 2) return cat(ranks.front(), "-", ranks.back());
  std::string s;
  for (size_t i = 0; i < ranks.size(); ++i) s += cat(i ? "," : "", ranks[i]);
  return s;
}

std::string describe_ranks(int rank, const std::vector<int>& node_of_rank, const Transport& tp,
                           const Network* network) {
  const int R = static_cast<int>(node_of_rank.size());
  const int nodes = *std::max_element(node_of_rank.begin(), node_of_rank.end()) + 1;
  std::vector<int> mine, rail, forwarded;
  const std::vector<int> none;
  const std::vector<int>& peers = network ? network->peers() : none;
  for (int r = 0; r < R; ++r) {
    if (node_of_rank[r] == node_of_rank[rank])
      mine.push_back(r);
    else if (std::find(peers.begin(), peers.end(), r) != peers.end())
      rail.push_back(r);
    else
      forwarded.push_back(r);
  }
  std::string s = cat(R, R == 1 ? " rank, " : " ranks, ", nodes, nodes == 1 ? " node" : " nodes");
  if (nodes > 1) s += cat(" of ", mine.size(), " (this rank on node ", node_of_rank[rank], ")");
  s += cat("; ", tp.describe(), " to ranks ", rank_list(mine));
  if (network) s += cat("; ", network->describe(), " to ranks ", rank_list(rail), " (rail peers)");
  if (!forwarded.empty()) s += cat("; ranks ", rank_list(forwarded), " through their rail peer's node");
  return s;
}

CounterSnapshot snapshot(const engine::CopyCounters& c) {
  auto get = [](const std::atomic<int64_t>& a) { return a.load(std::memory_order_relaxed); };
  return {get(c.dispatch_staged_tokens), get(c.dispatch_in_place_tokens), get(c.dispatch_pushed_tokens),
          get(c.combine_copied_rows),    get(c.combine_in_place_rows),    get(c.combine_direct_tokens),
          get(c.combine_shared_tokens)};
}

std::string describe_path(const CounterSnapshot& a, const CounterSnapshot& b) {
  std::string s;
  auto add = [&](int64_t n, const char* what) {
    if (n) s += cat(s.empty() ? "" : ", ", n, " ", what);
  };
  add(b.pushed - a.pushed, "tokens pushed into the receivers' outputs");
  add(b.staged - a.staged, "tokens staged");
  add(b.in_place - a.in_place, "tokens read in place");
  add(b.direct - a.direct, "tokens reduced directly from the holders' rows");
  add(b.shared - a.shared, "tokens reduced for a slower rank");
  add(b.copied_rows - a.copied_rows, "rows copied into windows");
  add(b.in_place_rows - a.in_place_rows, "rows read in place");
  return s.empty() ? "no rows moved by this rank" : s;
}

std::string elapsed_ms(std::chrono::steady_clock::time_point t0) {
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f ms", ms);
  return buf;
}

}  // namespace epcomm::detail
