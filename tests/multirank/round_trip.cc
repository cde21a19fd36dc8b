// multirank/round_trip.cc — dispatch + combine checked against the independent reference model.
#include "multirank/round_trip.h"

#include "engine/internode.h"

#include <cstring>

#include "common/env.h"
#include "support/check.h"

namespace epcomm::testing {

BufferOptions test_options(int64_t nvl_bytes, double timeout_s) {
  BufferOptions o;
  o.num_nvl_bytes = nvl_bytes;
  o.timeout_s = timeout_s;
  // Under virtual nodes (EPCOMM_RANKS_PER_NODE, up to 4 nodes) every lane gets at least as much room as the
  // segment, so that the cases written for small segments force rounds internode too.
  o.num_rdma_bytes =
      4 * static_cast<int64_t>(engine::lane_overhead_bytes(64, engine::kMaxRanks) + nvl_bytes + 4096);
  return o;
}

DispatchArgs dispatch_args_of(const Problem& p, int r, Buffer& buf) {
  DispatchArgs args;
  args.x.data = x_of(p, r);
  args.topk_idx = topk_idx_of(p, r);
  args.topk_weights = topk_weights_of(p, r);
  args.num_tokens_per_expert =
      buf.get_dispatch_layout(*args.topk_idx, p.spec.num_experts).num_tokens_per_expert;
  return args;
}

Tensor x_of(const Problem& p, int r) {
  auto& in = p.ranks[r];
  return Tensor::wrap(const_cast<uint8_t*>(in.x.data()), p.spec.dtype, {in.num_tokens, p.spec.hidden});
}
Tensor topk_idx_of(const Problem& p, int r) {
  auto& in = p.ranks[r];
  return Tensor::wrap(const_cast<int64_t*>(in.topk_idx.data()), DType::i64, {in.num_tokens, p.spec.num_topk});
}
Tensor topk_weights_of(const Problem& p, int r) {
  auto& in = p.ranks[r];
  return Tensor::wrap(const_cast<float*>(in.topk_weights.data()), DType::f32,
                      {in.num_tokens, p.spec.num_topk});
}

void expect_error(const std::function<void()>& fn, ErrorCode code,
                  std::initializer_list<const char*> keywords) {
  try {
    fn();
  } catch (const Error& e) {
    std::string msg = e.what();
    REQUIRE(e.code() == code, "expected ", error_code_name(code), ", got ", error_code_name(e.code()), ": ",
            msg);
    for (const char* k : keywords)
      REQUIRE(msg.find(k) != std::string::npos, "message lacks '", k, "': ", msg);
    return;
  }
  REQUIRE(false, "expected an epcomm::Error(", error_code_name(code), "), nothing was thrown");
}

static std::vector<uint8_t> bytes_of(const Tensor& t) {
  return tensor_bytes(t);
}

static void check_handle(const Handle& h, const RefDispatch& ref, const std::string& where) {
  check_scalar(where + " handle.num_recv_rows", h.num_recv_rows(), ref.num_recv_rows);
  check_scalar(where + " handle.num_rows", h.num_rows(), ref.num_rows);
  check_equal(where + " handle.num_recv_tokens_per_expert", h.num_recv_tokens_per_expert(), ref.list);
  check_equal(where + " handle.num_recv_pairs_per_expert", h.num_recv_pairs_per_expert(), ref.cnt);
  check_equal(where + " handle.num_recv_rows_per_source", h.num_recv_rows_per_source(), ref.rows_per_source);
  check_equal(where + " handle.recv_src_rank", tensor_to_i32(h.recv_src_rank()), ref.src_rank);
  check_equal(where + " handle.recv_src_token", tensor_to_i32(h.recv_src_token()), ref.src_token);
  check_equal(where + " handle.recv_src_slot", tensor_to_i32(h.recv_src_slot()), ref.src_slot);
}

void run_round_trip(RankCtx& ctx, Buffer& buf, const RoundTrip& rt) {
  const Problem P = make_problem(rt.spec);
  const int r = ctx.rank, R = ctx.size;
  const int K = rt.spec.num_topk, E = rt.spec.num_experts;
  const bool topk = rt.spec.topk;
  const int rpn =
      buf.num_nodes() > 1 ? R / buf.num_nodes() : 0;  // the reference's partition (docs/normal-mode.md)
  const std::string where =
      epcomm::detail::cat("[", receive_order_name(rt.order), " seed ", rt.spec.seed, " rank ", r, "]");

  int64_t worst = rt.num_worst_tokens;
  if (worst < 0) {
    int64_t most = 0;
    for (int d = 0; d < R; ++d)
      most = std::max(most, ref_dispatch_placement(P, d, rt.order, rt.expert_alignment).num_recv_rows);
    worst = most - worst;
  }

  // Layout.
  Tensor ti = topk_idx_of(P, r), tw = topk_weights_of(P, r);
  std::vector<int32_t> ids32(P.ranks[r].topk_idx.begin(), P.ranks[r].topk_idx.end());
  if (rt.idx32) ti = Tensor::wrap(ids32.data(), DType::i32, {P.ranks[r].num_tokens, K});
  LayoutResult lay = buf.get_dispatch_layout(ti, E);
  RefLayout rl = ref_layout(P, r, rpn);
  check_equal(where + " num_tokens_per_rank", tensor_to_i64(lay.num_tokens_per_rank),
              std::vector<int64_t>(rl.num_tokens_per_rank.begin(), rl.num_tokens_per_rank.end()));
  check_equal(where + " num_tokens_per_expert", tensor_to_i64(lay.num_tokens_per_expert),
              std::vector<int64_t>(rl.num_tokens_per_expert.begin(), rl.num_tokens_per_expert.end()));
  check_equal(where + " is_token_in_rank", tensor_to_i64(lay.is_token_in_rank),
              std::vector<int64_t>(rl.is_token_in_rank.begin(), rl.is_token_in_rank.end()));
  if (rpn == 0) {
    REQUIRE(!lay.num_tokens_per_rdma_rank.has_value(), "one node: num_tokens_per_rdma_rank must be None");
  } else {
    REQUIRE(lay.num_tokens_per_rdma_rank.has_value(), "several nodes: num_tokens_per_rdma_rank missing");
    check_equal(where + " num_tokens_per_rdma_rank", tensor_to_i64(*lay.num_tokens_per_rdma_rank),
                std::vector<int64_t>(rl.num_tokens_per_rdma_rank.begin(), rl.num_tokens_per_rdma_rank.end()));
  }

  // Dispatch.
  DispatchArgs a;
  a.x.data = x_of(P, r);
  if (rt.shared_dispatch_input) {  // the same tokens, from the shared dispatch-input area
    Tensor sx = buf.get_dispatch_input(P.ranks[r].num_tokens, P.spec.hidden, P.spec.dtype);
    if (sx.nbytes()) std::memcpy(sx.data(), a.x.data.data(), sx.nbytes());
    a.x.data = sx;
  }
  a.num_tokens_per_expert = lay.num_tokens_per_expert;
  if (topk) {
    a.topk_idx = ti;
    a.topk_weights = tw;
    if (rt.pass_layout) {
      a.num_tokens_per_rank = lay.num_tokens_per_rank;
      a.is_token_in_rank = lay.is_token_in_rank;
    }
  } else {
    a.is_token_in_rank = lay.is_token_in_rank;
  }
  a.expert_alignment = rt.expert_alignment;
  a.num_worst_tokens = worst;
  a.receive_order = rt.order;
  a.async_finish = rt.async;
  // With output arenas on one node a private x is pushed, and combines of rows in place (fed back or in the
  // combine-input area) then read every copy straight from the holders: the counters say which path ran.
  // Across nodes the arenas only let each node's reducers read its holders' rows in place (no holder copies).
  const bool arenas = buf.num_output_arena_bytes() > 0;
  const bool direct = arenas && buf.num_nodes() == 1 && !rt.shared_dispatch_input;
  const Buffer::CopyCounters k0 = buf.copy_counters();
  DispatchResult d = buf.dispatch(a);
  if (rt.async) d.event.wait();
  REQUIRE(d.event.is_complete(), "event must be complete after wait()");
  const RefDispatch ref = ref_dispatch(P, r, rt.order, rt.expert_alignment, worst);
  const size_t row_bytes = P.row_bytes();
  check_scalar(where + " recv_x rows", d.recv_x.data.size(0), ref.num_rows);
  check_rows_equal(where + " recv_x", bytes_of(d.recv_x.data), ref.recv_x, row_bytes, P.spec.dtype);
  if (topk) {
    REQUIRE(d.recv_topk_idx && d.recv_topk_weights, "top-k outputs missing");
    REQUIRE(d.recv_topk_idx->dtype() == ti.dtype(), "recv_topk_idx must keep topk_idx's dtype");
    check_equal(where + " recv_topk_idx", tensor_to_i64(*d.recv_topk_idx), ref.recv_topk_idx, K);
    check_equal(where + " recv_topk_weights", tensor_to_f32(*d.recv_topk_weights), ref.recv_topk_weights, K);
  } else {
    REQUIRE(!d.recv_topk_idx && !d.recv_topk_weights, "without top-k the top-k outputs must be None");
  }
  REQUIRE(d.num_recv_tokens_per_expert_list.has_value(), "list missing");
  check_equal(where + " num_recv_tokens_per_expert_list", *d.num_recv_tokens_per_expert_list,
              ref.result_list());
  check_handle(*d.handle, ref, where);

  // Every rank's reference rows, for the combines.
  std::vector<RefDispatch> refs(R);
  std::vector<std::vector<uint8_t>> fed(R), outs(R);
  std::vector<std::vector<float>> recv_w(R);
  const DType cdt = rt.combine_dtype;
  const int64_t H2 = rt.combine_hidden ? rt.combine_hidden : rt.spec.hidden;
  for (int s = 0; s < R; ++s) {
    refs[s] = s == r ? ref : ref_dispatch(P, s, rt.order, rt.expert_alignment, worst);
    fed[s] = refs[s].recv_x;
    recv_w[s] = refs[s].recv_topk_weights;
    outs[s] = make_expert_output(rt.spec.seed ^ 0x5eed, refs[s], cdt, H2);
  }

  // Combine 1: received rows fed back.
  {
    CombineArgs c;
    c.x = d.recv_x.data;
    if (rt.shared_input) {  // the same rows, from the shared combine-input area
      if (rt.async) d.event.wait();
      c.x = buf.get_combine_input(*d.handle, d.recv_x.data.dtype(), d.recv_x.data.size(1));
      if (c.x.nbytes()) std::memcpy(c.x.data(), d.recv_x.data.data(), c.x.nbytes());
    }
    c.handle = d.handle;
    if (rt.order == ReceiveOrder::rank_major && topk) c.topk_weights = d.recv_topk_weights;
    c.async_finish = rt.async;
    if (rt.async) c.previous_event = d.event;
    CombineResult cr = buf.combine(c);
    cr.event.wait();
    // Once combine returns, the rows this rank lent are its own again: overwrite them at once, so that a
    // reader still behind (a peer reading them in place, or across nodes the proxy that reduces them for a
    // remote origin) would reduce NaN and fail that rank's check below.
    if (c.x.nbytes()) std::memset(c.x.data(), 0xFF, c.x.nbytes());
    const Buffer::CopyCounters k1 = buf.copy_counters();
    check_scalar<int64_t>(where + " dispatch_pushed_tokens",
                          k1.dispatch_pushed_tokens - k0.dispatch_pushed_tokens,
                          direct ? P.ranks[r].num_tokens : 0);
    check_scalar<int64_t>(where + " combine(fed back) combine_direct_tokens",
                          k1.combine_direct_tokens - k0.combine_direct_tokens,
                          direct ? P.ranks[r].num_tokens : 0);
    if (arenas || rt.shared_input)  // rows in shared memory: read in place, whatever the path
      check_scalar<int64_t>(where + " combine(fed back) combine_copied_rows",
                            k1.combine_copied_rows - k0.combine_copied_rows, 0);
    const bool rank_w = rt.order == ReceiveOrder::rank_major && topk;
    RefCombine rc = ref_combine(P, r, rt.order, rt.expert_alignment, worst, P.spec.dtype, P.spec.hidden, fed,
                                nullptr, rank_w ? &recv_w : nullptr, {}, rpn);
    check_rows_equal(where + " combine(fed back) combined_x", bytes_of(cr.combined_x), rc.combined_x,
                     row_bytes, P.spec.dtype);
    REQUIRE(cr.combined_topk_weights.has_value() == rc.has_weights, "combined_topk_weights presence");
    if (rc.has_weights)
      check_equal(where + " combine(fed back) combined_topk_weights",
                  tensor_to_f32(*cr.combined_topk_weights), rc.combined_topk_weights, K);
    if (rank_w) {  // feeding back recv_topk_weights returns the original weights, 0 at -1 slots
      std::vector<float> want(P.ranks[r].num_tokens * K);
      for (size_t i = 0; i < want.size(); ++i)
        want[i] = P.ranks[r].topk_idx[i] >= 0 ? P.ranks[r].topk_weights[i] : 0.0f;
      check_equal(where + " rank_major weights round trip", tensor_to_f32(*cr.combined_topk_weights), want,
                  K);
    }
  }

  // Combine 2: distinct per-row outputs (NaN in PAD/tail rows), other dtype/H', explicit weights, bias tuple.
  {
    const int64_t T = P.ranks[r].num_tokens;
    std::vector<uint8_t> mine = outs[r];
    CombineArgs c;
    c.x = Tensor::wrap(mine.data(), cdt, {ref.num_rows, H2});
    if (rt.shared_input) {
      c.x = buf.get_combine_input(*d.handle, cdt, H2);
      if (c.x.nbytes()) std::memcpy(c.x.data(), mine.data(), c.x.nbytes());
    }
    c.handle = d.handle;
    std::vector<float> explicit_w;
    if (rt.order == ReceiveOrder::expert_major) {
      explicit_w = make_random_weights(T * K, rt.spec.seed * 31 + r);
      c.topk_weights = Tensor::wrap(explicit_w.data(), DType::f32, {T, K});
    }
    std::vector<uint8_t> b1 = make_random_rows(T, H2, cdt, rt.spec.seed * 7 + r);
    std::vector<uint8_t> b2 = make_random_rows(T, H2, cdt, rt.spec.seed * 13 + r);
    c.bias = Tensor::wrap(b1.data(), cdt, {T, H2});
    c.bias2 = Tensor::wrap(b2.data(), cdt, {T, H2});
    CombineResult cr = buf.combine(c);
    RefCombine rc = ref_combine(P, r, rt.order, rt.expert_alignment, worst, cdt, H2, outs,
                                explicit_w.empty() ? nullptr : &explicit_w, nullptr, {&b1, &b2}, rpn);
    check_rows_equal(where + " combine(distinct outputs, bias tuple) combined_x", bytes_of(cr.combined_x),
                     rc.combined_x, H2 * dtype_size(cdt), cdt);
    if (rc.has_weights)
      check_equal(where + " combine(explicit weights) combined_topk_weights",
                  tensor_to_f32(*cr.combined_topk_weights), rc.combined_topk_weights, K);
  }

  // Cached re-dispatch of a new x (other hidden size and dtype) along the same routes.
  if (rt.cached) {
    const int64_t H3 = rt.spec.hidden + 8;
    std::vector<std::vector<uint8_t>> nx(R);
    for (int s = 0; s < R; ++s)
      nx[s] = make_random_rows(P.ranks[s].num_tokens, H3, DType::f32, rt.spec.seed + 100 + s);
    DispatchArgs ca;
    ca.x.data = Tensor::wrap(nx[r].data(), DType::f32, {P.ranks[r].num_tokens, H3});
    if (rt.shared_dispatch_input) {
      Tensor sx = buf.get_dispatch_input(P.ranks[r].num_tokens, H3, DType::f32);
      if (sx.nbytes()) std::memcpy(sx.data(), nx[r].data(), sx.nbytes());
      ca.x.data = sx;
    }
    ca.handle = d.handle;
    ca.async_finish = rt.async;
    const Buffer::CopyCounters k2 = buf.copy_counters();
    DispatchResult cd = buf.dispatch(ca);
    cd.event.wait();
    // A cached dispatch pushes where the fresh one did (its handle knows every row).
    check_scalar<int64_t>(where + " cached dispatch_pushed_tokens",
                          buf.copy_counters().dispatch_pushed_tokens - k2.dispatch_pushed_tokens,
                          direct ? P.ranks[r].num_tokens : 0);
    REQUIRE(!cd.handle && !cd.recv_topk_idx && !cd.num_recv_tokens_per_expert_list,
            "cached dispatch returns only recv_x");
    auto want = ref_cached_dispatch(P, r, rt.order, rt.expert_alignment, worst, nx, H3 * 4);
    check_rows_equal(where + " cached recv_x", bytes_of(cd.recv_x.data), want, H3 * 4, DType::f32);
  }
}

void check_names_missing(const Error& e, const RankCtx& ctx, const char* word, int missing, int seen) {
  const std::string m = e.what();
  REQUIRE(e.code() == ErrorCode::Timeout || e.code() == ErrorCode::Aborted, "got ", error_code_name(e.code()),
          ": ", m);
  const std::string named = epcomm::detail::cat(word, " ", missing, " (last call seen: #", seen);
  REQUIRE(m.find("timeout") != std::string::npos && m.find(named) != std::string::npos, "message: ", m,
          " (expected to name ", named, ")");
  const int rpn = env::ranks_per_node();  // virtual nodes of rpn consecutive ranks when 0 < rpn < size
  if (e.code() != ErrorCode::Timeout || rpn <= 0 || rpn >= ctx.size || missing / rpn == ctx.rank / rpn)
    return;
  const std::string via =
      ctx.rank % rpn == missing % rpn
          ? epcomm::detail::cat("this ", word, "'s rail peer")
          : epcomm::detail::cat("reached through ", word, " ", ctx.rank / rpn * rpn + missing % rpn);
  const std::string remote = epcomm::detail::cat(named, "; on node ", missing / rpn, ", ", via, ")");
  REQUIRE(m.find(remote) != std::string::npos, "message: ", m, " (expected to name ", remote, ")");
}

}  // namespace epcomm::testing
