// engine/combine_forward.cc — the internode half of combine: routing to the proxies, partials back.
#include "engine/combine_forward.h"

#include <algorithm>
#include <cstring>

namespace epcomm::engine {

CombineLane combine_lane(size_t data_bytes, const CombineGeometry& geo, int64_t W, size_t meta_entry,
                         size_t partial_bytes) {
  CombineLane c;
  c.meta_entry = meta_entry;
  c.partial_stride = align64(partial_bytes);
  auto fits = [&](int64_t w, CombineLane& out) {
    out.meta_off = align64(static_cast<size_t>(w) * geo.slots * (geo.row_stride + geo.weight_stride));
    out.partial_off = out.meta_off + align64(8 + static_cast<size_t>(w) * meta_entry);
    return out.partial_off + static_cast<size_t>(w) * out.partial_stride <= data_bytes;
  };
  const size_t per = geo.slots * (geo.row_stride + geo.weight_stride) + meta_entry + c.partial_stride;
  int64_t w = std::min<int64_t>(W, static_cast<int64_t>(data_bytes / per));
  while (w > 0 && !fits(w, c)) --w;
  c.window = w;
  if (w > 0) fits(w, c);
  return c;
}

Hierarchy::Hierarchy(OpContext& ctx, const CombineInput& in, const HandleData& hd, const CombineGeometry& geo,
                     const CombineLane& cl, int64_t halves, size_t lane_stride, uint8_t* cx, float* cw,
                     const std::vector<const uint8_t*>& shared_x)
    : ctx_(ctx),
      in_(in),
      hd_(hd),
      geo_(geo),
      cl_(cl),
      halves_(halves),
      lane_stride_(lane_stride),
      cx_(cx),
      cw_(cw),
      inter_(ctx.internode()),
      shared_x_(shared_x),
      row_bytes_(static_cast<size_t>(in.hidden) * dtype_size(in.dtype)) {
  if (!inter_) return;
  const Topology& t = inter_->topo;
  R_ = t.size;
  M_ = t.num_nodes;
  me_ = t.rank;
  node_ = t.node();
  K_ = hd.num_topk;
  L_ = hd.num_local;
  W_ = geo.window;
  expert_ = hd.order == ReceiveOrder::expert_major;
  seq_ = ctx.seq();
  weights_off_ = static_cast<size_t>(W_) * geo.slots * geo.row_stride;
  has_g_ = in.has_recv_weights;
  // Our tokens each other node holds copies of.
  tokens_.assign(M_, {});
  for (int64_t tk = 0; tk < hd.num_tokens; ++tk)
    for (int n = 0; n < M_; ++n)
      if (n != node_ && holds(tk, n)) tokens_[n].push_back(static_cast<int32_t>(tk));
  send_cursor_.assign(M_, 0);
  reduce_cursor_.assign(M_, 0);
  routing_.assign(static_cast<size_t>(2 * M_), {});
  // As proxy of rail peer s (node n): the ranks of our node holding copies of s's tokens, its windows.
  proxy_.assign(M_, {});
  for (int n = 0; n < M_; ++n) {
    if (n == node_) continue;
    Proxied& p = proxy_[n];
    p.source = t.rail(n);
    const int32_t* tpr = ctx.counts(p.source) + ctx.header(p.source)->num_counts - R_;
    for (int d : t.node_ranks[node_])
      if (tpr[d] > 0) p.contributors.push_back(d);
    const int64_t Ts = ctx.header(p.source)->num_tokens;
    p.nwin = p.contributors.empty() ? 0 : (Ts + W_ - 1) / W_;
  }
}

void Hierarchy::send_routing(int64_t w) {
  const int64_t t1 = std::min(hd_.num_tokens, (w + 1) * W_);
  for (int n = 0; n < M_; ++n) {
    if (n == node_ || tokens_[n].empty()) continue;
    const std::vector<int32_t>& list = tokens_[n];
    size_t c0 = send_cursor_[n], c1 = c0;
    while (c1 < list.size() && list[c1] < t1) ++c1;
    send_cursor_[n] = c1;
    std::vector<uint8_t>& buf = routing_[static_cast<size_t>((w % halves_) * M_ + n)];
    buf.assign(8 + (c1 - c0) * cl_.meta_entry, 0);
    *reinterpret_cast<int32_t*>(buf.data()) = static_cast<int32_t>(c1 - c0);
    uint8_t* e = buf.data() + 8;
    for (size_t c = c0; c < c1; ++c, e += cl_.meta_entry) {
      const int64_t tk = list[c];
      std::memcpy(e, &list[c], 4);
      if (expert_) {
        std::memcpy(e + 4, &hd_.topk_ids[tk * K_], 4 * static_cast<size_t>(K_));
        std::memcpy(e + 4 + 4 * K_, &in_.weights_used[tk * K_], 4 * static_cast<size_t>(K_));
      } else {
        std::memcpy(e + 4, &hd_.in_rank[tk * R_], static_cast<size_t>(R_));
      }
    }
    Network::Piece piece{buf.data(), buf.size()};
    uint64_t& last = last_routing_[w % halves_];
    last = std::max(last, ctx_.write_lane(inter_->topo.rail(n), &piece, 1, half_offset(w) + cl_.meta_off,
                                          offsetof(LaneControl, meta_ready), pack(seq_, w + 1)));
  }
}

bool Hierarchy::serve_as_proxy(bool& progressed) {
  bool all = true;
  for (int n = 0; n < M_; ++n) {
    if (n == node_) continue;
    Proxied& p = proxy_[n];
    LaneControl* lc = ctx_.lane_control(me_, n);
    if (p.opened < p.reduced + halves_ && p.opened < p.nwin &&
        lc->meta_ready.load(std::memory_order_acquire) >= pack(seq_, p.opened + 1)) {
      ++p.opened;
      ctx_.signal(lc->mirror.combine_open, pack(seq_, p.opened), me_);
      for (int d : p.contributors)
        if (d != me_) ctx_.notify(d);
      progressed = true;
    }
    const uint64_t ticket = p.ticket[p.reduced % halves_];
    if (p.reduced < p.opened && contributors_done(p) && (ticket == 0 || inter_->net->complete(ticket))) {
      send_partials(p, n);
      ++p.reduced;
      if (p.reduced == p.nwin) {  // closed: our node's holders are done lending rows for this origin
        ctx_.signal(lc->mirror.combine_open, pack(seq_, p.nwin + 1), me_);
        for (int d : p.contributors)
          if (d != me_) ctx_.notify(d);
      }
      progressed = true;
    }
    for (uint64_t t : p.ticket) all = all && (t == 0 || inter_->net->complete(t));
    all = all && p.reduced == p.nwin;
  }
  return all && all_routing_free();
}

bool Hierarchy::holds(int64_t t, int n) const {
  if (expert_) {
    for (int k = 0; k < K_; ++k) {
      const int32_t e = hd_.topk_ids[t * K_ + k];
      if (e >= 0 && ctx_.node_of(e / L_) == n) return true;
    }
    return false;
  }
  for (int d : inter_->topo.node_ranks[n])
    if (hd_.in_rank[t * R_ + d]) return true;
  return false;
}

void Hierarchy::sum_weights(const float* const* gs, int n, float* out) const {
  for (int k = 0; k < K_; ++k) {
    float p = 0.0f;
    for (int j = 0; j < n; ++j) p = p + gs[j][k];
    out[k] = p;
  }
}

bool Hierarchy::contributors_done(const Proxied& p) const {
  for (int d : p.contributors)
    if (ctx_.cell(p.source, d)->done.load(std::memory_order_acquire) < pack(seq_, p.reduced + 1))
      return false;
  return true;
}

void Hierarchy::send_partials(Proxied& p, int n) {
  const uint8_t* lane = ctx_.lane_base(me_, n) + half_offset(p.reduced);
  const uint8_t* meta = lane + cl_.meta_off;
  std::vector<float>& partials = p.partials[p.reduced % halves_];
  const int64_t count = *reinterpret_cast<const int32_t*>(meta);
  const int64_t t0 = p.reduced * W_;
  const size_t stride = cl_.partial_stride / 4;
  partials.assign(static_cast<size_t>(count) * stride, 0.0f);
  const uint8_t* rows[kMaxParts];
  float wts[kMaxParts];
  const float* gs[kMaxParts];
  for (int64_t e = 0; e < count; ++e) {
    const uint8_t* m = meta + 8 + e * cl_.meta_entry;
    int32_t t;
    std::memcpy(&t, m, 4);
    int c = 0;
    auto slot = [&](int s) {
      const size_t idx = static_cast<size_t>(t - t0) * geo_.slots + s;
      return std::make_pair(lane + idx * geo_.row_stride,
                            reinterpret_cast<const float*>(lane + weights_off_ + idx * geo_.weight_stride));
    };
    if (expert_) {
      for (int k = 0; k < K_; ++k) {
        int32_t id;
        float wk;
        std::memcpy(&id, m + 4 + 4 * k, 4);
        std::memcpy(&wk, m + 4 + 4 * K_ + 4 * k, 4);
        if (id < 0 || ctx_.node_of(id / L_) != node_) continue;
        rows[c] = lane_row(slot(k).first, id / L_);
        wts[c++] = wk;
      }
    } else {
      for (int d : inter_->topo.node_ranks[node_]) {
        if (!m[4 + d]) continue;
        rows[c] = lane_row(slot(d).first, d);
        gs[c++] = slot(d).second;
      }
    }
    float* out = partials.data() + e * stride;
    reduce_partial(in_.dtype, rows, expert_ ? wts : nullptr, c, in_.hidden, out);
    if (!expert_ && has_g_) sum_weights(gs, c, out + in_.hidden);
  }
  Network::Piece piece{partials.data(), partials.size() * sizeof(float)};
  p.ticket[p.reduced % halves_] = ctx_.write_lane(
      p.source, &piece, 1, half_offset(p.reduced) + cl_.partial_off,
      offsetof(LaneControl, from_proxy) + offsetof(PeerCell, done), pack(seq_, p.reduced + 1));
}

}  // namespace epcomm::engine
