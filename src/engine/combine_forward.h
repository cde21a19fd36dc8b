// engine/combine_forward.h — the internode half of combine (docs/internode.md): the lane layout of a
// combine window and the Hierarchy that, as origin, sends each window's routing to the nodes holding copies
// and reduces their partials, and as proxy of its rail peers reduces its node's copies into partials.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/combine.h"
#include "engine/kernels.h"
#include "engine/op_context.h"

namespace epcomm::engine {

// Internode: what a lane's data area holds during a combine (the same W everywhere): the copy window that
// the proxy's node fills for a remote origin, the routing the origin sends for it, and the f32 partials the
// proxy sends back (into the origin's lane for the proxy's node).
struct CombineLane {
  size_t meta_entry = 0, meta_off = 0, partial_stride = 0, partial_off = 0;
  int64_t window = 0;
};
CombineLane combine_lane(size_t data_bytes, const CombineGeometry& geo, int64_t W, size_t meta_entry,
                         size_t partial_bytes);

// The internode part of a combine (docs/normal-mode.md): as origin, send each window's routing to the proxies
// of the nodes that hold copies, then reduce with their partials; as proxy of our rail peers, open their
// windows to our node, reduce what our node wrote into one f32 partial per token and send it back.
class Hierarchy {
 public:
  // `halves` windows in flight; lane half h starts `h * lane_stride` bytes into the lane's data.
  // `shared_x[d]`: rank d's expert outputs as mapped here when they lie in shared memory (d on our node),
  // else null; d's slots in the copy windows then hold row indices into them instead of rows.
  Hierarchy(OpContext& ctx, const CombineInput& in, const HandleData& hd, const CombineGeometry& geo,
            const CombineLane& cl, int64_t halves, size_t lane_stride, uint8_t* cx, float* cw,
            const std::vector<const uint8_t*>& shared_x);

  // The network must be done with routing_ and the partials before they go, whatever way the call ends.
  ~Hierarchy() { ctx_.drain_writes(); }
  Hierarchy(const Hierarchy&) = delete;
  Hierarchy& operator=(const Hierarchy&) = delete;

  // The routing buffers of window w's half may be reused (the network is done with them).
  bool routing_free(int64_t w) const {
    const uint64_t t = last_routing_[w % halves_];
    return t == 0 || inter_->net->complete(t);
  }
  bool all_routing_free() const { return routing_free(0) && routing_free(1); }

  // Opens our window w on the other nodes: the routing of its tokens each node holds copies of.
  void send_routing(int64_t w);

  // Origin: reduces window w from our node's copies and the other nodes' partials (docs/normal-mode.md across
  // nodes). copy_of(t, slot) -> (row, receiving-side weights): a template, not std::function, on this
  // per-copy path.
  template <typename CopyOf>
  void reduce(int64_t w, const CopyOf& copy_of) {
    const int64_t t0 = w * W_, t1 = std::min(hd_.num_tokens, t0 + W_);
    const size_t row_bytes = static_cast<size_t>(in_.hidden) * dtype_size(in_.dtype);
    own_.resize(static_cast<size_t>(in_.hidden) + K_);
    std::vector<size_t> entry(M_, 0);  // next partial of each node in this window
    for (int64_t t = t0; t < t1; ++t) {
      const float* parts[kMaxParts];
      const float* wparts[kMaxParts];
      int np = 0;
      for (int n = 0; n < M_; ++n) {
        if (n == node_) {
          if (own_partial(t, copy_of)) {
            wparts[np] = own_.data() + in_.hidden;
            parts[np++] = own_.data();
          }
          continue;
        }
        const std::vector<int32_t>& list = tokens_[n];
        if (reduce_cursor_[n] >= list.size() || list[reduce_cursor_[n]] != t) continue;
        ++reduce_cursor_[n];
        const float* p = reinterpret_cast<const float*>(ctx_.lane_base(me_, n) + half_offset(w) +
                                                        cl_.partial_off + entry[n]++ * cl_.partial_stride);
        wparts[np] = p + in_.hidden;
        parts[np++] = p;
      }
      finish_partials(in_.dtype, parts, np, in_.hidden, in_.bias1 ? in_.bias1 + t * row_bytes : nullptr,
                      in_.bias2 ? in_.bias2 + t * row_bytes : nullptr, cx_ + t * row_bytes);
      if (!expert_ && cw_)
        for (int k = 0; k < K_; ++k) {
          float acc = 0.0f;
          for (int j = 0; j < np; ++j) acc = acc + wparts[j][k];
          cw_[t * K_ + k] = acc;
        }
    }
  }

  // Proxy duties; true once every proxied window was reduced and sent and the network is done with it all.
  // Once a proxied origin's last window is reduced, its mirrored `combine_open` is raised past the last
  // window (closed): holders that lent their shared rows for it may return.
  bool serve_as_proxy(bool& progressed);

 private:
  static constexpr int kMaxParts = 1024;
  struct Proxied {
    int source = -1;
    std::vector<int> contributors;
    int64_t nwin = 0, opened = 0, reduced = 0;
    uint64_t ticket[2] = {0, 0};     // of each half's partials write
    std::vector<float> partials[2];  // per half
  };

  // Where window w's half of a lane's data starts, from the lane's start.
  size_t half_offset(int64_t w) const {
    return inter_->lane.data + static_cast<size_t>(w % halves_) * lane_stride_;
  }

  // Does node n hold a copy of our token t?
  bool holds(int64_t t, int n) const;

  // Our node's partial of our token t into own_; false when our node holds no copy.
  template <typename CopyOf>
  bool own_partial(int64_t t, const CopyOf& copy_of) {
    const uint8_t* rows[kMaxParts];
    float wts[kMaxParts];
    const float* gs[kMaxParts];
    int n = 0;
    if (expert_) {
      for (int k = 0; k < K_; ++k) {
        const int32_t e = hd_.topk_ids[t * K_ + k];
        if (e < 0 || ctx_.node_of(e / L_) != node_) continue;
        rows[n] = copy_of(t, k).first;
        wts[n++] = in_.weights_used[t * K_ + k];
      }
    } else {
      for (int d : inter_->topo.node_ranks[node_]) {
        if (!hd_.in_rank[t * R_ + d]) continue;
        auto c = copy_of(t, d);
        rows[n] = c.first;
        gs[n++] = c.second;
      }
    }
    if (n == 0) return false;
    reduce_partial(in_.dtype, rows, expert_ ? wts : nullptr, n, in_.hidden, own_.data());
    if (!expert_ && has_g_) sum_weights(gs, n, own_.data() + in_.hidden);
    return true;
  }

  void sum_weights(const float* const* gs, int n, float* out) const;

  bool contributors_done(const Proxied& p) const;

  // Reduces what our node wrote for window p.reduced of rail peer p.source and sends the partials back.
  void send_partials(Proxied& p, int n);
  // The row a proxied window's slot written by holder d stands for (slot_row).
  const uint8_t* lane_row(const uint8_t* slot, int d) const {
    return slot_row(slot, shared_x_[d], row_bytes_);
  }

  OpContext& ctx_;
  const CombineInput& in_;
  const HandleData& hd_;
  CombineGeometry geo_;
  CombineLane cl_;
  int64_t halves_ = 1;
  size_t lane_stride_ = 0;
  uint8_t* cx_;
  float* cw_;
  Internode* inter_;
  const std::vector<const uint8_t*>& shared_x_;
  size_t row_bytes_ = 0;
  int R_ = 1, M_ = 1, me_ = 0, node_ = 0, K_ = 0, L_ = 1;
  int64_t W_ = 1;
  bool expert_ = true, has_g_ = false;
  uint64_t seq_ = 0, last_routing_[2] = {0, 0};
  size_t weights_off_ = 0;
  std::vector<std::vector<int32_t>> tokens_;
  std::vector<size_t> send_cursor_, reduce_cursor_;
  std::vector<std::vector<uint8_t>> routing_;
  std::vector<Proxied> proxy_;
  std::vector<float> own_;
};

}  // namespace epcomm::engine
