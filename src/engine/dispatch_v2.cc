// engine/dispatch_v2.cc — dispatch_v2 (docs/distribute-v2.md): every sender stages each token once in
// its own segment (quantized there, once per distinct destination row when per-expert scales make copies
// differ), window by window in two alternating halves; every receiver walks each source's windows and copies
// its rows straight to their final offsets, known from the exchanged per-expert counts. When every rank's
// outputs lie in its output arena (one node), the senders instead quantize each token once and write its
// rows straight into the receivers' outputs (push); the windows then carry only the routing, from which the
// receivers fill the rest of their outputs. Then the TP pair all-gathers its rows (own rows first).
#include <algorithm>
#include <cstring>
#include <optional>
#include <utility>

#include "engine/distribute_v2.h"
#include "engine/forward.h"
#include "engine/kernels.h"
#include "engine/pair_exchange.h"
#include "engine/row_copies.h"
#include "engine/staged_sender.h"
#include "engine/window_serve.h"
#include "quant/block.h"

namespace epcomm::engine::v2 {
namespace {

using quant::Smoothing;

// The counts a sender publishes after the params: rows per MoE expert [E], active tokens, payloads per token.
constexpr int kCountActive = 0, kCountPayloads = 1, kCountExtra = 2;

// Bytes of the metadata staged after each token's payloads: K ids, K expert scales, the active flag.
size_t meta_bytes(int K) {
  return static_cast<size_t>(K) * 8 + 4;
}

// Payloads per staged token: one, or one per slot and shared expert when a (S+E, H) table smooths each
// destination row differently (docs/distribute-v2.md `row`).
int payloads_per_token(const DispatchV2Input& in) {
  return in.smooth.kind == SmoothingSource::Kind::table ? in.lay.K + in.lay.S : 1;
}

Smoothing smoothing_for(const DispatchV2Input& in, int row) {
  switch (in.smooth.kind) {
    case SmoothingSource::Kind::none:
      return Smoothing::none();
    case SmoothingSource::Kind::scalar:
      return Smoothing::scalar(in.smooth.data[0]);
    case SmoothingSource::Kind::vector:
      return Smoothing::vector(in.smooth.data);
    case SmoothingSource::Kind::table:
      return Smoothing::vector(in.smooth.data + static_cast<int64_t>(row) * in.fmt.H);
  }
  return Smoothing::none();
}

quant::Fp8Format fp8_of(DType d) {
  return d == DType::f8e5m2 ? quant::Fp8Format::e5m2 : quant::Fp8Format::e4m3;
}

// Writes token t's payload for scale row `row`: data_bytes of data, then scale_bytes of scales
// (docs/distribute-v2.md). `plain`: the window is cache-sized (DispatchGeometry::cache_resident): no
// streaming stores.
void make_payload(const DispatchV2Input& in, int64_t t, int row, uint8_t* dst, std::vector<float>& scratch,
                  bool plain) {
  const RowFormat& f = in.fmt;
  const uint8_t* x = in.x + static_cast<size_t>(t) * in.x_row_bytes;
  const int64_t H = f.H;
  switch (f.quant_mode) {
    case 0:
      copy_row(dst, x, f.data_bytes, true, plain);
      return;
    case 1:
      quant::int8_static(f.x_dtype, x, H, smoothing_for(in, row), reinterpret_cast<int8_t*>(dst));
      return;
    case 2: {
      float scale = 0;
      if (f.out_dtype == DType::i8)
        quant::int8_per_token_a3(f.x_dtype, x, H, smoothing_for(in, row), reinterpret_cast<int8_t*>(dst),
                                 &scale);
      else
        quant::fp8_per_token(fp8_of(f.out_dtype), f.x_dtype, x, H, smoothing_for(in, row), dst, &scale);
      std::memcpy(dst + H, &scale, sizeof(float));
      return;
    }
    case 3: {
      const int64_t groups = ceil_div(H, quant::kGroup128);
      scratch.resize(static_cast<size_t>(groups));
      quant::fp8_per_group128_a3(fp8_of(f.out_dtype), f.x_dtype, x, H, smoothing_for(in, row), dst,
                                 scratch.data());
      std::memcpy(dst + H, scratch.data(), sizeof(float) * groups);
      return;
    }
    case 4: {
      const int64_t blocks = ceil_div(H, quant::kMxBlock);
      quant::mx_quantize(f.out_dtype == DType::f8e5m2 ? quant::MxElem::e5m2 : quant::MxElem::e4m3,
                         quant::ScaleRule::floor, f.x_dtype, x, H, dst, dst + H);
      std::memset(dst + H + blocks, 0, f.scale_bytes - static_cast<size_t>(blocks));  // Align2 padding
      return;
    }
  }
}

// One sender's staging geometry (equal on every rank that reads it: it follows from the sender's header).
// Internode, a remote sender's windows arrive compact in its proxy's lane (engine/forward.h).
struct SenderGeometry {
  size_t payload_stride = 0;
  DispatchGeometry geo{};
  size_t lane_half = 0, net_meta = 0;
  int payloads = 1;
};
SenderGeometry sender_geometry(const OpContext& ctx, const RowFormat& f, int K, int payloads) {
  SenderGeometry g;
  g.payloads = payloads;
  g.payload_stride = align64(std::max<size_t>(f.data_bytes + f.scale_bytes, 1));
  g.geo = window_geometry(ctx, g.payload_stride * payloads, meta_bytes(K), g.lane_half, g.net_meta);
  return g;
}

// One call's EP stage on this rank: the state its phases share. run_dispatch_v2 runs the phases in order,
// each leaving what the next needs. As sender we stage our tokens window by window in two alternating
// halves; as receiver we pull every source's windows into their final rows; internode, as proxy of our rail
// peers, we forward our node's acknowledgements.
struct DispatchV2Call {
  DispatchV2Call(OpContext& c, const DispatchV2Input& i, DispatchV2Output& o)
      : ctx(c),
        in(i),
        out(o),
        lay(i.lay),
        f(i.fmt),
        W(lay.W),
        me(i.me),
        K(lay.K),
        E(lay.E),
        S(lay.S),
        my_payloads(payloads_per_token(i)),
        mine(sender_geometry(c, f, K, my_payloads)),
        per_window(mine.geo.window),
        can_push(!c.internode() && o.expand_x_offset >= 0 && (f.scale_bytes == 0 || o.scales_offset >= 0)),
        seq(c.seq()),
        inter(c.internode()),
        my_area(c.data(me)),
        sender(c),
        copies(i.workers, i.threads, i.fmt.data_bytes, i.fmt.scale_bytes) {}

  // Phases.
  void count_own_rows();
  void set_up_internode();
  void exchange_headers();
  void check_sender_records();
  void plan_receive();
  void move_rows();

  // Sender side.
  void stage(int64_t w);
  void stage_token(int64_t t, uint8_t* half, int64_t t0, std::vector<float>& scratch) const;
  void choose_push();
  std::vector<int64_t> block_starts(int d) const;
  void plan_push();
  void push_rows();
  void push_token(int64_t t, uint8_t* scratch, std::vector<float>& qscratch, bool plain) const;
  void quantize_ahead(bool& progressed);
  bool pushed_by(int s) const {
    return ctx.cell(me, s)->pushed.load(std::memory_order_acquire) >= pack(seq, 1);
  }
  // Receiver side.
  void place(int64_t row, const uint8_t* payload, int32_t src, int32_t t, int32_t slot, float escale);
  void pull(int s, int64_t w);
  // Proxy side: the ranks of our node that pull rows from rail peer s (its counts say so), s's windows.
  bool receives(int s, int d) const;
  int64_t windows_of(int s) const { return ceil_div(tokens_of[s], geos[s].geo.window); }
  // The data loop.
  bool step(bool& progressed);
  bool all_pushed() const;
  std::vector<int> awaited() const;

  OpContext& ctx;
  const DispatchV2Input& in;
  DispatchV2Output& out;
  const Layout& lay;
  const RowFormat& f;
  const int W, me, K, E, S;
  const int my_payloads;
  SenderGeometry mine;  // (push: the windows carry only the routing)
  int64_t per_window;
  // Push: every rank's expand_x (and scale rows) lie in its output arena, on one node: decided once the
  // headers are in, from every rank's kPushRows.
  const bool can_push;
  bool push = false;
  const uint64_t seq;
  Internode* const inter;
  uint8_t* const my_area;  // free for staging: every call ends only once its peers are done with it

  // count_own_rows: rows per MoE expert, active tokens; the receivers of our rows and our windows go to
  // `sender` (staged pull; set_up_internode starts its network half across nodes).
  std::vector<int32_t> per_expert;
  int32_t n_active = 0;
  bool any_dest = false;
  StagedSender sender;
  RowCopies copies;  // the payload rows a pulled window places here (over the copy threads)
  // set_up_internode.
  std::optional<AckForwarder> acks;
  // check_sender_records: every sender's geometry and tokens.
  std::vector<SenderGeometry> geos;
  std::vector<int64_t> tokens_of;
  // plan_receive: this rank's role, the next row of each block el·W + r, rows per source.
  bool shared = false;
  int m = 0;     // MoE rank index
  int sexp = 0;  // shared expert served (shared rank)
  std::vector<int64_t> cursor, rows_from;
  // move_rows: windows to pull per source, pulled so far.
  std::vector<int64_t> nwin, pulled;
  // plan_push: the destinations of our tokens' rows, token by token (token t's are
  // [push_first[t], push_first[t + 1])), and whether the host's pushed rows fit the cache.
  // Each row's data and scales destinations, and the (S+E, H) smoothing table's row of its payload
  // (per-destination payloads).
  std::vector<uint8_t*> push_data, push_scales;
  std::vector<int32_t> push_smooth;
  std::vector<int64_t> push_first;
  bool push_plain = false;
  // A sender that may push quantizes its tokens into `ahead` (one payload per token, `ahead_stride` apart)
  // while it waits for the headers; tokens [0, ahead_done) are ready there.
  uint8_t* ahead = nullptr;
  size_t ahead_stride = 0;
  int64_t ahead_done = 0;
  std::vector<float> ahead_scratch;
};

void DispatchV2Call::count_own_rows() {
  per_expert.assign(E, 0);
  for (int64_t t = 0; t < in.bs; ++t) {
    n_active += in.active[t];
    for (int k = 0; k < K; ++k)
      if (int32_t e = in.ids[t * K + k]; e >= 0) ++per_expert[e];
  }
  std::vector<uint8_t> dest(W, 0);
  for (int e = 0; e < E; ++e)
    if (per_expert[e] > 0) dest[lay.rank_of(e)] = 1;
  if (n_active > 0)
    for (int p = 0; p < lay.Sr; ++p)
      if (lay.shared_serves(p, me)) dest[p] = 1;
  any_dest = std::find(dest.begin(), dest.end(), 1) != dest.end();
  sender.set_windows(any_dest && per_window > 0 ? ceil_div(in.bs, per_window) : 0);
  sender.set_receivers(std::move(dest));
}

// Internode: each other node gets, compact, the active tokens routed to one of its ranks (all active tokens
// when one of its shared-expert ranks serves us); as proxy of our rail peers we forward our node's acks.
void DispatchV2Call::set_up_internode() {
  if (!inter) return;
  const Topology& topo = inter->topo;
  const int M = topo.num_nodes;
  std::vector<uint8_t> shared_node(M, 0);
  if (n_active > 0)
    for (int p = 0; p < lay.Sr; ++p)
      if (lay.shared_serves(p, me)) shared_node[topo.node_of[p]] = 1;
  std::vector<std::vector<int32_t>> node_tokens(M);
  std::vector<uint8_t> needs(M);
  for (int64_t t = 0; t < in.bs; ++t) {
    if (!in.active[t]) continue;
    needs = shared_node;
    for (int k = 0; k < K; ++k)
      if (int32_t e = in.ids[t * K + k]; e >= 0) needs[topo.node_of[lay.rank_of(e)]] = 1;
    for (int n = 0; n < M; ++n)
      if (n != topo.node() && needs[n]) node_tokens[n].push_back(static_cast<int32_t>(t));
  }
  sender.start_network(my_area, mine.geo, mine.lane_half, mine.net_meta, in.bs,
                       static_cast<size_t>(f.data_bytes + f.scale_bytes) * my_payloads,
                       std::move(node_tokens));
  acks.emplace(ctx);
}

// Header: params, counts per expert, active tokens, payloads per token. The first two windows are staged
// while the headers travel.
void DispatchV2Call::exchange_headers() {
  HeaderData& h = ctx.begin_header(OpKind::dispatch_v2);
  h.num_tokens = in.bs;
  h.hidden = f.H;
  h.num_topk = K;
  h.num_experts = E;
  int32_t* c = put_params(ctx, in.params, E + kCountExtra);
  std::copy(per_expert.begin(), per_expert.end(), c);
  c[E + kCountActive] = n_active;
  c[E + kCountPayloads] = my_payloads;
  if (can_push) {  // where senders write our rows, visible with the header
    Control* own = ctx.control(me);
    own->out_offset = out.expand_x_offset;
    own->out_scale_offset = out.scales_offset;
    h.flags |= kPushRows;
  }
  ctx.publish_header();
  // (A rank that may push stages nothing yet: its windows' geometry depends on whether every rank pushes.
  // It quantizes its tokens meanwhile, for the push.)
  while (!can_push && sender.staged() < std::min<int64_t>(sender.windows(), 2))
    sender.stage_next([this](int64_t w) { stage(w); });
  if (can_push && my_payloads == 1 && f.quant_mode != 0 && in.payload_scratch && in.bs > 0) {
    ahead_stride = align64(f.data_bytes + f.scale_bytes);
    std::vector<uint8_t>& buf = *in.payload_scratch;
    buf.resize(std::max(buf.size(), static_cast<size_t>(in.bs) * ahead_stride + kAlign));
    ahead = buf.data() + (kAlign - reinterpret_cast<uintptr_t>(buf.data()) % kAlign) % kAlign;
  }
  if (inter)
    ctx.exchange_headers([this](bool& progressed) { sender.send(progressed); });
  else if (ahead)
    ctx.exchange_headers([this](bool& progressed) { quantize_ahead(progressed); });
  else
    ctx.exchange_headers();
  check_params(ctx, OpKind::dispatch_v2,
               {kParamW, kParamE, kParamT, kParamShard, kParamS, kParamSr, kParamGlobalBs, kParamH, kParamK,
                kParamDtype, kParamQuantMode, kParamOutDtype},
               true);
  choose_push();
}

// Push when every rank can: the windows then carry only the routing (no payloads).
void DispatchV2Call::choose_push() {
  push = can_push;
  for (int r = 0; r < W; ++r) push = push && (ctx.header(r)->flags & kPushRows);
  if (!push) return;
  mine = sender_geometry(ctx, f, K, 0);
  per_window = mine.geo.window;
  sender.set_windows(any_dest && per_window > 0 ? ceil_div(in.bs, per_window) : 0);
}

// Every sender's geometry; a record that does not fit is the same error on every rank.
void DispatchV2Call::check_sender_records() {
  geos.resize(W);
  tokens_of.resize(W);
  for (int s = 0; s < W; ++s) {
    geos[s] = sender_geometry(ctx, f, K, push ? 0 : peer_counts(ctx, s)[E + kCountPayloads]);
    tokens_of[s] = ctx.header(s)->num_tokens;
    const SenderGeometry& g = geos[s];
    if (g.geo.window < 1 && inter &&
        dispatch_geometry(ctx.layout().data_bytes, g.geo.row_stride, meta_bytes(K)).window >= 1)
      EPCOMM_THROW(InvalidUsage, ctx.prefix(),
                   "capacity: num_rdma_bytes = ", inter->lane.bytes * inter->topo.num_nodes, " (one lane of ",
                   inter->lane.bytes, " bytes per node) cannot hold one forwarded token of ep rank ", s, " (",
                   g.geo.row_stride + g.net_meta, " bytes); the minimum is ",
                   min_rdma_bytes_for(ctx, g.geo, g.net_meta),
                   " bytes (GroupContextOptions::num_rdma_bytes)");
    if (g.geo.window < 1)
      EPCOMM_THROW(InvalidUsage, ctx.prefix(), "capacity: the group's segment (", ctx.layout().total,
                   " bytes per rank) cannot hold one staged token of ep rank ", s, " (",
                   g.geo.row_stride + g.geo.meta_stride, " bytes); the minimum is ",
                   control_bytes(W) + dispatch_min_data_bytes(g.geo.row_stride, meta_bytes(K)),
                   " bytes (GroupContextOptions::segment_bytes)");
  }
}

// Receiver d's rows per block b = el·W + s, in block order (docs/distribute-v2.md), then their total.
std::vector<int64_t> DispatchV2Call::block_starts(int d) const {
  const bool sh = lay.is_shared(d);
  const int Lp = lay.local_experts(d), md = d - lay.Sr;
  std::vector<int64_t> block(static_cast<size_t>(W) * Lp + 1, 0);
  for (int s = 0; s < W; ++s) {
    const int32_t* pc = peer_counts(ctx, s);
    if (sh)
      block[s] = lay.shared_serves(d, s) ? pc[E + kCountActive] : 0;
    else
      for (int el = 0; el < Lp; ++el) block[static_cast<size_t>(el) * W + s] = pc[md * lay.L + el];
  }
  int64_t total = 0;  // block sizes -> starts, the total last
  for (int64_t& b : block) total += std::exchange(b, total);
  return block;
}

// The receive plan of this rank: blocks b = el·W + r in order (docs/distribute-v2.md).
void DispatchV2Call::plan_receive() {
  shared = lay.is_shared(me);
  m = me - lay.Sr;
  sexp = shared ? lay.shared_expert_of(me) : 0;
  const std::vector<int64_t> starts = block_starts(me);
  const size_t blocks = starts.size() - 1;
  out.cnt.assign(blocks, 0);
  cursor.assign(starts.begin(), starts.end() - 1);
  rows_from.assign(W, 0);
  for (size_t b = 0; b < blocks; ++b) {
    out.cnt[b] = static_cast<int32_t>(starts[b + 1]);
    rows_from[b % W] += starts[b + 1] - starts[b];
  }
  const int64_t total = starts[blocks];
  out.n_own = total;
  EPCOMM_ASSERT(total <= lay.capacity(me), ctx.prefix(), "rank ", me, " receives ", total,
                " rows, above its capacity A = ", lay.capacity(me));
}

// Data: stage our windows, pull every source's windows into their final rows.
void DispatchV2Call::move_rows() {
  nwin.assign(W, 0);
  pulled.assign(W, 0);
  for (int s = 0; s < W; ++s)
    if (rows_from[s] > 0) nwin[s] = ceil_div(tokens_of[s], geos[s].geo.window);
  if (push) {
    while (sender.staged() < std::min<int64_t>(sender.windows(), 2))  // the routing, read while we push
      sender.stage_next([this](int64_t w) { stage(w); });
    plan_push();
    push_rows();
  }
  ctx.run(
      "dispatch rows", [this](bool& progressed) { return step(progressed); }, [this] { return awaited(); });
}

// Push: where each row of our tokens goes, in the order the receivers' walks place them (token by token;
// per token the shared ranks that serve us, then the slots k).
void DispatchV2Call::plan_push() {
  std::vector<std::vector<int64_t>> next(W);  // receiver d: its next row of each block (el, us)
  std::vector<uint8_t*> data(W), scales(W);
  int64_t host_rows = 0;
  for (int d = 0; d < W; ++d) {
    const std::vector<int64_t> starts = block_starts(d);
    // Never a row past d's outputs (which hold T·A rows; d checks its own total the same way).
    EPCOMM_ASSERT(starts.back() <= lay.capacity(d), ctx.prefix(), "rank ", d, " would receive ",
                  starts.back(), " rows, above its capacity A = ", lay.capacity(d));
    host_rows += starts.back();
    for (int el = 0; el < lay.local_experts(d); ++el)
      next[d].push_back(starts[static_cast<size_t>(el) * W + me]);
    data[d] = ctx.transport().arena(d) + ctx.control(d)->out_offset;
    scales[d] = f.scale_bytes ? ctx.transport().arena(d) + ctx.control(d)->out_scale_offset : nullptr;
  }
  push_plain =
      static_cast<size_t>(host_rows) * (f.data_bytes + f.scale_bytes) <= cache_resident_push_bytes() / 2;
  auto add = [&](int d, int el, int smooth_row) {
    const int64_t row = next[d][el]++;
    push_data.push_back(data[d] + static_cast<size_t>(row) * f.data_bytes);
    push_scales.push_back(scales[d] ? scales[d] + static_cast<size_t>(row) * f.scale_bytes : nullptr);
    push_smooth.push_back(smooth_row);
  };
  const size_t most = static_cast<size_t>(in.bs) * static_cast<size_t>(K + lay.Sr);  // rows, at most
  push_data.reserve(most);
  push_scales.reserve(most);
  push_smooth.reserve(most);
  push_first.assign(static_cast<size_t>(in.bs) + 1, 0);
  for (int64_t t = 0; t < in.bs; ++t) {
    push_first[t] = static_cast<int64_t>(push_data.size());
    if (!in.active[t]) continue;
    for (int p = 0; p < lay.Sr; ++p)
      if (lay.shared_serves(p, me)) add(p, 0, lay.shared_expert_of(p));
    for (int k = 0; k < K; ++k)
      if (const int32_t e = in.ids[t * K + k]; e >= 0) {
        const int d = lay.rank_of(e);
        add(d, e - (d - lay.Sr) * lay.L, S + e);
      }
  }
  push_first[in.bs] = static_cast<int64_t>(push_data.size());
}

// Push: our tokens' rows, split over the call's copy threads by token; then every receiver is told.
void DispatchV2Call::push_rows() {
  const int64_t bytes = static_cast<int64_t>(push_data.size() * (f.data_bytes + f.scale_bytes));
  const size_t room = align64(f.data_bytes + f.scale_bytes) + kAlign;
  for_parts(in.workers, in.threads, bytes, in.bs, [&](int64_t b, int64_t e) {
    std::vector<uint8_t> buf(room);  // one payload, quantized once and copied to each destination
    uint8_t* scratch = buf.data() + (kAlign - reinterpret_cast<uintptr_t>(buf.data()) % kAlign) % kAlign;
    std::vector<float> qscratch;
    for (int64_t t = b; t < e; ++t) push_token(t, scratch, qscratch, push_plain);
    store_fence();  // this thread's streaming stores, before the receivers are told
  });
  for (int d = 0; d < W; ++d)
    if (sender.receives(d)) ctx.signal(ctx.cell(d, me)->pushed, pack(seq, 1), d);
  if (in.counters) {
    int64_t tokens = 0;
    for (int64_t t = 0; t < in.bs; ++t) tokens += push_first[t + 1] > push_first[t];
    in.counters->add(in.counters->dispatch_pushed_tokens, tokens);
  }
}

// While the headers travel: the next few of our tokens quantized into `ahead` (a pass stays short, so that
// arriving headers are seen soon).
void DispatchV2Call::quantize_ahead(bool& progressed) {
  const int64_t begin = ahead_done, end = std::min<int64_t>(in.bs, ahead_done + 8);
  for (; ahead_done < end; ++ahead_done)
    if (in.active[ahead_done])
      make_payload(in, ahead_done, 0, ahead + static_cast<size_t>(ahead_done) * ahead_stride, ahead_scratch,
                   true);
  progressed = progressed || end > begin;  // (none left: the wait may sleep)
}

// Token t's payload, made once (once per copy with a smoothing table), written to each of its rows.
void DispatchV2Call::push_token(int64_t t, uint8_t* scratch, std::vector<float>& qscratch, bool plain) const {
  const int64_t i = push_first[t];
  const int n = static_cast<int>(push_first[t + 1] - i);
  auto put = [&](int64_t j, int count, const uint8_t* src) {
    write_token_rows(push_data.data() + j, push_scales.data() + j, count, src, f.data_bytes,
                     src + f.data_bytes, f.scale_bytes, plain);
  };
  if (n == 0) return;
  if (my_payloads > 1) {  // each copy quantized with its own smoothing row
    for (int64_t j = i; j < i + n; ++j) {
      make_payload(in, t, push_smooth[j], scratch, qscratch, true);
      put(j, 1, scratch);
    }
    return;
  }
  if (f.quant_mode == 0) return put(i, n, in.x + static_cast<size_t>(t) * in.x_row_bytes);
  if (t < ahead_done) return put(i, n, ahead + static_cast<size_t>(t) * ahead_stride);  // quantized already
  make_payload(in, t, 0, scratch, qscratch, true);
  put(i, n, scratch);
}

// Stages window w into its half, its tokens split over the call's copy threads (each token's record is
// written by one thread).
void DispatchV2Call::stage(int64_t w) {
  uint8_t* half = my_area + static_cast<size_t>(w % 2) * mine.geo.half_bytes;
  const int64_t t0 = w * per_window, t1 = std::min(in.bs, t0 + per_window);
  const int64_t bytes = (t1 - t0) * static_cast<int64_t>(in.x_row_bytes) * my_payloads;  // x rows read
  for_parts(in.workers, in.threads, bytes, t1 - t0, [&](int64_t b, int64_t e) {
    std::vector<float> scratch;
    for (int64_t t = t0 + b; t < t0 + e; ++t) stage_token(t, half, t0, scratch);
  });
  if (in.counters && !push)
    in.counters->add(in.counters->dispatch_staged_tokens,
                     std::count(in.active.begin() + t0, in.active.begin() + t1, uint8_t{1}));
}

void DispatchV2Call::stage_token(int64_t t, uint8_t* half, int64_t t0, std::vector<float>& scratch) const {
  uint8_t* rec = half + static_cast<size_t>(t - t0) * mine.geo.row_stride;
  uint8_t* meta = half + static_cast<size_t>(per_window) * mine.geo.row_stride +
                  static_cast<size_t>(t - t0) * mine.geo.meta_stride;
  const int32_t* ids = &in.ids[t * K];
  std::memcpy(meta, ids, sizeof(int32_t) * K);
  if (!in.expert_scales.empty())
    std::memcpy(meta + 4 * K, &in.expert_scales[t * K], sizeof(float) * K);
  else
    std::memset(meta + 4 * K, 0, sizeof(float) * K);
  const uint32_t act = in.active[t];
  std::memcpy(meta + 8 * K, &act, 4);
  if (!act || push) return;  // (push: the routing only)
  if (t < ahead_done)        // quantized while the headers travel, for a push that not every rank could take
    return copy_row(rec, ahead + static_cast<size_t>(t) * ahead_stride, f.data_bytes + f.scale_bytes, true,
                    mine.geo.cache_resident);
  if (my_payloads == 1) return make_payload(in, t, 0, rec, scratch, mine.geo.cache_resident);
  for (int k = 0; k < K; ++k)
    if (ids[k] >= 0)
      make_payload(in, t, S + ids[k], rec + static_cast<size_t>(k) * mine.payload_stride, scratch,
                   mine.geo.cache_resident);
  for (int s = 0; s < S; ++s)
    make_payload(in, t, s, rec + static_cast<size_t>(K + s) * mine.payload_stride, scratch,
                 mine.geo.cache_resident);
}

void DispatchV2Call::place(int64_t row, const uint8_t* payload, int32_t src, int32_t t, int32_t slot,
                           float escale) {
  if (!push)  // (pushed rows are in place already)
    copies.add(out.expand_x + static_cast<size_t>(row) * f.data_bytes,
               f.scale_bytes ? out.dynamic_scales + static_cast<size_t>(row) * f.scale_bytes : nullptr,
               payload);
  out.assist[3 * row] = src;
  out.assist[3 * row + 1] = t;
  out.assist[3 * row + 2] = slot;
  if (out.expand_scales) out.expand_scales[row] = escale;
}

void DispatchV2Call::pull(int s, int64_t w) {
  const SenderGeometry& g = geos[s];
  const StagedWindow win = StagedWindow::of(ctx, s, w, g.geo, g.lane_half, g.net_meta, tokens_of[s]);
  for (int64_t e = 0; e < win.count; ++e) {
    const int64_t t = win.token(e);
    const uint8_t* rec = win.payload(e);
    const uint8_t* meta = win.meta(e);
    uint32_t act;
    std::memcpy(&act, meta + 8 * K, 4);
    if (!act) continue;
    if (shared) {
      const size_t idx = g.payloads > 1 ? static_cast<size_t>(K + sexp) : 0;
      place(cursor[s]++, rec + idx * g.payload_stride, s, static_cast<int32_t>(t), K + sexp, 1.0f);
      continue;
    }
    for (int k = 0; k < K; ++k) {
      int32_t e;
      std::memcpy(&e, meta + 4 * k, 4);
      const int el = e - m * lay.L;
      if (e < 0 || el < 0 || el >= lay.L) continue;
      float es;
      std::memcpy(&es, meta + 4 * K + 4 * k, 4);
      const size_t idx = g.payloads > 1 ? static_cast<size_t>(k) : 0;
      place(cursor[static_cast<size_t>(el) * W + s]++, rec + idx * g.payload_stride, s,
            static_cast<int32_t>(t), k, es);
    }
  }
  copies.flush();  // the window's rows, over the copy threads, before its acknowledgement
}

bool DispatchV2Call::receives(int s, int d) const {
  const int32_t* pc = peer_counts(ctx, s);
  if (lay.is_shared(d)) return lay.shared_serves(d, s) && pc[E + kCountActive] > 0;
  for (int el = 0; el < lay.L; ++el)
    if (pc[(d - lay.Sr) * lay.L + el] > 0) return true;
  return false;
}

bool DispatchV2Call::step(bool& progressed) {
  bool all = sender.step(progressed, [this](int64_t w) { stage(w); });
  if (inter)
    all = acks->step(
              progressed, [this](int s, int d) { return receives(s, d); },
              [this](int s) { return windows_of(s); }) &&
          all;
  const bool pulled_all = serve_published_windows(ctx, me, &Control::stage_ready, &PeerCell::ack, pulled,
                                                  nwin, progressed, [this](int s, int64_t w) { pull(s, w); });
  return all && pulled_all && all_pushed();
}

bool DispatchV2Call::all_pushed() const {
  for (int s = 0; push && s < W; ++s)
    if (rows_from[s] > 0 && !pushed_by(s)) return false;
  return true;
}

std::vector<int> DispatchV2Call::awaited() const {
  std::vector<int> peers;  // sources still to pull, then receivers whose acknowledgements we await
  for (int s = 0; s < W; ++s)
    if (s != me && (pulled[s] < nwin[s] || (push && rows_from[s] > 0 && !pushed_by(s)))) peers.push_back(s);
  if (!sender.done()) sender.add_awaited(peers);
  return peers;
}

}  // namespace

void run_dispatch_v2(OpContext& ctx, const DispatchV2Input& in, DispatchV2Output& out,
                     const std::function<void()>& on_moving) {
  DispatchV2Call call(ctx, in, out);
  call.count_own_rows();
  call.set_up_internode();
  call.exchange_headers();
  call.check_sender_records();
  call.plan_receive();
  on_moving();
  call.move_rows();
}

void run_dispatch_v2_tp(OpContext& tctx, const DispatchV2Input& in, DispatchV2Output& out,
                        const std::function<void()>& on_moving) {
  const RowFormat& f = in.fmt;
  const int W = in.lay.W;
  const int n_blocks = W * in.lay.local_experts(in.me);
  HeaderData& h = tctx.begin_header(OpKind::dispatch_v2);
  h.num_tokens = in.bs;
  int32_t* c = put_params(tctx, in.params, 1 + n_blocks);
  c[0] = static_cast<int32_t>(out.n_own);
  std::copy(out.cnt.begin(), out.cnt.end(), c + 1);
  tctx.publish_header();
  tctx.exchange_headers();
  check_params(tctx, OpKind::dispatch_v2,
               {kParamW, kParamE, kParamT, kParamShard, kParamS, kParamSr, kParamGlobalBs, kParamH, kParamK,
                kParamDtype, kParamQuantMode, kParamOutDtype, kParamEpRank},
               true);
  const int peer = 1 - tctx.rank();
  const int32_t* pc = peer_counts(tctx, peer);
  out.n_peer = pc[0];
  out.peer_cnt.assign(pc + 1, pc + 1 + n_blocks);
  EPCOMM_ASSERT(out.n_own + out.n_peer <= 2 * in.lay.capacity(in.me), tctx.prefix(), "TP rows exceed 2·A");

  const bool escale = out.expand_scales != nullptr;
  const size_t rec = f.data_bytes + f.scale_bytes + (escale ? sizeof(float) : 0);
  on_moving();
  pair_exchange(
      tctx, "tp all-gather", out.n_own, out.n_peer, rec,
      [&](int64_t i, uint8_t* dst) {
        std::memcpy(dst, out.expand_x + static_cast<size_t>(i) * f.data_bytes, f.data_bytes);
        if (f.scale_bytes)
          std::memcpy(dst + f.data_bytes, out.dynamic_scales + static_cast<size_t>(i) * f.scale_bytes,
                      f.scale_bytes);
        if (escale) std::memcpy(dst + f.data_bytes + f.scale_bytes, &out.expand_scales[i], sizeof(float));
      },
      [&](int64_t i, const uint8_t* src) {
        const int64_t row = out.n_own + i;
        std::memcpy(out.expand_x + static_cast<size_t>(row) * f.data_bytes, src, f.data_bytes);
        if (f.scale_bytes)
          std::memcpy(out.dynamic_scales + static_cast<size_t>(row) * f.scale_bytes, src + f.data_bytes,
                      f.scale_bytes);
        if (escale) std::memcpy(&out.expand_scales[row], src + f.data_bytes + f.scale_bytes, sizeof(float));
      });
}

void write_dispatch_counts(const DispatchV2Input& in, DispatchV2Output& out, int tp_world_size, int tp_rank) {
  const int W = in.lay.W;
  const int Lp = in.lay.local_experts(in.me);
  for (size_t b = 0; b < out.cnt.size(); ++b) out.ep_recv_counts[b] = out.cnt[b];
  if (tp_world_size == 2) {
    for (size_t b = 0; b < out.peer_cnt.size(); ++b) out.ep_recv_counts[out.cnt.size() + b] = out.peer_cnt[b];
    out.expert_token_nums[0] = out.n_own + out.n_peer;  // L = 1 with TP (docs/distribute-v2.md)
    out.tp_recv_counts[tp_rank] = static_cast<int32_t>(out.n_own);
    out.tp_recv_counts[1 - tp_rank] = static_cast<int32_t>(out.n_peer);
    return;
  }
  if (tp_world_size == 1) out.tp_recv_counts[0] = static_cast<int32_t>(out.n_own);
  if (in.lay.is_shared(in.me)) {
    out.expert_token_nums[0] = out.n_own;
    return;
  }
  int64_t prev = 0;
  for (int el = 0; el < Lp; ++el) {
    const int64_t end = out.cnt[static_cast<size_t>(el) * W + W - 1];
    out.expert_token_nums[el] = in.expert_token_nums_type == 0 ? end : end - prev;
    prev = end;
  }
}

}  // namespace epcomm::engine::v2
