// engine/forward.h — the internode half of a dispatch, shared by the normal mode and dispatch_v2 (two-hop
// model of engine/internode.h). A sender's staged window goes once to every other node that needs any of its
// tokens, compact (only those tokens), in one network write into the lane its rail peer there keeps for it;
// receivers read local and remote windows alike through StagedWindow; and each proxy forwards to its rail
// peers the acknowledgements of the ranks of its node, so that senders know when a window half is free.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/internode.h"
#include "engine/op_context.h"
#include "engine/protocol.h"

namespace epcomm::engine {

// One staged window as a receiver sees it: a local source's half (every token of the window, at fixed
// strides) or, for a remote source, the compact copy its proxy holds (only the tokens this node needs).
struct StagedWindow {
  int64_t count = 0, t0 = 0;
  const int32_t* tokens = nullptr;  // compact: the entries' token indices
  const uint8_t *rows = nullptr, *metas = nullptr;
  size_t row_stride = 0, meta_stride = 0;

  // A local half of window `window` tokens per half, starting at token t0 with `count` tokens.
  static StagedWindow local(const uint8_t* half, const DispatchGeometry& g, int64_t t0, int64_t count) {
    return {count, t0, nullptr, half, half + g.window * g.row_stride, g.row_stride, g.meta_stride};
  }
  static StagedWindow compact(const uint8_t* half, size_t row_stride, size_t meta_stride) {
    const int64_t n = *reinterpret_cast<const int32_t*>(half);
    const CompactWindow c = compact_window(n, meta_stride, row_stride);
    return {n,
            0,
            reinterpret_cast<const int32_t*>(half + 8),
            half + c.rows_off,
            half + c.meta_off,
            row_stride,
            meta_stride};
  }
  // Window w of source s as this rank reads it (`geo` and `lane_half` from window_geometry for s's rows).
  static StagedWindow of(const OpContext& ctx, int s, int64_t w, const DispatchGeometry& geo,
                         size_t lane_half, size_t net_meta, int64_t tokens_of_s) {
    if (ctx.remote(s)) {
      StagedWindow win =
          compact(ctx.data(s) + static_cast<size_t>(w % 2) * lane_half, geo.row_stride, net_meta);
      // Never read outside the lane: a window announced without having landed whole (which the network
      // prevents) must not be walked.
      if (win.count < 0 || win.count > geo.window)
        EPCOMM_THROW(Aborted, ctx.prefix(), "the forwarded window ", w, " of ", ctx.peer_name(s), " claims ",
                     win.count, " tokens, more than a window holds (", geo.window,
                     "): its data did not land whole");
      return win;
    }
    const int64_t t0 = w * geo.window;
    return local(ctx.data(s) + static_cast<size_t>(w % 2) * geo.half_bytes, geo, t0,
                 std::min(tokens_of_s, t0 + geo.window) - t0);
  }
  int64_t token(int64_t e) const { return tokens ? tokens[e] : t0 + e; }
  const uint8_t* payload(int64_t e) const { return rows + e * row_stride; }
  const uint8_t* meta(int64_t e) const { return metas + e * meta_stride; }
};

// The window a dispatch uses for rows of `row_bytes` with `meta` routing bytes: what fits half of the data
// area and, internode, a compact half of a lane. Sets `lane_half` (0 on one node) and `net_meta`, the routing
// bytes each compact entry carries (0 when meta is 0).
DispatchGeometry window_geometry(const OpContext& ctx, size_t row_bytes, size_t meta, size_t& lane_half,
                                 size_t& net_meta);
// The smallest num_rdma_bytes that holds one forwarded token of this geometry.
size_t min_rdma_bytes_for(const OpContext& ctx, const DispatchGeometry& geo, size_t net_meta);

// Sends this rank's staged windows to the nodes that need their tokens. The network must be done with the
// windows' pieces before they go: the destructor waits for that (bounded), however the call ends.
class WindowSender {
 public:
  // `node_tokens[n]`: the tokens node n needs, ascending (empty for this node). `row_bytes`: the payload
  // bytes counted per forwarded row (Internode::row_bytes_sent).
  WindowSender(const OpContext& ctx, const uint8_t* area, const DispatchGeometry& geo, size_t lane_half,
               size_t net_meta, int64_t num_tokens, size_t row_bytes,
               std::vector<std::vector<int32_t>> node_tokens);
  ~WindowSender() { ctx_.drain_writes(); }
  WindowSender(const WindowSender&) = delete;
  WindowSender& operator=(const WindowSender&) = delete;

  // Sends windows [sent, staged) to every node that needs them, once the rail peer there has finished the
  // previous call (its lane for us is free then), whether or not its header of this call is in yet.
  void send_staged(int64_t staged, bool& progressed);
  // Every node that needs our tokens has been sent windows [0, w).
  bool all_sent(int64_t w) const;
  // The network is done reading the half window w would be staged in.
  bool half_free(int64_t w) const;
  // The network is done reading every window sent.
  bool complete() const;
  bool sends_to(int node) const { return !node_tokens_[node].empty(); }

 private:
  void send_window(int64_t w, int n);

  const OpContext& ctx_;
  Internode& inter_;
  const uint8_t* area_;
  DispatchGeometry geo_;
  size_t lane_half_, net_meta_, row_bytes_;
  int64_t num_tokens_;
  std::vector<std::vector<int32_t>> node_tokens_;
  std::vector<size_t> cursor_;
  std::vector<int64_t> sent_;
  std::vector<std::vector<int32_t>> hdr_;            // [2·M]: count + token list of each half and node
  std::vector<std::vector<Network::Piece>> pieces_;  // [2·M]
  uint64_t tickets_[2] = {0, 0}, last_ticket_ = 0;
};

// As proxy of its rail peers: once every rank of this node that pulls from rail peer s acknowledged a window,
// tells s (the least acknowledgement goes back). receives(s, d): local rank d pulls from remote s;
// windows(s): s's window count. step() returns true once every such acknowledgement went back.
class AckForwarder {
 public:
  explicit AckForwarder(const OpContext& ctx);
  template <typename Receives, typename Windows>
  bool step(bool& progressed, Receives&& receives, Windows&& windows) {
    const Topology& t = ctx_.internode()->topo;
    bool all = true;
    for (int n = 0; n < t.num_nodes; ++n) {
      if (n == t.node()) continue;
      const int s = t.rail(n);
      uint64_t m = UINT64_MAX;
      for (int d : t.node_ranks[t.node()])
        if (receives(s, d)) m = std::min(m, ctx_.cell(s, d)->ack.load(std::memory_order_acquire));
      if (m == UINT64_MAX) continue;  // nobody here receives from s
      if (m > forwarded_[n]) {
        forward(s, m);
        forwarded_[n] = m;
        progressed = true;
      }
      all = all && forwarded_[n] == pack(ctx_.seq(), windows(s));
    }
    return all;
  }

 private:
  void forward(int s, uint64_t value);
  const OpContext& ctx_;
  std::vector<uint64_t> forwarded_;
};

}  // namespace epcomm::engine
