// engine/combine.cc — combine over a Transport: windows over each origin's tokens with one fixed slot per
// (token, slot k) in expert_major or (token, rank d) in rank_major, so that the origin reads every copy of a
// token side by side and reduces in canonical order without staging anything else.
#include "engine/combine.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <optional>

#include "common/env.h"
#include "engine/combine_direct.h"
#include "engine/combine_forward.h"
#include "engine/dispatch.h"
#include "engine/kernels.h"
#include "engine/window_serve.h"
#include "tensor/output_arena.h"

namespace epcomm::engine {

using Clock = std::chrono::steady_clock;

// Combine window half: a few MiB, well inside the L3 the ranks of a host share (see docs/performance.md).
constexpr size_t kCombineHalfBytes = size_t{4} << 20;

namespace {

// Origin: one token's copies and weights, and the next token's (prefetched); one per copy thread.
struct TokenRows {
  const uint8_t* rows[1024];
  float wts[1024];
  const uint8_t* next[1024];
  float next_wts[1024];
};

// One windowed combine call, phase by phase; run_combine below is its driver.
class CombineCall {
 public:
  CombineCall(OpContext& ctx, const CombineInput& in, CombineOutput& out);
  void exchange_headers();  // 1. header (and, across nodes, the holders' counts), every header in
  void choose_geometry();   // 2. window, halves and lane layout; capacity errors
  void poison_outputs() const;
  bool direct() const;  // every header says kReadRowsInPlace: run_direct instead of windows
  void move_rows();     // 3. rounds: open our windows, fill the origins' windows, reduce ours
  void finish() const;

 private:
  void fill_header();
  void set_up_windows();
  void fill(int s, int64_t w);
  void fill_copy(int s, int64_t w, int64_t t0, uint8_t* area, int32_t row);
  std::pair<const uint8_t*, const float*> reduce_copy_of(int64_t w, int64_t t, int slot) const;
  const uint8_t* copy_of(int64_t w, int64_t t, int slot) const;
  int gather(int64_t w, int64_t t, const uint8_t** ptrs, float* ws) const;
  void sum_recv_weights(int64_t w, int64_t t) const;
  void reduce(int64_t w);
  void reduce_tokens(int64_t w, int64_t t0, int64_t t1, TokenRows& r) const;
  void reduce_window(int64_t w);
  void clear_local(int64_t w);
  bool contributors_done(int64_t w) const;
  void open_window(bool& progressed);
  bool fill_origins(bool& progressed);
  bool lending(int s) const;
  bool data_step(bool& progressed);
  std::vector<int> awaited_peers() const;
  // The rank holding the copy in `slot` of token t: the owner of expert k's id, or rank `slot`.
  int holder_of(int64_t t, int slot) const { return expert_ ? hd_.topk_ids[t * K_ + slot] / L_ : slot; }
  size_t local_index(int64_t w, size_t idx) const {
    return static_cast<size_t>(w % halves_) * WL_ * slots_ + idx;
  }

  OpContext& ctx_;
  const CombineInput& in_;
  CombineOutput& out_;
  const HandleData& hd_;
  const int R_, me_;
  const bool expert_;
  const int K_, L_;
  const int64_t T_, Hc_;
  const size_t elem_;
  const Clock::time_point t_start_;
  Internode* const inter_;
  const int M_;
  const int slots_;
  const size_t row_bytes_, wbytes_;
  Clock::time_point t_headers_;
  // Geometry (choose_geometry).
  int64_t halves_ = 1;
  size_t area_bytes_ = 0, lane_stride_ = 0;
  CombineGeometry geo_{};
  CombineLane cl_;
  // Rounds (set_up_windows).
  int64_t W_ = 0, my_nwin_ = 0, WL_ = 1;
  uint64_t seq_ = 0;
  std::vector<int64_t> nwin_, filled_, done_us_, pos_;
  const int32_t* src_tok_ = nullptr;
  const int32_t* src_slot_ = nullptr;
  uint8_t* my_area_ = nullptr;
  // Holders whose expert outputs lie in their shared combine-input area: their slots in our windows hold the
  // row index (int64) instead of the row, and we read the row in place. Such a holder may return only once
  // every origin it serves has reduced its last window (`combine_open` = pack(seq, windows + 1): closed).
  std::vector<const uint8_t*> shared_x_;
  bool by_index_ = false;
  // Own contributions, per half and slot: pointers into x (and the receiving-side weights) instead of copies.
  std::vector<const uint8_t*> local_rows_;
  std::vector<const float*> local_weights_;
  size_t weights_off_ = 0;
  uint8_t* cx_ = nullptr;
  float* cw_ = nullptr;
  int64_t reduced_ = 0, opened_ = 0;
  std::optional<Hierarchy> hier_;
  TokenRows rows_;  // the calling thread's
};

CombineCall::CombineCall(OpContext& ctx, const CombineInput& in, CombineOutput& out)
    : ctx_(ctx),
      in_(in),
      out_(out),
      hd_(*in.handle),
      R_(ctx.size()),
      me_(ctx.rank()),
      expert_(hd_.order == ReceiveOrder::expert_major),
      K_(hd_.num_topk),
      L_(hd_.num_local),
      T_(hd_.num_tokens),
      Hc_(in.hidden),
      elem_(dtype_size(in.dtype)),
      t_start_(Clock::now()),
      inter_(ctx.internode()),
      M_(inter_ ? inter_->topo.num_nodes : 1),
      slots_(expert_ ? K_ : R_),
      row_bytes_(static_cast<size_t>(Hc_) * elem_),
      wbytes_(in.has_recv_weights ? sizeof(float) * K_ : 0) {}

void CombineCall::fill_header() {
  HeaderData& h =
      ctx_.begin_header(hd_.expert_block_rows > 0 ? OpKind::low_latency_combine : OpKind::combine);
  h.order = static_cast<uint32_t>(hd_.order);
  h.flags = (hd_.has_topk ? kHasTopk : 0) | (in_.has_recv_weights ? kHasWeights : 0);
  h.num_experts = hd_.num_experts;
  h.num_topk = K_;
  h.dtype = static_cast<int32_t>(in_.dtype);
  h.quant_mode = -1;
  h.hidden = Hc_;
  h.row_bytes = static_cast<int64_t>(row_bytes_);
  h.num_tokens = T_;
  h.expert_alignment = hd_.expert_alignment;
  h.handle_id = hd_.seq;
  h.expert_block_rows = hd_.expert_block_rows;  // low-latency: checked against the peers' (call_checks.cc)
  std::copy(std::begin(in_.chunks), std::end(in_.chunks), h.chunks);
  // Shared x: the ranks of our node that reduce our rows (origins, and across nodes the proxies of remote
  // origins) read them in place; rows still cross the network only inside partials.
  h.input_offset = in_.shared_offset;
  if (in_.shared_offset >= 0 && in_.shared_in_arena) h.flags |= kInputInArena;
  // A rank without rows has nothing to lend, wherever its (empty) x and weights lie.
  const bool no_rows = hd_.num_rows == 0;
  if (!inter_ && hd_.pushed && !in_.cost_stats && (in_.shared_offset >= 0 || no_rows) &&
      (expert_ || !in_.has_recv_weights || in_.recv_weights_offset >= 0 || no_rows))
    h.flags |= kReadRowsInPlace;
  h.weights_offset = in_.recv_weights_offset;
  if (inter_) {  // proxies learn which ranks of their node hold copies of our tokens
    h.num_counts = hd_.num_experts + R_;
    int32_t* c = ctx_.counts(me_);
    std::fill(c, c + hd_.num_experts, 0);
    std::copy(hd_.tokens_per_rank.begin(), hd_.tokens_per_rank.end(), c + hd_.num_experts);
  }
}

void CombineCall::exchange_headers() {
  fill_header();
  ctx_.publish_header();
  ctx_.exchange_headers();
  check_headers_match(ctx_);
  t_headers_ = Clock::now();
}

void CombineCall::choose_geometry() {
  // Two halves when a window fits in half the area: contributors fill window w + 1 while the origin reduces
  // w. A half is capped at kCombineHalfBytes so that the copies a contributor writes are still in the
  // shared cache when the origin reads them (a 32 MiB half went to DRAM and back: two extra touches).
  size_t half = std::min(kCombineHalfBytes, ctx_.layout().data_bytes / 2 / kAlign * kAlign);
  if (combine_geometry(half, row_bytes_, slots_, wbytes_).window < 1)
    half = ctx_.layout().data_bytes / 2 / kAlign * kAlign;  // one token's slots exceed the cap
  // Internode routing entry: token index, then K expert ids and K weights (expert_major) or R destination
  // flags (rank_major). Partial: H' f32, then K f32 of reduced receiving-side weights (rank_major).
  const size_t meta_entry =
      expert_ ? 4 + 8 * static_cast<size_t>(K_) : (4 + static_cast<size_t>(R_) + 3) / 4 * 4;
  const size_t partial_bytes =
      4 * static_cast<size_t>(Hc_) + (!expert_ && wbytes_ ? 4 * static_cast<size_t>(K_) : 0);
  bool two = combine_geometry(half, row_bytes_, slots_, wbytes_).window >= 1;
  // Internode the lanes' data is split the same way (copy window, routing and partials per half), so that
  // window w + 1 is filled, and its partials travel, while w is reduced; one half when that does not fit.
  if (inter_ && two) {
    lane_stride_ = inter_->lane.data_bytes / 2 / kAlign * kAlign;
    const CombineGeometry g2 = combine_geometry(half, row_bytes_, slots_, wbytes_);
    if (combine_lane(lane_stride_, g2, g2.window, meta_entry, partial_bytes).window < 1) {
      two = false;
      lane_stride_ = 0;
    }
  }
  halves_ = two ? 2 : 1;
  area_bytes_ = two ? half : ctx_.layout().data_bytes;
  geo_ = combine_geometry(area_bytes_, row_bytes_, slots_, wbytes_);
  if (inter_) {
    const size_t lane_room = two ? lane_stride_ : inter_->lane.data_bytes;
    cl_ = combine_lane(lane_room, geo_, geo_.window, meta_entry, partial_bytes);
    if (geo_.window >= 1 && cl_.window < 1)
      EPCOMM_THROW(InvalidUsage, ctx_.prefix(), "capacity: num_rdma_bytes = ", inter_->lane.bytes * M_,
                   " (one lane of ", inter_->lane.bytes,
                   " bytes per node) cannot hold the copies of one token (", slots_, " x ", row_bytes_,
                   " bytes) with its routing and f32 partial; the minimum for this call is ",
                   M_ * (lane_overhead_bytes(inter_->topo.ranks_per_node, R_) +
                         combine_min_data_bytes(row_bytes_, slots_, wbytes_) + 3 * kAlign + meta_entry +
                         align64(partial_bytes)));
    geo_.window = std::min(geo_.window, cl_.window);
    cl_ = combine_lane(lane_room, geo_, geo_.window, meta_entry, partial_bytes);
  }
  if (geo_.window < 1)
    EPCOMM_THROW(InvalidUsage, ctx_.prefix(), "capacity: num_nvl_bytes = ", ctx_.layout().total,
                 " cannot hold the ", slots_, " copies of one token (", row_bytes_,
                 " bytes each); the minimum for this call is ",
                 control_bytes(R_) + combine_min_data_bytes(row_bytes_, slots_, wbytes_));
}

// The caller allocated the outputs (their shapes are known locally); only the debug poison happens here.
void CombineCall::poison_outputs() const {
  if (!in_.poison) return;
  if (out_.combined_x.nbytes()) std::memset(out_.combined_x.data(), 0xFF, out_.combined_x.nbytes());
  if (out_.combined_topk_weights && out_.combined_topk_weights->nbytes())
    std::memset(out_.combined_topk_weights->data(), 0xFF, out_.combined_topk_weights->nbytes());
}

bool CombineCall::direct() const {
  for (int r = 0; r < R_; ++r)
    if (!(ctx_.header(r)->flags & kReadRowsInPlace)) return false;
  return true;
}

void CombineCall::set_up_windows() {
  W_ = geo_.window;
  nwin_.assign(R_, 0);
  filled_.assign(R_, 0);
  done_us_.assign(R_, -1);
  for (int s = 0; s < R_; ++s) {
    int64_t Ts = ctx_.header(s)->num_tokens;
    nwin_[s] = hd_.rows_per_source[s] > 0 ? (Ts + W_ - 1) / W_ : 0;
    if (nwin_[s] == 0)
      done_us_[s] = std::chrono::duration_cast<std::chrono::microseconds>(t_headers_ - t_start_).count();
  }
  my_nwin_ = (T_ + W_ - 1) / W_;
  seq_ = ctx_.seq();
  src_tok_ = hd_.recv_src_token.data_as<int32_t>();
  src_slot_ = hd_.recv_src_slot.data_as<int32_t>();
  pos_.assign(hd_.source_offsets.begin(), hd_.source_offsets.end() - 1);
  my_area_ = ctx_.data(me_);
  shared_x_.assign(R_, nullptr);
  for (int p = 0; p < R_; ++p) shared_x_[p] = ctx_.shared_input(p);
  by_index_ = shared_x_[me_] != nullptr;
  WL_ = std::max<int64_t>(1, std::min(W_, T_));  // a window never holds more than T tokens
  local_rows_.assign(static_cast<size_t>(halves_) * WL_ * slots_, nullptr);
  local_weights_.assign(static_cast<size_t>(halves_) * WL_ * slots_, nullptr);
  weights_off_ = static_cast<size_t>(W_) * slots_ * geo_.row_stride;
  cx_ = out_.combined_x.data_as<uint8_t>();
  cw_ = out_.combined_topk_weights ? out_.combined_topk_weights->data_as<float>() : nullptr;
  hier_.emplace(ctx_, in_, hd_, geo_, cl_, halves_, lane_stride_, cx_, cw_, shared_x_);
}

// Contributor: write the copies of origin s's tokens in window w into s's slots, split over the call's copy
// threads (each copy goes to its own slot).
void CombineCall::fill(int s, int64_t w) {
  // A remote origin's window is the copy window in its proxy's lane (here), in the same half.
  uint8_t* area =
      ctx_.data(s) + static_cast<size_t>(w % halves_) * (ctx_.remote(s) ? lane_stride_ : area_bytes_);
  const int64_t t0 = w * W_, t1 = t0 + W_;
  const int64_t end = hd_.source_offsets[s + 1];
  const int64_t first = pos_[s];
  int64_t last = first;
  while (last < end && src_tok_[hd_.source_rows[last]] < t1) ++last;
  // Own copies and row indices are pointers and words: only copied rows are worth more threads.
  const int64_t bytes = s == me_ || by_index_ ? 0 : (last - first) * static_cast<int64_t>(row_bytes_);
  for_parts(in_.workers, in_.threads, bytes, last - first, [&](int64_t b, int64_t e) {
    for (int64_t p = first + b; p < first + e; ++p) fill_copy(s, w, t0, area, hd_.source_rows[p]);
  });
  pos_[s] = last;
  if (in_.counters && s != me_)
    in_.counters->add(by_index_ ? in_.counters->combine_in_place_rows : in_.counters->combine_copied_rows,
                      last - first);
}

// One copy (our received row `row`) into origin s's window w, which starts at token t0.
void CombineCall::fill_copy(int s, int64_t w, int64_t t0, uint8_t* area, int32_t row) {
  const int64_t t = src_tok_[row];
  const int slot = expert_ ? src_slot_[row] : me_;
  const size_t idx = static_cast<size_t>(t - t0) * slots_ + slot;
  if (s == me_) {  // own copies are read in place by the reduction: no copy
    const size_t l = local_index(w, idx);
    local_rows_[l] = in_.x + row * row_bytes_;
    if (wbytes_) local_weights_[l] = in_.recv_weights + row * K_;
  } else if (by_index_) {  // the origin reads row `row` of our shared x
    const int64_t r64 = row;
    std::memcpy(area + idx * geo_.row_stride, &r64, sizeof(r64));
    if (wbytes_)
      std::memcpy(area + weights_off_ + idx * geo_.weight_stride, in_.recv_weights + row * K_, wbytes_);
  } else {
    // Plain stores: the origin reads this copy within the next window or two, from the cache.
    std::memcpy(area + idx * geo_.row_stride, in_.x + row * row_bytes_, row_bytes_);
    if (wbytes_)
      std::memcpy(area + weights_off_ + idx * geo_.weight_stride, in_.recv_weights + row * K_, wbytes_);
  }
}

// The copy of slot `slot` of token t in window w: our own expert output in place, a peer's shared row whose
// index the slot holds, or a peer's copy in the window; with its receiving-side weights (rank_major). The
// internode reduction's view (only holders of our node write into our window).
std::pair<const uint8_t*, const float*> CombineCall::reduce_copy_of(int64_t w, int64_t t, int slot) const {
  const size_t idx = static_cast<size_t>(t - w * W_) * slots_ + slot;
  const float* own = local_weights_[local_index(w, idx)];
  const uint8_t* win = my_area_ + static_cast<size_t>(w % halves_) * area_bytes_;
  return {copy_of(w, t, slot),
          own ? own : reinterpret_cast<const float*>(win + weights_off_ + idx * geo_.weight_stride)};
}

// The row of slot `slot` of token t in window w: in place (ours, or a holder's shared row whose index the
// slot holds) or in the window.
const uint8_t* CombineCall::copy_of(int64_t w, int64_t t, int slot) const {
  const size_t idx = static_cast<size_t>(t - w * W_) * slots_ + slot;
  if (const uint8_t* own = local_rows_[local_index(w, idx)]) return own;
  const uint8_t* in_window =
      my_area_ + static_cast<size_t>(w % halves_) * area_bytes_ + idx * geo_.row_stride;
  return slot_row(in_window, shared_x_[holder_of(t, slot)], row_bytes_);
}

// The contributions of token t in canonical order (slot k ascending, or rank d ascending).
int CombineCall::gather(int64_t w, int64_t t, const uint8_t** ptrs, float* ws) const {
  int n = 0;
  hd_.for_each_copy(t, [&](int slot, int) {
    ptrs[n] = copy_of(w, t, slot);
    if (expert_) ws[n] = in_.weights_used[t * K_ + slot];
    ++n;
  });
  return n;
}

// rank_major with receiving-side weights: combined_topk_weights of token t sums the holders' weight rows.
void CombineCall::sum_recv_weights(int64_t w, int64_t t) const {
  const uint8_t* win = my_area_ + static_cast<size_t>(w % halves_) * area_bytes_;
  const size_t first = static_cast<size_t>(t - w * W_) * slots_;
  for (int k = 0; k < K_; ++k) {
    float p = 0.0f;
    for (int d = 0; d < R_; ++d) {
      if (!hd_.in_rank[t * R_ + d]) continue;
      const float* lw = local_weights_[local_index(w, first + d)];
      const float* g =
          lw ? lw : reinterpret_cast<const float*>(win + weights_off_ + (first + d) * geo_.weight_stride);
      p = p + g[k];
    }
    cw_[t * K_ + k] = 0.0f + p;
  }
}

// Tokens [t0, t1) of window w with the scratch r. Inlined into reduce: called out of line, the one-thread
// rank_major combine at one rank ran 12-15% slower on the development VM.
[[gnu::always_inline]] inline void CombineCall::reduce_tokens(int64_t w, int64_t t0, int64_t t1,
                                                              TokenRows& r) const {
  for (int64_t t = t0; t < t1; ++t) {
    const int n = gather(w, t, r.rows, r.wts);
    // The kernel prefetches ahead within a row; the starts of the next token's rows are fetched here.
    if (t + 1 < t1) prefetch_row_starts(r.next, gather(w, t + 1, r.next, r.next_wts), row_bytes_);
    reduce_token(in_.dtype, r.rows, expert_ ? r.wts : nullptr, n, Hc_,
                 in_.bias1 ? in_.bias1 + t * row_bytes_ : nullptr,
                 in_.bias2 ? in_.bias2 + t * row_bytes_ : nullptr, cx_ + t * row_bytes_);
    if (!expert_ && cw_) sum_recv_weights(w, t);
  }
}

// Origin, one node: reduce window w into combined_x, its tokens split over the call's copy threads (each
// token reduced by one thread, in canonical order).
void CombineCall::reduce(int64_t w) {
  const int64_t t0 = w * W_, t1 = std::min(T_, t0 + W_);
  const int64_t bytes = (t1 - t0) * slots_ * static_cast<int64_t>(row_bytes_);  // the copies read, at most
  for_parts(in_.workers, in_.threads, bytes, t1 - t0, [&](int64_t b, int64_t e) {
    if (b == 0 && e == t1 - t0) return reduce_tokens(w, t0, t1, rows_);  // one thread: the call's own
    TokenRows mine;
    reduce_tokens(w, t0 + b, t0 + e, mine);
    store_fence();  // this thread's streaming stores, before the call returns them
  });
}

// The next window in w's half starts empty.
void CombineCall::clear_local(int64_t w) {
  const size_t first = local_index(w, 0);
  std::fill(local_rows_.begin() + first, local_rows_.begin() + first + WL_ * slots_, nullptr);
  std::fill(local_weights_.begin() + first, local_weights_.begin() + first + WL_ * slots_, nullptr);
}

void CombineCall::reduce_window(int64_t w) {
  if (inter_)
    hier_->reduce(w, [&](int64_t t, int slot) { return reduce_copy_of(w, t, slot); });
  else
    reduce(w);
  clear_local(w);
}

bool CombineCall::contributors_done(int64_t w) const {
  for (int p = 0; p < R_; ++p)
    if (hd_.tokens_per_rank[p] > 0 &&
        ctx_.cell(me_, p)->done.load(std::memory_order_acquire) < pack(seq_, w + 1))
      return false;
  return true;
}

// Opens our next window (two in flight) to its contributors, and across nodes sends its routing.
void CombineCall::open_window(bool& progressed) {
  if (!(opened_ < my_nwin_ && opened_ < reduced_ + halves_ && (!inter_ || hier_->routing_free(opened_))))
    return;
  if (inter_) hier_->send_routing(opened_);
  ++opened_;
  ctx_.control(me_)->combine_open.store(pack(seq_, opened_), std::memory_order_seq_cst);
  for (int p = 0; p < R_; ++p)
    if (hd_.tokens_per_rank[p] > 0 && p != me_ && !ctx_.remote(p)) ctx_.notify(p);
  progressed = true;
}

// Fills every origin's open windows; true once all are filled.
bool CombineCall::fill_origins(bool& progressed) {
  return serve_published_windows(
      ctx_, me_, &Control::combine_open, &PeerCell::done, filled_, nwin_, progressed, [&](int s, int64_t w) {
        fill(s, w);
        if (w + 1 == nwin_[s])
          done_us_[s] =
              std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t_start_).count();
      });
}

// Lending our shared rows to origin s: until it has closed its windows.
bool CombineCall::lending(int s) const {
  return by_index_ && s != me_ && nwin_[s] > 0 &&
         ctx_.control(s)->combine_open.load(std::memory_order_acquire) < pack(seq_, nwin_[s] + 1);
}

bool CombineCall::data_step(bool& progressed) {
  open_window(progressed);
  bool all = fill_origins(progressed);
  if (reduced_ < opened_ && contributors_done(reduced_)) {
    reduce_window(reduced_);
    ++reduced_;
    if (reduced_ == my_nwin_) {  // closed: holders that lent us their shared rows may return
      ctx_.control(me_)->combine_open.store(pack(seq_, my_nwin_ + 1), std::memory_order_seq_cst);
      if (by_index_ || std::any_of(shared_x_.begin(), shared_x_.end(), [](const uint8_t* q) { return q; }))
        for (int p = 0; p < R_; ++p)
          if (hd_.tokens_per_rank[p] > 0 && p != me_) ctx_.notify(p);
    }
    progressed = true;
  }
  for (int s = 0; s < R_; ++s)
    if (lending(s)) all = false;
  if (inter_) all = hier_->serve_as_proxy(progressed) && all;
  return all && reduced_ == my_nwin_;
}

std::vector<int> CombineCall::awaited_peers() const {
  std::vector<int> peers;
  for (int s = 0; s < R_; ++s)
    if (filled_[s] < nwin_[s]) add_awaited(peers, s, me_);
  for (int s = 0; s < R_; ++s)  // origins still reading our shared rows
    if (lending(s)) add_awaited(peers, s, me_);
  if (reduced_ < opened_)
    for (int p = 0; p < R_; ++p)
      if (hd_.tokens_per_rank[p] > 0 && ctx_.cell(me_, p)->done.load() < pack(seq_, reduced_ + 1))
        add_awaited(peers, p, me_);
  return peers;
}

void CombineCall::move_rows() {
  set_up_windows();
  ctx_.run(
      "data", [&](bool& progressed) { return data_step(progressed); }, [&] { return awaited_peers(); });
}

void CombineCall::finish() const {
  if (expert_ && cw_ && T_ * K_ > 0)  // none in low-latency mode
    std::memcpy(cw_, in_.weights_used.data(), sizeof(float) * T_ * K_);
  if (in_.cost_stats) add_cost_stats(*in_.cost_stats, done_us_);
}

}  // namespace

void run_combine(OpContext& ctx, const CombineInput& in, CombineOutput& out,
                 const std::function<void()>& on_shapes) {
  CombineCall call(ctx, in, out);
  call.exchange_headers();
  call.choose_geometry();
  call.poison_outputs();
  on_shapes();
  if (call.direct()) return run_direct(ctx, in, out);
  call.move_rows();
  call.finish();
}

}  // namespace epcomm::engine
