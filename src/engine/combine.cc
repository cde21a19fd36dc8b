// engine/combine.cc — combine over a Transport: windows over each origin's tokens with one fixed slot per
// (token, slot k) in expert_major or (token, rank d) in rank_major, so that the origin reads every copy of a
// token side by side and reduces in canonical order without staging anything else.
#include "engine/combine.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>

#include "common/env.h"
#include "engine/dispatch.h"
#include "engine/kernels.h"
#include "tensor/output_arena.h"

namespace epcomm::engine {

using Clock = std::chrono::steady_clock;

// Combine window half: a few MiB, well inside the L3 the ranks of a host share (see docs/performance.md).
constexpr size_t kCombineHalfBytes = size_t{4} << 20;

namespace {

// Internode: what a lane's data area holds during a combine (the same W everywhere): the copy window that
// the proxy's node fills for a remote origin, the routing the origin sends for it, and the f32 partials the
// proxy sends back (into the origin's lane for the proxy's node).
struct CombineLane {
  size_t meta_entry = 0, meta_off = 0, partial_stride = 0, partial_off = 0;
  int64_t window = 0;
};
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

// The internode part of a combine (docs/normal-mode.md): as origin, send each window's routing to the proxies
// of the nodes that hold copies, then reduce with their partials; as proxy of our rail peers, open their
// windows to our node, reduce what our node wrote into one f32 partial per token and send it back.
class Hierarchy {
 public:
  // `halves` windows in flight; lane half h starts `h * lane_stride` bytes into the lane's data.
  Hierarchy(OpContext& ctx, const CombineInput& in, const Handle::Impl& hd, const CombineGeometry& geo,
            const CombineLane& cl, int64_t halves, size_t lane_stride, uint8_t* cx, float* cw)
      : ctx_(ctx),
        in_(in),
        hd_(hd),
        geo_(geo),
        cl_(cl),
        halves_(halves),
        lane_stride_(lane_stride),
        cx_(cx),
        cw_(cw),
        inter_(ctx.internode()) {
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
  void send_routing(int64_t w) {
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
  bool serve_as_proxy(bool& progressed) {
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
        progressed = true;
      }
      for (uint64_t t : p.ticket) all = all && (t == 0 || inter_->net->complete(t));
      all = all && p.reduced == p.nwin;
    }
    return all && all_routing_free();
  }

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
  bool holds(int64_t t, int n) const {
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

  void sum_weights(const float* const* gs, int n, float* out) const {
    for (int k = 0; k < K_; ++k) {
      float p = 0.0f;
      for (int j = 0; j < n; ++j) p = p + gs[j][k];
      out[k] = p;
    }
  }

  bool contributors_done(const Proxied& p) const {
    for (int d : p.contributors)
      if (ctx_.cell(p.source, d)->done.load(std::memory_order_acquire) < pack(seq_, p.reduced + 1))
        return false;
    return true;
  }

  // Reduces what our node wrote for window p.reduced of rail peer p.source and sends the partials back.
  void send_partials(Proxied& p, int n) {
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
          rows[c] = slot(k).first;
          wts[c++] = wk;
        }
      } else {
        for (int d : inter_->topo.node_ranks[node_]) {
          if (!m[4 + d]) continue;
          rows[c] = slot(d).first;
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

  OpContext& ctx_;
  const CombineInput& in_;
  const Handle::Impl& hd_;
  CombineGeometry geo_;
  CombineLane cl_;
  int64_t halves_ = 1;
  size_t lane_stride_ = 0;
  uint8_t* cx_;
  float* cw_;
  Internode* inter_;
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

// The chunks an origin's `share_chunks` word (first << 32 | end) leaves unclaimed: [first, end).
struct ChunkRange {
  uint32_t first, end;
  explicit ChunkRange(uint64_t word)
      : first(static_cast<uint32_t>(word >> 32)), end(static_cast<uint32_t>(word)) {}
  uint32_t left() const { return end > first ? end - first : 0; }
};

// Claims one chunk of an origin's `share_chunks`: the origin from the front, helpers from the back. False
// once none is left.
bool claim_chunk(std::atomic<uint64_t>& word, bool front, uint32_t& chunk) {
  uint64_t v = word.load(std::memory_order_acquire);
  while (true) {
    const auto [first, end] = ChunkRange(v);
    if (first >= end) return false;
    const uint64_t next =
        front ? (uint64_t{first + 1} << 32) | end : (uint64_t{first} << 32) | uint64_t{end - 1};
    if (word.compare_exchange_weak(v, next, std::memory_order_acq_rel, std::memory_order_acquire)) {
      chunk = front ? first : end - 1;
      return true;
    }
  }
}

// The count of a word pack(seq, n) written in this call, else 0 (a word of an earlier call).
uint64_t count_of(uint64_t word, uint64_t seq) {
  return word >> 32 == seq ? static_cast<uint32_t>(word) : 0;
}

// Reduces tokens of one origin from its copy table (ShareCopy, `slots` per token), as mapped on the rank
// that runs it: the origin itself, or a helper reducing a chunk of the origin's tokens into its outputs.
struct DirectReduce {
  const ShareCopy* table;
  int slots, K;
  DType dtype;
  int64_t hidden;
  size_t row_bytes;
  const uint8_t* const* xs;  // every holder's x
  const float* const* gs;    // rank_major: every holder's receiving-side weights
  const uint8_t *bias1, *bias2;
  bool weighted;  // expert_major: each copy scaled by its weight
  uint8_t* cx;
  float* cw;  // rank_major: sums of the holders' receiving-side weight rows, or null

  void run(int64_t t0, int64_t t1) const {
    // Token t's copies, gathered one token ahead so that the starts of the next token's rows are fetched
    // while this one is reduced (the kernel prefetches within).
    struct Copies {
      const uint8_t* rows[1024];
      float w[1024];
      const float* g[1024];
      int n = 0;
    } bufs[2];
    auto gather = [&](int64_t t, Copies& c) {
      c.n = 0;
      const ShareCopy* e = table + t * slots;
      for (int i = 0; i < slots && e[i].holder >= 0; ++i, ++c.n) {
        c.rows[c.n] = xs[e[i].holder] + e[i].row * static_cast<int64_t>(row_bytes);
        c.w[c.n] = e[i].weight;
        if (cw) c.g[c.n] = gs[e[i].holder] + static_cast<int64_t>(e[i].row) * K;
      }
    };
    if (t0 < t1) gather(t0, bufs[0]);
    for (int64_t t = t0; t < t1; ++t) {
      const Copies& c = bufs[(t - t0) % 2];
      if (t + 1 < t1) {
        Copies& next = bufs[(t + 1 - t0) % 2];
        gather(t + 1, next);
        prefetch_row_starts(next.rows, next.n, row_bytes, c.rows, c.n);
      }
      reduce_token(dtype, c.rows, weighted ? c.w : nullptr, c.n, hidden,
                   bias1 ? bias1 + t * row_bytes : nullptr, bias2 ? bias2 + t * row_bytes : nullptr,
                   cx + t * row_bytes);
      if (cw)
        for (int k = 0; k < K; ++k) {
          float p = 0.0f;
          for (int i = 0; i < c.n; ++i) p = p + c.g[i][k];
          cw[t * K + k] = 0.0f + p;
        }
    }
  }
};

// Reduces this rank's tokens with `own` over the call's copy threads: chunks claimed from the front of
// `shared` (peers done with their own tokens claim from its back), or contiguous parts when nothing is
// shared (null). Returns the tokens reduced here; `bytes` (the rows read) sizes the thread count.
int64_t reduce_own_tokens(const DirectReduce& own, const CombineInput& in, std::atomic<uint64_t>* shared,
                          int64_t T, int64_t bytes) {
  std::atomic<int64_t> reduced{0};
  auto part = [&](int i, int n) {
    int64_t count = 0;
    if (shared) {
      uint32_t c;
      while (claim_chunk(*shared, true, c)) {
        const int64_t t0 = int64_t{c} * kShareChunkTokens, t1 = std::min(T, t0 + kShareChunkTokens);
        own.run(t0, t1);
        count += t1 - t0;
      }
    } else {
      int64_t t0, t1;
      part_range(T, i, n, t0, t1);
      own.run(t0, t1);
      count = t1 - t0;
    }
    reduced.fetch_add(count, std::memory_order_relaxed);
    if (n > 1) store_fence();  // this thread's streaming stores, before they are published
  };
  const int threads = threads_for_bytes(in.threads, bytes);
  if (in.workers && threads > 1)
    in.workers->run(threads, part);
  else
    part(0, 1);
  return reduced.load();
}

// Direct combine (every header says kReadRowsInPlace): each origin reads every copy of its tokens straight
// from its holder's x, at the rows the dispatch wrote them to (handle send_rows), and reduces them in the
// same canonical order as the windows would. No windows: the headers are the only synchronisation before,
// and `combine_open` = pack(seq, 1) (closed) tells a holder that an origin is done with its rows.
//
// Shared reduction: an origin whose outputs lie in its output arena publishes its copy table, and a rank
// done with its own tokens reduces chunks of the origin's last ones (docs/design.md, "Combine"), so that the
// call takes about the mean of the ranks' times rather than the slowest one's. A token's result does not
// depend on which rank reduced it (same kernel, same order).
void run_direct(OpContext& ctx, const CombineInput& in, CombineOutput& out) {
  const int R = ctx.size(), me = ctx.rank();
  const Handle::Impl& hd = *in.handle;
  const bool expert = hd.order == ReceiveOrder::expert_major;
  const int K = hd.num_topk;
  const int64_t T = hd.num_tokens;
  const uint64_t seq = ctx.seq();
  const size_t row_bytes = static_cast<size_t>(in.hidden) * dtype_size(in.dtype);
  std::vector<const uint8_t*> xs(R, nullptr);
  std::vector<const float*> gs(R, nullptr);  // rank_major: the holders' receiving-side weights
  for (int p = 0; p < R; ++p) {
    xs[p] = p == me ? in.x : ctx.shared_input(p);
    const int64_t g = ctx.header(p)->weights_offset;
    gs[p] = p == me  ? in.recv_weights
            : g >= 0 ? reinterpret_cast<const float*>(ctx.transport().arena(p) + g)
                     : nullptr;
  }
  const int32_t* at = hd.send_rows.data();
  const int slots = hd.copy_slots();
  uint8_t* cx = out.combined_x.data_as<uint8_t>();
  // rank_major: combined_topk_weights (returned with receiving-side weights) sums the holders' rows of them.
  float* cw = out.combined_topk_weights ? out.combined_topk_weights->data_as<float>() : nullptr;
  const bool sum_g = !expert && cw;

  // Offer our tokens to helpers when they may write our outputs (both in our output arena), there are no
  // biases (private tensors), and the table fits in our data area (unused by a direct combine).
  const std::shared_ptr<OutputArena> arena = ctx.transport().output_arena();
  const int64_t cx_off = arena ? arena->offset_of(cx, out.combined_x.nbytes()) : -1;
  const int64_t cw_off = sum_g && arena ? arena->offset_of(cw, sizeof(float) * T * K) : -1;
  const size_t table_bytes = sizeof(ShareCopy) * static_cast<size_t>(T) * slots;
  // auto: also when the ranks outnumber the cores, up to two per core. The scheduler shares the cores by
  // time, not by progress: a core can idle while two unfinished ranks take turns on the other. Beyond two
  // per core, a helper descheduled in the middle of a chunk holds its origin up for longer than sharing
  // gains (docs/performance.md, "Shared reduction when oversubscribed"). All R ranks are on this host
  // (direct: one node).
  const int sharing = env::combine_sharing();
  const bool share = R > 1 && (sharing < 0 ? !env::ranks_outnumber_cores(R, 2) : sharing == 1);
  // The table goes in our data area (unused by a direct combine) whenever it fits, offered or not: no
  // allocation per call.
  const bool table_fits = table_bytes <= ctx.layout().data_bytes;
  const bool offer = share && table_fits && T >= 2 * kShareChunkTokens && !in.bias1 && !in.bias2 &&
                     cx_off >= 0 && (!sum_g || cw_off >= 0);
  std::vector<ShareCopy> private_table;
  if (!table_fits) private_table.resize(static_cast<size_t>(T) * slots);
  ShareCopy* table = table_fits ? reinterpret_cast<ShareCopy*>(ctx.data(me)) : private_table.data();
  for (int64_t t = 0; t < T; ++t) {
    ShareCopy* e = table + t * slots;
    int n = 0;
    hd.for_each_copy(t, [&](int slot, int holder) {
      e[n++] = {holder, at[t * slots + slot], expert ? in.weights_used[t * K + slot] : 0.0f};
    });
    if (n < slots) e[n].holder = -1;
  }
  Control* mine = ctx.control(me);
  if (offer) {
    mine->share_out_offset = cx_off;
    mine->share_weights_offset = cw_off;
    mine->share_chunks.store((T + kShareChunkTokens - 1) / kShareChunkTokens, std::memory_order_relaxed);
    mine->share_ready.store(pack(seq, 1), std::memory_order_release);
    for (int p = 0; p < R; ++p)
      if (p != me) ctx.notify(p);  // a peer already done with its own tokens may start on ours
  }

  const DirectReduce own{table,     slots,    K,        in.dtype, in.hidden, row_bytes,           xs.data(),
                         gs.data(), in.bias1, in.bias2, expert,   cx,        sum_g ? cw : nullptr};
  // Our tokens we reduced ourselves, over the call's copy threads.
  const int64_t reduced = reduce_own_tokens(own, in, offer ? &mine->share_chunks : nullptr, T,
                                            T * slots * static_cast<int64_t>(row_bytes));
  if (expert && cw && T * K > 0) std::memcpy(cw, in.weights_used.data(), sizeof(float) * T * K);

  // Helping: one chunk of the origin with the most chunks left (the slowest, on a host with many ranks). Its
  // outputs are in its output arena, as mapped here; its results are ours to publish (share_done) before it
  // may close.
  std::vector<int64_t> claimed(R, 0), done(R, 0);
  int64_t helped = 0;
  auto help_one = [&] {
    if (!share) return false;
    while (true) {
      int o = -1;
      uint32_t most = 0;
      for (int p = 0; p < R; ++p) {
        if (p == me || ctx.control(p)->share_ready.load(std::memory_order_acquire) != pack(seq, 1)) continue;
        const uint32_t left = ChunkRange(ctx.control(p)->share_chunks.load(std::memory_order_relaxed)).left();
        if (left > most) {
          most = left;
          o = p;
        }
      }
      if (o < 0) return false;
      Control* oc = ctx.control(o);
      uint32_t c;
      if (!claim_chunk(oc->share_chunks, false, c)) continue;  // taken meanwhile: look again
      PeerCell* cell = ctx.cell(o, me);
      const int64_t To = ctx.header(o)->num_tokens;
      const int64_t t0 = int64_t{c} * kShareChunkTokens, t1 = std::min(To, t0 + kShareChunkTokens);
      claimed[o] += t1 - t0;
      cell->share_claimed.store(pack(seq, claimed[o]), std::memory_order_release);
      uint8_t* base = ctx.transport().arena(o);
      const int64_t wo = oc->share_weights_offset;
      DirectReduce theirs = own;  // the same call's geometry and holders, the origin's table and outputs
      theirs.table = reinterpret_cast<const ShareCopy*>(ctx.data(o));
      theirs.bias1 = theirs.bias2 = nullptr;  // an origin with biases does not offer
      theirs.cx = base + oc->share_out_offset;
      theirs.cw = wo >= 0 ? reinterpret_cast<float*>(base + wo) : nullptr;
      theirs.run(t0, t1);
      done[o] += t1 - t0;
      helped += t1 - t0;
      cell->share_done.store(pack(seq, done[o]), std::memory_order_release);
      ctx.notify(o);
      return true;
    }
  };
  // Our tokens helpers have reduced so far (all of the rest once it equals T - reduced).
  auto reduced_by_helpers = [&] {
    int64_t n = 0;
    for (int p = 0; p < R; ++p)
      if (p != me) n += count_of(ctx.cell(me, p)->share_done.load(std::memory_order_acquire), seq);
    return n;
  };

  // Closed: the holders we read from may return (and reuse their x) once every origin they serve is.
  bool closed = false;
  auto close = [&] {
    mine->combine_open.store(pack(seq, 1), std::memory_order_seq_cst);
    for (int p = 0; p < R; ++p)
      if (hd.tokens_per_rank[p] > 0 && p != me) ctx.notify(p);
    closed = true;
  };
  auto open_origins = [&] {
    std::vector<int> peers;
    for (int s = 0; s < R; ++s)
      if (s != me && hd.rows_per_source[s] > 0 &&
          ctx.control(s)->combine_open.load(std::memory_order_acquire) < pack(seq, 1))
        peers.push_back(s);
    return peers;
  };
  ctx.run(
      "data",
      [&](bool& progressed) {
        if (!closed && reduced_by_helpers() == T - reduced) {
          close();
          progressed = true;
        }
        if (help_one()) {
          progressed = true;
          return false;
        }
        return closed && open_origins().empty();
      },
      [&] {
        std::vector<int> peers = open_origins();
        for (int p = 0; p < R; ++p)  // helpers still reducing tokens of ours
          if (p != me && count_of(ctx.cell(me, p)->share_claimed.load(), seq) !=
                             count_of(ctx.cell(me, p)->share_done.load(), seq))
            peers.push_back(p);
        return peers;
      });
  if (in.counters) {
    int64_t lent = 0;
    for (int s = 0; s < R; ++s) lent += s == me ? 0 : hd.rows_per_source[s];
    in.counters->add(in.counters->combine_in_place_rows, lent);
    in.counters->add(in.counters->combine_direct_tokens, T);
    in.counters->add(in.counters->combine_shared_tokens, helped);
  }
}

}  // namespace

void run_combine(OpContext& ctx, const CombineInput& in, CombineOutput& out,
                 const std::function<void()>& on_shapes) {
  const int R = ctx.size(), me = ctx.rank();
  const Handle::Impl& hd = *in.handle;
  const bool expert = hd.order == ReceiveOrder::expert_major;
  const int K = hd.num_topk;
  const int64_t T = hd.num_tokens, Hc = in.hidden;
  const size_t elem = dtype_size(in.dtype);
  const auto t_start = Clock::now();

  HeaderData& h = ctx.begin_header(OpKind::combine);
  h.order = static_cast<uint32_t>(hd.order);
  h.flags = (hd.has_topk ? kHasTopk : 0) | (in.has_recv_weights ? kHasWeights : 0);
  h.num_experts = hd.num_experts;
  h.num_topk = K;
  h.dtype = static_cast<int32_t>(in.dtype);
  h.quant_mode = -1;
  h.hidden = Hc;
  h.row_bytes = static_cast<int64_t>(Hc * elem);
  h.num_tokens = T;
  h.expert_alignment = hd.expert_alignment;
  h.handle_id = hd.seq;
  std::copy(std::begin(in.chunks), std::end(in.chunks), h.chunks);
  Internode* inter = ctx.internode();
  h.input_offset = inter ? -1 : in.shared_offset;  // across nodes copies always travel
  if (!inter && in.shared_offset >= 0 && in.shared_in_arena) h.flags |= kInputInArena;
  // A rank without rows has nothing to lend, wherever its (empty) x and weights lie.
  const bool no_rows = hd.num_rows == 0;
  if (!inter && hd.pushed && !in.cost_stats && (in.shared_offset >= 0 || no_rows) &&
      (expert || !in.has_recv_weights || in.recv_weights_offset >= 0 || no_rows))
    h.flags |= kReadRowsInPlace;
  h.weights_offset = in.recv_weights_offset;
  const int M = inter ? inter->topo.num_nodes : 1;
  if (inter) {  // proxies learn which ranks of their node hold copies of our tokens
    h.num_counts = hd.num_experts + R;
    int32_t* c = ctx.counts(me);
    std::fill(c, c + hd.num_experts, 0);
    std::copy(hd.tokens_per_rank.begin(), hd.tokens_per_rank.end(), c + hd.num_experts);
  }
  ctx.publish_header();
  ctx.exchange_headers();
  check_headers_match(ctx);
  const auto t_headers = Clock::now();

  const int slots = expert ? K : R;
  const size_t row_bytes = static_cast<size_t>(Hc) * elem;
  const size_t wbytes = in.has_recv_weights ? sizeof(float) * K : 0;
  // Two halves when a window fits in half the area: contributors fill window w + 1 while the origin reduces
  // w. A half is capped at kCombineHalfBytes so that the copies a contributor writes are still in the
  // shared cache when the origin reads them (a 32 MiB half went to DRAM and back: two extra touches).
  size_t half = std::min(kCombineHalfBytes, ctx.layout().data_bytes / 2 / kAlign * kAlign);
  if (combine_geometry(half, row_bytes, slots, wbytes).window < 1)
    half = ctx.layout().data_bytes / 2 / kAlign * kAlign;  // one token's slots exceed the cap
  // Internode routing entry: token index, then K expert ids and K weights (expert_major) or R destination
  // flags (rank_major). Partial: H' f32, then K f32 of reduced receiving-side weights (rank_major).
  const size_t meta_entry =
      expert ? 4 + 8 * static_cast<size_t>(K) : (4 + static_cast<size_t>(R) + 3) / 4 * 4;
  const size_t partial_bytes =
      4 * static_cast<size_t>(Hc) + (!expert && wbytes ? 4 * static_cast<size_t>(K) : 0);
  bool two = combine_geometry(half, row_bytes, slots, wbytes).window >= 1;
  // Internode the lanes' data is split the same way (copy window, routing and partials per half), so that
  // window w + 1 is filled, and its partials travel, while w is reduced; one half when that does not fit.
  size_t lane_stride = 0;
  if (inter && two) {
    lane_stride = inter->lane.data_bytes / 2 / kAlign * kAlign;
    const CombineGeometry g2 = combine_geometry(half, row_bytes, slots, wbytes);
    if (combine_lane(lane_stride, g2, g2.window, meta_entry, partial_bytes).window < 1) {
      two = false;
      lane_stride = 0;
    }
  }
  const int64_t halves = two ? 2 : 1;
  const size_t area_bytes = two ? half : ctx.layout().data_bytes;
  CombineGeometry geo = combine_geometry(area_bytes, row_bytes, slots, wbytes);
  CombineLane cl;
  if (inter) {
    const size_t lane_room = two ? lane_stride : inter->lane.data_bytes;
    cl = combine_lane(lane_room, geo, geo.window, meta_entry, partial_bytes);
    if (geo.window >= 1 && cl.window < 1)
      EPCOMM_THROW(InvalidUsage, ctx.prefix(), "capacity: num_rdma_bytes = ", inter->lane.bytes * M,
                   " (one lane of ", inter->lane.bytes,
                   " bytes per node) cannot hold the copies of one token (", slots, " x ", row_bytes,
                   " bytes) with its routing and f32 partial; the minimum for this call is ",
                   M * (lane_overhead_bytes(inter->topo.ranks_per_node, R) +
                        combine_min_data_bytes(row_bytes, slots, wbytes) + 3 * kAlign + meta_entry +
                        align64(partial_bytes)));
    geo.window = std::min(geo.window, cl.window);
    cl = combine_lane(lane_room, geo, geo.window, meta_entry, partial_bytes);
  }
  if (geo.window < 1)
    EPCOMM_THROW(InvalidUsage, ctx.prefix(), "capacity: num_nvl_bytes = ", ctx.layout().total,
                 " cannot hold the ", slots, " copies of one token (", row_bytes,
                 " bytes each); the minimum for this call is ",
                 control_bytes(R) + combine_min_data_bytes(row_bytes, slots, wbytes));

  // The caller allocated the outputs (their shapes are known locally); only the debug poison happens here.
  if (in.poison) {
    if (out.combined_x.nbytes()) std::memset(out.combined_x.data(), 0xFF, out.combined_x.nbytes());
    if (out.combined_topk_weights && out.combined_topk_weights->nbytes())
      std::memset(out.combined_topk_weights->data(), 0xFF, out.combined_topk_weights->nbytes());
  }
  on_shapes();
  bool direct = true;
  for (int r = 0; r < R; ++r) direct = direct && (ctx.header(r)->flags & kReadRowsInPlace);
  if (direct) return run_direct(ctx, in, out);

  const int64_t W = geo.window;
  std::vector<int64_t> nwin(R), filled(R, 0), done_us(R, -1);
  for (int s = 0; s < R; ++s) {
    int64_t Ts = ctx.header(s)->num_tokens;
    nwin[s] = hd.rows_per_source[s] > 0 ? (Ts + W - 1) / W : 0;
    if (nwin[s] == 0)
      done_us[s] = std::chrono::duration_cast<std::chrono::microseconds>(t_headers - t_start).count();
  }
  const int64_t my_nwin = (T + W - 1) / W;
  const uint64_t seq = ctx.seq();
  const int32_t* src_tok = hd.recv_src_token.data_as<int32_t>();
  const int32_t* src_slot = hd.recv_src_slot.data_as<int32_t>();
  std::vector<int64_t> pos(hd.source_offsets.begin(), hd.source_offsets.end() - 1);
  uint8_t* my_area = ctx.data(me);
  // Holders whose expert outputs lie in their shared combine-input area: their slots in our windows hold the
  // row index (int64) instead of the row, and we read the row in place. Such a holder may return only once
  // every origin it serves has reduced its last window (`combine_open` = pack(seq, windows + 1): closed).
  std::vector<const uint8_t*> shared_x(R, nullptr);
  for (int p = 0; p < R; ++p) shared_x[p] = ctx.shared_input(p);
  const bool by_index = shared_x[me] != nullptr;
  const int L = hd.num_local;
  // The rank holding the copy in `slot` of token t: the owner of expert k's id, or rank `slot`.
  auto holder_of = [&](int64_t t, int slot) { return expert ? hd.topk_ids[t * K + slot] / L : slot; };
  // Own contributions, per half and slot: pointers into x (and the receiving-side weights) instead of copies.
  const int64_t WL = std::max<int64_t>(1, std::min(W, T));  // a window never holds more than T tokens
  std::vector<const uint8_t*> local_rows(static_cast<size_t>(halves) * WL * slots, nullptr);
  std::vector<const float*> local_weights(static_cast<size_t>(halves) * WL * slots, nullptr);
  const size_t weights_off = static_cast<size_t>(W) * slots * geo.row_stride;

  // Contributor: write the copies of origin s's tokens in window w into s's slots.
  auto fill = [&](int s, int64_t w) {
    // A remote origin's window is the copy window in its proxy's lane (here), in the same half.
    uint8_t* area =
        ctx.data(s) + static_cast<size_t>(w % halves) * (ctx.remote(s) ? lane_stride : area_bytes);
    const int64_t t0 = w * W, t1 = t0 + W;
    const int64_t end = hd.source_offsets[s + 1];
    const int64_t first = pos[s];
    while (pos[s] < end) {
      const int32_t row = hd.source_rows[pos[s]];
      const int64_t t = src_tok[row];
      if (t >= t1) break;
      const int slot = expert ? src_slot[row] : me;
      const size_t idx = static_cast<size_t>(t - t0) * slots + slot;
      if (s == me) {  // own copies are read in place by the reduction: no copy
        const size_t l = static_cast<size_t>(w % halves) * WL * slots + idx;
        local_rows[l] = in.x + row * row_bytes;
        if (wbytes) local_weights[l] = in.recv_weights + row * K;
      } else if (by_index) {  // the origin reads row `row` of our shared x
        const int64_t r64 = row;
        std::memcpy(area + idx * geo.row_stride, &r64, sizeof(r64));
        if (wbytes)
          std::memcpy(area + weights_off + idx * geo.weight_stride, in.recv_weights + row * K, wbytes);
      } else {
        // Plain stores: the origin reads this copy within the next window or two, from the cache.
        std::memcpy(area + idx * geo.row_stride, in.x + row * row_bytes, row_bytes);
        if (wbytes)
          std::memcpy(area + weights_off + idx * geo.weight_stride, in.recv_weights + row * K, wbytes);
      }
      ++pos[s];
    }
    if (in.counters && s != me)
      in.counters->add(by_index ? in.counters->combine_in_place_rows : in.counters->combine_copied_rows,
                       pos[s] - first);
  };

  // Origin: reduce window w into combined_x.
  const uint8_t* rows_ptr[1024];
  float wts[1024];
  const uint8_t* next_ptr[1024];
  float next_wts[1024];
  uint8_t* cx = out.combined_x.data_as<uint8_t>();
  float* cw = out.combined_topk_weights ? out.combined_topk_weights->data_as<float>() : nullptr;
  // The copy of slot `slot` of token t in window w: our own expert output in place, or a peer's in the
  // window; with its receiving-side weights (rank_major).
  auto reduce_copy_of = [&](int64_t w, int64_t t, int slot) -> std::pair<const uint8_t*, const float*> {
    const uint8_t* win = my_area + static_cast<size_t>(w % halves) * area_bytes;
    const size_t idx = static_cast<size_t>(t - w * W) * slots + slot;
    const size_t l = static_cast<size_t>(w % halves) * WL * slots + idx;
    const uint8_t* row = local_rows[l] ? local_rows[l] : win + idx * geo.row_stride;
    const float* g = local_weights[l]
                         ? local_weights[l]
                         : reinterpret_cast<const float*>(win + weights_off + idx * geo.weight_stride);
    return {row, g};
  };
  auto reduce = [&](int64_t w) {
    const int64_t t0 = w * W, t1 = std::min(T, t0 + W);
    const uint8_t* win = my_area + static_cast<size_t>(w % halves) * area_bytes;
    const uint8_t** lrow = local_rows.data() + static_cast<size_t>(w % halves) * WL * slots;
    const float** lw = local_weights.data() + static_cast<size_t>(w % halves) * WL * slots;
    auto copy_of = [&](int64_t t, int slot) -> const uint8_t* {
      const size_t idx = static_cast<size_t>(t - t0) * slots + slot;
      if (lrow[idx]) return lrow[idx];
      const uint8_t* in_window = win + idx * geo.row_stride;
      if (const uint8_t* sx = shared_x[holder_of(t, slot)]) {
        int64_t row;
        std::memcpy(&row, in_window, sizeof(row));
        return sx + row * static_cast<int64_t>(row_bytes);
      }
      return in_window;
    };
    // The contributions of token t in canonical order (slot k ascending, or rank d ascending).
    auto gather = [&](int64_t t, const uint8_t** ptrs, float* ws) {
      int n = 0;
      hd.for_each_copy(t, [&](int slot, int) {
        ptrs[n] = copy_of(t, slot);
        if (expert) ws[n] = in.weights_used[t * K + slot];
        ++n;
      });
      return n;
    };
    for (int64_t t = t0; t < t1; ++t) {
      const int n = gather(t, rows_ptr, wts);
      // The kernel prefetches ahead within a row; the starts of the next token's rows are fetched here.
      if (t + 1 < t1) prefetch_row_starts(next_ptr, gather(t + 1, next_ptr, next_wts), row_bytes);
      reduce_token(in.dtype, rows_ptr, expert ? wts : nullptr, n, Hc,
                   in.bias1 ? in.bias1 + t * row_bytes : nullptr,
                   in.bias2 ? in.bias2 + t * row_bytes : nullptr, cx + t * row_bytes);
      if (!expert && cw) {
        const size_t first = static_cast<size_t>(t - t0) * slots;
        for (int k = 0; k < K; ++k) {
          float p = 0.0f;
          for (int d = 0; d < R; ++d) {
            if (!hd.in_rank[t * R + d]) continue;
            const float* g =
                lw[first + d]
                    ? lw[first + d]
                    : reinterpret_cast<const float*>(win + weights_off + (first + d) * geo.weight_stride);
            p = p + g[k];
          }
          cw[t * K + k] = 0.0f + p;
        }
      }
    }
    std::fill(lrow, lrow + static_cast<size_t>(WL) * slots,
              nullptr);  // the next window in this half starts empty
    std::fill(lw, lw + static_cast<size_t>(WL) * slots, nullptr);
  };

  int64_t reduced = 0, opened = 0;
  Hierarchy hier(ctx, in, hd, geo, cl, halves, lane_stride, cx, cw);
  auto contributors_done = [&](int64_t w) {
    for (int p = 0; p < R; ++p)
      if (hd.tokens_per_rank[p] > 0 &&
          ctx.cell(me, p)->done.load(std::memory_order_acquire) < pack(seq, w + 1))
        return false;
    return true;
  };
  ctx.run(
      "data",
      [&](bool& progressed) {
        if (opened < my_nwin && opened < reduced + halves && (!inter || hier.routing_free(opened))) {
          if (inter) hier.send_routing(opened);
          ++opened;
          ctx.control(me)->combine_open.store(pack(seq, opened), std::memory_order_seq_cst);
          for (int p = 0; p < R; ++p)
            if (hd.tokens_per_rank[p] > 0 && p != me && !ctx.remote(p)) ctx.notify(p);
          progressed = true;
        }
        bool all = true;
        for (int s : ctx.arrival_order()) {
          while (filled[s] < nwin[s] &&
                 ctx.control(s)->combine_open.load(std::memory_order_acquire) >= pack(seq, filled[s] + 1)) {
            fill(s, filled[s]);
            ++filled[s];
            ctx.signal(ctx.cell(s, me)->done, pack(seq, filled[s]), s);
            progressed = true;
            if (filled[s] == nwin[s])
              done_us[s] =
                  std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t_start).count();
          }
          all = all && filled[s] == nwin[s];
        }
        if (reduced < opened && contributors_done(reduced)) {
          if (inter) {
            hier.reduce(reduced, [&](int64_t t, int slot) { return reduce_copy_of(reduced, t, slot); });
            // The next window in this half starts empty.
            const size_t first = static_cast<size_t>(reduced % halves) * WL * slots;
            std::fill(local_rows.begin() + first, local_rows.begin() + first + WL * slots, nullptr);
            std::fill(local_weights.begin() + first, local_weights.begin() + first + WL * slots, nullptr);
          } else
            reduce(reduced);
          ++reduced;
          if (reduced == my_nwin) {  // closed: holders that lent us their shared rows may return
            ctx.control(me)->combine_open.store(pack(seq, my_nwin + 1), std::memory_order_seq_cst);
            if (by_index || std::any_of(shared_x.begin(), shared_x.end(), [](const uint8_t* q) { return q; }))
              for (int p = 0; p < R; ++p)
                if (hd.tokens_per_rank[p] > 0 && p != me) ctx.notify(p);
          }
          progressed = true;
        }
        // Lending our shared rows: done once every origin we serve has closed its windows.
        if (by_index)
          for (int s = 0; s < R; ++s)
            if (s != me && nwin[s] > 0 &&
                ctx.control(s)->combine_open.load(std::memory_order_acquire) < pack(seq, nwin[s] + 1))
              all = false;
        if (inter) all = hier.serve_as_proxy(progressed) && all;
        return all && reduced == my_nwin;
      },
      [&] {
        std::vector<int> peers;
        for (int s = 0; s < R; ++s)
          if (filled[s] < nwin[s] && s != me) peers.push_back(s);
        if (by_index)  // origins still reading our shared rows
          for (int s = 0; s < R; ++s)
            if (s != me && nwin[s] > 0 &&
                ctx.control(s)->combine_open.load(std::memory_order_acquire) < pack(seq, nwin[s] + 1) &&
                std::find(peers.begin(), peers.end(), s) == peers.end())
              peers.push_back(s);
        if (reduced < opened)
          for (int p = 0; p < R; ++p)
            if (hd.tokens_per_rank[p] > 0 && p != me &&
                ctx.cell(me, p)->done.load() < pack(seq, reduced + 1) &&
                std::find(peers.begin(), peers.end(), p) == peers.end())
              peers.push_back(p);
        return peers;
      });

  if (expert && T * K > 0) std::memcpy(cw, in.weights_used.data(), sizeof(float) * T * K);  // cw: null at 0
  if (in.cost_stats) add_cost_stats(*in.cost_stats, done_us);
}

}  // namespace epcomm::engine
