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
#include <optional>

#include "engine/forward.h"
#include "engine/kernels.h"
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
  bool pushed = false;  // the senders write the payload rows themselves

  void copy_payload(int64_t row, const uint8_t* payload) const {
    if (pushed) return;
    copy_row(data + row * data_row, payload, data_row);
    if (scale_row) std::memcpy(scales + row * scale_row, payload + data_row, scale_row);
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
      const int m = plan.count[static_cast<size_t>(t)];
      if (scale_bytes)
        for (int j = 0; j < m; ++j) std::memcpy(plan.scales[at + j], scales, scale_bytes);
      copy_row_to(plan.rows.data() + at, m, x, bytes, false, cache_resident);
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

void add_cost_stats(const Tensor& stats, const std::vector<int64_t>& micros) {
  for (size_t r = 0; r < micros.size(); ++r) {
    int64_t us = std::max<int64_t>(micros[r], 0);
    if (stats.dtype() == DType::i64) {
      stats.data_as<int64_t>()[r] += us;
    } else {
      int64_t v = static_cast<int64_t>(stats.data_as<int32_t>()[r]) + us;
      stats.data_as<int32_t>()[r] = static_cast<int32_t>(std::min<int64_t>(v, INT32_MAX));
    }
  }
}

void check_headers_match(const OpContext& ctx) {
  const int R = ctx.size();
  auto differs = [&](auto get) {
    for (int r = 1; r < R; ++r)
      if (get(ctx.header(r)) != get(ctx.header(0))) return true;
    return false;
  };
  auto report = [&](const char* name, auto get) {
    if (!differs(get)) return;
    std::string per_rank;
    for (int r = 0; r < R; ++r) per_rank += detail::cat(r ? ", " : "", "rank ", r, " = ", get(ctx.header(r)));
    EPCOMM_THROW(InvalidUsage, ctx.prefix(), "mismatch: ranks disagree on ", name, ": ", per_rank);
  };
  auto order_name = [](const HeaderData* h) {
    return std::string(receive_order_name(static_cast<ReceiveOrder>(h->order)));
  };
  report("the operation",
         [](const HeaderData* h) { return std::string(op_kind_name(static_cast<OpKind>(h->op))); });
  report("receive_order", order_name);
  report("handle (dispatch id)", [](const HeaderData* h) { return h->handle_id; });
  report("num_experts", [](const HeaderData* h) { return h->num_experts; });
  report("num_topk", [](const HeaderData* h) { return h->num_topk; });
  report("hidden", [](const HeaderData* h) { return h->hidden; });
  report("payload dtype",
         [](const HeaderData* h) { return std::string(dtype_name(static_cast<DType>(h->dtype))); });
  report("quant_mode", [](const HeaderData* h) {
    return std::string(h->quant_mode < 0 ? "plain" : quant_mode_name(static_cast<QuantMode>(h->quant_mode)));
  });
  report("presence of topk_idx", [](const HeaderData* h) { return (h->flags & kHasTopk) != 0; });
  report("presence of weights", [](const HeaderData* h) { return (h->flags & kHasWeights) != 0; });
  report("expert_alignment", [](const HeaderData* h) { return h->expert_alignment; });
  report("config.num_max_nvl_chunked_send_tokens", [](const HeaderData* h) { return h->chunks[0]; });
  report("config.num_max_nvl_chunked_recv_tokens", [](const HeaderData* h) { return h->chunks[1]; });
  report("config.num_max_rdma_chunked_send_tokens", [](const HeaderData* h) { return h->chunks[2]; });
  report("config.num_max_rdma_chunked_recv_tokens", [](const HeaderData* h) { return h->chunks[3]; });
}

void run_dispatch(OpContext& ctx, DispatchInput& in, DispatchOutput& out,
                  const std::function<void()>& on_shapes) {
  const int R = ctx.size(), me = ctx.rank();
  // Our tokens' routing. A fresh dispatch moves these vectors into its handle below: their elements stay
  // where they are, so these pointers stay valid.
  const int32_t* const my_ids = in.ids.data();
  const float* const my_weights = in.weights.data();
  const uint8_t* const my_in_rank = in.in_rank.data();
  const Handle::Impl* hd = in.handle.get();
  const int K = in.cached ? hd->num_topk : in.num_topk;
  const bool has_topk = in.cached ? hd->has_topk : in.num_topk > 0;
  const auto t_start = Clock::now();

  // Window geometry and staging are local: the first two windows are staged while the headers travel
  // (our data area is free: every op ends only once the peers are done with it).
  const size_t row_bytes = in.format.data_row_bytes + in.format.scale_row_bytes;
  const size_t meta = meta_bytes_of(K, R, in.cached);
  Internode* inter = ctx.internode();
  const int M = inter ? inter->topo.num_nodes : 1, my_node = ctx.node_of(me);
  size_t lane_half = 0, net_meta = 0;  // net_meta: routing bytes per compact entry
  DispatchGeometry geo = window_geometry(ctx, row_bytes, meta, lane_half, net_meta);
  int64_t W = geo.window;
  // The capacity rule (docs/normal-mode.md) holds for the staged record, whether or not the rows are pushed.
  const int64_t row_window = W;
  int64_t my_nwin = W > 0 ? num_windows(in.num_tokens, W) : 0;
  uint8_t* my_area = ctx.data(me);
  const RowFormat& f = in.format;
  // x in our shared dispatch-input area (one node, plain rows): receivers read the rows in place, the
  // windows carry only the routing (same geometry, so that every rank computes the same windows).
  const bool share_x = !inter && in.shared_offset >= 0 && !f.quantize && !in.scales;
  // Whether our rows can be pushed (every rank must say so): outputs in our output arena, x private (or
  // quantized here), one node, no cost statistics asked for (pushed rows land only once
  // every rank has arrived, so a late rank's delay would show in every element instead of its own:
  // docs/normal-mode.md).
  Transport& tp = ctx.transport();
  const OutputArena* arena = tp.output_arena().get();
  auto arena_offset = [&](const Tensor& t) { return arena ? arena->offset_of(t.data(), t.nbytes()) : -1; };
  // Quantizing senders quantize each token once and push its codes and scales; a (data, scales) input pushes
  // its data rows and gathers each token's scales once.
  // A cached dispatch pushes when the fresh one did: its handle says where every copy goes.
  const bool can_push = arena && !inter && (!in.cached || hd->pushed) && !in.cost_stats && !share_x &&
                        (!out.recv_x.data.defined() || arena_offset(out.recv_x.data) >= 0) &&
                        (!out.recv_x.scales || arena_offset(*out.recv_x.scales) >= 0);
  bool push = false;  // decided once the headers are in
  auto stage = [&](int64_t w) {
    uint8_t* half = my_area + static_cast<size_t>(w % 2) * geo.half_bytes;
    const int64_t t0 = w * W, t1 = std::min(in.num_tokens, t0 + W);
    if (in.counters && !push)
      in.counters->add(share_x ? in.counters->dispatch_in_place_tokens : in.counters->dispatch_staged_tokens,
                       t1 - t0);
    for (int64_t t = t0; t < t1; ++t) {
      uint8_t* dst = half + (t - t0) * geo.row_stride;
      const uint8_t* x = in.x + t * in.x_row_bytes;
      // With share_x only the routing is staged: receivers read the row in our dispatch-input area; pushed
      // rows are written into the receivers' outputs instead.
      const bool rows = !share_x && !push;
      if (rows && f.quantize) {
        quant::quantize_row(*f.quantize, in.x_dtype, x, in.hidden, dst, dst + f.data_row_bytes);
      } else if (rows) {
        // Plain stores into a cache-sized window: the receivers read it from the shared cache.
        copy_row(dst, x, f.data_row_bytes, true, geo.cache_resident);
        if (in.scales)
          gather_scales(dst + f.data_row_bytes, in.scales, t, in.scale_stride0, in.scale_stride1,
                        f.scale_cols, dtype_size(f.scale_dtype));
      }
      if (meta) {
        uint8_t* m = half + W * geo.row_stride + (t - t0) * geo.meta_stride;
        if (K > 0) {
          std::memcpy(m, &my_ids[t * K], sizeof(int32_t) * K);
          std::memcpy(m + 4 * K, &my_weights[t * K], sizeof(float) * K);
        } else {
          std::memcpy(m, &my_in_rank[t * R], R);
        }
      }
    }
  };

  int64_t staged = 0;
  const uint64_t seq = ctx.seq();
  auto publish_staged = [&] {
    ++staged;
    ctx.control(me)->stage_ready.store(pack(ctx.seq(), staged), std::memory_order_seq_cst);
  };

  // Internode: the tokens each other node needs (ascending) go there as compact windows; as proxy of our
  // rail peers we forward our node's acknowledgements.
  std::optional<WindowSender> sender;
  std::optional<AckForwarder> acks;
  if (inter) {
    const uint8_t* in_rank = in.cached ? hd->in_rank.data() : my_in_rank;
    const Topology& topo = inter->topo;
    std::vector<std::vector<int32_t>> node_tokens(M);
    for (int64_t t = 0; t < in.num_tokens; ++t)
      for (int n = 0; n < M; ++n) {
        if (n == my_node) continue;
        for (int p : topo.node_ranks[n])
          if (in_rank[t * R + p]) {
            node_tokens[n].push_back(static_cast<int32_t>(t));
            break;
          }
      }
    sender.emplace(ctx, my_area, geo, lane_half, net_meta, in.num_tokens, row_bytes, std::move(node_tokens));
    acks.emplace(ctx);
  }
  auto send_staged = [&](bool& progressed) { sender->send_staged(staged, progressed); };
  // 1. Header (and counts, for a fresh dispatch).
  HeaderData& h = ctx.begin_header(in.cached ? OpKind::cached_dispatch : OpKind::dispatch);
  h.order = static_cast<uint32_t>(in.order);
  h.flags =
      (has_topk ? kHasTopk | kHasWeights : 0) | (!has_topk ? kHasInRank : 0) | (can_push ? kPushRows : 0);
  h.num_experts = in.num_experts;
  h.num_topk = K;
  h.dtype = static_cast<int32_t>(in.format.data_dtype);
  h.quant_mode = in.format.plain ? -1 : static_cast<int32_t>(in.format.mode);
  h.hidden = in.hidden;
  h.row_bytes = static_cast<int64_t>(in.format.data_row_bytes + in.format.scale_row_bytes);
  h.num_tokens = in.num_tokens;
  h.expert_alignment = in.expert_alignment;
  h.num_worst_tokens = in.num_worst_tokens;
  h.handle_id = in.cached ? hd->seq : 0;
  h.input_offset = share_x ? in.shared_offset : -1;
  std::copy(std::begin(in.chunks), std::end(in.chunks), h.chunks);
  if (!in.cached) {
    h.num_counts = in.num_experts + R;
    int32_t* c = ctx.counts(me);
    std::copy(in.pairs_per_expert.begin(), in.pairs_per_expert.end(), c);
    std::copy(in.tokens_per_rank.begin(), in.tokens_per_rank.end(), c + in.num_experts);
  }
  if (inter) {  // the proxies learn from the counts which of their node's ranks pull our rows (cached too)
    const std::vector<int32_t>& tpr = in.cached ? hd->tokens_per_rank : in.tokens_per_rank;
    h.num_counts = in.num_experts + R;
    int32_t* c = ctx.counts(me);
    if (in.cached) std::fill(c, c + in.num_experts, 0);
    std::copy(tpr.begin(), tpr.end(), c + in.num_experts);
  }
  ctx.publish_header();
  // (A rank that may push stages nothing yet: its windows' geometry depends on whether every rank pushes.)
  while (!can_push && staged < std::min<int64_t>(my_nwin, 2)) {
    stage(staged);
    publish_staged();
  }
  if (inter)
    ctx.exchange_headers(send_staged);
  else
    ctx.exchange_headers();
  check_headers_match(ctx);
  push = true;
  for (int r = 0; r < R; ++r) push = push && (ctx.header(r)->flags & kPushRows);
  if (push) {  // the windows carry only the routing
    geo = window_geometry(ctx, 0, meta, lane_half, net_meta);
    W = geo.window;
    my_nwin = num_windows(in.num_tokens, W);
  }

  const auto t_headers = Clock::now();
  std::vector<int64_t> tokens_of(R);
  for (int s = 0; s < R; ++s) tokens_of[s] = ctx.header(s)->num_tokens;

  // 2. The receive plan: exact rows of every receiver, known on every rank.
  const int L = in.num_experts / R;
  routing::ExpertMap map{in.num_experts, R, L};
  routing::ReceivePlan plan;
  std::vector<int64_t> rows_matrix;  // every receiver's rows per source (the handle keeps it)
  std::vector<std::vector<int64_t>> push_start(push ? R : 0);  // receiver d's first row of each of our runs
  int64_t host_rows = in.cached ? hd->host_recv_rows : 0;      // rows all receivers get together
  if (!in.cached) {
    std::vector<const int32_t*> pairs(R), toks(R);
    for (int s = 0; s < R; ++s) {
      pairs[s] = ctx.counts(s);
      toks[s] = ctx.counts(s) + in.num_experts;
    }
    rows_matrix.assign(static_cast<size_t>(R) * R, 0);
    for (int d = 0; d < R; ++d) {
      routing::ReceivePlan p = routing::plan_receive(d, in.order, map, in.expert_alignment, pairs, toks);
      for (int s = 0; s < R; ++s) rows_matrix[static_cast<size_t>(s) * R + d] = p.rows_per_source[s];
      int64_t worst = ctx.header(d)->num_worst_tokens;
      if (worst > 0 && p.num_recv_rows > worst)
        EPCOMM_THROW(InvalidUsage, ctx.prefix(), "capacity: receiving rank ", d,
                     " gets N = ", p.num_recv_rows, " rows but its num_worst_tokens = ", worst,
                     "; nothing was sent (rows are never truncated)");
      check_receive_capacity(ctx, d, p.num_recv_rows, f, K, in.idx_dtype);  // every rank, every receiver
      if (push) push_start[d] = p.start;
      host_rows += p.num_recv_rows;
      if (d == me) plan = std::move(p);
    }
  }

  // 3. Only a segment that cannot hold one staged token is an error (every rank sees the same sizes).
  if (geo.window < 1 && inter && dispatch_geometry(ctx.layout().data_bytes, row_bytes, meta).window >= 1)
    EPCOMM_THROW(InvalidUsage, ctx.prefix(), "capacity: num_rdma_bytes = ", inter->lane.bytes * M,
                 " (one lane of ", inter->lane.bytes, " bytes per node) cannot hold one forwarded token of ",
                 row_bytes, " bytes (+", meta, " bytes of routing); the minimum for this call is ",
                 min_rdma_bytes_for(ctx, geo, net_meta));
  if (row_window < 1)
    EPCOMM_THROW(InvalidUsage, ctx.prefix(), "capacity: num_nvl_bytes = ", ctx.layout().total,
                 " cannot hold one staged token of ", row_bytes, " bytes (+", meta,
                 " bytes of routing); the minimum for this call is ",
                 control_bytes(R) + dispatch_min_data_bytes(row_bytes, meta));

  // 4. Outputs.
  const int64_t N = in.cached ? hd->num_recv_rows : plan.num_recv_rows;
  const int64_t rows = in.cached ? hd->num_rows : (in.num_worst_tokens > 0 ? in.num_worst_tokens : N);
  Outputs o;
  // Outputs whose shape is known locally (cached and worst-case dispatch) were allocated by the caller.
  if (!out.recv_x.data.defined()) {
    out.recv_x.data = in.allocator->allocate(f.data_dtype, {rows, f.data_cols});
    if (f.scale_row_bytes) {
      Shape ss = f.scale_shape == RowFormat::ScaleShape::vec   ? Shape{rows}
                 : f.scale_shape == RowFormat::ScaleShape::mat ? Shape{rows, f.scale_cols}
                                                               : Shape{rows * f.scale_cols};
      out.recv_x.scales = in.allocator->allocate(f.scale_dtype, ss);
    }
    if (!in.cached && has_topk) {
      out.recv_topk_idx = in.allocator->allocate(in.idx_dtype, {rows, K});
      out.recv_topk_weights = in.allocator->allocate(DType::f32, {rows, K});
    }
  }
  poison(out.recv_x.data, in.poison);
  if (out.recv_x.scales) poison(*out.recv_x.scales, in.poison);
  o.data = out.recv_x.data.data_as<uint8_t>();
  o.data_row = f.data_row_bytes;
  if (f.scale_row_bytes) {
    o.scales = out.recv_x.scales->data_as<uint8_t>();
    o.scale_row = f.scale_row_bytes;
  }
  o.K = K;
  Handle::Impl* nh = out.handle.get();
  if (!in.cached) {
    if (has_topk) {
      poison(*out.recv_topk_idx, in.poison);
      poison(*out.recv_topk_weights, in.poison);
      o.idx = out.recv_topk_idx->data();
      o.idx64 = in.idx_dtype == DType::i64;
      o.weights = out.recv_topk_weights->data_as<float>();
    }
    if (!nh->recv_src_rank.defined()) {
      nh->recv_src_rank = in.allocator->allocate(DType::i32, {rows});
      nh->recv_src_token = in.allocator->allocate(DType::i32, {rows});
      nh->recv_src_slot = in.allocator->allocate(DType::i32, {rows});
    }
    o.src_rank = nh->recv_src_rank.data_as<int32_t>();
    o.src_token = nh->recv_src_token.data_as<int32_t>();
    o.src_slot = nh->recv_src_slot.data_as<int32_t>();
    if (in.order == ReceiveOrder::expert_major)
      for (int j = 0; j < L; ++j) o.fill_empty(plan.pad_begin[j], plan.block_end[j]);
    o.fill_empty(N, rows);
    out.list = in.num_worst_tokens > 0 ? std::vector<int64_t>{} : plan.list;
  } else {
    const int32_t* src = hd->recv_src_rank.data_as<int32_t>();
    for (int64_t r = 0; r < rows; ++r)
      if (src[r] < 0) o.fill_empty(r, r + 1);
  }
  const std::vector<int64_t>& rows_from = in.cached ? hd->rows_per_source : plan.rows_per_source;
  QuarantineOnFailure quarantine;
  if (push) {  // our recv_x is ready (PAD rows and poison written): the senders may write into it now
    const int64_t off = arena_offset(out.recv_x.data);
    EPCOMM_CHECK(
        off >= 0, ctx.prefix(),
        "allocator: Allocator::adopt returned memory outside this rank's "
        "output arena for recv_x; it must view the arena's bytes (or set num_output_arena_bytes = 0)");
    const int64_t scale_off = out.recv_x.scales ? arena_offset(*out.recv_x.scales) : -1;
    EPCOMM_CHECK(
        !f.scale_row_bytes || scale_off >= 0, ctx.prefix(),
        "allocator: Allocator::adopt returned memory outside this rank's output arena for the scales of "
        "recv_x; it must view the arena's bytes (or set num_output_arena_bytes = 0)");
    o.pushed = true;
    quarantine.add(out.recv_x.data);
    if (out.recv_x.scales) quarantine.add(*out.recv_x.scales);
    ctx.control(me)->out_offset = off;
    ctx.control(me)->out_scale_offset = scale_off;
    ctx.control(me)->out_ready.store(pack(seq, 1), std::memory_order_release);
    for (int s = 0; s < R; ++s)
      if (s != me && rows_from[s] > 0) ctx.notify(s);
  }
  if (!in.cached) {
    // The handle's shape fields are final before on_shapes(); the row lists fill in during the data phase.
    nh->seq = ctx.seq();
    nh->order = in.order;
    nh->num_ranks = R;
    nh->num_experts = in.num_experts;
    nh->num_topk = K;
    nh->num_local = L;
    nh->num_tokens = in.num_tokens;
    nh->num_recv_rows = N;
    nh->host_recv_rows = host_rows;
    nh->num_rows = rows;
    nh->expert_alignment = in.expert_alignment;
    nh->num_worst_tokens = in.num_worst_tokens;
    nh->hidden = in.hidden;
    nh->has_topk = has_topk;
    nh->topk_ids = std::move(in.ids);
    nh->topk_weights = std::move(in.weights);
    nh->in_rank = std::move(in.in_rank);
    nh->tokens_per_rank = in.tokens_per_rank;
    nh->list = plan.list;
    nh->cnt = plan.cnt;
    nh->rows_per_source = plan.rows_per_source;
    nh->rows_matrix = std::move(rows_matrix);
  }
  on_shapes();

  // 5. Rounds: stage own windows, pull every source's windows.
  const std::vector<int32_t>& my_dest_tokens = in.cached ? hd->tokens_per_rank : in.tokens_per_rank;
  std::vector<int64_t> nwin(R), pulled(R, 0), done_us(R, -1);
  for (int s = 0; s < R; ++s) {
    nwin[s] = rows_from[s] > 0 ? num_windows(tokens_of[s], W) : 0;
    if (nwin[s] == 0)
      done_us[s] = std::chrono::duration_cast<std::chrono::microseconds>(t_headers - t_start).count();
  }

  // Receive cursors (fresh): next row of (s, j) in expert_major or of s in rank_major.
  std::vector<int64_t> cursor = plan.start;
  std::vector<int64_t> src_fill;
  if (!in.cached) {
    nh->source_offsets.assign(R + 1, 0);
    for (int s = 0; s < R; ++s) nh->source_offsets[s + 1] = nh->source_offsets[s] + rows_from[s];
    nh->source_rows.resize(nh->source_offsets[R]);
    src_fill.assign(nh->source_offsets.begin(), nh->source_offsets.end() - 1);
  }
  std::vector<int64_t> cached_pos(R);
  if (in.cached)
    for (int s = 0; s < R; ++s) cached_pos[s] = hd->source_offsets[s];

  // Sources whose x lies in their shared dispatch-input area: rows are read there, in place.
  std::vector<const uint8_t*> shared_x(R, nullptr);
  for (int s = 0; s < R; ++s) shared_x[s] = ctx.shared_input(s);

  // Push: once a receiver of our tokens has published its recv_x, we write each of its rows once, straight
  // into its place there (the receivers' plans give the rows; the order matches their reading of our
  // routing: ascending tokens, top-k slots in order), then fence and raise our cell in its segment. One pass
  // over our tokens serves every receiver ready by then (one read of a token for all its rows); a receiver
  // that comes later gets a pass of its own, so that a late rank does not hold up the others' rows (unless
  // the ranks outnumber the cores: then we wait for all of them, below).
  std::vector<char> pushed_to(R, 0);
  int push_left = 0;  // receivers of our tokens not served yet
  if (push) {
    for (int d = 0; d < R; ++d) push_left += my_dest_tokens[d] > 0;
    if (!in.cached) {
      nh->send_rows.assign(static_cast<size_t>(in.num_tokens) * nh->copy_slots(), -1);
      nh->pushed = true;
    }
  }
  auto out_ready = [&](int d) {
    return ctx.control(d)->out_ready.load(std::memory_order_acquire) >= pack(seq, 1);
  };
  auto pushed_by = [&](int s) {
    return ctx.cell(me, s)->pushed.load(std::memory_order_acquire) >= pack(seq, 1);
  };
  const bool oversubscribed = tp.oversubscribed();
  std::vector<char> serve(R, 0);  // receivers the next pass serves (refilled at every poll, not reallocated)
  auto push_rows = [&](const std::vector<char>& now) {
    std::vector<uint8_t*> dest(R, nullptr), dest_scales(R, nullptr);
    std::vector<int64_t> next(R, 0);              // rank_major: receiver d's next row for our tokens
    std::vector<std::vector<int64_t>> next_e(R);  // expert_major: per local expert of d
    const bool by_expert = in.order == ReceiveOrder::expert_major && K > 0;
    for (int d = 0; d < R; ++d) {
      if (!now[d]) continue;
      dest[d] = tp.arena(d) + ctx.control(d)->out_offset;
      if (f.scale_row_bytes) dest_scales[d] = tp.arena(d) + ctx.control(d)->out_scale_offset;
      if (in.cached) continue;  // the handle's send_rows give the rows
      if (by_expert)
        next_e[d].assign(push_start[d].begin() + static_cast<ptrdiff_t>(me) * L,
                         push_start[d].begin() + static_cast<ptrdiff_t>(me + 1) * L);
      else
        next[d] = push_start[d][me];
    }
    // A fresh dispatch records in its handle where every copy went; a cached one reads it there.
    int32_t* send_rows = in.cached ? nullptr : nh->send_rows.data();
    const int32_t* sent_to = in.cached ? hd->send_rows.data() : nullptr;
    PushPlan plan((in.cached ? *hd : *nh).copy_slots(), in.num_tokens);  // entries per token of send_rows
    const size_t bytes = f.data_row_bytes, scale_bytes = f.scale_row_bytes;
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      auto put = [&](int d, int64_t row) {
        plan.add(t, dest[d] + row * bytes, scale_bytes ? dest_scales[d] + row * scale_bytes : nullptr);
      };
      if (in.cached) {  // the same rows as the fresh dispatch
        hd->for_each_copy(t, [&](int slot, int holder) {
          if (now[holder]) put(holder, sent_to[t * plan.slots + slot]);
        });
        continue;
      }
      for (int d = 0; d < R; ++d) {
        if (!now[d]) continue;
        auto write = [&](int64_t row, int k) {
          put(d, row);
          send_rows[t * plan.slots + (by_expert ? k : d)] = static_cast<int32_t>(row);
        };
        if (K == 0) {
          if (my_in_rank[t * R + d]) write(next[d]++, -1);
        } else {
          for_each_row(map, by_expert, &my_ids[t * K], K, d, by_expert ? next_e[d].data() : &next[d], write);
        }
      }
    }
    // Few rows in all: plain stores, so that the receivers find them in the shared cache.
    write_pushed_rows(in, f, plan,
                      static_cast<size_t>(host_rows) * (bytes + scale_bytes) <= cache_resident_push_bytes());
    store_fence();  // one fence for all the rows' streaming stores, before the releases that publish them
    for (int d = 0; d < R; ++d)
      if (now[d]) {
        pushed_to[d] = 1;
        --push_left;
        ctx.signal(ctx.cell(d, me)->pushed, pack(seq, 1), d);
      }
  };

  auto pull = [&](int s, int64_t w) {
    const int64_t t0 = w * W, t1 = std::min(tokens_of[s], t0 + W);
    const StagedWindow win = StagedWindow::of(ctx, s, w, geo, lane_half, net_meta, tokens_of[s]);
    const uint8_t* sx = shared_x[s];
    auto payload_of = [&](int64_t e) { return sx ? sx + win.token(e) * row_bytes : win.payload(e); };
    if (in.cached) {
      const int32_t* src_tok = hd->recv_src_token.data_as<int32_t>();
      int64_t& pos = cached_pos[s];
      const int64_t end = hd->source_offsets[s + 1];
      int64_t e = 0;
      while (pos < end) {
        int32_t row = hd->source_rows[pos];
        if (src_tok[row] >= t1) break;
        while (e < win.count && win.token(e) < src_tok[row]) ++e;  // ascending; holds every token we need
        EPCOMM_CHECK_INTERNAL(e < win.count && win.token(e) == src_tok[row], ctx.prefix(), "internal: token ",
                              src_tok[row], " of rank ", s, " missing from its forwarded window ", w);
        o.copy_payload(row, payload_of(e));
        ++pos;
      }
      return;
    }
    for (int64_t e = 0; e < win.count; ++e) {
      const int64_t t = win.token(e);
      const uint8_t* payload = payload_of(e);
      const uint8_t* m = win.meta(e);
      if (K == 0) {  // rank_major without top-k
        if (!m[me]) continue;
        int64_t row = cursor[s]++;
        o.copy_payload(row, payload);
        o.src_rank[row] = s;
        o.src_token[row] = static_cast<int32_t>(t);
        o.src_slot[row] = -1;
        nh->source_rows[src_fill[s]++] = static_cast<int32_t>(row);
        continue;
      }
      int32_t ids[64];
      float ws[64];
      const int32_t* idp = reinterpret_cast<const int32_t*>(m);
      const float* wp = reinterpret_cast<const float*>(m + 4 * K);
      if (K <= 64) {
        std::memcpy(ids, idp, 4 * K);
        std::memcpy(ws, wp, 4 * K);
        idp = ids;
        wp = ws;
      }
      const bool by_expert = in.order == ReceiveOrder::expert_major;
      int64_t* next = &cursor[by_expert ? static_cast<size_t>(s) * L : static_cast<size_t>(s)];
      for_each_row(map, by_expert, idp, K, me, next, [&](int64_t row, int k) {
        o.copy_payload(row, payload);
        // expert_major: the row of slot k (its local expert there, -1 and +0 elsewhere); rank_major: the
        // token's row (every slot whose expert is here).
        o.set_topk(row, idp, wp, static_cast<int64_t>(me) * L, L, by_expert ? k : -1);
        o.src_rank[row] = s;
        o.src_token[row] = static_cast<int32_t>(t);
        o.src_slot[row] = k;
        nh->source_rows[src_fill[s]++] = static_cast<int32_t>(row);
      });
    }
  };

  // As proxy of rail peer s: the ranks of our node that pull from s (its counts say so).
  auto receives = [&](int s, int d) { return ctx.counts(s)[ctx.header(s)->num_counts - R + d] > 0; };
  auto windows = [&](int s) { return num_windows(tokens_of[s], W); };

  auto can_stage = [&](int64_t w) {
    if (w < 2) return true;
    for (int p = 0; p < R; ++p)
      if (my_dest_tokens[p] > 0 && ctx.cell(me, p)->ack.load(std::memory_order_acquire) < pack(seq, w - 1))
        return false;
    return !inter || (sender->all_sent(w - 1) && sender->half_free(w));
  };
  ctx.run(
      "data",
      [&](bool& progressed) {
        // Internode: every staged window goes to the proxies of the nodes that need our tokens (only once the
        // headers are in: their lanes are free then).
        if (inter) send_staged(progressed);
        while (staged < my_nwin && (!inter || sender->all_sent(staged)) && can_stage(staged)) {
          stage(staged);
          publish_staged();
          for (int p = 0; p < R; ++p)
            if (my_dest_tokens[p] > 0 && p != me && !ctx.remote(p)) ctx.notify(p);
          progressed = true;
        }
        // Done once every window is staged and acknowledged (so that the next call may reuse the area)
        // and every source's windows are pulled.
        bool all = staged == my_nwin && can_stage(my_nwin + 1) && push_left == 0;
        if (inter)
          all = acks->step(progressed, receives, windows) && all && sender->all_sent(my_nwin) &&
                sender->complete();
        for (int s : ctx.arrival_order()) {
          while (pulled[s] < nwin[s] &&
                 ctx.control(s)->stage_ready.load(std::memory_order_acquire) >= pack(seq, pulled[s] + 1)) {
            pull(s, pulled[s]);
            ++pulled[s];
            ctx.signal(ctx.cell(s, me)->ack, pack(seq, pulled[s]), s);
            progressed = true;
          }
          // A source is done once its windows are read and, pushing, its rows are written.
          const bool done = pulled[s] == nwin[s] && (!push || nwin[s] == 0 || pushed_by(s));
          if (done && done_us[s] < 0)
            done_us[s] =
                std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t_start).count();
          all = all && done;
        }
        // Our rows, to every receiver whose recv_x is out. After the routing windows above: the metadata
        // of the rows we receive is filled (and acknowledged) before our long pass, not after it.
        if (push_left > 0) {
          int ready = 0;
          for (int d = 0; d < R; ++d)
            ready += serve[d] = !pushed_to[d] && my_dest_tokens[d] > 0 && out_ready(d);
          // Ranks outnumbering the cores: a receiver not ready yet is mostly waiting for a core, which our
          // pass would hold for milliseconds, and serving it later costs a second read of every token. Wait
          // (asleep) until every receiver is ready and serve them all in one pass.
          if (ready > 0 && (ready == push_left || !oversubscribed)) {
            push_rows(serve);
            progressed = true;  // (`all` above already counted this pass as pending)
          }
        }
        return all;
      },
      [&] {
        std::vector<int> peers;  // sources not yet staged, and receivers whose acks block our staging
        for (int s = 0; s < R; ++s)
          if ((pulled[s] < nwin[s] || (push && nwin[s] > 0 && !pushed_by(s))) && s != me) peers.push_back(s);
        if (push_left > 0)  // receivers whose recv_x we wait for
          for (int d = 0; d < R; ++d)
            if (d != me && my_dest_tokens[d] > 0 && !pushed_to[d] && !out_ready(d) &&
                std::find(peers.begin(), peers.end(), d) == peers.end())
              peers.push_back(d);
        if (!(staged == my_nwin && can_stage(my_nwin + 1)))
          for (int p = 0; p < R; ++p)
            if (my_dest_tokens[p] > 0 && p != me && std::find(peers.begin(), peers.end(), p) == peers.end())
              peers.push_back(p);
        return peers;
      });

  if (push && in.counters) in.counters->add(in.counters->dispatch_pushed_tokens, in.num_tokens);
  if (in.cost_stats) add_cost_stats(*in.cost_stats, done_us);
}

}  // namespace epcomm::engine
