// engine/combine_v2.cc — combine_v2 and combine_add_rms_norm (docs/distribute-v2.md). The TP pair
// first reduces its rows; then each origin opens a window over its own tokens with one fixed slot per (token,
// slot ∈ [0, K+S)), every rank writes its rows (int8-compressed with comm_quant_mode 2) into the origins'
// slots and stamps each slot, and the origin checks the stamps against its own mask and ids and reduces in
// the fixed order (MoE slots by k, shared experts by s, shared_expert_x) with one rounding. The rows an
// origin returns to itself are read in place from its x (uncompressed: with comm_quant_mode 2 they take the
// slots like every other row). When every rank's x lies in its output arena (one node, comm_quant_mode 0),
// the contributors write only row indices into the slots and the origins read every row in place; each
// origin then tells its contributors when it is done reading, and a contributor returns only after that.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <optional>
#include <string>

#include "engine/distribute_v2.h"
#include "engine/distribute_v2_kernels.h"
#include "engine/kernels.h"
#include "engine/pair_exchange.h"
#include "engine/window_serve.h"
#include "quant/block.h"

namespace epcomm::engine::v2 {
namespace {

// Cap of one origin's window (its rows and stamps): a few windows of the host's ranks stay well inside the
// cache they share (engine/kernels.h, cache_resident_push_bytes). 1 and 4 MiB measured alike at the decode
// shape, 8 MiB and the whole area 2x slower (docs/performance.md).
constexpr size_t kWindowBytes = size_t{1} << 20;

// Counts after the params: rows per origin [W], 1 + largest token index per origin [W], rows we expect.
int count_origin(int /*W*/, int o) {
  return o;
}
int count_max_token(int W, int o) {
  return W + o;
}
int count_expected(int W) {
  return 2 * W;
}

size_t wire_bytes(const CombineV2Input& in) {
  const size_t H = static_cast<size_t>(in.H);
  return in.comm_quant == 2 ? H + 2 * static_cast<size_t>(ceil_div(in.H, quant::kCombineGroup)) : 2 * H;
}

// A slot's stamp: the call, the window and the writer, so that the origin can tell arrivals of this window
// from stale bytes and name the sender.
uint64_t stamp(uint64_t seq, int64_t w, int writer) {
  return ((seq & 0xFFFFFFFFull) << 32) | (static_cast<uint64_t>(w + 1) << 11) |
         static_cast<uint64_t>(writer + 1);
}
bool stamp_is(uint64_t v, uint64_t seq, int64_t w) {
  return (v >> 11) == (stamp(seq, w, 0) >> 11);
}
int stamp_writer(uint64_t v) {
  return static_cast<int>(v & 0x7FF) - 1;
}

// Across nodes, a proxy sends an origin the rows its node wrote into a window, compact: a 64-byte-aligned
// block with the entry count and an (index in the window, writer) pair per entry, then the rows.
size_t compact_head(int64_t entries) {
  return align64(8 + 8 * static_cast<size_t>(entries));
}
size_t compact_bytes(int64_t entries, size_t row_stride) {
  return compact_head(entries) + static_cast<size_t>(entries) * row_stride;
}

// The origin's reduction of one token: its accumulator and norm scratch, decoded rows (comm_quant_mode 2)
// and the rows in reduction order with their weights. One per copy thread.
struct TokenScratch {
  std::vector<float> acc, scratch;
  std::vector<uint8_t> decoded;
  std::vector<const uint8_t*> row_ptrs;
  std::vector<float> weights;
  std::vector<uint8_t> weighted;
  TokenScratch(int64_t H, int slots, size_t row_bytes, bool decode)
      : acc(static_cast<size_t>(H)),
        scratch(static_cast<size_t>(H)),
        decoded(decode ? static_cast<size_t>(slots) * row_bytes : 0),
        row_ptrs(slots + 1),
        weights(slots + 1),
        weighted(slots + 1) {}
};

}  // namespace

void prepare_combine_v2(CombineV2Input& in) {
  const Layout& lay = in.lay;
  const int W = lay.W, slots = lay.K + lay.S;
  std::vector<int64_t> per_origin(W + 1, 0);
  for (int64_t i = 0; i < in.n_own; ++i) {
    const int32_t r = in.assist[3 * i], t = in.assist[3 * i + 1], slot = in.assist[3 * i + 2];
    EPCOMM_CHECK(r >= 0 && r < W, "argument: assist_info_for_combine: row ", i, " = (", r, ", ", t, ", ",
                 slot, "): source rank ", r, " outside [0, ", W, ")");
    EPCOMM_CHECK(slot >= 0 && slot < slots, "argument: assist_info_for_combine: row ", i, " = (", r, ", ", t,
                 ", ", slot, "): slot ", slot, " outside [0, K+S = ", slots, ")");
    EPCOMM_CHECK(t >= 0 && t < lay.max_bs, "argument: assist_info_for_combine: row ", i, " = (", r, ", ", t,
                 ", ", slot, "): token index ", t, " outside [0, maxBs = ", lay.max_bs, ")");
    ++per_origin[r + 1];
  }
  for (int o = 0; o < W; ++o) per_origin[o + 1] += per_origin[o];
  in.origin_offsets = per_origin;
  in.origin_rows.assign(static_cast<size_t>(in.n_own), 0);
  std::vector<int64_t> fill(per_origin.begin(), per_origin.end() - 1);
  for (int64_t i = 0; i < in.n_own; ++i) in.origin_rows[fill[in.assist[3 * i]]++] = static_cast<int32_t>(i);
  auto key = [&](int32_t i) {
    return static_cast<int64_t>(in.assist[3 * i + 1]) * slots + in.assist[3 * i + 2];
  };
  for (int o = 0; o < W; ++o) {
    auto b = in.origin_rows.begin() + per_origin[o], e = in.origin_rows.begin() + per_origin[o + 1];
    std::stable_sort(b, e, [&](int32_t a, int32_t c) { return key(a) < key(c); });
    for (auto it = b; it + 1 < e; ++it)
      EPCOMM_CHECK(key(*it) != key(*(it + 1)), "argument: assist_info_for_combine: rows ", *it, " and ",
                   *(it + 1), " both return (token ", in.assist[3 * *it + 1], ", slot ",
                   in.assist[3 * *it + 2], ") to ep rank ", o, " (duplicate row)");
  }
}

void run_combine_v2_tp(OpContext& tctx, const CombineV2Input& in, const uint8_t* expand_x, int64_t n_send,
                       uint8_t* y, const std::function<void()>& on_moving) {
  const size_t row = static_cast<size_t>(in.H) * 2;
  const OpKind op = in.residual ? OpKind::combine_add_rms_norm : OpKind::combine_v2;
  HeaderData& h = tctx.begin_header(op);
  h.num_tokens = in.bs;
  int32_t* c = put_params(tctx, in.params, 2);
  c[0] = static_cast<int32_t>(in.n_own);
  c[1] = static_cast<int32_t>(n_send);
  tctx.publish_header();
  tctx.exchange_headers();
  check_params(tctx, op,
               {kParamW, kParamE, kParamT, kParamShard, kParamS, kParamSr, kParamGlobalBs, kParamH, kParamK,
                kParamDtype, kParamCommQuant, kParamEpRank},
               true);
  const int peer = 1 - tctx.rank();
  const int32_t* pc = peer_counts(tctx, peer);
  if (pc[1] != in.n_own || c[1] != pc[0])
    EPCOMM_THROW(InvalidUsage, tctx.prefix(), "mismatch: tp_send_counts: this rank returns ", n_send,
                 " rows to tp rank ", peer, ", which owns ", pc[0], " rows (its ep_send_counts); tp rank ",
                 peer, " returns ", pc[1], " rows, this rank owns ", in.n_own);
  on_moving();
  if (in.n_own > 0) std::memcpy(y, expand_x, static_cast<size_t>(in.n_own) * row);  // y: null at 0 rows
  pair_exchange(
      tctx, "tp reduce", n_send, in.n_own, row,
      [&](int64_t i, uint8_t* dst) {
        std::memcpy(dst, expand_x + static_cast<size_t>(in.n_own + i) * row, row);
      },
      [&](int64_t i, const uint8_t* src) {
        add_pair_row(in.dt, y + static_cast<size_t>(i) * row, src, in.H);
      });
}

namespace {

// One call's EP stage on this rank: the state its phases share. run_combine_v2 runs the phases in order,
// each leaving what the next needs. As contributor we write our rows into the origins' windows; as origin we
// open our windows and reduce them; internode, as proxy of rail peer o on node n, our node's rows for o's
// window collect in the lane we keep for n: we open o's windows there when o says so (meta_ready), and send
// each back compact once every rank of our node that returns rows to o has written its part.
struct CombineV2Call {
  CombineV2Call(OpContext& c, const CombineV2Input& i, const CombineV2Output& o)
      : ctx(c),
        in(i),
        out(o),
        lay(i.lay),
        W(lay.W),
        me(i.me),
        K(lay.K),
        S(lay.S),
        slots(K + S),
        H(i.H),
        row_bytes(static_cast<size_t>(H) * 2),
        wire(wire_bytes(i)),
        op(i.residual ? OpKind::combine_add_rms_norm : OpKind::combine_v2),
        seq(c.seq()),
        inter(c.internode()),
        M(inter ? inter->topo.num_nodes : 1),
        my_area(c.data(me)) {}

  // Phases.
  void exchange_headers();
  void fit_window();
  void check_row_counts();
  [[noreturn]] void throw_row_count_mismatch(int o, int64_t want, int64_t sum) const;
  void plan_windows();
  void move_rows();

  std::atomic<uint64_t>* tag_at(int o, int64_t idx) const {
    return reinterpret_cast<std::atomic<uint64_t>*>(ctx.data(o) + tags_off +
                                                    static_cast<size_t>(idx) * geo.weight_stride);
  }
  bool returns_to(int d, int o) const { return peer_counts(ctx, d)[count_origin(W, o)] > 0; }
  // Contributor: write our rows of origin o's window w into its slots.
  void fill(int o, int64_t w);
  void fill_row(int o, int64_t w, int64_t t0, int32_t i);
  // Origin.
  void open_window();
  bool contributors_done(int64_t w) const;
  void gather_remote(int64_t w, int64_t n_slots);
  int collect_rows(int64_t w, int64_t t, int64_t t0, TokenScratch& r) const;
  void zero_token(int64_t t) const;
  void reduce(int64_t w);
  void reduce_token(int64_t w, int64_t t, int64_t t0, TokenScratch& r) const;
  const uint8_t* row_in_place(int writer, const uint8_t* slot, int64_t t, int s) const;
  void choose_in_place();
  bool origins_released() const;
  // Proxy.
  bool proxy_can_open(int n) const;
  void proxy_open(int n);
  bool proxy_can_forward(int n) const;
  void proxy_forward(int n);
  bool proxy_step(bool& progressed);
  // The data loop.
  bool step(bool& progressed);
  std::vector<int> awaited() const;

  OpContext& ctx;
  const CombineV2Input& in;
  const CombineV2Output& out;
  const Layout& lay;
  const int W, me, K, S, slots;
  const int64_t H;
  const size_t row_bytes, wire;
  const OpKind op;
  const uint64_t seq;
  Internode* const inter;
  const int M;  // nodes (1 on one node)
  uint8_t* const my_area;

  // fit_window: the window, and internode where a lane's data keeps the rows that come back.
  CombineGeometry geo{};
  size_t ret_off = 0;
  // check_row_counts.
  std::vector<int64_t> tokens_of;
  // plan_windows: windows per origin, filled so far, our next row per origin, ranks that return rows to us.
  int64_t per_window = 0;
  bool cache_resident = false;  // windows within kWindowBytes: rows written with plain stores
  size_t tags_off = 0;
  std::vector<int64_t> nwin, filled, pos;
  std::vector<uint8_t> contributes;
  // Internode. As origin: the nodes that return rows to us, and the rows of the open window that came back.
  // As proxy, per node n: windows of its rail peer to serve, opened, forwarded, the last write, its pieces.
  std::vector<uint8_t> node_contributes;
  std::vector<const uint8_t*> remote_row;
  std::vector<int32_t> remote_writer;
  // Our own rows of the open window, read in place from our x (comm_quant_mode 0): their slots stay empty.
  bool own_in_place = false;
  std::vector<const uint8_t*> own_row;
  // Every rank's x in its output arena: slots carry row indices, origins read the rows in place (in_x[s]:
  // rank s's x as mapped here, rows_of[s] its rows); `released` once we told our contributors we are done.
  bool in_place = false, released = false;
  std::vector<const uint8_t*> in_x;
  std::vector<int64_t> rows_of;
  std::vector<int64_t> px_windows, px_opened, px_forwarded;
  std::vector<uint64_t> px_ticket;
  std::vector<std::vector<int32_t>> px_head;
  std::vector<std::vector<Network::Piece>> px_pieces;
  std::optional<DrainOnExit> drain;  // after the buffers the network reads: destroyed before them
  // The origin's reduction.
  int64_t my_windows = 0, reduced = 0;
  bool open = false;
};

// Header: params, rows and largest token per origin, rows this rank expects.
void CombineV2Call::exchange_headers() {
  int64_t expected = 0;
  for (int64_t t = 0; t < in.bs; ++t) {
    if (!in.active[t]) continue;
    expected += S;
    for (int k = 0; k < K; ++k) expected += in.ids[t * K + k] >= 0;
  }
  HeaderData& h = ctx.begin_header(op);
  h.num_tokens = in.bs;
  h.hidden = H;
  int32_t* c = put_params(ctx, in.params, 2 * W + 1);
  for (int o = 0; o < W; ++o) {
    const int64_t b = in.origin_offsets[o], e = in.origin_offsets[o + 1];
    c[count_origin(W, o)] = static_cast<int32_t>(e - b);
    c[count_max_token(W, o)] = e > b ? in.assist[3 * in.origin_rows[e - 1] + 1] + 1 : 0;
  }
  c[count_expected(W)] = static_cast<int32_t>(expected);
  if (!inter && in.comm_quant == 0 && (in.rows_offset >= 0 || in.n_own == 0)) {
    h.flags |= kReadRowsInPlace;
    h.input_offset = in.rows_offset;
  }
  ctx.publish_header();
  ctx.exchange_headers();
  check_params(ctx, op,
               {kParamW, kParamE, kParamT, kParamShard, kParamS, kParamSr, kParamGlobalBs, kParamH, kParamK,
                kParamDtype, kParamCommQuant},
               true);
  choose_in_place();
}

// Rows read in place when every rank can (its x in its output arena, or no rows at all).
void CombineV2Call::choose_in_place() {
  in_place = true;
  for (int s = 0; s < W; ++s) in_place = in_place && (ctx.header(s)->flags & kReadRowsInPlace);
  if (!in_place) return;
  in_x.assign(W, nullptr);
  rows_of.assign(W, 0);
  for (int s = 0; s < W; ++s) {
    const int64_t off = ctx.header(s)->input_offset;
    if (off >= 0) in_x[s] = ctx.transport().arena(s) + off;
    for (int o = 0; o < W; ++o) rows_of[s] += peer_counts(ctx, s)[count_origin(W, o)];
  }
}

// Room for one token's slots, the same check on every rank.
void CombineV2Call::fit_window() {
  // Windows of at most kWindowBytes, written with plain stores: the origin reduces a window while it is
  // still in the cache its contributors wrote it to. One window over the whole area (rows to memory with
  // streaming stores, then read back from there) made the decode shape's combine 2.5x slower.
  const size_t slot_bytes = in_place ? sizeof(int64_t) : wire;  // in place: a row index per slot
  geo =
      combine_geometry(std::min(ctx.layout().data_bytes, kWindowBytes), slot_bytes, slots, sizeof(uint64_t));
  cache_resident = geo.window >= 1;
  if (!cache_resident)  // one token's slots exceed the cap
    geo = combine_geometry(ctx.layout().data_bytes, slot_bytes, slots, sizeof(uint64_t));
  if (inter) {  // a remote origin's window lives in its proxy's lane, and goes back compact into the origin's
    // Each half of a lane's data: the copy window of the mirrored origin (this rank as its proxy), then
    // the rows that node returns for our own window (this rank as origin).
    ret_off = inter->lane.data_bytes / 2 / kAlign * kAlign;
    const size_t room = ret_off;
    int64_t wl = combine_geometry(room, wire, slots, sizeof(uint64_t)).window;
    while (wl > 0 && compact_bytes(wl * slots, geo.row_stride) > room) --wl;
    if (wl < 1 && geo.window >= 1)
      EPCOMM_THROW(InvalidUsage, ctx.prefix(),
                   "capacity: num_rdma_bytes = ", inter->lane.bytes * inter->topo.num_nodes, " (one lane of ",
                   inter->lane.bytes, " bytes per node) cannot hold the ", slots, " rows of one token (",
                   wire, " bytes each) twice; the minimum is ",
                   static_cast<size_t>(inter->topo.num_nodes) *
                       (lane_overhead_bytes(inter->topo.ranks_per_node, W) +
                        2 * (combine_min_data_bytes(wire, slots, sizeof(uint64_t)) + kAlign)),
                   " bytes (GroupContextOptions::num_rdma_bytes)");
    geo.window = std::min(geo.window, wl);
  }
  if (geo.window < 1)
    EPCOMM_THROW(InvalidUsage, ctx.prefix(), "capacity: the group's segment (", ctx.layout().total,
                 " bytes per rank) cannot hold the ", slots, " rows of one token (", wire,
                 " bytes each); the minimum is ",
                 control_bytes(W) + combine_min_data_bytes(wire, slots, sizeof(uint64_t)),
                 " bytes (GroupContextOptions::segment_bytes)");
}

// Every origin gets exactly the rows it expects (its mask and ids) from rows whose tokens it has; every rank
// makes the same checks. The message's list of senders is written only when the check fails (formatting it
// on every call cost ~0.3 us per sender).
void CombineV2Call::check_row_counts() {
  tokens_of.resize(W);
  for (int o = 0; o < W; ++o) tokens_of[o] = ctx.header(o)->num_tokens;
  for (int o = 0; o < W; ++o) {
    int64_t sum = 0;
    for (int s = 0; s < W; ++s) {
      const int32_t* pc = peer_counts(ctx, s);
      sum += pc[count_origin(W, o)];
      if (pc[count_max_token(W, o)] > tokens_of[o])
        EPCOMM_THROW(InvalidUsage, ctx.prefix(), "argument: assist_info_for_combine of ", ctx.peer_name(s),
                     " returns a row for token ", pc[count_max_token(W, o)] - 1, " of ", ctx.peer_name(o),
                     ", which has Bs = ", tokens_of[o], " tokens");
    }
    const int64_t want = peer_counts(ctx, o)[count_expected(W)];
    if (sum != want) throw_row_count_mismatch(o, want, sum);
  }
}

[[noreturn]] void CombineV2Call::throw_row_count_mismatch(int o, int64_t want, int64_t sum) const {
  std::string senders;
  for (int s = 0; s < W; ++s)
    if (const int32_t n = peer_counts(ctx, s)[count_origin(W, o)])
      senders += detail::cat(senders.empty() ? "" : ", ", ctx.peer_name(s), ": ", n);
  EPCOMM_THROW(InvalidUsage, ctx.prefix(), "argument: ", ctx.peer_name(o), " expects ", want,
               " rows (active slots of its x_active_mask and expert_ids, plus ", S,
               " shared per active token) but the ranks return ", sum, " (",
               senders.empty() ? "none" : senders,
               "): expert_ids, x_active_mask or the layout differ from the dispatch");
}

// Windows over each origin's tokens: who fills which, and (internode) what each proxy serves.
void CombineV2Call::plan_windows() {
  per_window = geo.window;
  tags_off = static_cast<size_t>(per_window) * slots * geo.row_stride;
  nwin.assign(W, 0);
  filled.assign(W, 0);
  pos.assign(in.origin_offsets.begin(), in.origin_offsets.end() - 1);
  for (int o = 0; o < W; ++o)
    if (in.origin_offsets[o + 1] > in.origin_offsets[o]) nwin[o] = ceil_div(tokens_of[o], per_window);
  contributes.assign(W, 0);
  for (int s = 0; s < W; ++s) contributes[s] = peer_counts(ctx, s)[count_origin(W, me)] > 0;
  node_contributes.assign(M, 0);
  px_windows.assign(M, 0);
  px_opened.assign(M, 0);
  px_forwarded.assign(M, 0);
  px_ticket.assign(M, 0);
  px_head.resize(M);
  px_pieces.resize(M);
  drain.emplace(ctx);
  if (inter) {
    const Topology& topo = inter->topo;
    for (int s = 0; s < W; ++s)
      if (contributes[s] && ctx.remote(s)) node_contributes[topo.node_of[s]] = 1;
    remote_row.assign(static_cast<size_t>(per_window) * slots, nullptr);
    remote_writer.assign(remote_row.size(), -1);
    for (int n = 0; n < M; ++n) {
      if (n == topo.node()) continue;
      const int o = topo.rail(n);
      for (int d : topo.node_ranks[topo.node()])
        if (returns_to(d, o)) px_windows[n] = ceil_div(tokens_of[o], per_window);
    }
  }
  my_windows = in.bs > 0 ? ceil_div(in.bs, per_window) : 0;
  // Rows we return to ourselves are reduced straight from our x: with comm_quant_mode 2 every row is
  // compressed on the way, ours too, so they still go through the slots.
  own_in_place = in.comm_quant != 2;
  if (own_in_place) own_row.assign(static_cast<size_t>(per_window) * slots, nullptr);
}

void CombineV2Call::move_rows() {
  ctx.run(
      "combine rows", [this](bool& progressed) { return step(progressed); }, [this] { return awaited(); });
}

// Contributor: our rows of origin o's window w, split over the call's copy threads (each row goes to its own
// slot, whose stamp is exchanged atomically).
void CombineV2Call::fill(int o, int64_t w) {
  const int64_t t0 = w * per_window, t1 = t0 + per_window;
  const int64_t end = in.origin_offsets[o + 1], first = pos[o];
  int64_t last = first;
  while (last < end && in.assist[3 * in.origin_rows[last] + 1] < t1) ++last;
  // Our own rows are pointers (own_in_place): only copied rows are worth more threads.
  const int64_t bytes =
      (o == me && own_in_place) || in_place ? 0 : (last - first) * static_cast<int64_t>(row_bytes);
  for_parts(in.workers, in.threads, bytes, last - first, [&](int64_t b, int64_t e) {
    for (int64_t p = first + b; p < first + e; ++p) fill_row(o, w, t0, in.origin_rows[p]);
  });
  pos[o] = last;
  if (in.counters && o != me)
    in.counters->add(in_place ? in.counters->combine_in_place_rows : in.counters->combine_copied_rows,
                     last - first);
}

// Our row i into its slot of origin o's window w (which starts at token t0), stamped.
void CombineV2Call::fill_row(int o, int64_t w, int64_t t0, int32_t i) {
  const int64_t t = in.assist[3 * i + 1];
  const int slot = in.assist[3 * i + 2];
  const int64_t idx = (t - t0) * slots + slot;
  uint8_t* dst = ctx.data(o) + static_cast<size_t>(idx) * geo.row_stride;
  const uint8_t* src = in.rows + static_cast<size_t>(i) * row_bytes;
  if (o == me && own_in_place) {  // prepare_combine_v2 rejected duplicates among our own rows
    own_row[idx] = src;
    return;
  }
  if (in_place) {  // the origin reads row i of our x in place
    const int64_t row = i;
    std::memcpy(dst, &row, sizeof(row));
  } else if (in.comm_quant == 2) {
    quant::int8_group8_combine(in.dt, src, H, reinterpret_cast<int8_t*>(dst),
                               reinterpret_cast<uint16_t*>(dst + H));
  } else {
    copy_row(dst, src, row_bytes, true, cache_resident);
  }
  const uint64_t old = tag_at(o, idx)->exchange(stamp(seq, w, me), std::memory_order_acq_rel);
  if (stamp_is(old, seq, w))
    EPCOMM_THROW(InvalidUsage, ctx.prefix(), "argument: ", ctx.peer_name(stamp_writer(old)),
                 " and this rank both return a row for (t=", t, ", slot=", slot, ") of ", ctx.peer_name(o),
                 " (duplicate row)");
}

// Clears the slots of our next window and tells the contributors (internode: the proxies of the nodes that
// return rows to us, which open their copy of the window).
void CombineV2Call::open_window() {
  const int64_t t0 = reduced * per_window, t1 = std::min(in.bs, t0 + per_window);
  for (int64_t idx = 0; idx < (t1 - t0) * slots; ++idx) tag_at(me, idx)->store(0, std::memory_order_relaxed);
  if (own_in_place) std::fill(own_row.begin(), own_row.end(), nullptr);
  ctx.control(me)->combine_open.store(pack(seq, reduced + 1), std::memory_order_seq_cst);
  for (int s = 0; s < W; ++s)
    if (contributes[s] && s != me && !ctx.remote(s)) ctx.notify(s);
  if (inter)
    for (int n = 0; n < inter->topo.num_nodes; ++n)
      if (node_contributes[n])
        ctx.write_lane(inter->topo.rail(n), nullptr, 0, 0, offsetof(LaneControl, meta_ready),
                       pack(seq, reduced + 1));
  open = true;
}

bool CombineV2Call::contributors_done(int64_t w) const {
  for (int s = 0; s < W; ++s)
    if (contributes[s] && ctx.cell(me, s)->done.load(std::memory_order_acquire) < pack(seq, w + 1))
      return false;
  return true;
}

// Origin: the rows of window w that came back from the other nodes (checked against our own arrivals).
void CombineV2Call::gather_remote(int64_t w, int64_t n_slots) {
  std::fill(remote_row.begin(), remote_row.begin() + n_slots, nullptr);
  for (int n = 0; n < M; ++n) {
    if (!node_contributes[n]) continue;
    const uint8_t* base = ctx.lane_base(me, n) + inter->lane.data + ret_off;
    const int64_t count = *reinterpret_cast<const int32_t*>(base);
    const int32_t* ent = reinterpret_cast<const int32_t*>(base + 8);
    const uint8_t* rows_at = base + compact_head(count);
    EPCOMM_CHECK_INTERNAL(count >= 0 && count <= n_slots, ctx.prefix(),
                          "internal: ", ctx.peer_name(inter->topo.rail(n)), " (proxy on node ", n,
                          ") returned ", count, " rows for window ", w, " of ", n_slots, " slots");
    for (int64_t e = 0; e < count; ++e) {
      const int32_t idx = ent[2 * e], writer = ent[2 * e + 1];
      EPCOMM_CHECK_INTERNAL(idx >= 0 && idx < n_slots, ctx.prefix(),
                            "internal: ", ctx.peer_name(inter->topo.rail(n)), " (proxy on node ", n,
                            ") returned slot ", idx, " outside window ", w);
      const uint64_t local = tag_at(me, idx)->load(std::memory_order_acquire);
      const int other = remote_row[idx]                ? remote_writer[idx]
                        : stamp_is(local, seq, w)      ? stamp_writer(local)
                        : own_in_place && own_row[idx] ? me
                                                       : -1;
      if (other >= 0)
        EPCOMM_THROW(InvalidUsage, ctx.prefix(), "argument: ", ctx.peer_name(other), " and ",
                     ctx.peer_name(writer), " both return a row for (t=", w * per_window + idx / slots,
                     ", slot=", idx % slots, ") of this rank (duplicate row)");
      remote_row[idx] = rows_at + static_cast<size_t>(e) * geo.row_stride;
      remote_writer[idx] = writer;
    }
  }
}

// Token t's arrived rows in reduction order (row_ptrs, weights, weighted), checked against our mask and
// ids; returns their number. t0: the window's first token.
int CombineV2Call::collect_rows(int64_t w, int64_t t, int64_t t0, TokenScratch& r) const {
  const bool act = in.active[t];
  int n = 0;
  for (int s = 0; s < slots; ++s) {
    const int64_t idx = (t - t0) * slots + s;
    const uint64_t v = tag_at(me, idx)->load(std::memory_order_acquire);
    bool arrived = stamp_is(v, seq, w);
    int writer = stamp_writer(v);
    const uint8_t* src = my_area + static_cast<size_t>(idx) * geo.row_stride;
    if (inter && remote_row[idx]) {
      arrived = true;
      writer = remote_writer[idx];
      src = remote_row[idx];
    }
    if (own_in_place && own_row[idx]) {
      if (arrived)
        EPCOMM_THROW(InvalidUsage, ctx.prefix(), "argument: ", ctx.peer_name(writer),
                     " and this rank both return a row for (t=", t, ", slot=", s,
                     ") of this rank (duplicate row)");
      arrived = true;
      writer = me;
      src = own_row[idx];
    }
    const bool wanted = act && (s >= K || in.ids[t * K + s] >= 0);
    if (arrived && !wanted)
      EPCOMM_THROW(InvalidUsage, ctx.prefix(), "argument: ", ctx.peer_name(writer),
                   " returned a row for (t=", t, ", slot=", s, "), which is not active on this rank (",
                   act ? "expert_ids / x_active_mask slot" : "masked token", ")");
    if (!arrived && wanted)
      EPCOMM_THROW(InvalidUsage, ctx.prefix(), "argument: no rank returned a row for (t=", t, ", slot=", s,
                   "), an active slot of this rank (another row went elsewhere)");
    if (!wanted) continue;
    if (in_place && writer != me) src = row_in_place(writer, src, t, s);
    if (in.comm_quant == 2) {
      uint8_t* dec = r.decoded.data() + static_cast<size_t>(s) * row_bytes;
      quant::int8_group8_combine_dequant(in.dt, reinterpret_cast<const int8_t*>(src),
                                         reinterpret_cast<const uint16_t*>(src + H), H,
                                         reinterpret_cast<uint16_t*>(dec));
      src = dec;
    }
    r.row_ptrs[n] = src;
    r.weighted[n] = s < K;
    r.weights[n] = s < K ? in.expert_scales[t * K + s] : 1.0f;
    ++n;
  }
  return n;
}

// In place: the row of `writer`'s x whose index it wrote into slot (t, s), checked against its row count.
const uint8_t* CombineV2Call::row_in_place(int writer, const uint8_t* slot, int64_t t, int s) const {
  int64_t row;
  std::memcpy(&row, slot, sizeof(row));
  EPCOMM_CHECK_INTERNAL(row >= 0 && row < rows_of[writer] && in_x[writer], ctx.prefix(),
                        "internal: ", ctx.peer_name(writer), " named row ", row, " of its ", rows_of[writer],
                        " for (t=", t, ", slot=", s, ")");
  return in_x[writer] + static_cast<size_t>(row) * row_bytes;
}

void CombineV2Call::zero_token(int64_t t) const {
  std::memset(out.x + static_cast<size_t>(t) * row_bytes, 0, row_bytes);
  if (out.y) std::memset(out.y + static_cast<size_t>(t) * row_bytes, 0, row_bytes);
  if (out.rstd) out.rstd[t] = 0.0f;
}

// Origin: reduce window w into the outputs, its tokens split over the call's copy threads (each token
// reduced by one thread, in the fixed order).
void CombineV2Call::reduce(int64_t w) {
  const int64_t t0 = w * per_window, t1 = std::min(in.bs, t0 + per_window);
  if (inter) gather_remote(w, (t1 - t0) * slots);
  const int64_t bytes = (t1 - t0) * (slots + 1) * static_cast<int64_t>(row_bytes);  // rows read, at most
  for_parts(in.workers, in.threads, bytes, t1 - t0, [&](int64_t b, int64_t e) {
    TokenScratch r(H, slots, row_bytes, in.comm_quant == 2);
    for (int64_t t = t0 + b; t < t0 + e; ++t) reduce_token(w, t, t0, r);
  });
}

void CombineV2Call::reduce_token(int64_t w, int64_t t, int64_t t0, TokenScratch& r) const {
  int n = collect_rows(w, t, t0, r);
  if (!in.active[t]) return zero_token(t);
  if (in.shared_x) {
    r.row_ptrs[n] = in.shared_x + static_cast<size_t>(t) * row_bytes;
    r.weighted[n] = 0;
    r.weights[n] = 1.0f;
    ++n;
  }
  if (!in.residual)
    return accumulate_round_rows(in.dt, r.row_ptrs.data(), r.weights.data(), r.weighted.data(), n, H,
                                 out.x + static_cast<size_t>(t) * row_bytes);
  accumulate_rows(in.dt, r.row_ptrs.data(), r.weights.data(), r.weighted.data(), n, H, r.acc.data());
  add_rms_norm_row(in.dt, r.acc.data(), in.residual + static_cast<size_t>(t) * row_bytes, in.gamma, H,
                   in.norm_eps, out.x + static_cast<size_t>(t) * row_bytes,
                   out.y + static_cast<size_t>(t) * row_bytes, &out.rstd[t], r.scratch.data());
}

// Proxy of the rail peer on node n: its next window may open once it said so and our last write is read.
bool CombineV2Call::proxy_can_open(int n) const {
  return ctx.lane_control(me, n)->meta_ready.load(std::memory_order_acquire) >= pack(seq, px_opened[n] + 1) &&
         (px_ticket[n] == 0 || inter->net->complete(px_ticket[n]));
}

void CombineV2Call::proxy_open(int n) {
  const int o = inter->topo.rail(n);
  const int64_t w = px_opened[n];
  const int64_t t0 = w * per_window, t1 = std::min(tokens_of[o], t0 + per_window);
  for (int64_t idx = 0; idx < (t1 - t0) * slots; ++idx) tag_at(o, idx)->store(0, std::memory_order_relaxed);
  ctx.lane_control(me, n)->mirror.combine_open.store(pack(seq, w + 1), std::memory_order_seq_cst);
  ctx.notify_all();
  ++px_opened[n];
}

// The open window goes back once every rank of our node that returns rows to its origin has written.
bool CombineV2Call::proxy_can_forward(int n) const {
  const Topology& topo = inter->topo;
  const int o = topo.rail(n);
  bool ready = true;
  for (int d : topo.node_ranks[topo.node()])
    ready = ready && (!returns_to(d, o) ||
                      ctx.cell(o, d)->done.load(std::memory_order_acquire) >= pack(seq, px_forwarded[n] + 1));
  return ready;
}

// Sends the window back compact: the stamped slots' (index, writer) pairs, then the rows.
void CombineV2Call::proxy_forward(int n) {
  const int o = inter->topo.rail(n);
  const int64_t fw = px_forwarded[n];
  const int64_t t0 = fw * per_window, t1 = std::min(tokens_of[o], t0 + per_window);
  std::vector<int32_t>& head = px_head[n];
  head.assign(2, 0);
  for (int64_t idx = 0; idx < (t1 - t0) * slots; ++idx) {
    const uint64_t v = tag_at(o, idx)->load(std::memory_order_acquire);
    if (!stamp_is(v, seq, fw)) continue;
    head.push_back(static_cast<int32_t>(idx));
    head.push_back(stamp_writer(v));
  }
  const int64_t count = static_cast<int64_t>(head.size() / 2 - 1);
  head[0] = static_cast<int32_t>(count);
  head.resize(compact_head(count) / 4, 0);
  std::vector<Network::Piece>& pcs = px_pieces[n];
  pcs.assign(1, Network::Piece{head.data(), compact_head(count)});
  const uint8_t* area = ctx.data(o);
  for (int64_t a = 0; a < count;) {  // runs of consecutive slots are contiguous in the window
    int64_t b = a + 1;
    while (b < count && head[2 + 2 * b] == head[2 + 2 * (b - 1)] + 1) ++b;
    pcs.push_back({area + static_cast<size_t>(head[2 + 2 * a]) * geo.row_stride,
                   static_cast<size_t>(b - a) * geo.row_stride});
    a = b;
  }
  px_ticket[n] =
      ctx.write_lane(o, pcs.data(), static_cast<int>(pcs.size()), inter->lane.data + ret_off,
                     offsetof(LaneControl, from_proxy) + offsetof(PeerCell, done), pack(seq, fw + 1));
  inter->rows_sent += static_cast<uint64_t>(count);
  inter->row_bytes_sent += static_cast<uint64_t>(count) * wire;
  ++px_forwarded[n];
}

// Proxy: one pass over the rail peers whose windows we hold; true once all went back.
bool CombineV2Call::proxy_step(bool& progressed) {
  bool all = true;
  for (int n = 0; n < M; ++n) {
    if (n == inter->topo.node() || px_forwarded[n] == px_windows[n]) continue;
    all = false;
    if (px_opened[n] == px_forwarded[n] && proxy_can_open(n)) {
      proxy_open(n);
      progressed = true;
    }
    if (px_forwarded[n] == px_opened[n] || !proxy_can_forward(n)) continue;
    proxy_forward(n);
    progressed = true;
  }
  return all;
}

bool CombineV2Call::step(bool& progressed) {
  if (reduced < my_windows && !open) {
    open_window();
    progressed = true;
  }
  bool all = serve_published_windows(ctx, me, &Control::combine_open, &PeerCell::done, filled, nwin,
                                     progressed, [this](int o, int64_t w) { fill(o, w); });
  if (open && contributors_done(reduced)) {
    reduce(reduced);
    ++reduced;
    open = false;
    progressed = true;
  }
  if (inter) all = proxy_step(progressed) && all;
  if (in_place && !released && reduced == my_windows) {  // done reading our contributors' x
    for (int s = 0; s < W; ++s)
      if (contributes[s] && s != me) ctx.signal(ctx.cell(s, me)->ack, pack(seq, 1), s);
    released = progressed = true;
  }
  return all && reduced == my_windows && (!in_place || origins_released());
}

// In place: every origin we return rows to is done reading them (our x may go once we return).
bool CombineV2Call::origins_released() const {
  for (int o = 0; o < W; ++o)
    if (o != me && returns_to(me, o) && ctx.cell(me, o)->ack.load(std::memory_order_acquire) < pack(seq, 1))
      return false;
  return true;
}

std::vector<int> CombineV2Call::awaited() const {
  std::vector<int> peers;  // origins whose windows we still fill, then contributors we wait for
  for (int o = 0; o < W; ++o)
    if (filled[o] < nwin[o] && o != me) peers.push_back(o);
  if (open)
    for (int s = 0; s < W; ++s)
      if (contributes[s] && ctx.cell(me, s)->done.load(std::memory_order_acquire) < pack(seq, reduced + 1))
        add_awaited(peers, s, me);
  if (in_place && reduced == my_windows)  // origins still reading our x
    for (int o = 0; o < W; ++o)
      if (o != me && returns_to(me, o) && ctx.cell(me, o)->ack.load(std::memory_order_acquire) < pack(seq, 1))
        add_awaited(peers, o, me);
  if (inter)  // as proxy: origins whose next window we await, contributors of the open one
    for (int n = 0; n < inter->topo.num_nodes; ++n) {
      if (n == inter->topo.node() || px_forwarded[n] == px_windows[n]) continue;
      const int o = inter->topo.rail(n);
      if (px_opened[n] == px_forwarded[n])
        add_awaited(peers, o, me);
      else
        for (int d : inter->topo.node_ranks[inter->topo.node()])
          if (returns_to(d, o) &&
              ctx.cell(o, d)->done.load(std::memory_order_acquire) < pack(seq, px_opened[n]))
            add_awaited(peers, d, me);
    }
  return peers;
}

}  // namespace

void run_combine_v2(OpContext& ctx, const CombineV2Input& in, const CombineV2Output& out,
                    const std::function<void()>& on_moving) {
  CombineV2Call call(ctx, in, out);
  call.exchange_headers();
  call.fit_window();
  call.check_row_counts();
  on_moving();
  call.plan_windows();
  call.move_rows();
}

}  // namespace epcomm::engine::v2
