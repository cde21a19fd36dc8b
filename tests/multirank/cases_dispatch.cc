// multirank/cases_dispatch.cc — dispatch/combine results against the reference: random and skewed routing,
// both orders, alignment, worst case, zero-token ranks, rounds, cached re-dispatch, invariance.
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "multirank/round_trip.h"
#include "support/check.h"

using namespace epcomm;
using namespace epcomm::testing;

namespace {

// Whether Buffers on one node get output arenas here (EPCOMM_OUTPUT_ARENA=0 turns them off: docs/env.md).
bool env_arena_on() {
  const char* v = std::getenv("EPCOMM_OUTPUT_ARENA");
  return !v || std::string(v) != "0";
}

ProblemSpec spec_for(const RankCtx& ctx, uint64_t seed, int experts_per_rank, int topk, int64_t hidden,
                     DType dt = DType::bf16) {
  ProblemSpec s;
  s.num_ranks = ctx.size;
  s.num_experts = ctx.size * experts_per_rank;
  s.num_topk = topk;
  s.hidden = hidden;
  s.dtype = dt;
  s.seed = seed;
  s.min_tokens = 0;
  s.max_tokens = 40;
  return s;
}

const ReceiveOrder kOrders[] = {ReceiveOrder::expert_major, ReceiveOrder::rank_major};

}  // namespace

MR_CASE("dispatch_random", {}) {
  Buffer buf(ctx.group, test_options());
  uint64_t seed = 1;
  for (ReceiveOrder order : kOrders) {
    for (int64_t align : {1, 128}) {
      RoundTrip rt;
      rt.spec = spec_for(ctx, seed++, 3, 4, 96);
      rt.order = order;
      rt.expert_alignment = align;
      run_round_trip(ctx, buf, rt);
    }
    RoundTrip big;  // the production hidden size, f16 combine of another width
    big.spec = spec_for(ctx, seed++, 4, 8, 7168);
    big.spec.max_tokens = 12;
    big.order = order;
    big.combine_dtype = DType::f16;
    big.combine_hidden = 136;
    run_round_trip(ctx, buf, big);
    for (DType dt : {DType::f16, DType::f32}) {  // other payload dtypes; f32 combine
      RoundTrip rt;
      rt.spec = spec_for(ctx, seed++, 2, 3, 40, dt);
      rt.order = order;
      rt.combine_dtype = DType::f32;
      run_round_trip(ctx, buf, rt);
    }
    RoundTrip i32;  // int32 top-k ids
    i32.spec = spec_for(ctx, seed++, 3, 4, 24);
    i32.order = order;
    i32.idx32 = true;
    run_round_trip(ctx, buf, i32);
    RoundTrip bits;  // random bit patterns: NaN, -0 and subnormals arrive byte for byte
    bits.spec = spec_for(ctx, seed++, 2, 2, 33);
    bits.spec.random_bits = true;
    bits.order = order;
    bits.pass_layout = false;
    run_round_trip(ctx, buf, bits);
  }
}

// Combine from the shared combine-input area (Buffer::get_combine_input): on one node the origins read the
// holders' rows in place; the results must equal the reference bit for bit, as with private inputs, in
// both orders, with alignment, worst-case rows, other dtypes and widths, async chains, and windows that move
// in rounds (small segment). Across nodes the same calls take the copying path.
// The round trips of both shared-area cases, per order: two expert alignments over several windows of the
// 1 MiB segment, then f16 tokens with worst-case rows in an async chain (`extra` = true). `run` sets the
// case's own fields, runs the round trip and checks what is particular to it.
template <typename Run>
void shared_area_sweep(RankCtx& ctx, uint64_t seed, Run&& run) {
  for (ReceiveOrder order : kOrders) {
    for (int64_t align : {1, 64}) {
      RoundTrip rt;
      rt.spec = spec_for(ctx, seed++, 3, 4, 512);
      rt.spec.min_tokens = 150;
      rt.spec.max_tokens = 300;
      rt.order = order;
      rt.expert_alignment = align;
      run(rt, false);
    }
    RoundTrip other;
    other.spec = spec_for(ctx, seed++, 2, 3, 40, DType::f16);
    other.order = order;
    other.num_worst_tokens = -3;
    other.async = true;
    run(other, true);
  }
}

MR_CASE("combine_shared_input", {}) {
  BufferOptions o = test_options(1 << 20);
  o.num_combine_input_bytes = 8 << 20;
  Buffer buf(ctx.group, o);
  REQUIRE(buf.num_combine_input_bytes() == 8 << 20, "num_combine_input_bytes ",
          buf.num_combine_input_bytes());
  shared_area_sweep(ctx, 300, [&](RoundTrip& rt, bool extra) {
    if (extra) {  // an f32 combine of another width
      rt.combine_dtype = DType::f32;
      rt.combine_hidden = 72;
    }
    rt.shared_input = true;
    run_round_trip(ctx, buf, rt);
  });
  // Too small an area: a clear capacity error naming the option, nothing else happens.
  Buffer none(ctx.group, test_options(1 << 20));
  const Problem pr = make_problem(spec_for(ctx, 9, 2, 2, 64));
  DispatchArgs args = dispatch_args_of(pr, ctx.rank, none);
  DispatchResult d = none.dispatch(args);
  if (d.handle->num_rows() > 0)
    expect_error([&] { none.get_combine_input(*d.handle); }, ErrorCode::InvalidUsage,
                 {"get_combine_input", "num_combine_input_bytes = 0"});
  else  // no rows need no area
    REQUIRE(none.get_combine_input(*d.handle).size(0) == 0, "a rank without rows got a non-empty area");
}

// Shared reduction in direct combines: rank 0 holds far more tokens than the others, so they finish their own
// first and reduce chunks of rank 0's tokens into its outputs (combine_shared_tokens). Distinct expert
// outputs per row (written over recv_x, which lies in the output arena) and, in rank_major, the
// receiving-side weights fed back: every result must equal the reference bit for bit, whoever reduced it.
// Combines repeat until some rank has helped (scheduling decides who finishes first); never helping in 60
// calls fails. With more than two ranks per core (auto), or EPCOMM_COMBINE_SHARING=0, nobody may help: 10
// calls, none helped.
MR_CASE("combine_shared_reduction", {false, 2}) {
  Buffer buf(ctx.group, test_options(16 << 20));
  if (buf.num_output_arena_bytes() == 0 || buf.num_nodes() > 1)
    throw Skip("needs one node with output arenas (direct combines)");
  const int R = ctx.size, r = ctx.rank;
  // EPCOMM_COMBINE_SHARING (docs/env.md): auto helps unless the ranks exceed twice the cores; 0 or 1 decide.
  const unsigned cores = std::thread::hardware_concurrency();
  const char* knob = std::getenv("EPCOMM_COMBINE_SHARING");
  const std::string sharing = knob && *knob ? knob : "auto";
  const bool helps = sharing == "auto" ? cores == 0 || static_cast<unsigned>(R) <= 2 * cores : sharing == "1";
  uint64_t seed = 500;
  for (ReceiveOrder order : kOrders) {
    ProblemSpec spec = spec_for(ctx, seed++, 4, 4, 2048);  // a few ms of work for rank 0, even under load
    spec.tokens_override.assign(R, 5);
    spec.tokens_override[0] = 3000;
    const Problem P = make_problem(spec);
    DispatchArgs args = dispatch_args_of(P, r, buf);
    args.receive_order = order;
    DispatchResult d = buf.dispatch(args);
    std::vector<std::vector<uint8_t>> outs(R);
    std::vector<std::vector<float>> recv_w(R);
    for (int s = 0; s < R; ++s) {
      const RefDispatch ref = ref_dispatch(P, s, order);
      outs[s] = make_expert_output(seed, ref, DType::bf16, spec.hidden);
      recv_w[s] = ref.recv_topk_weights;
    }
    REQUIRE(d.recv_x.data.nbytes() == outs[r].size(), "recv_x bytes ", d.recv_x.data.nbytes(), ", expected ",
            outs[r].size());
    if (!outs[r].empty()) std::memcpy(d.recv_x.data.data(), outs[r].data(), outs[r].size());
    const bool rank_w = order == ReceiveOrder::rank_major;
    const RefCombine rc = ref_combine(P, r, order, 1, 0, DType::bf16, spec.hidden, outs, nullptr,
                                      rank_w ? &recv_w : nullptr, {});
    const std::string where = std::string("combine_shared_reduction ") + receive_order_name(order);
    int64_t helped = 0;
    const int calls = helps ? 60 : 10;
    for (int call = 0; call < calls && (helped == 0 || !helps); ++call) {
      const Buffer::CopyCounters k0 = buf.copy_counters();
      CombineArgs c;
      c.x = d.recv_x.data;
      c.handle = d.handle;
      if (rank_w) c.topk_weights = d.recv_topk_weights;
      const CombineResult cr = buf.combine(c);
      const Buffer::CopyCounters k1 = buf.copy_counters();
      check_scalar<int64_t>(where + " combine_direct_tokens",
                            k1.combine_direct_tokens - k0.combine_direct_tokens, P.ranks[r].num_tokens);
      REQUIRE(cr.combined_x.nbytes() == rc.combined_x.size(), where, " combined_x bytes ",
              cr.combined_x.nbytes(), ", expected ", rc.combined_x.size());
      check_rows_equal(where + " combined_x", cr.combined_x.data_as<uint8_t>(), rc.combined_x.data(),
                       P.ranks[r].num_tokens, P.row_bytes(), DType::bf16);
      if (rank_w)
        check_equal(where + " combined_topk_weights", tensor_to_f32(*cr.combined_topk_weights),
                    rc.combined_topk_weights, spec.num_topk);
      // Every rank learns how many tokens the others reduced for rank 0 in this call.
      const int64_t mine = k1.combine_shared_tokens - k0.combine_shared_tokens;
      REQUIRE(mine >= 0 && mine <= P.ranks[0].num_tokens, where, " combine_shared_tokens grew by ", mine);
      std::vector<std::byte> b(sizeof mine);
      std::memcpy(b.data(), &mine, sizeof mine);
      const std::vector<std::byte> all = ctx.group->bootstrap().all_gather(b);
      for (int s = 0; s < R; ++s) {
        int64_t v;
        std::memcpy(&v, all.data() + s * sizeof v, sizeof v);
        helped += v;
      }
    }
    if (!helps)
      REQUIRE(helped == 0, where, ": ", R, " ranks on ", cores, " cores, EPCOMM_COMBINE_SHARING=", sharing,
              ", yet ", helped, " tokens were reduced by helpers");
    else
      REQUIRE(helped > 0, where, ": no rank reduced any of rank 0's 3000 tokens in 60 combines");
  }
}

// Dispatch from the shared dispatch-input area (Buffer::get_dispatch_input): on one node the receivers read
// the senders' rows in place and nothing but the routing is staged. Results must equal the reference bit for
// bit in both orders, with alignment, worst-case rows, other dtypes, cached re-dispatch, async chains and
// windows that move in rounds (small segment); the copy counters must show which path ran. Across nodes the
// same calls stage as before.
MR_CASE("dispatch_shared_input", {}) {
  BufferOptions o = test_options(1 << 20);
  o.num_dispatch_input_bytes = 4 << 20;
  o.num_combine_input_bytes = 8 << 20;  // both areas in one segment
  Buffer buf(ctx.group, o);
  REQUIRE(buf.num_dispatch_input_bytes() == 4 << 20, "num_dispatch_input_bytes ",
          buf.num_dispatch_input_bytes());
  const bool one_node = buf.num_nodes() == 1;
  shared_area_sweep(ctx, 400, [&](RoundTrip& rt, bool extra) {
    rt.shared_dispatch_input = true;
    if (extra) {  // both shared areas
      rt.shared_input = true;
      run_round_trip(ctx, buf, rt);
      return;
    }
    rt.cached = true;
    const Buffer::CopyCounters c0 = buf.copy_counters();
    run_round_trip(ctx, buf, rt);
    const Buffer::CopyCounters c1 = buf.copy_counters();
    const int64_t T = make_problem(rt.spec).ranks[ctx.rank].num_tokens;
    // Two dispatches (fresh, cached) of T tokens each.
    check_scalar<int64_t>("dispatch_in_place_tokens",
                          c1.dispatch_in_place_tokens - c0.dispatch_in_place_tokens, one_node ? 2 * T : 0);
    check_scalar<int64_t>("dispatch_staged_tokens", c1.dispatch_staged_tokens - c0.dispatch_staged_tokens,
                          one_node ? 0 : 2 * T);
  });
  // A private x is pushed into the receivers' outputs where every rank has an output arena (by default) on
  // one node, else staged (and counted so); so is a quantized dispatch of a shared x.
  const Problem pr = make_problem(spec_for(ctx, 9, 2, 2, 64));
  const int64_t T = pr.ranks[ctx.rank].num_tokens;
  DispatchArgs args = dispatch_args_of(pr, ctx.rank, buf);
  const bool arenas = buf.num_output_arena_bytes() > 0;
  REQUIRE(arenas == env_arena_on(), "num_output_arena_bytes ", buf.num_output_arena_bytes());
  const bool pushes = arenas && one_node;
  Buffer::CopyCounters c0 = buf.copy_counters();
  DispatchResult d = buf.dispatch(args);
  Buffer::CopyCounters c1 = buf.copy_counters();
  check_scalar<int64_t>("private x: dispatch_staged_tokens",
                        c1.dispatch_staged_tokens - c0.dispatch_staged_tokens, pushes ? 0 : T);
  check_scalar<int64_t>("private x: dispatch_pushed_tokens",
                        c1.dispatch_pushed_tokens - c0.dispatch_pushed_tokens, pushes ? T : 0);
  check_scalar<int64_t>("private x: dispatch_in_place_tokens",
                        c1.dispatch_in_place_tokens - c0.dispatch_in_place_tokens, 0);
  {  // recv_x fed back lies in the output arena: the origins (across nodes, the proxies) read it in place, no
     // holder copies a row
    CombineArgs c;
    c.x = d.recv_x.data;
    c.handle = d.handle;
    buf.combine(c);
    const Buffer::CopyCounters c2 = buf.copy_counters();
    const int64_t copied = c2.combine_copied_rows - c1.combine_copied_rows,
                  in_place = c2.combine_in_place_rows - c1.combine_in_place_rows;
    int64_t held = 0;  // rows of other ranks' tokens (a rank's own rows are not counted either way)
    const std::vector<int64_t> per_source = d.handle->num_recv_rows_per_source();
    for (int s = 0; s < ctx.size; ++s) held += s == ctx.rank ? 0 : per_source[s];
    REQUIRE(arenas ? copied == 0 && (in_place > 0 || held == 0) : in_place == 0 && (copied > 0 || held == 0),
            "recv_x fed back: ", copied, " rows copied, ", in_place, " read in place (", held,
            " rows of other ranks held; output arena ", arenas ? "on" : "off", ")");
    // Pushed rows fed back: every origin reads its copies straight from the holders, no windows.
    check_scalar<int64_t>("recv_x fed back: combine_direct_tokens",
                          c2.combine_direct_tokens - c1.combine_direct_tokens, pushes ? T : 0);
    c1 = c2;
  }
  Tensor sx = buf.get_dispatch_input(T, 64);
  if (sx.nbytes()) std::memcpy(sx.data(), args.x.data.data(), sx.nbytes());
  args.x.data = sx;
  args.quant_mode = QuantMode::int8;
  buf.dispatch(args);
  Buffer::CopyCounters c2 = buf.copy_counters();
  // A quantizing sender cannot let receivers read its bf16 rows in place: it quantizes each token once and
  // pushes codes and scales (output arenas), else stages them.
  check_scalar<int64_t>("quantized: dispatch_staged_tokens",
                        c2.dispatch_staged_tokens - c1.dispatch_staged_tokens, pushes ? 0 : T);
  check_scalar<int64_t>("quantized: dispatch_pushed_tokens",
                        c2.dispatch_pushed_tokens - c1.dispatch_pushed_tokens, pushes ? T : 0);
  // Too large a request: a capacity error naming the option.
  expect_error([&] { buf.get_dispatch_input(1 << 20, 7168); }, ErrorCode::InvalidUsage,
               {"get_dispatch_input", "num_dispatch_input_bytes = 4194304", "capacity"});
  Buffer none(ctx.group, test_options(1 << 20));
  expect_error([&] { none.get_dispatch_input(1, 64); }, ErrorCode::InvalidUsage,
               {"get_dispatch_input", "num_dispatch_input_bytes = 0"});
  REQUIRE(none.get_dispatch_input(0, 64).size(0) == 0, "zero tokens need no area");
  expect_error([&] { none.get_dispatch_input(1, 0); }, ErrorCode::InvalidUsage, {"argument: hidden"});
}

MR_CASE("dispatch_skewed_rounds", {}) {
  // Every token to one rank, through a segment of the minimum size: many rounds, same results.
  for (ReceiveOrder order : kOrders) {
    RoundTrip rt;
    rt.spec = spec_for(ctx, 77, 2, 4, 96);
    rt.spec.routing = ProblemSpec::Routing::skewed_one_rank;
    rt.spec.skew_rank = ctx.size - 1;
    rt.spec.min_tokens = 20;
    rt.spec.max_tokens = 60;
    rt.order = order;
    const int64_t row = 96 * 2 + 8;  // generous: combine rows of f32 + 8 columns are larger
    int64_t minimum = std::max(min_nvl_bytes(row * 2, 4, ctx.size), min_nvl_bytes((96 + 8) * 4, 4, ctx.size));
    Buffer buf(ctx.group, test_options(minimum));
    run_round_trip(ctx, buf, rt);
  }
}

MR_CASE("dispatch_large_transfer", {}) {
  // The data moved is at least 10x the segment: it must move in rounds, never fail.
  const int64_t H = 7168;
  const int64_t nvl = min_nvl_bytes((H + 8) * 4, 8, ctx.size);
  Buffer buf(ctx.group, test_options(nvl));
  for (ReceiveOrder order : kOrders) {
    RoundTrip rt;
    rt.spec = spec_for(ctx, 5, 4, 8, H);
    rt.spec.min_tokens = rt.spec.max_tokens = 256;
    rt.spec.neg_prob = 0.0;
    rt.order = order;
    Problem P = make_problem(rt.spec);
    int64_t rows = 0;
    for (int d = 0; d < ctx.size; ++d) rows += ref_dispatch_placement(P, d, order).num_recv_rows;
    REQUIRE(rows * H * 2 >= 10 * nvl, "transfer of ", rows * H * 2, " bytes is not 10x the segment ", nvl);
    run_round_trip(ctx, buf, rt);
  }
}

MR_CASE("dispatch_output_reserve", {}) {
  // A Buffer with an output reserve: its pages are written through and, unless EPCOMM_ARENA_SETTLE=0, every
  // rank passes over every reserve it may write (storing zeros) before the constructor returns. The outputs
  // of the first calls land in those pages and must equal the reference, fresh and cached.
  BufferOptions o = test_options();
  o.num_output_reserve_bytes = 24 << 20;
  Buffer buf(ctx.group, o);
  const int64_t pushed_before = buf.copy_counters().dispatch_pushed_tokens;
  uint64_t seed = 41;
  for (int rep = 0; rep < 2; ++rep)
    for (ReceiveOrder order : kOrders) {
      RoundTrip rt;  // the production hidden size: the first call's rows fill the start of the reserve
      rt.spec = spec_for(ctx, seed++, 4, 8, 7168);
      rt.spec.min_tokens = 24;
      rt.spec.max_tokens = 48;
      rt.order = order;
      run_round_trip(ctx, buf, rt);
    }
  // On one node with arenas the rows were pushed into the receivers' arenas, where the reserves are.
  if (buf.num_output_arena_bytes() > 0 && buf.num_nodes() == 1)
    REQUIRE(buf.copy_counters().dispatch_pushed_tokens > pushed_before,
            "dispatch_output_reserve: no dispatch pushed its rows into the output arenas");
}

MR_CASE("dispatch_zero_tokens", {}) {
  Buffer buf(ctx.group, test_options());
  for (ReceiveOrder order : kOrders) {
    RoundTrip some;  // every other rank holds no token
    some.spec = spec_for(ctx, 11, 2, 3, 64);
    some.spec.tokens_override.resize(ctx.size);
    for (int s = 0; s < ctx.size; ++s) some.spec.tokens_override[s] = s % 2 ? 0 : 17 + s;
    some.order = order;
    run_round_trip(ctx, buf, some);
    RoundTrip none;  // nobody holds a token: 0-row outputs everywhere
    none.spec = spec_for(ctx, 12, 2, 3, 64);
    none.spec.tokens_override.assign(ctx.size, 0);
    none.order = order;
    none.expert_alignment = 4;
    run_round_trip(ctx, buf, none);
    RoundTrip empty;  // all slots -1: combine gives the bias alone
    empty.spec = spec_for(ctx, 13, 2, 3, 64);
    empty.spec.routing = ProblemSpec::Routing::all_empty;
    empty.order = order;
    run_round_trip(ctx, buf, empty);
  }
}

MR_CASE("dispatch_no_topk", {}) {
  Buffer buf(ctx.group, test_options());
  RoundTrip rt;
  rt.spec = spec_for(ctx, 21, 2, 3, 48);
  rt.spec.topk = false;
  rt.order = ReceiveOrder::rank_major;
  rt.expert_alignment = 8;
  run_round_trip(ctx, buf, rt);
}

MR_CASE("dispatch_worst_case", {}) {
  Buffer buf(ctx.group, test_options());
  for (ReceiveOrder order : kOrders) {
    RoundTrip rt;
    rt.spec = spec_for(ctx, 31, 2, 4, 40);
    rt.spec.min_tokens = 4;
    rt.order = order;
    rt.expert_alignment = order == ReceiveOrder::expert_major ? 4 : 1;
    rt.num_worst_tokens = -5;  // the largest N plus 5: a zeroed tail everywhere
    run_round_trip(ctx, buf, rt);

    // Overflow: rank 0 allows one row only; every rank raises, naming rank 0, and the Buffer stays usable.
    Problem P = make_problem(rt.spec);
    int64_t n0 = ref_dispatch_placement(P, 0, order, rt.expert_alignment).num_recv_rows;
    if (n0 > 1) {
      Tensor ti = topk_idx_of(P, ctx.rank);
      LayoutResult lay = buf.get_dispatch_layout(ti, rt.spec.num_experts);
      DispatchArgs a;
      a.x.data = x_of(P, ctx.rank);
      a.topk_idx = ti;
      a.topk_weights = topk_weights_of(P, ctx.rank);
      a.num_tokens_per_expert = lay.num_tokens_per_expert;
      a.receive_order = order;
      a.expert_alignment = rt.expert_alignment;
      a.num_worst_tokens = ctx.rank == 0 ? 1 : 100000;
      expect_error([&] { buf.dispatch(a); }, ErrorCode::InvalidUsage,
                   {"capacity", "receiving rank 0", "num_worst_tokens = 1"});
    }
    rt.num_worst_tokens = 0;
    run_round_trip(ctx, buf, rt);  // still usable
  }
}

MR_CASE("dispatch_async_invariance", {}) {
  // Async calls with chained events, other segment sizes and thread counts: identical results.
  for (int64_t nvl : {int64_t{0}, int64_t{1} << 20}) {
    BufferOptions o = test_options(nvl);
    Buffer buf(ctx.group, o);
    for (ReceiveOrder order : kOrders) {
      RoundTrip rt;
      rt.spec = spec_for(ctx, 41, 3, 5, 200);
      rt.order = order;
      rt.async = true;
      rt.expert_alignment = 16;
      run_round_trip(ctx, buf, rt);
    }
  }
}

MR_CASE("dispatch_pressure_repeat", {}) {
  // 20 repetitions on one seed, two Buffers interleaved: every result equals the reference each time.
  Buffer a(ctx.group, test_options(2 << 20));
  Buffer b(ctx.group, test_options(1 << 20));
  for (int i = 0; i < 20; ++i) {
    RoundTrip rt;
    rt.spec = spec_for(ctx, 51, 2, 4, 64);
    rt.order = i % 2 ? ReceiveOrder::rank_major : ReceiveOrder::expert_major;
    rt.cached = i % 3 == 0;
    run_round_trip(ctx, i % 2 ? a : b, rt);
  }
}

MR_CASE("warm_up_at_creation", {}) {
  // A Buffer ends its creation with one-token round trips (EPCOMM_WARMUP; docs/design.md, "Warm-up"). The
  // caller sees no trace of them: the copy counters start at zero, the first call is numbered #1 in its
  // messages, and the first calls return the reference's results (the low_latency_* cases check the first
  // low-latency calls of their fresh Buffers). EPCOMM_WARMUP=2 (the .invalid variant) is refused at
  // creation, naming the variable and the value.
  const char* w = std::getenv("EPCOMM_WARMUP");
  if (w && std::string(w) == "2") {
    try {
      Buffer refused(ctx.group, test_options());
      REQUIRE(false, "EPCOMM_WARMUP=2 must fail the Buffer's creation");
    } catch (const Error& e) {
      const std::string m = e.what();
      REQUIRE(e.code() == ErrorCode::InvalidUsage && m.find("EPCOMM_WARMUP") != std::string::npos &&
                  m.find("'2'") != std::string::npos,
              "got ", error_code_name(e.code()), ": ", m);
    }
    return;
  }
  BufferOptions o = test_options();
  o.low_latency_mode = true;
  Buffer buf(ctx.group, o);
  const Buffer::CopyCounters c = buf.copy_counters();
  REQUIRE(c.dispatch_staged_tokens == 0 && c.dispatch_pushed_tokens == 0 && c.dispatch_in_place_tokens == 0 &&
              c.combine_copied_rows == 0 && c.combine_in_place_rows == 0 && c.combine_direct_tokens == 0 &&
              c.combine_shared_tokens == 0,
          "copy counters after creation: staged ", c.dispatch_staged_tokens, " pushed ",
          c.dispatch_pushed_tokens, " copied rows ", c.combine_copied_rows, " direct ",
          c.combine_direct_tokens);
  // The first call fails its validation on every rank (x missing): its message calls it dispatch#1.
  try {
    buf.dispatch(DispatchArgs{});
    REQUIRE(false, "a dispatch without x must fail");
  } catch (const Error& e) {
    const std::string m = e.what();
    REQUIRE(m.find("dispatch#1: ") != std::string::npos, "the first call's message: ", m);
  }
  uint64_t seed = 61;
  for (ReceiveOrder order : kOrders) {
    RoundTrip rt;
    rt.spec = spec_for(ctx, seed++, 4, 8, 7168);
    rt.order = order;
    run_round_trip(ctx, buf, rt);
  }
}
