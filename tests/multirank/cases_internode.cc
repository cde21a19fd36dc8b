// multirank/cases_internode.cc — internode specifics (docs/normal-mode.md): the same problem on one node
// and on virtual nodes (EPCOMM_RANKS_PER_NODE, set by ctest) gives identical dispatch results, and each token
// crosses the network once per other node that needs it. The foundation cases also run under virtual nodes
// (tests/multirank/CMakeLists.txt) against the reference for the partition in use.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "common/env.h"
#include "multirank/round_trip.h"
#include "multirank/v2_harness.h"
#include "support/check.h"

using namespace epcomm;
using namespace epcomm::testing;

namespace {

int partition_or_skip(const RankCtx& ctx) {
  const int P = env::ranks_per_node();
  if (P <= 0 || P >= ctx.size || ctx.size % P != 0)
    throw Skip("needs EPCOMM_RANKS_PER_NODE = P with 0 < P < ranks, P dividing the ranks");
  return P;
}

ProblemSpec internode_spec(const RankCtx& ctx, uint64_t seed, int64_t hidden) {
  ProblemSpec s;
  s.num_ranks = ctx.size;
  s.num_experts = ctx.size * 4;
  s.num_topk = 6;
  s.hidden = hidden;
  s.seed = seed;
  s.min_tokens = 0;
  s.max_tokens = 300;
  return s;
}

std::vector<uint8_t> bytes(const Tensor& t) {
  std::vector<uint8_t> v(t.nbytes());
  if (t.nbytes()) std::memcpy(v.data(), t.data(), t.nbytes());
  return v;
}

}  // namespace

// Dispatch on one node and across virtual nodes: every output and handle array bitwise equal.
MR_CASE("internode_matches_single_node", {}) {
  const int P = partition_or_skip(ctx);
  BufferOptions one = test_options(2 << 20);
  one.ranks_per_node = ctx.size;  // one node, whatever the environment says
  BufferOptions many = test_options(2 << 20);
  many.ranks_per_node = P;
  Buffer a(ctx.group, one), b(ctx.group, many);
  REQUIRE(a.num_nodes() == 1 && b.num_nodes() == ctx.size / P, "partition: got ", a.num_nodes(), " and ",
          b.num_nodes(), " nodes");
  for (ReceiveOrder order : {ReceiveOrder::expert_major, ReceiveOrder::rank_major}) {
    const Problem pr = make_problem(internode_spec(ctx, 11 + static_cast<int>(order), 520));
    DispatchArgs args = dispatch_args_of(pr, ctx.rank, a);
    args.receive_order = order;
    args.expert_alignment = order == ReceiveOrder::expert_major ? 4 : 1;
    DispatchResult x = a.dispatch(args), y = b.dispatch(args);
    const std::string where = epcomm::detail::cat("[", receive_order_name(order), " rank ", ctx.rank, "] ");
    REQUIRE(bytes(x.recv_x.data) == bytes(y.recv_x.data), where, "recv_x differs between 1 and ",
            b.num_nodes(), " nodes");
    REQUIRE(bytes(*x.recv_topk_idx) == bytes(*y.recv_topk_idx), where, "recv_topk_idx differs");
    REQUIRE(bytes(*x.recv_topk_weights) == bytes(*y.recv_topk_weights), where, "recv_topk_weights differs");
    REQUIRE(*x.num_recv_tokens_per_expert_list == *y.num_recv_tokens_per_expert_list, where, "list differs");
    REQUIRE(bytes(x.handle->recv_src_rank()) == bytes(y.handle->recv_src_rank()), where, "src ranks differ");
    REQUIRE(bytes(x.handle->recv_src_token()) == bytes(y.handle->recv_src_token()), where,
            "src tokens differ");
    // Cached re-dispatch along the same routes, both Buffers.
    DispatchArgs c;
    c.x.data = x_of(pr, ctx.rank);
    c.handle = x.handle;
    DispatchResult cx = a.dispatch(c);
    c.handle = y.handle;
    DispatchResult cy = b.dispatch(c);
    REQUIRE(bytes(cx.recv_x.data) == bytes(cy.recv_x.data), where, "cached recv_x differs");
  }
}

// The dedup counter: one row per distinct (token, other node that needs it), nothing more.
MR_CASE("internode_dedup", {}) {
  const int P = partition_or_skip(ctx);
  BufferOptions o = test_options(1 << 20);  // small segments: several windows
  o.ranks_per_node = P;
  Buffer buf(ctx.group, o);
  const Problem pr = make_problem(internode_spec(ctx, 5, 256));
  const int r = ctx.rank, R = ctx.size, K = pr.spec.num_topk, L = pr.spec.num_experts / R;
  const int64_t T = pr.ranks[r].num_tokens;
  const int64_t row = static_cast<int64_t>(pr.row_bytes());
  int64_t want = 0;
  for (int64_t t = 0; t < T; ++t) {
    std::set<int> nodes;
    for (int k = 0; k < K; ++k) {
      const int64_t e = pr.ranks[r].topk_idx[t * K + k];
      if (e >= 0 && (e / L) / P != r / P) nodes.insert(static_cast<int>((e / L) / P));
    }
    want += static_cast<int64_t>(nodes.size());
  }
  DispatchArgs args = dispatch_args_of(pr, r, buf);
  const Buffer::InternodeCounters before = buf.internode_counters();
  DispatchResult d = buf.dispatch(args);
  const Buffer::InternodeCounters after = buf.internode_counters();
  const int64_t rows = after.rows - before.rows;
  REQUIRE(rows == want, "rank ", r, ": ", rows,
          " rows crossed the network, expected one per distinct (token, "
          "other node) = ",
          want);
  REQUIRE(after.row_bytes - before.row_bytes == want * row, "row bytes: got ",
          after.row_bytes - before.row_bytes, ", expected ", want * row);
  // Everything else on the wire is routing (per row: token index + K ids and weights, 64-byte aligned
  // records), window headers, the call header with counts, and acknowledgements.
  const int64_t sent = after.network_bytes - before.network_bytes;
  const int64_t meta_bound = want * (4 + 64 + 64) + 64 * 1024;
  REQUIRE(sent >= want * row && sent <= want * row + meta_bound, "network bytes ", sent,
          " outside [rows, rows + metadata bound ", meta_bound, "]");
  (void)d;
}

// distribute-v2 across nodes: dispatch_v2 sends one record per distinct (active token, other node with one
// of its experts), and each proxy returns exactly the rows its node computed for its rail peers' tokens. Rows
// are checked against the reference by the harness; the counts here come from the inputs alone.
MR_CASE("v2_internode_dedup", {}) {
  const int P = partition_or_skip(ctx);
  v2::V2Groups g = v2::make_v2_groups(ctx, 0, 1 << 20);
  REQUIRE(moe::group_num_nodes(*g.ep) == ctx.size / P, "the group spans ", moe::group_num_nodes(*g.ep),
          " nodes, expected ", ctx.size / P);
  v2::V2Run run;
  run.spec.W = ctx.size;
  run.spec.E = 2 * ctx.size;
  run.spec.K = 4;
  run.spec.H = 256;
  run.spec.bs = 300;
  run.spec.mask_dims = 2;  // masked slots and tokens do not travel
  run.spec.seed = 77;
  const v2::V2Problem p = v2::make_v2_problem(run.spec);
  const int me = ctx.rank, K = run.spec.K, L = run.spec.L(), my_node = me / P;
  auto node_of_expert = [&](int32_t e) { return (e / L) / P; };
  // Dispatch: distinct (token, other node) pairs of this rank's active slots.
  int64_t want_dispatch = 0;
  {
    const v2::V2Rank& in = p.at(me, 0);
    for (int64_t t = 0; t < in.bs; ++t) {
      if (!in.active_tok(t, run.spec.mask_dims, K)) continue;
      std::set<int> nodes;
      for (int k = 0; k < K; ++k)
        if (in.active_slot(t, k, run.spec.mask_dims, K) && node_of_expert(in.ids[t * K + k]) != my_node)
          nodes.insert(node_of_expert(in.ids[t * K + k]));
      want_dispatch += static_cast<int64_t>(nodes.size());
    }
  }
  // Combine, as proxy of rail peer o on each other node: the active slots of o whose expert is on our node.
  int64_t want_combine = 0;
  for (int n = 0; n < ctx.size / P; ++n) {
    if (n == my_node) continue;
    const int o = n * P + me % P;
    const v2::V2Rank& in = p.at(o, 0);
    for (int64_t t = 0; t < in.bs; ++t)
      for (int k = 0; k < K; ++k)
        if (in.active_tok(t, run.spec.mask_dims, K) && in.active_slot(t, k, run.spec.mask_dims, K) &&
            node_of_expert(in.ids[t * K + k]) == my_node)
          ++want_combine;
  }
  REQUIRE(want_dispatch > 0 && want_combine > 0, "the problem sends nothing across nodes (", want_dispatch,
          ", ", want_combine, ")");
  const int64_t row = run.spec.H * 2;
  run.combine = false;
  const moe::GroupNetworkCounters c0 = moe::group_network_counters(*g.ep);
  v2::run_v2(g, run);
  const moe::GroupNetworkCounters c1 = moe::group_network_counters(*g.ep);
  run.combine = true;
  v2::run_v2(g, run);
  const moe::GroupNetworkCounters c2 = moe::group_network_counters(*g.ep);
  const int64_t dispatch_rows = c1.rows - c0.rows, combine_rows = (c2.rows - c1.rows) - dispatch_rows;
  REQUIRE(
      dispatch_rows == want_dispatch, "ep rank ", me, ": dispatch_v2 sent ", dispatch_rows,
      " records over the network, expected one per distinct (active token, other node) = ", want_dispatch);
  REQUIRE(c1.row_bytes - c0.row_bytes == want_dispatch * row, "dispatch row bytes: got ",
          c1.row_bytes - c0.row_bytes, ", expected ", want_dispatch * row);
  REQUIRE(combine_rows == want_combine, "ep rank ", me, ": combine_v2 returned ", combine_rows,
          " rows as proxy, expected ", want_combine);
  // Besides the rows: per record its token index and routing (64-byte aligned), per returned row its
  // (slot, writer) pair, window headers, call headers with counts, acknowledgements and signals.
  const int64_t sent = (c2.network_bytes - c1.network_bytes);
  const int64_t rows_bytes = (want_dispatch + want_combine) * row;
  const int64_t bound = want_dispatch * (4 + 64) + want_combine * 8 + 256 * 1024;
  REQUIRE(sent >= rows_bytes && sent <= rows_bytes + bound, "network bytes of the round trip ", sent,
          " outside [rows ", rows_bytes, ", rows + metadata bound ", rows_bytes + bound, "]");
}

// A TP pair split over two nodes is refused on both ranks, naming tp_group, before anything moves; the EP
// groups (one rank each) stay usable.
MR_CASE("v2_tp_across_nodes", {}) {
  const int P = partition_or_skip(ctx);
  REQUIRE(P == 1 && ctx.size == 2, "runs as two nodes of one rank (2x1), got ", ctx.size, " ranks, P = ", P);
  v2::V2Groups g = v2::make_v2_groups(ctx, 2, 1 << 20);
  REQUIRE(moe::group_num_nodes(*g.tp) == 2, "the TP pair spans ", moe::group_num_nodes(*g.tp), " nodes");
  v2::V2Run run;
  run.spec.W = 1;
  run.spec.T = 2;
  run.spec.E = 2;
  run.spec.K = 1;
  run.spec.H = 32;
  run.spec.bs = 4;
  bool raised = false;
  try {
    v2::run_v2(g, run);
  } catch (const Error& e) {
    raised = true;
    const std::string m = e.what();
    REQUIRE(e.code() == ErrorCode::InvalidUsage, "code ", static_cast<int>(e.code()), ": ", m);
    REQUIRE(m.find("tp_group") != std::string::npos && m.find("different nodes") != std::string::npos,
            "the error does not name tp_group and the nodes: ", m);
  }
  REQUIRE(raised, "a TP pair across nodes was accepted");
  run.spec.T = 0;  // the EP group alone still works
  v2::V2Groups ep_only;
  ep_only.ep = g.ep;
  ep_only.ep_rank = g.ep_rank;
  v2::run_v2(ep_only, run);
}

// Run by tests/multirank/link_cut.sh: two nodes in two network namespaces joined by a veth pair. Rounds of
// dispatch + combine run until the script cuts the link (rank 0 drops a marker file after the first round);
// then every rank must fail with an error naming a peer, and tear down within its deadline.
MR_CASE("internode_link_cut", {}) {
  const int P = partition_or_skip(ctx);
  const char* marker = std::getenv("EPCOMM_TEST_MARKER");
  REQUIRE(marker && *marker, "EPCOMM_TEST_MARKER must name the file rank 0 creates after the first round");
  BufferOptions o = test_options(4 << 20, env::timeout_s());
  o.ranks_per_node = P;
  Buffer buf(ctx.group, o);
  const Problem pr = make_problem(internode_spec(ctx, 3, 2048));
  DispatchArgs args = dispatch_args_of(pr, ctx.rank, buf);
  const auto start = std::chrono::steady_clock::now();
  for (int round = 0;; ++round) {
    try {
      DispatchResult d = buf.dispatch(args);
      CombineArgs c;
      c.x = d.recv_x.data;
      c.handle = d.handle;
      buf.combine(c);
    } catch (const Error& e) {
      const std::string m = e.what();
      std::fprintf(stderr, "[rank %d] round %d failed as expected: %s\n", ctx.rank, round, m.c_str());
      REQUIRE(round > 0, "the first round failed before the link was cut: ", m);
      REQUIRE(e.code() == ErrorCode::Timeout || e.code() == ErrorCode::Aborted, "code ",
              static_cast<int>(e.code()), ": ", m);
      REQUIRE(m.find("rank ") != std::string::npos, "the error names no peer: ", m);
      return;  // the Buffer's teardown is timed by the script
    }
    if (round == 0 && ctx.rank == 0) {
      std::FILE* f = std::fopen(marker, "w");
      REQUIRE(f != nullptr, "cannot create ", marker);
      std::fclose(f);
    }
    REQUIRE(std::chrono::steady_clock::now() - start < std::chrono::seconds(90),
            "still running 90 s after the start: the cut link was not noticed");
  }
}
