// engine/dispatch.cc — dispatch: each sender stages its tokens (quantized once) in its own segment, window
// by window (two halves, so staging overlaps pulling); every receiver walks each source's window and copies
// the rows it owns straight to their final offsets, computed from the exchanged counts. A sender whose x
// lies in its shared dispatch-input area stages only the routing; receivers read its rows in place.
// When every rank's outputs come from its output arena (one node; a cached dispatch only when the fresh one
// pushed: its handle keeps every row), senders push instead: each
// writes its rows straight into the receivers' recv_x (every rank knows every receiver's plan), and the
// windows carry only the routing, from which the receivers fill the rest of their outputs.
#include "engine/dispatch.h"

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <optional>

#include "engine/forward.h"
#include "engine/kernels.h"
#include "engine/row_copies.h"
#include "engine/staged_sender.h"
#include "engine/window_serve.h"
#include "quant/row.h"
#include "routing/layout.h"
#include "tensor/output_arena.h"

namespace epcomm::engine {
namespace {

using Clock = std::chrono::steady_clock;

int64_t num_windows(int64_t tokens, int64_t window) {
  return (tokens + window - 1) / window;
}

// Metadata staged after each token's payload: K ids and K weights (top-k) or R destination flags.
size_t meta_bytes_of(int num_topk, int num_ranks, bool cached) {
  if (cached) return 0;
  return num_topk > 0 ? static_cast<size_t>(num_topk) * 8 : static_cast<size_t>(num_ranks);
}

struct Outputs {
  uint8_t* data = nullptr;
  uint8_t* scales = nullptr;
  size_t data_row = 0, scale_row = 0;
  void* idx = nullptr;
  bool idx64 = true;
  float* weights = nullptr;
  int K = 0;
  int32_t *src_rank = nullptr, *src_token = nullptr, *src_slot = nullptr;
  uint32_t* node_mask = nullptr;  // internode: the handle's recv_node_mask
  bool pushed = false;            // the senders write the payload rows themselves
  RowCopies* copies = nullptr;    // the call's payload copies (over its copy threads)

  void copy_payload(int64_t row, const uint8_t* payload) const {
    if (pushed) return;
    copies->add(data + row * data_row, scale_row ? scales + row * scale_row : nullptr, payload);
  }
  void set_idx(int64_t row, int k, int64_t v) const {
    if (idx64)
      static_cast<int64_t*>(idx)[row * K + k] = v;
    else
      static_cast<int32_t*>(idx)[row * K + k] = static_cast<int32_t>(v);
  }
  // Row `row`'s top-k ids and weights from the token's global ids and weights: slot k holds its local
  // expert (ids[k] - base) and weight where it is kept, -1 and +0 elsewhere. Kept: slot `only` alone
  // (only >= 0), or every slot whose expert lies in [base, base + L). Runs once per received row, on random
  // routing: masks instead of branches (a branch per slot mispredicted about half the time), on local copies
  // (the stores cannot alias them).
  void set_topk(int64_t row, const int32_t* ids, const float* w, int64_t base, int64_t L, int only) const {
    const int n = K;
    auto kept = [&](int k, int64_t v) -> int64_t {  // 0: kept, -1: not kept
      const bool keep = only >= 0 ? k == only : static_cast<uint64_t>(v) < static_cast<uint64_t>(L);
      return static_cast<int64_t>(keep) - 1;
    };
    float* __restrict wr = weights + row * n;
    if (idx64) {
      int64_t* __restrict ir = static_cast<int64_t*>(idx) + row * n;
      for (int k = 0; k < n; ++k) {
        const int64_t v = ids[k] - base;
        ir[k] = v | kept(k, v);
      }
    } else {
      int32_t* __restrict ir = static_cast<int32_t*>(idx) + row * n;
      for (int k = 0; k < n; ++k) {
        const int64_t v = ids[k] - base;
        ir[k] = static_cast<int32_t>(v | kept(k, v));
      }
    }
    for (int k = 0; k < n; ++k) {
      const uint32_t bits = std::bit_cast<uint32_t>(w[k]) & ~static_cast<uint32_t>(kept(k, ids[k] - base));
      wr[k] = std::bit_cast<float>(bits);
    }
  }
  // PAD and tail rows: zero payload, ids -1, weights +0, source -1.
  void fill_empty(int64_t begin, int64_t end) const {
    if (begin >= end) return;
    std::memset(data + begin * data_row, 0, (end - begin) * data_row);
    if (scale_row) std::memset(scales + begin * scale_row, 0, (end - begin) * scale_row);
    for (int64_t r = begin; r < end; ++r) {
      if (idx)
        for (int k = 0; k < K; ++k) set_idx(r, k, -1);
      if (weights) std::memset(weights + r * K, 0, sizeof(float) * K);
      if (src_rank) src_rank[r] = src_token[r] = src_slot[r] = -1;
    }
  }
};

void poison(const Tensor& t, bool on) {
  if (on && t.nbytes()) std::memset(t.data(), 0xFF, t.nbytes());
}

// The rows one token of a source occupies on receiver d, in the order the receiver numbers them: the single
// rule the receiver (filling its outputs) and, with pushed rows, the sender (writing the payload) share.
// expert_major: one row per top-k slot whose expert d hosts, in slot order, at next[local expert]++;
// rank_major: one row when any slot's expert is on d, at next[0]++. f(row, k): k is the slot (expert_major)
// or -1. `next` is d's cursor array for this source (L entries, or one).
template <typename F>
void for_each_row(const routing::ExpertMap& map, bool by_expert, const int32_t* ids, int K, int d,
                  int64_t* next, F&& f) {
  if (by_expert) {
    for (int k = 0; k < K; ++k)
      if (map.hosts(d, ids[k])) f(next[ids[k] - d * map.num_local]++, k);
    return;
  }
  for (int k = 0; k < K; ++k)
    if (map.hosts(d, ids[k])) {
      f(next[0]++, -1);
      return;
    }
}

// A recv_x published to the senders stays reserved if the call fails: a peer that has not noticed the failure
// may still be writing rows into it, so its memory must never back another output. Kept until the process
// exits (a failed Buffer cannot be used again anyway).
class QuarantineOnFailure {
 public:
  QuarantineOnFailure() : exceptions_(std::uncaught_exceptions()) {}
  ~QuarantineOnFailure() {
    if (tensors_.empty() || std::uncaught_exceptions() == exceptions_) return;
    static std::mutex m;
    static auto* kept = new std::vector<Tensor>();  // never destroyed: peers may outlive static destructors
    std::lock_guard<std::mutex> lk(m);
    kept->insert(kept->end(), tensors_.begin(), tensors_.end());
  }
  void add(const Tensor& t) { tensors_.push_back(t); }
  QuarantineOnFailure(const QuarantineOnFailure&) = delete;
  QuarantineOnFailure& operator=(const QuarantineOnFailure&) = delete;

 private:
  std::vector<Tensor> tensors_;
  int exceptions_;
};

// Receiver d's outputs must be allocatable (a huge expert_alignment pads every expert that gets a token):
// InvalidUsage on every rank, before anything is allocated, when its N rows exceed 2^31 - 1 or the host's
// memory.
void check_receive_capacity(const OpContext& ctx, int d, int64_t rows, const RowFormat& f, int K, DType idx) {
  EPCOMM_CHECK(rows < (int64_t{1} << 31), ctx.prefix(), "argument: rank ", d, " would receive ", rows,
               " rows, more than 2^31 - 1");
  const double per_row = static_cast<double>(f.data_row_bytes + f.scale_row_bytes + 3 * sizeof(int32_t)) +
                         static_cast<double>(K) * static_cast<double>(dtype_size(idx) + sizeof(float));
  static const double memory =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  EPCOMM_CHECK(per_row * static_cast<double>(rows) <= memory, ctx.prefix(), "capacity: receiving rank ", d,
               " gets N = ", rows, " rows (", static_cast<int64_t>(per_row * static_cast<double>(rows)),
               " bytes of outputs), more than this host's memory (", static_cast<int64_t>(memory),
               " bytes); nothing was sent");
}

// Where push_rows writes each of our tokens' rows: up to `slots` (data, scales) destinations per token.
struct PushPlan {
  PushPlan(int slots_per_token, int64_t tokens)
      : slots(slots_per_token),
        rows(static_cast<size_t>(tokens) * slots_per_token),
        scales(rows.size()),
        count(static_cast<size_t>(tokens), 0) {}
  void add(int64_t t, uint8_t* row, uint8_t* scale) {
    const size_t i = static_cast<size_t>(t) * slots + count[static_cast<size_t>(t)]++;
    rows[i] = row;
    scales[i] = scale;
  }
  int slots;
  std::vector<uint8_t*> rows, scales;  // [T * slots]
  std::vector<int32_t> count;          // [T]: destinations of each token
};

// Writes every planned row: each token read once (quantized once), its rows and scales stored at their
// destinations, tokens split over the call's copy threads. The caller fences before publishing.
void write_pushed_rows(const DispatchInput& in, const RowFormat& f, const PushPlan& plan,
                       bool cache_resident) {
  const size_t bytes = f.data_row_bytes, scale_bytes = f.scale_row_bytes;
  const int64_t T = in.num_tokens;
  int64_t rows = 0;
  for (int32_t c : plan.count) rows += c;
  auto part = [&](int i, int n) {
    int64_t t0, t1;
    part_range(T, i, n, t0, t1);
    // One token's codes then scales (quantizing here), or its scales alone (a (data, scales) input).
    std::vector<uint8_t> token(f.quantize ? bytes + scale_bytes : scale_bytes);
    const uint8_t* scales = f.quantize ? token.data() + bytes : token.data();
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* x = in.x + t * in.x_row_bytes;
      if (f.quantize) {  // once per token, whatever the number of its rows
        quant::quantize_row(*f.quantize, in.x_dtype, x, in.hidden, token.data(), token.data() + bytes);
        x = token.data();
      } else if (in.scales) {
        gather_scales(token.data(), in.scales, t, in.scale_stride0, in.scale_stride1, f.scale_cols,
                      dtype_size(f.scale_dtype));
      }
      const size_t at = static_cast<size_t>(t) * plan.slots;
      write_token_rows(plan.rows.data() + at, plan.scales.data() + at, plan.count[static_cast<size_t>(t)], x,
                       bytes, scales, scale_bytes, cache_resident);
    }
    if (n > 1) store_fence();  // this thread's streaming stores, before the caller publishes them
  };
  const int threads = threads_for_bytes(in.threads, rows * static_cast<int64_t>(bytes + scale_bytes));
  if (in.workers && threads > 1)
    in.workers->run(threads, part);
  else
    part(0, 1);
}

}  // namespace

namespace {

// One dispatch call, phase by phase; run_dispatch below is its driver. The members are the call's state,
// shared by the phases; each phase is one method.
class DispatchCall {
 public:
  DispatchCall(OpContext& ctx, DispatchInput& in, DispatchOutput& out);
  void exchange_headers();     // 1. header (and counts), the first windows staged, every header in
  void plan_receives();        // 2. every receiver's rows, known on every rank
  void check_windows() const;  // 3. a segment that cannot hold one staged token
  void check_block_capacity(int d, const routing::ReceivePlan& p) const;
  void keep_my_starts(int d, const routing::ReceivePlan& p);
  bool write_sparse_pairs(HeaderData& h) const;
  const int32_t* pairs_of(int s, std::vector<int32_t>& dense) const;
  // Our rows are placed per expert of the receiver (expert_major with top-k), else as one run per receiver.
  bool by_expert() const { return in_.order == ReceiveOrder::expert_major && K_ > 0; }
  void set_up_outputs();  // 4. outputs, published to pushing senders, the handle's shape
  void move_rows();       // 5. rounds: stage own windows, pull (or push) every source's rows
  void finish() const;

 private:
  void stage(int64_t w);
  void stage_token(int64_t t, uint8_t* half, int64_t t0, bool rows);
  void start_internode();
  void fill_header();
  void allocate_outputs();
  void bind_outputs();
  void publish_recv_x();
  void fill_handle_shape();
  void set_up_rounds();
  void set_up_records();
  void record_rail(int s, const StagedWindow& win);
  uint32_t ids_mask(const int32_t* ids) const {
    uint32_t bits = 0;
    for (int k = 0; k < K_; ++k)
      if (ids[k] >= 0) bits |= expert_bit_[ids[k]];
    return bits;
  }
  uint32_t flags_mask(const uint8_t* m) const;
  void push_rows(const std::vector<char>& now);
  void plan_push(const std::vector<char>& now, PushPlan& plan);
  void pull(int s, int64_t w);
  void pull_cached(int s, int64_t w, int64_t t1, const StagedWindow& win, const uint8_t* sx);
  void pull_entry(int s, int64_t t, const uint8_t* payload, const uint8_t* m);
  bool out_ready(int d) const {
    return ctx_.control(d)->out_ready.load(std::memory_order_acquire) >= pack(seq_, 1);
  }
  bool pushed_by(int s) const {
    return ctx_.cell(me_, s)->pushed.load(std::memory_order_acquire) >= pack(seq_, 1);
  }
  int64_t elapsed_us(Clock::time_point t) const {
    return std::chrono::duration_cast<std::chrono::microseconds>(t - t_start_).count();
  }
  int64_t arena_offset(const Tensor& t) const {
    return arena_ ? arena_->offset_of(t.data(), t.nbytes()) : -1;
  }
  bool data_step(bool& progressed);
  bool pull_sources(bool& progressed);
  void serve_receivers(bool& progressed);
  std::vector<int> awaited_peers() const;

  OpContext& ctx_;
  DispatchInput& in_;
  DispatchOutput& out_;
  const int R_, me_;
  // Our tokens' routing. A fresh dispatch moves these vectors into its handle: their elements stay where
  // they are, so these pointers stay valid.
  const int32_t* const my_ids_;
  const float* const my_weights_;
  const uint8_t* const my_in_rank_;
  const HandleData* const hd_;
  HandleData* const nh_;
  const int K_;
  const bool has_topk_;
  const Clock::time_point t_start_;
  const RowFormat& f_;
  const size_t row_bytes_, meta_;
  Internode* const inter_;
  const int M_, my_node_;
  Transport& tp_;
  const OutputArena* const arena_;
  const uint64_t seq_;
  // Window geometry and staging are local: the first two windows are staged while the headers travel (our
  // data area is free: every op ends only once the peers are done with it).
  size_t lane_half_ = 0, net_meta_ = 0;  // net_meta: routing bytes per compact entry
  DispatchGeometry geo_;
  int64_t W_;
  int64_t row_window_;  // the capacity rule (docs/normal-mode.md) holds for the staged record, pushed or not
  uint8_t* const my_area_;
  bool share_x_ = false;
  bool can_push_ = false;
  bool push_ = false;    // decided once the headers are in
  StagedSender sender_;  // our windows (staged pull)
  RowCopies copies_;     // the payload rows a pulled window places here
  std::optional<AckForwarder> acks_;
  Clock::time_point t_headers_;
  std::vector<int64_t> tokens_of_;
  int L_ = 0;
  routing::ExpertMap map_{};
  routing::ReceivePlan plan_;
  std::vector<int64_t> rows_matrix_;  // every receiver's rows per source (the handle keeps it)
  std::vector<int64_t> my_starts_;    // receiver d's first row of each of our runs (keep_my_starts)
  int64_t host_rows_ = 0;             // rows all receivers get together
  int64_t N_ = 0, rows_ = 0;
  Outputs o_;
  const std::vector<int64_t>* rows_from_ = nullptr;
  QuarantineOnFailure quarantine_;
  const std::vector<int32_t>* my_dest_tokens_ = nullptr;
  std::vector<int64_t> nwin_, pulled_, done_us_;
  std::vector<int64_t> cursor_;  // receive cursors (fresh): next row of (s, j) expert_major, of s rank_major
  std::vector<int64_t> src_fill_, cached_pos_;
  std::vector<const uint8_t*> shared_x_;  // sources whose x lies in their shared dispatch-input area
  std::vector<char> pushed_to_;
  int push_left_ = 0;  // receivers of our tokens not served yet
  bool sent_ = false;  // in_.on_sent was called
  bool oversubscribed_ = false;
  std::vector<char> serve_;  // receivers the next pass serves (refilled at every poll, not reallocated)
  // Internode, fresh normal mode: the handle records the node masks of the rows and, as proxy, the entries of
  // the rail peers' windows (engine/handle_impl.h); walk_rail_[s]: we read rail peer s's windows to do so.
  bool record_ = false, record_masks_ = false;
  std::vector<uint32_t> expert_bit_;  // [E]: bit of the expert's rank on this node, 0 elsewhere
  std::vector<char> walk_rail_;
};

DispatchCall::DispatchCall(OpContext& ctx, DispatchInput& in, DispatchOutput& out)
    : ctx_(ctx),
      in_(in),
      out_(out),
      R_(ctx.size()),
      me_(ctx.rank()),
      my_ids_(in.ids.data()),
      my_weights_(in.weights.data()),
      my_in_rank_(in.in_rank.data()),
      hd_(in.handle.get()),
      nh_(out.handle.get()),
      K_(in.cached ? hd_->num_topk : in.num_topk),
      has_topk_(in.cached ? hd_->has_topk : in.num_topk > 0),
      t_start_(Clock::now()),
      f_(in.format),
      row_bytes_(in.format.data_row_bytes + in.format.scale_row_bytes),
      meta_(meta_bytes_of(K_, R_, in.cached)),
      inter_(ctx.internode()),
      M_(inter_ ? inter_->topo.num_nodes : 1),
      my_node_(ctx.node_of(me_)),
      tp_(ctx.transport()),
      arena_(tp_.output_arena().get()),
      seq_(ctx.seq()),
      my_area_(ctx.data(me_)),
      sender_(ctx),
      copies_(in.workers, in.threads, in.format.data_row_bytes, in.format.scale_row_bytes) {
  geo_ = window_geometry(ctx_, row_bytes_, meta_, lane_half_, net_meta_);
  W_ = geo_.window;
  row_window_ = W_;
  sender_.set_windows(W_ > 0 ? num_windows(in_.num_tokens, W_) : 0);
  // x in our shared dispatch-input area (one node, plain rows): receivers read the rows in place, the
  // windows carry only the routing (same geometry, so that every rank computes the same windows).
  share_x_ = !inter_ && in_.shared_offset >= 0 && !f_.quantize && !in_.scales;
  // Whether our rows can be pushed (every rank must say so): outputs in our output arena, x private (or
  // quantized here), one node, no cost statistics asked for (pushed rows land only once every rank has
  // arrived, so a late rank's delay would show in every element instead of its own: docs/normal-mode.md).
  // Quantizing senders quantize each token once and push its codes and scales; a (data, scales) input pushes
  // its data rows and gathers each token's scales once. A cached dispatch pushes when the fresh one did: its
  // handle says where every copy goes.
  record_ = inter_ && !in_.cached && in_.expert_block_rows == 0;
  record_masks_ = record_ && inter_->topo.ranks_per_node <= 32;
  can_push_ = arena_ && !inter_ && (!in_.cached || hd_->pushed) && !in_.cost_stats && !share_x_ &&
              (!out_.recv_x.data.defined() || arena_offset(out_.recv_x.data) >= 0) &&
              (!out_.recv_x.scales || arena_offset(*out_.recv_x.scales) >= 0);
}

// Stages window w into its half, its tokens split over the call's copy threads (each token's record is
// written by one thread).
void DispatchCall::stage(int64_t w) {
  uint8_t* half = my_area_ + static_cast<size_t>(w % 2) * geo_.half_bytes;
  const int64_t t0 = w * W_, t1 = std::min(in_.num_tokens, t0 + W_);
  if (in_.counters && !push_)
    in_.counters->add(
        share_x_ ? in_.counters->dispatch_in_place_tokens : in_.counters->dispatch_staged_tokens, t1 - t0);
  // With share_x only the routing is staged: receivers read the row in our dispatch-input area; pushed rows
  // are written into the receivers' outputs instead.
  const bool rows = !share_x_ && !push_;
  // The bytes a staged token reads (its x row, quantized or not); routing alone runs on this thread.
  const int64_t token_bytes = !rows         ? 0
                              : f_.quantize ? in_.hidden * static_cast<int64_t>(dtype_size(in_.x_dtype))
                                            : row_bytes_;
  for_parts(in_.workers, in_.threads, (t1 - t0) * token_bytes, t1 - t0, [&](int64_t b, int64_t e) {
    for (int64_t t = t0 + b; t < t0 + e; ++t) stage_token(t, half, t0, rows);
  });
}

void DispatchCall::stage_token(int64_t t, uint8_t* half, int64_t t0, bool rows) {
  uint8_t* dst = half + (t - t0) * geo_.row_stride;
  const uint8_t* x = in_.x + t * in_.x_row_bytes;
  if (rows && f_.quantize) {
    quant::quantize_row(*f_.quantize, in_.x_dtype, x, in_.hidden, dst, dst + f_.data_row_bytes);
  } else if (rows) {
    // Plain stores into a cache-sized window: the receivers read it from the shared cache.
    copy_row(dst, x, f_.data_row_bytes, true, geo_.cache_resident);
    if (in_.scales)
      gather_scales(dst + f_.data_row_bytes, in_.scales, t, in_.scale_stride0, in_.scale_stride1,
                    f_.scale_cols, dtype_size(f_.scale_dtype));
  }
  if (!meta_) return;
  uint8_t* m = half + W_ * geo_.row_stride + (t - t0) * geo_.meta_stride;
  if (K_ > 0) {
    std::memcpy(m, &my_ids_[t * K_], sizeof(int32_t) * K_);
    std::memcpy(m + 4 * K_, &my_weights_[t * K_], sizeof(float) * K_);
  } else {
    std::memcpy(m, &my_in_rank_[t * R_], R_);
  }
}

// Internode: the tokens each other node needs (ascending) go there as compact windows; as proxy of our rail
// peers we forward our node's acknowledgements.
void DispatchCall::start_internode() {
  const uint8_t* in_rank = in_.cached ? hd_->in_rank.data() : my_in_rank_;
  const Topology& topo = inter_->topo;
  std::vector<std::vector<int32_t>> node_tokens(M_);
  for (int64_t t = 0; t < in_.num_tokens; ++t)
    for (int n = 0; n < M_; ++n) {
      if (n == my_node_) continue;
      for (int p : topo.node_ranks[n])
        if (in_rank[t * R_ + p]) {
          node_tokens[n].push_back(static_cast<int32_t>(t));
          break;
        }
    }
  sender_.start_network(my_area_, geo_, lane_half_, net_meta_, in_.num_tokens, row_bytes_,
                        std::move(node_tokens));
  acks_.emplace(ctx_);
}

void DispatchCall::fill_header() {
  HeaderData& h = ctx_.begin_header(in_.cached                  ? OpKind::cached_dispatch
                                    : in_.expert_block_rows > 0 ? OpKind::low_latency_dispatch
                                                                : OpKind::dispatch);
  h.order = static_cast<uint32_t>(in_.order);
  h.flags =
      (has_topk_ ? kHasTopk | kHasWeights : 0) | (!has_topk_ ? kHasInRank : 0) | (can_push_ ? kPushRows : 0);
  h.num_experts = in_.num_experts;
  h.num_topk = K_;
  h.dtype = static_cast<int32_t>(f_.data_dtype);
  h.quant_mode = f_.plain ? -1 : static_cast<int32_t>(f_.mode);
  h.hidden = in_.hidden;
  h.row_bytes = static_cast<int64_t>(row_bytes_);
  h.num_tokens = in_.num_tokens;
  h.expert_alignment = in_.expert_alignment;
  h.num_worst_tokens = in_.num_worst_tokens;
  h.expert_block_rows = in_.expert_block_rows;
  h.handle_id = in_.cached ? hd_->seq : 0;
  h.input_offset = share_x_ ? in_.shared_offset : -1;
  std::copy(std::begin(in_.chunks), std::end(in_.chunks), h.chunks);
  if (!in_.cached) {
    h.num_counts = in_.num_experts + R_;
    int32_t* c = ctx_.counts(me_);
    if (!write_sparse_pairs(h)) std::copy(in_.pairs_per_expert.begin(), in_.pairs_per_expert.end(), c);
    std::copy(in_.tokens_per_rank.begin(), in_.tokens_per_rank.end(), c + in_.num_experts);
  }
  if (inter_) {  // the proxies learn from the counts which of their node's ranks pull our rows (cached too)
    const std::vector<int32_t>& tpr = in_.cached ? hd_->tokens_per_rank : in_.tokens_per_rank;
    h.num_counts = in_.num_experts + R_;
    int32_t* c = ctx_.counts(me_);
    if (in_.cached) std::fill(c, c + in_.num_experts, 0);
    std::copy(tpr.begin(), tpr.end(), c + in_.num_experts);
  }
}

// Lists our non-zero pairs per expert in the header when they are few (kSparseCounts); false otherwise.
bool DispatchCall::write_sparse_pairs(HeaderData& h) const {
  int n = 0;
  for (int e = 0; e < in_.num_experts; ++e) {
    const int32_t c = in_.pairs_per_expert[e];
    if (c == 0) continue;
    if (n == kSparseCounts) return false;
    h.sparse[2 * n] = e;
    h.sparse[2 * n + 1] = c;
    ++n;
  }
  h.num_sparse = n;
  return true;
}

// Rank s's pairs per expert: ours, its counts array, or (listed sparsely in its header) a dense copy here.
const int32_t* DispatchCall::pairs_of(int s, std::vector<int32_t>& dense) const {
  if (s == me_) return in_.pairs_per_expert.data();
  const HeaderData* h = ctx_.header(s);
  if (h->num_sparse < 0) return ctx_.counts(s);
  const size_t E = static_cast<size_t>(in_.num_experts);
  int32_t* row = dense.data() + static_cast<size_t>(s) * E;
  std::fill(row, row + E, 0);
  for (int i = 0; i < h->num_sparse; ++i) {
    const int32_t e = h->sparse[2 * i];
    EPCOMM_CHECK_INTERNAL(e >= 0 && e < in_.num_experts, ctx_.prefix(), "internal: ", ctx_.peer_name(s),
                          " listed expert ", e, " of ", in_.num_experts);
    row[e] = h->sparse[2 * i + 1];
  }
  return row;
}

void DispatchCall::exchange_headers() {
  if (inter_) start_internode();
  fill_header();
  ctx_.publish_header();
  // (A rank that may push stages nothing yet: its windows' geometry depends on whether every rank pushes.)
  while (!can_push_ && sender_.staged() < std::min<int64_t>(sender_.windows(), 2))
    sender_.stage_next([this](int64_t w) { stage(w); });
  if (inter_)
    ctx_.exchange_headers([&](bool& progressed) { sender_.send(progressed); });
  else
    ctx_.exchange_headers();
  check_headers_match(ctx_);
  push_ = true;
  for (int r = 0; r < R_; ++r) push_ = push_ && (ctx_.header(r)->flags & kPushRows);
  if (push_) {  // the windows carry only the routing
    geo_ = window_geometry(ctx_, 0, meta_, lane_half_, net_meta_);
    W_ = geo_.window;
    sender_.set_windows(num_windows(in_.num_tokens, W_));
  }
  t_headers_ = Clock::now();
  tokens_of_.resize(R_);
  for (int s = 0; s < R_; ++s) tokens_of_[s] = ctx_.header(s)->num_tokens;
}

void DispatchCall::plan_receives() {
  L_ = in_.num_experts / R_;
  map_ = routing::ExpertMap{in_.num_experts, R_, L_};
  my_starts_.resize(push_ ? static_cast<size_t>(R_) * (by_expert() ? L_ : 1) : 0);
  host_rows_ = in_.cached ? hd_->host_recv_rows : 0;
  if (in_.cached) return;
  std::vector<const int32_t*> pairs(R_), toks(R_);
  thread_local std::vector<int32_t> dense;  // the sparsely listed sources' pairs, rebuilt (kept across calls)
  dense.resize(static_cast<size_t>(R_) * in_.num_experts);
  for (int s = 0; s < R_; ++s) {
    pairs[s] = pairs_of(s, dense);
    toks[s] = ctx_.counts(s) + in_.num_experts;
  }
  rows_matrix_.assign(static_cast<size_t>(R_) * R_, 0);
  routing::ReceivePlan other;  // every other receiver's plan, one after the other in the same vectors
  for (int d = 0; d < R_; ++d) {
    routing::ReceivePlan& p = d == me_ ? plan_ : other;
    routing::plan_receive(p, d, in_.order, map_, in_.expert_alignment, pairs, toks, in_.expert_block_rows);
    check_block_capacity(d, p);
    for (int s = 0; s < R_; ++s) rows_matrix_[static_cast<size_t>(s) * R_ + d] = p.rows_per_source[s];
    int64_t worst = ctx_.header(d)->num_worst_tokens;
    if (worst > 0 && p.num_recv_rows > worst)
      EPCOMM_THROW(InvalidUsage, ctx_.prefix(), "capacity: receiving rank ", d, " gets N = ", p.num_recv_rows,
                   " rows but its num_worst_tokens = ", worst,
                   "; nothing was sent (rows are never truncated)");
    check_receive_capacity(ctx_, d, p.num_recv_rows, f_, K_, in_.idx_dtype);  // every rank, every receiver
    if (push_) keep_my_starts(d, p);
    // The rows written (a low-latency block's unused rows are never touched).
    host_rows_ +=
        in_.expert_block_rows > 0 ? std::accumulate(p.cnt.begin(), p.cnt.end(), int64_t{0}) : p.num_recv_rows;
  }
}

// Where our rows start on receiver d, for push_rows: our run of each of d's local experts (expert_major with
// top-k), or our one run (rank_major, or no top-k).
void DispatchCall::keep_my_starts(int d, const routing::ReceivePlan& p) {
  if (by_expert()) {
    const auto mine = p.start.begin() + static_cast<ptrdiff_t>(me_) * L_;
    std::copy(mine, mine + L_, my_starts_.begin() + static_cast<ptrdiff_t>(d) * L_);
  } else {
    my_starts_[d] = p.start[me_];
  }
}

// Low-latency layout: an expert's pairs must fit its block of R * T_max rows. With distinct experts per
// token (checked by the API) they always do; this guards the invariant the block offsets rely on.
void DispatchCall::check_block_capacity(int d, const routing::ReceivePlan& p) const {
  for (int j = 0; j < L_ && in_.expert_block_rows > 0; ++j)
    if (p.cnt[j] > in_.expert_block_rows)
      EPCOMM_THROW(InvalidUsage, ctx_.prefix(), "capacity: local expert ", j, " of rank ", d, " gets ",
                   p.cnt[j], " rows, more than its block of ", in_.expert_block_rows,
                   " (num_ranks x num_max_dispatch_tokens_per_rank); nothing was sent");
}

// Only a segment that cannot hold one staged token is an error (every rank sees the same sizes).
void DispatchCall::check_windows() const {
  if (geo_.window < 1 && inter_ && dispatch_geometry(ctx_.layout().data_bytes, row_bytes_, meta_).window >= 1)
    EPCOMM_THROW(InvalidUsage, ctx_.prefix(), "capacity: num_rdma_bytes = ", inter_->lane.bytes * M_,
                 " (one lane of ", inter_->lane.bytes, " bytes per node) cannot hold one forwarded token of ",
                 row_bytes_, " bytes (+", meta_, " bytes of routing); the minimum for this call is ",
                 min_rdma_bytes_for(ctx_, geo_, net_meta_));
  if (row_window_ < 1)
    EPCOMM_THROW(InvalidUsage, ctx_.prefix(), "capacity: num_nvl_bytes = ", ctx_.layout().total,
                 " cannot hold one staged token of ", row_bytes_, " bytes (+", meta_,
                 " bytes of routing); the minimum for this call is ",
                 control_bytes(R_) + dispatch_min_data_bytes(row_bytes_, meta_));
}

// Outputs whose shape is known locally (cached and worst-case dispatch) were allocated by the caller.
void DispatchCall::allocate_outputs() {
  if (out_.recv_x.data.defined()) return;
  out_.recv_x.data = in_.allocator->allocate(f_.data_dtype, {rows_, f_.data_cols});
  if (f_.scale_row_bytes) {
    Shape ss = f_.scale_shape == RowFormat::ScaleShape::vec   ? Shape{rows_}
               : f_.scale_shape == RowFormat::ScaleShape::mat ? Shape{rows_, f_.scale_cols}
                                                              : Shape{rows_ * f_.scale_cols};
    out_.recv_x.scales = in_.allocator->allocate(f_.scale_dtype, ss);
  }
  if (!in_.cached && has_topk_ && in_.expert_block_rows == 0) {
    out_.recv_topk_idx = in_.allocator->allocate(in_.idx_dtype, {rows_, K_});
    out_.recv_topk_weights = in_.allocator->allocate(DType::f32, {rows_, K_});
  }
}

// Points o_ at the outputs (poisoned first when asked) and writes their PAD and tail rows.
void DispatchCall::bind_outputs() {
  poison(out_.recv_x.data, in_.poison);
  if (out_.recv_x.scales) poison(*out_.recv_x.scales, in_.poison);
  o_.data = out_.recv_x.data.data_as<uint8_t>();
  o_.data_row = f_.data_row_bytes;
  o_.copies = &copies_;
  if (f_.scale_row_bytes) {
    o_.scales = out_.recv_x.scales->data_as<uint8_t>();
    o_.scale_row = f_.scale_row_bytes;
  }
  o_.K = K_;
  if (in_.cached) {
    const int32_t* src = hd_->recv_src_rank.data_as<int32_t>();
    for (int64_t r = 0; r < rows_; ++r)
      if (src[r] < 0) o_.fill_empty(r, r + 1);
    return;
  }
  if (has_topk_ && out_.recv_topk_idx) {
    poison(*out_.recv_topk_idx, in_.poison);
    poison(*out_.recv_topk_weights, in_.poison);
    o_.idx = out_.recv_topk_idx->data();
    o_.idx64 = in_.idx_dtype == DType::i64;
    o_.weights = out_.recv_topk_weights->data_as<float>();
  }
  if (!nh_->recv_src_rank.defined()) {
    nh_->recv_src_rank = in_.allocator->allocate(DType::i32, {rows_});
    nh_->recv_src_token = in_.allocator->allocate(DType::i32, {rows_});
    nh_->recv_src_slot = in_.allocator->allocate(DType::i32, {rows_});
  }
  o_.src_rank = nh_->recv_src_rank.data_as<int32_t>();
  o_.src_token = nh_->recv_src_token.data_as<int32_t>();
  o_.src_slot = nh_->recv_src_slot.data_as<int32_t>();
  // Low-latency blocks: the rows past each expert's pairs stay unwritten, source entries included (spec:
  // unspecified; nothing reads them), so a call touches only the memory its rows fill.
  if (in_.expert_block_rows == 0 && in_.order == ReceiveOrder::expert_major) {
    for (int j = 0; j < L_; ++j) o_.fill_empty(plan_.pad_begin[j], plan_.block_end[j]);
  }
  o_.fill_empty(N_, rows_);
  out_.list = in_.num_worst_tokens > 0 ? std::vector<int64_t>{} : plan_.list;
}

// Our recv_x is ready (PAD rows and poison written): the senders may write into it now.
void DispatchCall::publish_recv_x() {
  const int64_t off = arena_offset(out_.recv_x.data);
  EPCOMM_CHECK(off >= 0, ctx_.prefix(),
               "allocator: Allocator::adopt returned memory outside this rank's "
               "output arena for recv_x; it must view the arena's bytes (or set num_output_arena_bytes = 0)");
  const int64_t scale_off = out_.recv_x.scales ? arena_offset(*out_.recv_x.scales) : -1;
  EPCOMM_CHECK(
      !f_.scale_row_bytes || scale_off >= 0, ctx_.prefix(),
      "allocator: Allocator::adopt returned memory outside this rank's output arena for the scales of "
      "recv_x; it must view the arena's bytes (or set num_output_arena_bytes = 0)");
  o_.pushed = true;
  quarantine_.add(out_.recv_x.data);
  if (out_.recv_x.scales) quarantine_.add(*out_.recv_x.scales);
  ctx_.control(me_)->out_offset = off;
  ctx_.control(me_)->out_scale_offset = scale_off;
  ctx_.control(me_)->out_ready.store(pack(seq_, 1), std::memory_order_release);
  for (int s = 0; s < R_; ++s)
    if (s != me_ && (*rows_from_)[s] > 0) ctx_.notify(s);
}

// The handle's shape fields are final before on_shapes(); the row lists fill in during the data phase.
void DispatchCall::fill_handle_shape() {
  nh_->seq = ctx_.seq();
  nh_->order = in_.order;
  nh_->num_ranks = R_;
  nh_->num_experts = in_.num_experts;
  nh_->num_topk = K_;
  nh_->num_local = L_;
  nh_->num_tokens = in_.num_tokens;
  nh_->num_recv_rows = N_;
  nh_->host_recv_rows = host_rows_;
  nh_->num_rows = rows_;
  nh_->expert_alignment = in_.expert_alignment;
  nh_->num_worst_tokens = in_.num_worst_tokens;
  nh_->expert_block_rows = in_.expert_block_rows;
  nh_->hidden = in_.hidden;
  nh_->has_topk = has_topk_;
  nh_->topk_ids = std::move(in_.ids);
  nh_->topk_weights = std::move(in_.weights);
  nh_->in_rank = std::move(in_.in_rank);
  nh_->tokens_per_rank = in_.tokens_per_rank;
  nh_->list = plan_.list;
  nh_->cnt = plan_.cnt;
  nh_->rows_per_source = plan_.rows_per_source;
  nh_->rows_matrix = std::move(rows_matrix_);
}

void DispatchCall::set_up_outputs() {
  N_ = in_.cached ? hd_->num_recv_rows : plan_.num_recv_rows;
  rows_ = in_.cached ? hd_->num_rows : (in_.num_worst_tokens > 0 ? in_.num_worst_tokens : N_);
  allocate_outputs();
  bind_outputs();
  rows_from_ = in_.cached ? &hd_->rows_per_source : &plan_.rows_per_source;
  if (push_) publish_recv_x();
  if (!in_.cached) fill_handle_shape();
}

void DispatchCall::set_up_rounds() {
  my_dest_tokens_ = in_.cached ? &hd_->tokens_per_rank : &in_.tokens_per_rank;
  std::vector<uint8_t> receivers(R_);
  for (int d = 0; d < R_; ++d) receivers[d] = (*my_dest_tokens_)[d] > 0;
  sender_.set_receivers(std::move(receivers));
  nwin_.assign(R_, 0);
  pulled_.assign(R_, 0);
  done_us_.assign(R_, -1);
  set_up_records();
  for (int s = 0; s < R_; ++s) {
    nwin_[s] = (*rows_from_)[s] > 0 || walk_rail_[s] ? num_windows(tokens_of_[s], W_) : 0;
    if ((*rows_from_)[s] == 0) done_us_[s] = elapsed_us(t_headers_);
  }
  cursor_ = plan_.start;
  if (!in_.cached) {
    nh_->source_offsets.assign(R_ + 1, 0);
    for (int s = 0; s < R_; ++s) nh_->source_offsets[s + 1] = nh_->source_offsets[s] + (*rows_from_)[s];
    nh_->source_rows.resize(nh_->source_offsets[R_]);
    src_fill_.assign(nh_->source_offsets.begin(), nh_->source_offsets.end() - 1);
  }
  cached_pos_.assign(R_, 0);
  if (in_.cached)
    for (int s = 0; s < R_; ++s) cached_pos_[s] = hd_->source_offsets[s];
  shared_x_.assign(R_, nullptr);
  for (int s = 0; s < R_; ++s) shared_x_[s] = ctx_.shared_input(s);
  pushed_to_.assign(R_, 0);
  if (push_) {
    for (int d = 0; d < R_; ++d) push_left_ += (*my_dest_tokens_)[d] > 0;
    if (!in_.cached) {
      nh_->send_rows.assign(static_cast<size_t>(in_.num_tokens) * nh_->copy_slots(), -1);
      nh_->pushed = true;
    }
  }
  oversubscribed_ = tp_.oversubscribed();
  serve_.assign(R_, 0);
}

// What the handle records across nodes (engine/handle_impl.h). As proxy we read every window a rail peer
// sends to this node, whether or not we receive rows from it (and acknowledge it: the AckForwarder counts us
// then).
void DispatchCall::set_up_records() {
  walk_rail_.assign(R_, 0);
  if (!record_) return;
  const Topology& topo = inter_->topo;
  expert_bit_.assign(static_cast<size_t>(in_.num_experts), 0);
  for (int e = 0; e < in_.num_experts && record_masks_ && L_ > 0; ++e)
    if (topo.is_local(e / L_)) expert_bit_[e] = uint32_t{1} << topo.local_index[e / L_];
  if (record_masks_) nh_->recv_node_mask.assign(static_cast<size_t>(rows_), 0);
  o_.node_mask = record_masks_ ? nh_->recv_node_mask.data() : nullptr;
  nh_->rail_tokens.assign(M_, {});
  nh_->rail_ids.assign(M_, {});
  nh_->rail_masks.assign(M_, {});
  nh_->rail_num_tokens.assign(M_, 0);
  for (int n = 0; n < M_; ++n) {
    const int s = topo.rail(n);
    nh_->rail_num_tokens[n] = tokens_of_[s];
    if (n == my_node_) continue;
    const int32_t* tpr = ctx_.counts(s) + ctx_.header(s)->num_counts - R_;
    for (int d : topo.node_ranks[my_node_]) walk_rail_[s] = walk_rail_[s] || tpr[d] > 0;
  }
}

uint32_t DispatchCall::flags_mask(const uint8_t* m) const {
  uint32_t bits = 0;
  const std::vector<int>& ranks = inter_->topo.node_ranks[my_node_];
  for (size_t j = 0; j < ranks.size(); ++j) bits |= static_cast<uint32_t>(m[ranks[j]] != 0) << j;
  return bits;
}

// The entries of rail peer s's window w, as its proxy (engine/handle_impl.h).
void DispatchCall::record_rail(int s, const StagedWindow& win) {
  const int n = ctx_.node_of(s);
  std::vector<int32_t>& tokens = nh_->rail_tokens[n];
  std::vector<int32_t>& ids = nh_->rail_ids[n];
  std::vector<uint32_t>& masks = nh_->rail_masks[n];
  for (int64_t e = 0; e < win.count; ++e) {
    tokens.push_back(static_cast<int32_t>(win.token(e)));
    const uint8_t* m = win.meta(e);
    if (K_ == 0) {
      if (record_masks_) masks.push_back(flags_mask(m));
      continue;
    }
    const size_t at = ids.size();
    ids.resize(at + K_);
    std::memcpy(ids.data() + at, m, sizeof(int32_t) * K_);
    if (record_masks_) masks.push_back(ids_mask(ids.data() + at));
  }
}

// Where each of our tokens' rows goes on the receivers in `now`: a cached dispatch reads it in its handle,
// a fresh one follows the receivers' plans (the order matches their reading of our routing: ascending
// tokens, top-k slots in order) and records it in its handle.
void DispatchCall::plan_push(const std::vector<char>& now, PushPlan& plan) {
  std::vector<uint8_t*> dest(R_, nullptr), dest_scales(R_, nullptr);
  std::vector<int64_t> next(R_, 0);              // rank_major: receiver d's next row for our tokens
  std::vector<std::vector<int64_t>> next_e(R_);  // expert_major: per local expert of d
  const bool by_expert = this->by_expert();
  for (int d = 0; d < R_; ++d) {
    if (!now[d]) continue;
    dest[d] = tp_.arena(d) + ctx_.control(d)->out_offset;
    if (f_.scale_row_bytes) dest_scales[d] = tp_.arena(d) + ctx_.control(d)->out_scale_offset;
    if (in_.cached) continue;  // the handle's send_rows give the rows
    if (by_expert)
      next_e[d].assign(my_starts_.begin() + static_cast<ptrdiff_t>(d) * L_,
                       my_starts_.begin() + static_cast<ptrdiff_t>(d + 1) * L_);
    else
      next[d] = my_starts_[d];
  }
  int32_t* send_rows = in_.cached ? nullptr : nh_->send_rows.data();
  const int32_t* sent_to = in_.cached ? hd_->send_rows.data() : nullptr;
  const size_t bytes = f_.data_row_bytes, scale_bytes = f_.scale_row_bytes;
  for (int64_t t = 0; t < in_.num_tokens; ++t) {
    auto put = [&](int d, int64_t row) {
      plan.add(t, dest[d] + row * bytes, scale_bytes ? dest_scales[d] + row * scale_bytes : nullptr);
    };
    if (in_.cached) {  // the same rows as the fresh dispatch
      hd_->for_each_copy(t, [&](int slot, int holder) {
        if (now[holder]) put(holder, sent_to[t * plan.slots + slot]);
      });
      continue;
    }
    for (int d = 0; d < R_; ++d) {
      if (!now[d]) continue;
      auto write = [&](int64_t row, int k) {
        put(d, row);
        send_rows[t * plan.slots + (by_expert ? k : d)] = static_cast<int32_t>(row);
      };
      if (K_ == 0) {
        if (my_in_rank_[t * R_ + d]) write(next[d]++, -1);
      } else {
        for_each_row(map_, by_expert, &my_ids_[t * K_], K_, d, by_expert ? next_e[d].data() : &next[d],
                     write);
      }
    }
  }
}

// Push: once a receiver of our tokens has published its recv_x, we write each of its rows once, straight into
// its place there, then fence and raise our cell in its segment. One pass over our tokens serves every
// receiver ready by then (one read of a token for all its rows); a receiver that comes later gets a pass of
// its own, so that a late rank does not hold up the others' rows (unless the ranks outnumber the cores:
// then we wait for all of them, serve_receivers).
void DispatchCall::push_rows(const std::vector<char>& now) {
  PushPlan plan((in_.cached ? *hd_ : *nh_).copy_slots(), in_.num_tokens);  // entries per token of send_rows
  plan_push(now, plan);
  // Few rows in all: plain stores, so that the receivers find them in the shared cache. Low-latency blocks
  // take half that: their rows lie sparsely at the start of each expert's R * T_max block of a large output,
  // lines no cache holds, and each plain store first reads its line (fp8 decode shape, 15 MB per host:
  // streaming 0.80-0.87 ms against 1.28 plain; bf16 at 7.3 MB: plain 5-10% faster).
  const size_t limit =
      in_.expert_block_rows > 0 ? cache_resident_push_bytes() / 2 : cache_resident_push_bytes();
  write_pushed_rows(in_, f_, plan, static_cast<size_t>(host_rows_) * row_bytes_ <= limit);
  store_fence();  // one fence for all the rows' streaming stores, before the releases that publish them
  for (int d = 0; d < R_; ++d)
    if (now[d]) {
      pushed_to_[d] = 1;
      --push_left_;
      ctx_.signal(ctx_.cell(d, me_)->pushed, pack(seq_, 1), d);
    }
}

// A cached dispatch: the handle lists the rows of source s in its window's token range, in token order.
void DispatchCall::pull_cached(int s, int64_t w, int64_t t1, const StagedWindow& win, const uint8_t* sx) {
  const int32_t* src_tok = hd_->recv_src_token.data_as<int32_t>();
  int64_t& pos = cached_pos_[s];
  const int64_t end = hd_->source_offsets[s + 1];
  int64_t e = 0;
  while (pos < end) {
    int32_t row = hd_->source_rows[pos];
    if (src_tok[row] >= t1) break;
    while (e < win.count && win.token(e) < src_tok[row]) ++e;  // ascending; holds every token we need
    EPCOMM_CHECK_INTERNAL(e < win.count && win.token(e) == src_tok[row], ctx_.prefix(), "internal: token ",
                          src_tok[row], " of rank ", s, " missing from its forwarded window ", w);
    o_.copy_payload(row, sx ? sx + win.token(e) * row_bytes_ : win.payload(e));
    ++pos;
  }
  copies_.flush();
}

// One staged entry of source s (token t, its payload and routing): the rows it occupies here.
void DispatchCall::pull_entry(int s, int64_t t, const uint8_t* payload, const uint8_t* m) {
  if (K_ == 0) {  // rank_major without top-k
    if (!m[me_]) return;
    int64_t row = cursor_[s]++;
    o_.copy_payload(row, payload);
    if (o_.node_mask) o_.node_mask[row] = flags_mask(m);
    o_.src_rank[row] = s;
    o_.src_token[row] = static_cast<int32_t>(t);
    o_.src_slot[row] = -1;
    nh_->source_rows[src_fill_[s]++] = static_cast<int32_t>(row);
    return;
  }
  int32_t ids[64];
  float ws[64];
  const int32_t* idp = reinterpret_cast<const int32_t*>(m);
  const float* wp = reinterpret_cast<const float*>(m + 4 * K_);
  if (K_ <= 64) {
    std::memcpy(ids, idp, 4 * K_);
    std::memcpy(ws, wp, 4 * K_);
    idp = ids;
    wp = ws;
  }
  const bool by_expert = in_.order == ReceiveOrder::expert_major;
  int64_t* next = &cursor_[by_expert ? static_cast<size_t>(s) * L_ : static_cast<size_t>(s)];
  const uint32_t mask = o_.node_mask ? ids_mask(idp) : 0;
  for_each_row(map_, by_expert, idp, K_, me_, next, [&](int64_t row, int k) {
    o_.copy_payload(row, payload);
    if (o_.node_mask) o_.node_mask[row] = mask;
    // expert_major: the row of slot k (its local expert there, -1 and +0 elsewhere); rank_major: the token's
    // row (every slot whose expert is here).
    if (o_.idx) o_.set_topk(row, idp, wp, static_cast<int64_t>(me_) * L_, L_, by_expert ? k : -1);
    o_.src_rank[row] = s;
    o_.src_token[row] = static_cast<int32_t>(t);
    o_.src_slot[row] = k;
    nh_->source_rows[src_fill_[s]++] = static_cast<int32_t>(row);
  });
}

void DispatchCall::pull(int s, int64_t w) {
  const int64_t t0 = w * W_, t1 = std::min(tokens_of_[s], t0 + W_);
  const StagedWindow win = StagedWindow::of(ctx_, s, w, geo_, lane_half_, net_meta_, tokens_of_[s]);
  const uint8_t* sx = shared_x_[s];
  if (in_.cached) return pull_cached(s, w, t1, win, sx);
  if (walk_rail_[s]) record_rail(s, win);
  if ((*rows_from_)[s] == 0) return;  // read as proxy only
  for (int64_t e = 0; e < win.count; ++e)
    pull_entry(s, win.token(e), sx ? sx + win.token(e) * row_bytes_ : win.payload(e), win.meta(e));
  copies_.flush();  // the window's rows, over the copy threads, before its acknowledgement
}

// Every source's staged windows that are out; true once all are read and, pushing, its rows written.
bool DispatchCall::pull_sources(bool& progressed) {
  serve_published_windows(ctx_, me_, &Control::stage_ready, &PeerCell::ack, pulled_, nwin_, progressed,
                          [&](int s, int64_t w) { pull(s, w); });
  bool all = true;
  for (int s = 0; s < R_; ++s) {
    const bool done = pulled_[s] == nwin_[s] && (!push_ || nwin_[s] == 0 || pushed_by(s));
    if (done && done_us_[s] < 0) done_us_[s] = elapsed_us(Clock::now());
    all = all && done;
  }
  return all;
}

// Our rows, to every receiver whose recv_x is out.
void DispatchCall::serve_receivers(bool& progressed) {
  int ready = 0;
  for (int d = 0; d < R_; ++d)
    ready += serve_[d] = !pushed_to_[d] && (*my_dest_tokens_)[d] > 0 && out_ready(d);
  // Ranks outnumbering the cores: a receiver not ready yet is mostly waiting for a core, which our pass would
  // hold for milliseconds, and serving it later costs a second read of every token. Wait (asleep) until every
  // receiver is ready and serve them all in one pass.
  if (ready > 0 && (ready == push_left_ || !oversubscribed_)) {
    push_rows(serve_);
    progressed = true;  // (data_step's `all` already counted this pass as pending)
  }
}

// One poll of the data phase; true once the call's part is done.
bool DispatchCall::data_step(bool& progressed) {
  // Internode: every staged window goes to the proxies of the nodes that need our tokens (only once the
  // headers are in: their lanes are free then).
  // Done once every window is staged, acknowledged and sent (so that the next call may reuse the area) and
  // every source's windows are pulled.
  bool all = sender_.step(progressed, [this](int64_t w) { stage(w); }) && push_left_ == 0;
  if (inter_) {
    // As proxy of rail peer s: the ranks of our node that pull from s (its counts say so).
    // (and we, reading its windows for the handle: set_up_records)
    auto receives = [&](int s, int d) {
      return ctx_.counts(s)[ctx_.header(s)->num_counts - R_ + d] > 0 || (d == me_ && walk_rail_[s]);
    };
    auto windows = [&](int s) { return num_windows(tokens_of_[s], W_); };
    all = acks_->step(progressed, receives, windows) && all;
  }
  all = pull_sources(progressed) && all;
  // After the routing windows above: the metadata of the rows we receive is filled (and acknowledged)
  // before our long pass, not after it.
  if (push_left_ > 0) serve_receivers(progressed);
  if (in_.on_sent && !sent_ && push_left_ == 0 && sender_.staged() == sender_.windows()) {
    sent_ = true;
    in_.on_sent();
  }
  return all;
}

// The peers a stalled data phase waits for: sources not yet staged, receivers whose recv_x we wait for, and
// receivers whose acknowledgements block our staging.
std::vector<int> DispatchCall::awaited_peers() const {
  std::vector<int> peers;
  for (int s = 0; s < R_; ++s)
    if (pulled_[s] < nwin_[s] || (push_ && nwin_[s] > 0 && !pushed_by(s))) add_awaited(peers, s, me_);
  if (push_left_ > 0)
    for (int d = 0; d < R_; ++d)
      if ((*my_dest_tokens_)[d] > 0 && !pushed_to_[d] && !out_ready(d)) add_awaited(peers, d, me_);
  if (!sender_.done()) sender_.add_awaited(peers);
  return peers;
}

void DispatchCall::move_rows() {
  set_up_rounds();
  ctx_.run(
      "data", [&](bool& progressed) { return data_step(progressed); }, [&] { return awaited_peers(); });
}

void DispatchCall::finish() const {
  if (push_ && in_.counters) in_.counters->add(in_.counters->dispatch_pushed_tokens, in_.num_tokens);
  if (in_.cost_stats) add_cost_stats(*in_.cost_stats, done_us_);
}

}  // namespace

void run_dispatch(OpContext& ctx, DispatchInput& in, DispatchOutput& out,
                  const std::function<void()>& on_shapes) {
  DispatchCall call(ctx, in, out);
  call.exchange_headers();
  call.plan_receives();
  call.check_windows();
  call.set_up_outputs();
  on_shapes();
  call.move_rows();
  call.finish();
}

}  // namespace epcomm::engine
