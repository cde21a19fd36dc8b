// engine/window_serve.h — the window hand-off that every windowed protocol repeats: serve each peer's
// published windows in arrival order, answering each one, and list the peers a timeout names once each.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "engine/op_context.h"

namespace epcomm::engine {

// For every peer s in arrival order: while s has published window served[s] (its Control word `published`
// reached pack(seq, served[s] + 1)) and served[s] < windows[s], runs serve(s, served[s]), counts it and
// answers s with pack(seq, served[s]) in our cell `answer` of s's segment. Returns true once every peer's
// windows are served. dispatch: stage_ready / ack (pull a staged window); combine: combine_open / done
// (write into an open window).
template <typename Serve>
bool serve_published_windows(OpContext& ctx, int me, std::atomic<uint64_t> Control::*published,
                             std::atomic<uint64_t> PeerCell::*answer, std::vector<int64_t>& served,
                             const std::vector<int64_t>& windows, bool& progressed, Serve&& serve) {
  const uint64_t seq = ctx.seq();
  bool all = true;
  for (int s : ctx.arrival_order()) {
    while (served[s] < windows[s] &&
           (ctx.control(s)->*published).load(std::memory_order_acquire) >= pack(seq, served[s] + 1)) {
      serve(s, served[s]);
      ++served[s];
      ctx.signal(ctx.cell(s, me)->*answer, pack(seq, served[s]), s);
      progressed = true;
    }
    all = all && served[s] == windows[s];
  }
  return all;
}

// Adds rank r to a Timeout message's peer list unless it is this rank or already listed.
inline void add_awaited(std::vector<int>& peers, int r, int me) {
  if (r != me && std::find(peers.begin(), peers.end(), r) == peers.end()) peers.push_back(r);
}

}  // namespace epcomm::engine
