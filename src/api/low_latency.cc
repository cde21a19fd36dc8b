// api/low_latency.cc — Buffer::low_latency_dispatch / low_latency_combine (docs/low-latency.md): DeepEP's
// low-latency layout on the normal-mode protocols. A low-latency dispatch is an expert_major dispatch whose
// local experts own fixed blocks of R * T_max rows (engine::DispatchInput::expert_block_rows), so that its
// rows land straight in the 3-D [L, R * T_max, H] output (pushed into the receivers' memory on one node);
// the combine is the expert_major weighted combine, read in place where x lies in the output arena.
#include <algorithm>
#include <cstring>

#include "api/buffer_impl.h"
#include "api/event_state.h"
#include "api/low_latency_masks.h"
#include "common/check.h"
#include "common/env.h"
#include "engine/internode.h"
#include "quant/row.h"
#include "routing/layout.h"

namespace epcomm {
namespace {

constexpr int kMaxTopk = 32;

void check_tensor(const Tensor& t, const char* name, const Shape& shape, std::initializer_list<DType> dtypes,
                  const char* meaning) {
  const bool dtype_ok = t.defined() && std::find(dtypes.begin(), dtypes.end(), t.dtype()) != dtypes.end();
  if (t.defined() && t.shape() == shape && dtype_ok && t.is_contiguous()) return;
  std::string want;
  for (DType d : dtypes) want += detail::cat(want.empty() ? "" : " or ", dtype_name(d));
  EPCOMM_THROW(InvalidUsage, "argument: ", name, ": expected a contiguous ", shape_str(shape), " ", meaning,
               " tensor of ", want, ", got ",
               t.defined() ? detail::cat(dtype_name(t.dtype()), " ", shape_str(t.shape()),
                                         t.is_contiguous() ? "" : " (not contiguous)")
                           : std::string("None"));
}

QuantMode format_of(const LowLatencyDispatchArgs& a) {
  if (!a.use_fp8) return QuantMode::bf16;
  if (a.use_ue8m0) return QuantMode::pergroup_fp8_e4m3_ue8m0;
  return a.round_scale ? QuantMode::pergroup_fp8_e4m3_pow2 : QuantMode::pergroup_fp8_e4m3;
}

// The experts of one token are distinct (each expert block holds R * T_max rows, one per source token).
void check_distinct_experts(const std::vector<int32_t>& ids, int64_t T, int K) {
  for (int64_t t = 0; t < T; ++t) {
    const int32_t* row = ids.data() + t * K;
    for (int k = 1; k < K; ++k)
      for (int k0 = 0; k0 < k && row[k] >= 0; ++k0)
        EPCOMM_CHECK(row[k0] != row[k], "argument: topk_idx: token ", t, " lists expert ", row[k],
                     " twice (slots ", k0, " and ", k,
                     "); low-latency mode needs the experts of one token to be distinct");
  }
}

// Checks of low-latency mode itself (the normal-mode checks of x and topk_idx run after, in
// prepare_dispatch); fills `ids` with the normalized top-k ids.
void check_dispatch_args(const Buffer::Impl& b, const LowLatencyDispatchArgs& a, std::vector<int32_t>& ids) {
  const int R = b.num_ranks;
  EPCOMM_CHECK(b.options.low_latency_mode,
               "argument: low_latency_mode: this Buffer was created with low_latency_mode = false");
  EPCOMM_CHECK(!(a.async_finish && a.return_recv_hook),
               "argument: async_finish and return_recv_hook: expected at most one of them, got both");
  const int64_t tmax = a.num_max_dispatch_tokens_per_rank;
  EPCOMM_CHECK(tmax >= 1 && tmax <= (int64_t{1} << 20),
               "argument: num_max_dispatch_tokens_per_rank: expected 1 to ", int64_t{1} << 20, ", got ",
               tmax);
  EPCOMM_CHECK(a.num_experts >= 1 && a.num_experts % R == 0 && a.num_experts <= engine::kMaxExperts,
               "argument: num_experts: expected a positive multiple of the ", R, " ranks, at most ",
               engine::kMaxExperts, ", got ", a.num_experts);
  EPCOMM_CHECK(a.x.defined() && a.x.dim() == 2 && a.x.dtype() == DType::bf16 && a.x.is_contiguous(),
               "argument: x: expected a contiguous [num_tokens, hidden] bf16 tensor, got ",
               a.x.defined() ? detail::cat(dtype_name(a.x.dtype()), " ", shape_str(a.x.shape())) : "None");
  const int64_t T = a.x.size(0), H = a.x.size(1);
  EPCOMM_CHECK(T <= tmax, "argument: x: ", T, " tokens, more than num_max_dispatch_tokens_per_rank = ", tmax);
  EPCOMM_CHECK(a.topk_idx.defined() && a.topk_idx.dim() == 2 && a.topk_idx.size(0) == T &&
                   (a.topk_idx.dtype() == DType::i64 || a.topk_idx.dtype() == DType::i32) &&
                   a.topk_idx.is_contiguous(),
               "argument: topk_idx: expected a contiguous [", T, ", num_topk] i64 (or i32) tensor, got ",
               a.topk_idx.defined()
                   ? detail::cat(dtype_name(a.topk_idx.dtype()), " ", shape_str(a.topk_idx.shape()))
                   : "None");
  const int K = static_cast<int>(a.topk_idx.size(1));
  EPCOMM_CHECK(K >= 1 && K <= kMaxTopk, "argument: topk_idx: num_topk = ", K, ", expected 1 to ", kMaxTopk);
  if (a.use_fp8)
    EPCOMM_CHECK(H % 128 == 0, "argument: x: use_fp8 needs hidden to be a multiple of 128, got hidden = ", H);
  if (a.use_ue8m0) {
    EPCOMM_CHECK(a.use_fp8, "argument: use_ue8m0: requires use_fp8 = true");
    EPCOMM_CHECK(a.round_scale,
                 "argument: use_ue8m0: requires round_scale = true (ue8m0 scales are powers of two)");
    EPCOMM_CHECK(H % 512 == 0,
                 "argument: x: use_ue8m0 needs hidden to be a multiple of 512, got hidden = ", H);
  }
  ids.resize(static_cast<size_t>(T) * K);
  routing::normalize_topk_ids(a.topk_idx.data(), a.topk_idx.dtype() == DType::i64, T, K, a.num_experts,
                              ids.data());
  check_distinct_experts(ids, T, K);
  const int L = a.num_experts / R;
  if (a.cumulative_local_expert_recv_stats)
    check_tensor(*a.cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", {L},
                 {DType::i32}, "[num_local_experts]");
  if (a.dispatch_wait_recv_cost_stats)
    check_tensor(*a.dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats", {R}, {DType::i64},
                 "[num_ranks] (DeepEP's code; its docstring's [num_ranks, num_ranks] is not accepted)");
}

// The normal-mode arguments of the same rows that prepare_dispatch_from_ids reads: x, the format, the
// statistics (the routing comes normalized from check_dispatch_args).
DispatchArgs normal_args(const LowLatencyDispatchArgs& a) {
  DispatchArgs d;
  d.x.data = a.x;
  d.topk_idx = a.topk_idx;
  d.receive_order = ReceiveOrder::expert_major;
  d.dispatch_wait_recv_cost_stats = a.dispatch_wait_recv_cost_stats;
  const QuantMode mode = format_of(a);
  if (mode != QuantMode::bf16) d.quant_mode = mode;
  return d;
}

// What the call fills besides the engine's outputs, allocated up front (every shape is known).
struct LowLatencyOutputs {
  int L = 0, R = 0;
  int64_t block = 0;  // R * T_max
  LowLatencyDispatchResult result;
  std::optional<Tensor> cumulative_stats;
};

void allocate_outputs(Buffer::Impl& b, const engine::DispatchInput& in, engine::DispatchOutput& out,
                      LowLatencyOutputs& o) {
  Allocator& al = *b.allocator;
  const int64_t rows = o.block * o.L;
  const auto& f = in.format;
  out.recv_x.data = al.allocate(f.data_dtype, {rows, f.data_cols});
  if (f.scale_row_bytes) {
    out.recv_x.scales = al.allocate(f.scale_dtype, {rows, f.scale_cols});
    const bool packed = f.scale_dtype == DType::e8m0;  // four ue8m0 bytes per i32
    const int64_t cols = packed ? f.scale_cols / 4 : f.scale_cols;
    o.result.recv_scales = al.allocate(packed ? DType::i32 : DType::f32, {o.L, cols, o.block});
  }
  out.handle->recv_src_rank = al.allocate(DType::i32, {rows});
  out.handle->recv_src_token = al.allocate(DType::i32, {rows});
  out.handle->recv_src_slot = al.allocate(DType::i32, {rows});
  o.result.recv_x = Tensor::wrap(out.recv_x.data.data(), f.data_dtype, {o.L, o.block, f.data_cols}, {},
                                 out.recv_x.data.owner());
  o.result.recv_count = al.allocate(DType::i32, {o.L});
  o.result.src_info = Tensor::wrap(out.handle->recv_src_token.data(), DType::i32, {o.L, o.block}, {},
                                   out.handle->recv_src_token.owner());
  o.result.layout_range = al.allocate(DType::i64, {o.L, o.R});
}

// Scales of the valid rows, transposed into DeepEP's column-major [L, groups, R * T_max] (4-byte words:
// f32 scales, or four packed ue8m0 bytes). Tiles of kTile rows: each group's kTile words go out as one
// 64-byte line instead of one store per line (the rows of a tile stay in L1 while their groups are read).
void transpose_scales(const Tensor& rows, Tensor& cols, const std::vector<int64_t>& cnt, int64_t block) {
  constexpr int64_t kTile = 16;
  const int64_t words = cols.size(1);
  const auto* src = static_cast<const uint32_t*>(rows.data());
  auto* dst = static_cast<uint32_t*>(cols.data());
  for (size_t j = 0; j < cnt.size(); ++j)
    for (int64_t i0 = 0; i0 < cnt[j]; i0 += kTile) {
      const int64_t n = std::min(kTile, cnt[j] - i0);
      const uint32_t* s = src + (static_cast<int64_t>(j) * block + i0) * words;
      uint32_t* d = dst + static_cast<int64_t>(j) * words * block + i0;
      for (int64_t g = 0; g < words; ++g)
        for (int64_t r = 0; r < n; ++r) d[g * block + r] = s[r * words + g];
    }
}

// Counts, layout ranges, scales and statistics, from the finished dispatch (on the communication thread).
// The rows of expert j from source s are counted straight into layout_range[j, s], then each expert's
// counts become (begin << 32) | rows: one pass over the received rows and none over empty experts (most
// of them in a decode step; a clear of per-source counters for each of them cost ~7 ns per local expert).
void finish_dispatch(const engine::DispatchOutput& out, LowLatencyOutputs& o) {
  const Handle::Impl& h = *out.handle;
  const std::vector<int32_t>& live = h.live_ranks;  // rank index -> real rank (empty: the same)
  auto* count = o.result.recv_count.data_as<int32_t>();
  auto* range = o.result.layout_range.data_as<int64_t>();
  const int32_t* src = h.recv_src_rank.data_as<int32_t>();
  std::memset(range, 0, sizeof(int64_t) * static_cast<size_t>(o.L) * o.R);
  for (int j = 0; j < o.L; ++j) {
    const int64_t n = h.cnt[j];
    count[j] = static_cast<int32_t>(n);
    if (n == 0) continue;
    int64_t* per = range + static_cast<int64_t>(j) * o.R;
    const int32_t* rows = src + j * o.block;
    for (int64_t i = 0; i < n; ++i) ++per[live.empty() ? rows[i] : live[rows[i]]];
    int64_t begin = 0;
    for (int s = 0; s < o.R; ++s) {
      const int64_t c = per[s];
      per[s] = (begin << 32) | c;
      begin += c;
    }
  }
  if (o.result.recv_scales) transpose_scales(*out.recv_x.scales, *o.result.recv_scales, h.cnt, o.block);
  if (o.cumulative_stats) {
    auto* acc = o.cumulative_stats->data_as<int32_t>();
    for (int j = 0; j < o.L; ++j) acc[j] += count[j];
  }
}

// Rank masks or shrink are in use: the call runs among the live ranks (low_latency_masks.h).
bool uses_masks(Buffer::Impl& b) {
  ll::MaskState& ms = ll::mask_state(b);
  {
    std::lock_guard<std::mutex> lk(ms.m);
    if (!ms.shrink && std::find(ms.masked.begin(), ms.masked.end(), 1) == ms.masked.end()) return false;
  }
  EPCOMM_CHECK(!b.inter, "epcomm[rank ", b.rank,
               "] low-latency mode: rank masks and enable_shrink work on one node only; this Buffer spans ",
               b.num_nodes, " nodes");
  return true;
}

// The context of a call among the live ranks of `view` (rank masks or shrink in use).
engine::OpContext live_context(const Buffer::Impl& b, ll::MaskView& view, uint64_t seq, engine::OpKind kind) {
  engine::OpContext sub(view, b.segment.engine, seq, kind, b.timeout_s);
  b.name_call(sub);
  return sub;
}

// This rank's validation failed: the live peers' same call raises Aborted quoting `msg`; the Buffer stays
// usable (launch keeps it so for an Aborted error before data moved).
[[noreturn]] void fail_among_live(engine::OpContext& sub, engine::OpKind kind, const std::string& msg) {
  sub.publish_failed_header(kind, msg);
  throw Error(ErrorCode::Aborted, msg);
}

void run_masked_dispatch(Buffer::Impl& b, engine::OpContext& sub, const ll::LiveSet& live,
                         engine::DispatchInput& in, engine::DispatchOutput& out,
                         const std::function<void()>& on_shapes) {
  const int L = in.num_experts / b.num_ranks;
  std::vector<int32_t> map = ll::expert_map(live, L);
  std::optional<Tensor> real_stats = in.cost_stats;
  ll::restrict_dispatch(in, live, map, *b.allocator);
  out.handle->live_ranks = live.live;
  out.handle->expert_map = std::move(map);
  engine::run_dispatch(sub, in, out, on_shapes);
  if (real_stats) ll::widen_stats(*in.cost_stats, *real_stats, live.live);
}

}  // namespace

bool fail_low_latency_among_live(Buffer::Impl& b, uint64_t s, engine::OpKind kind, const std::string& msg) {
  if (!uses_masks(b)) return false;
  auto st = launch(b, s, kind, std::nullopt, std::string(), true,
                   [&b, kind, msg](engine::OpContext& ctx, const std::function<void()>&) -> int64_t {
                     const ll::LiveSet live = ll::enter_call(b, ctx);
                     ll::MaskView view(*b.transport, live.live);
                     engine::OpContext sub = live_context(b, view, ctx.seq(), kind);
                     fail_among_live(sub, kind, msg);
                   });
  st->wait();
  return true;
}

LowLatencyDispatchResult Buffer::low_latency_dispatch(const LowLatencyDispatchArgs& a) {
  Impl& b = *impl_;
  b.check_usable("low_latency_dispatch");
  const uint64_t s = ++b.seq;
  auto in = std::make_shared<engine::DispatchInput>();
  auto out = std::make_shared<engine::DispatchOutput>();
  auto o = std::make_shared<LowLatencyOutputs>();
  std::optional<Error> verr;
  try {
    std::vector<int32_t> ids;
    check_dispatch_args(b, a, ids);
    prepare_dispatch_from_ids(b, normal_args(a), static_cast<int>(a.num_experts),
                              static_cast<int>(a.topk_idx.size(1)), std::move(ids), *in);
    o->R = b.num_ranks;
    o->L = a.num_experts / b.num_ranks;
    o->block = a.num_max_dispatch_tokens_per_rank * b.num_ranks;
    in->expert_block_rows = o->block;
  } catch (const Error& e) {
    verr = Error(e.code(), b.prefix("low_latency_dispatch", s) + e.what());
  }
  if (!verr) {
    in->allocator = b.allocator.get();
    in->poison = b.poison;
    in->workers = &b.workers;
    in->counters = &b.counters;
    out->handle = std::make_shared<Handle::Impl>();
    out->handle->buffer_key = &b;
    out->handle->buffer_alive = b.alive;
    allocate_outputs(b, *in, *out, *o);
    o->cumulative_stats = a.cumulative_local_expert_recv_stats;
  }
  const bool masks = uses_masks(b);
  const std::string msg = verr ? std::string(verr->what()) : std::string();
  const bool async = a.async_finish || a.return_recv_hook;
  auto state = std::make_shared<detail::EventState>();
  if (a.return_recv_hook && !verr) in->on_sent = [state] { state->rows_sent(); };
  // On one node a hooked dispatch's sending is its work (the rows are written into the receivers' recv_x),
  // and once it is sent the rows of the others are all but in: it runs like a synchronous call (on this
  // thread when the communication thread is idle) and hook() finds it complete. Across nodes the network
  // part runs on the communication thread after the call returned.
  const bool hooked_inline = a.return_recv_hook && b.num_nodes == 1;
  auto st = launch(
      b, s, engine::OpKind::low_latency_dispatch, std::nullopt, masks ? std::string() : msg,
      !async || hooked_inline || verr.has_value(),
      [&b, masks, msg, in, out, o](engine::OpContext& ctx, const std::function<void()>& on_shapes) {
        if (!masks) {
          engine::run_dispatch(ctx, *in, *out, on_shapes);
        } else {
          const ll::LiveSet live = ll::enter_call(b, ctx);
          ll::MaskView view(*b.transport, live.live);
          engine::OpContext sub = live_context(b, view, ctx.seq(), engine::OpKind::low_latency_dispatch);
          if (!msg.empty()) fail_among_live(sub, engine::OpKind::low_latency_dispatch, msg);
          run_masked_dispatch(b, sub, live, *in, *out, on_shapes);
        }
        finish_dispatch(*out, *o);
        return static_cast<int64_t>(out->recv_x.data.nbytes());
      },
      state);
  if (verr) {
    st->wait();
    throw *verr;
  }
  out->handle->wait_shapes = [st] {
    if (auto e = st->wait_shapes()) std::rethrow_exception(e);
  };
  if (!async) {
    if (auto e = st->wait()) std::rethrow_exception(e);
  } else if (a.return_recv_hook) {
    if (auto e = st->wait_sent()) std::rethrow_exception(e);
  }
  // A finished synchronous call's outputs are handed over (copying them would copy every tensor's shape);
  // an asynchronous one may still be filling them on the communication thread.
  LowLatencyDispatchResult r = async ? o->result : std::move(o->result);
  r.handle = std::make_shared<const Handle>(out->handle);
  r.event = EventOverlap(st);
  return r;
}

namespace {

const Handle::Impl& low_latency_handle(const Buffer::Impl& b, const std::shared_ptr<const Handle>& h) {
  EPCOMM_CHECK(h != nullptr, "argument: handle: required, got None");
  const Handle::Impl& hd = own_handle(b, h);
  EPCOMM_CHECK(
      hd.expert_block_rows > 0,
      "argument: handle: it comes from a normal-mode dispatch; low_latency_combine takes the handle of "
      "a low_latency_dispatch");
  return hd;
}

// x [L, R * T_max, H] bf16, topk_idx equal to the dispatch's, topk_weights [T, K] f32, out [T, H] bf16.
// Whether slot i of the dispatch's ids names an expert of a rank masked now (DeepEP's shrink test then passes
// -1 there: such a pair is absent either way).
bool holder_masked_now(const Handle::Impl& hd, size_t i, const std::vector<uint8_t>& masked) {
  const int32_t id = hd.topk_ids[i];
  if (id < 0) return false;
  const int v = id / hd.num_local;
  return masked[hd.live_ranks.empty() ? v : hd.live_ranks[v]] != 0;
}

void check_combine_args(Buffer::Impl& b, const LowLatencyCombineArgs& a, const Handle::Impl& hd) {
  const int L = hd.num_local;
  const int64_t T = hd.num_tokens;
  const int K = hd.num_topk;
  EPCOMM_CHECK(a.x.defined() && a.x.dim() == 3 && a.x.size(0) == L && a.x.size(1) == hd.expert_block_rows,
               "argument: x: expected [", L, ", ", hd.expert_block_rows,
               ", hidden] = [num_local_experts, num_ranks * num_max_dispatch_tokens_per_rank, hidden], got ",
               a.x.defined() ? shape_str(a.x.shape()) : std::string("None"));
  check_tensor(a.x, "x", a.x.shape(), {DType::bf16}, "");
  EPCOMM_CHECK(
      a.topk_idx.defined() && a.topk_idx.dim() == 2 && a.topk_idx.size(0) == T && a.topk_idx.size(1) == K &&
          (a.topk_idx.dtype() == DType::i64 || a.topk_idx.dtype() == DType::i32) &&
          a.topk_idx.is_contiguous(),
      "argument: topk_idx: expected the dispatch's contiguous [", T, ", ", K, "] i64 (or i32) tensor, got ",
      a.topk_idx.defined() ? detail::cat(dtype_name(a.topk_idx.dtype()), " ", shape_str(a.topk_idx.shape()))
                           : "None");
  std::vector<int32_t> ids(static_cast<size_t>(T) * K);
  routing::normalize_topk_ids(a.topk_idx.data(), a.topk_idx.dtype() == DType::i64, T, K, b.num_ranks * L,
                              ids.data());
  if (!hd.expert_map.empty())  // the dispatch ran among the unmasked ranks (numbered within them)
    for (int32_t& id : ids) id = id >= 0 ? hd.expert_map[id] : id;
  const std::vector<uint8_t> masked = ll::mask_state(b).snapshot();
  for (size_t i = 0; i < ids.size(); ++i)
    EPCOMM_CHECK(ids[i] == hd.topk_ids[i] || (ids[i] < 0 && holder_masked_now(hd, i, masked)),
                 "argument: topk_idx[", i / K, ", ", i % K, "] = ", ids[i], " differs from the dispatch's ",
                 hd.topk_ids[i], " (combine takes the dispatch's topk_idx)");
  check_tensor(a.topk_weights, "topk_weights", {T, K}, {DType::f32}, "[num_tokens, num_topk]");
  if (a.out) check_tensor(*a.out, "out", {T, a.x.size(2)}, {DType::bf16}, "[num_tokens, hidden]");
  if (a.combine_wait_recv_cost_stats)
    check_tensor(*a.combine_wait_recv_cost_stats, "combine_wait_recv_cost_stats", {b.num_ranks}, {DType::i64},
                 "[num_ranks]");
}

// Whether the live ranks of a combine are those of its dispatch (else a rank was masked in between).
bool same_ranks(const ll::LiveSet& live, const Handle::Impl& hd) {
  if (hd.live_ranks.empty()) return live.identity();
  return hd.live_ranks == live.live;
}

std::shared_ptr<detail::EventState> launch_masked_combine(Buffer::Impl& b, uint64_t s,
                                                          const std::optional<Error>& verr, bool async_finish,
                                                          std::shared_ptr<engine::CombineInput> in,
                                                          std::shared_ptr<engine::CombineOutput> out) {
  const std::string msg = verr ? std::string(verr->what()) : std::string();
  auto body = [&b, msg, in, out](engine::OpContext& ctx, const std::function<void()>& on_shapes) {
    const ll::LiveSet live = ll::enter_call(b, ctx);
    ll::MaskView view(*b.transport, live.live);
    engine::OpContext sub = live_context(b, view, ctx.seq(), engine::OpKind::low_latency_combine);
    if (!msg.empty()) fail_among_live(sub, engine::OpKind::low_latency_combine, msg);
    if (!same_ranks(live, *in->handle)) {
      ll::combine_among_survivors(b, ctx, live, *in, *out, on_shapes);
      return static_cast<int64_t>(out->combined_x.nbytes());
    }
    std::optional<Tensor> real_stats = in->cost_stats;
    in->cost_stats = ll::narrow_stats(real_stats, live.live.size(), *b.allocator);
    engine::run_combine(sub, *in, *out, on_shapes);
    if (real_stats) ll::widen_stats(*in->cost_stats, *real_stats, live.live);
    return static_cast<int64_t>(out->combined_x.nbytes());
  };
  auto st = launch(b, s, engine::OpKind::low_latency_combine, std::nullopt, std::string(),
                   !async_finish || verr.has_value(), body);
  await_launch(st, verr, async_finish);
  return st;
}

}  // namespace

LowLatencyCombineResult Buffer::low_latency_combine(const LowLatencyCombineArgs& a) {
  Impl& b = *impl_;
  b.check_usable("low_latency_combine");
  const uint64_t s = ++b.seq;
  auto in = std::make_shared<engine::CombineInput>();
  auto out = std::make_shared<engine::CombineOutput>();
  std::optional<Error> verr;
  try {
    EPCOMM_CHECK(b.options.low_latency_mode,
                 "argument: low_latency_mode: this Buffer was created with low_latency_mode = false");
    const Handle::Impl& hd = low_latency_handle(b, a.handle);
    check_combine_args(b, a, hd);
    CombineArgs c;
    c.x = Tensor::wrap(a.x.data(), DType::bf16, {a.x.size(0) * a.x.size(1), a.x.size(2)}, {}, a.x.owner());
    c.handle = a.handle;
    c.topk_weights = a.topk_weights;
    c.combine_send_cost_stats = a.combine_wait_recv_cost_stats;
    prepare_combine(b, c, *in);
  } catch (const Error& e) {
    verr = Error(e.code(), b.prefix("low_latency_combine", s) + e.what());
  }
  if (!verr) {
    in->poison = b.poison;
    in->workers = &b.workers;
    in->counters = &b.counters;
    out->combined_x =
        a.out ? *a.out : b.allocator->allocate(DType::bf16, {in->handle->num_tokens, in->hidden});
  }
  std::shared_ptr<detail::EventState> st;
  // A handle of a dispatch among fewer ranks (a mask since cleaned) combines among the ranks live now.
  if (!uses_masks(b) && (verr || in->handle->live_ranks.empty()))
    st = launch_combine(b, s, engine::OpKind::low_latency_combine, std::nullopt, verr, a.async_finish, in,
                        out);
  else
    st = launch_masked_combine(b, s, verr, a.async_finish, in, out);
  LowLatencyCombineResult r;
  r.combined_x = a.async_finish ? out->combined_x : std::move(out->combined_x);  // as in the dispatch
  r.event = EventOverlap(st);
  return r;
}

int64_t Buffer::get_low_latency_rdma_size_hint(int64_t t_max, int64_t hidden, int num_ranks,
                                               int num_experts) {
  const char* pre = "get_low_latency_rdma_size_hint: ";
  EPCOMM_CHECK(t_max >= 1 && hidden >= 1 && num_ranks >= 1 && num_ranks <= engine::kMaxRanks, pre,
               "argument: expected num_max_dispatch_tokens_per_rank, hidden >= 1 and 1 <= num_ranks <= ",
               engine::kMaxRanks, ", got ", t_max, ", ", hidden, ", ", num_ranks);
  EPCOMM_CHECK(num_experts >= 1 && num_experts % num_ranks == 0, pre,
               "argument: num_experts: expected a positive multiple of the ", num_ranks, " ranks, got ",
               num_experts);
  // Two calls in flight of E * T_max rows at the widest row of any format (bf16 plus 16 bytes of routing),
  // spread over the lanes of the worst node partition (P ranks per node, R / P nodes); each lane also holds
  // its fixed part and the copies of one token with its f32 partial (top-k at most 32).
  const int64_t rows = 2 * int64_t{num_experts} * t_max * (2 * hidden + 16);
  const int64_t token = (std::min(num_experts, 32) + 2) * (4 * hidden + 64);
  int64_t lanes = rows;
  for (int P = 1; P <= num_ranks; ++P)
    if (num_ranks % P == 0) {
      const int64_t M = num_ranks / P;
      const auto lane =
          static_cast<int64_t>(engine::lane_overhead_bytes(P, num_ranks)) + 4096 + rows / M + token;
      lanes = std::max(lanes, M * ((lane + 4095) / 4096 * 4096));
    }
  return (lanes + 127) / 128 * 128;
}

Tensor Buffer::low_latency_combine_buffer(const Handle& handle) {
  Impl& b = *impl_;
  const std::string pre = detail::cat("epcomm[rank ", b.rank, "] get_next_low_latency_combine_buffer: ");
  const Handle::Impl& hd = handle.impl();
  EPCOMM_CHECK(hd.buffer_key == &b && !hd.buffer_alive.expired(), pre,
               "argument: handle: it belongs to another Buffer or to a destroyed one");
  EPCOMM_CHECK(hd.expert_block_rows > 0, pre,
               "argument: handle: it comes from a normal-mode dispatch, not a low_latency_dispatch");
  return b.allocator->allocate(DType::bf16, {hd.num_local, hd.expert_block_rows, hd.hidden});
}

// ---- rank masks ----------------------------------------------------------------------------------------

void Buffer::low_latency_update_mask_buffer(int rank, bool mask) {
  Impl& b = *impl_;
  EPCOMM_CHECK(rank >= 0 && rank < b.num_ranks, "epcomm[rank ", b.rank,
               "] low_latency_update_mask_buffer: argument: rank: expected 0 to ", b.num_ranks - 1, ", got ",
               rank);
  ll::MaskState& ms = ll::mask_state(b);
  std::lock_guard<std::mutex> lk(ms.m);
  ms.masked[rank] = mask ? 1 : 0;
}

std::vector<int32_t> Buffer::low_latency_query_mask_buffer() {
  std::vector<uint8_t> m = ll::mask_state(*impl_).snapshot();
  return std::vector<int32_t>(m.begin(), m.end());
}

void Buffer::set_low_latency_shrink(bool enable) {
  ll::MaskState& ms = ll::mask_state(*impl_);
  std::lock_guard<std::mutex> lk(ms.m);
  ms.shrink = enable;
}

namespace {

// One collective round among the live ranks (after the shrink agreement), then `then` on the
// communication thread. Synchronous.
void run_round(Buffer::Impl& b, const char* op, const std::function<void()>& then) {
  b.check_usable(op);
  const uint64_t s = ++b.seq;
  auto st = launch(b, s, engine::OpKind::low_latency_clean, std::nullopt, std::string(), true,
                   [&b, then](engine::OpContext& ctx, const std::function<void()>&) {
                     const ll::LiveSet live = ll::enter_call(b, ctx);
                     ll::MaskView view(*b.transport, live.live);
                     engine::OpContext sub =
                         live_context(b, view, ctx.seq(), engine::OpKind::low_latency_clean);
                     sub.begin_header(engine::OpKind::low_latency_clean);
                     sub.publish_header();
                     sub.exchange_headers();
                     then();
                     return int64_t{0};
                   });
  if (auto e = st->wait()) std::rethrow_exception(e);
}

}  // namespace

void Buffer::low_latency_clean_mask_buffer() {
  Impl& b = *impl_;
  EPCOMM_CHECK(!b.inter, "epcomm[rank ", b.rank,
               "] low_latency_clean_mask_buffer: rank masks work on one node only; this Buffer spans ",
               b.num_nodes, " nodes");
  run_round(b, "low_latency_clean_mask_buffer", [&b] {
    ll::MaskState& ms = ll::mask_state(b);
    std::lock_guard<std::mutex> lk(ms.m);
    std::fill(ms.masked.begin(), ms.masked.end(), 0);
  });
}

void Buffer::clean_low_latency_buffer(int64_t t_max, int64_t hidden, int num_experts) {
  Impl& b = *impl_;
  const std::string pre = detail::cat("epcomm[rank ", b.rank, "] clean_low_latency_buffer: ");
  EPCOMM_CHECK(b.options.low_latency_mode, pre,
               "argument: low_latency_mode: this Buffer was created with low_latency_mode = false");
  EPCOMM_CHECK(t_max >= 1 && hidden >= 1, pre,
               "argument: expected num_max_dispatch_tokens_per_rank >= 1 and hidden >= 1, got ", t_max,
               " and ", hidden);
  EPCOMM_CHECK(num_experts >= 1 && num_experts % b.num_ranks == 0, pre,
               "argument: num_experts: expected a positive multiple of the ", b.num_ranks, " ranks, got ",
               num_experts);
  ll::MaskState& ms = ll::mask_state(b);
  {
    std::lock_guard<std::mutex> lk(ms.m);
    if (!ms.shrink) return;
  }
  uses_masks(b);
  run_round(b, "clean_low_latency_buffer", [] {});
}

}  // namespace epcomm
