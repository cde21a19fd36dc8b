// engine/forward.cc — compact window forwarding and acknowledgement forwarding across nodes.
#include "engine/forward.h"

#include <algorithm>
#include <cstddef>

namespace epcomm::engine {

DispatchGeometry window_geometry(const OpContext& ctx, size_t row_bytes, size_t meta, size_t& lane_half,
                                 size_t& net_meta) {
  DispatchGeometry g = dispatch_geometry(ctx.layout().data_bytes, row_bytes, meta);
  if (!ctx.internode()) {  // one node: cache-sized windows (across nodes the lanes set the size)
    const int64_t cap = static_cast<int64_t>(kDispatchWindowBytes / (g.row_stride + g.meta_stride));
    g.window = std::min(g.window, std::max<int64_t>(cap, 1));
    g.cache_resident = cap >= 1;
  }
  lane_half = 0;
  net_meta = meta ? g.meta_stride : 0;
  if (const Internode* in = ctx.internode()) {
    lane_half = in->lane.data_bytes / 2 / kAlign * kAlign;
    int64_t wl = lane_half > 72 ? static_cast<int64_t>((lane_half - 72) / (4 + net_meta + g.row_stride)) : 0;
    while (wl > 0 && compact_window_max(wl, net_meta, g.row_stride) > lane_half) --wl;
    g.window = std::min(g.window, wl);
  }
  return g;
}

size_t min_rdma_bytes_for(const OpContext& ctx, const DispatchGeometry& geo, size_t net_meta) {
  const Internode* in = ctx.internode();
  return static_cast<size_t>(in->topo.num_nodes) *
         (lane_overhead_bytes(in->topo.ranks_per_node, in->topo.size) +
          2 * align64(compact_window_max(1, net_meta, geo.row_stride)) + 2 * kAlign);
}

WindowSender::WindowSender(const OpContext& ctx, const uint8_t* area, const DispatchGeometry& geo,
                           size_t lane_half, size_t net_meta, int64_t num_tokens, size_t row_bytes,
                           std::vector<std::vector<int32_t>> node_tokens)
    : ctx_(ctx),
      inter_(*ctx.internode()),
      area_(area),
      geo_(geo),
      lane_half_(lane_half),
      net_meta_(net_meta),
      row_bytes_(row_bytes),
      num_tokens_(num_tokens),
      node_tokens_(std::move(node_tokens)) {
  const int M = inter_.topo.num_nodes;
  cursor_.assign(M, 0);
  sent_.assign(M, 0);
  hdr_.resize(2 * static_cast<size_t>(M));
  pieces_.resize(2 * static_cast<size_t>(M));
}

// Window w to node n: the entries it needs, compact, in one write.
void WindowSender::send_window(int64_t w, int n) {
  const int M = inter_.topo.num_nodes;
  const int64_t W = geo_.window;
  const uint8_t* half = area_ + static_cast<size_t>(w % 2) * geo_.half_bytes;
  const int64_t t0 = w * W, t1 = std::min(num_tokens_, t0 + W);
  const std::vector<int32_t>& list = node_tokens_[n];
  const size_t c0 = cursor_[n];
  size_t c1 = c0;
  while (c1 < list.size() && list[c1] < t1) ++c1;
  cursor_[n] = c1;
  const int64_t cnt = static_cast<int64_t>(c1 - c0);
  const CompactWindow cw = compact_window(cnt, net_meta_, geo_.row_stride);
  std::vector<int32_t>& hb = hdr_[static_cast<size_t>(w % 2) * M + n];
  hb.assign(cw.meta_off / 4, 0);
  hb[0] = static_cast<int32_t>(cnt);
  std::copy(list.begin() + static_cast<ptrdiff_t>(c0), list.begin() + static_cast<ptrdiff_t>(c1),
            hb.begin() + 2);
  std::vector<Network::Piece>& pcs = pieces_[static_cast<size_t>(w % 2) * M + n];
  pcs.assign(1, Network::Piece{hb.data(), cw.meta_off});
  // Runs of consecutive tokens are contiguous in the staged half: one piece each (routing, then rows).
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 0 && !net_meta_) continue;
    const uint8_t* base = pass == 0 ? half + W * geo_.row_stride : half;
    const size_t stride = pass == 0 ? geo_.meta_stride : geo_.row_stride;
    for (size_t a = c0; a < c1;) {
      size_t b = a + 1;
      while (b < c1 && list[b] == list[b - 1] + 1) ++b;
      pcs.push_back({base + (list[a] - t0) * stride, (b - a) * stride});
      a = b;
    }
  }
  const uint64_t ticket = ctx_.write_lane(inter_.topo.rail(n), pcs.data(), static_cast<int>(pcs.size()),
                                          inter_.lane.data + static_cast<size_t>(w % 2) * lane_half_,
                                          offsetof(Control, stage_ready), pack(ctx_.seq(), w + 1));
  inter_.rows_sent += static_cast<uint64_t>(cnt);
  inter_.row_bytes_sent += static_cast<uint64_t>(cnt) * row_bytes_;
  tickets_[w % 2] = std::max(tickets_[w % 2], ticket);
  last_ticket_ = std::max(last_ticket_, ticket);
}

void WindowSender::send_staged(int64_t staged, bool& progressed) {
  const Topology& t = inter_.topo;
  for (int n = 0; n < t.num_nodes; ++n) {
    if (n == t.node() || node_tokens_[n].empty() || sent_[n] == staged) continue;
    if (!ctx_.lane_released(t.rail(n))) continue;
    while (sent_[n] < staged) send_window(sent_[n]++, n);
    progressed = true;
  }
}

bool WindowSender::all_sent(int64_t w) const {
  for (int n = 0; n < inter_.topo.num_nodes; ++n)
    if (n != inter_.topo.node() && !node_tokens_[n].empty() && sent_[n] < w) return false;
  return true;
}

bool WindowSender::half_free(int64_t w) const {
  return tickets_[w % 2] == 0 || inter_.net->complete(tickets_[w % 2]);
}

bool WindowSender::complete() const {
  return last_ticket_ == 0 || inter_.net->complete(last_ticket_);
}

AckForwarder::AckForwarder(const OpContext& ctx)
    : ctx_(ctx), forwarded_(static_cast<size_t>(ctx.internode()->topo.num_nodes), pack(ctx.seq(), 0)) {}

void AckForwarder::forward(int s, uint64_t value) {
  ctx_.write_lane(s, nullptr, 0, 0, offsetof(LaneControl, from_proxy) + offsetof(PeerCell, ack), value);
}

}  // namespace epcomm::engine
