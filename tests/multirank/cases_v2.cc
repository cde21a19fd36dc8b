// multirank/cases_v2.cc — dispatch_v2 / combine_v2 / combine_add_rms_norm against the global reference:
// EP layouts, shared experts, masks, global_bs, TP pairs, quantization, caller buffers.
#include "multirank/round_trip.h"
#include "multirank/v2_harness.h"
#include "quant/block.h"
#include "support/check.h"
#include "support/ref_float.h"

// MR_CASE's options list leaves the body to the macro.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

using namespace epcomm;
using namespace epcomm::testing;
using namespace epcomm::testing::v2;

namespace {

V2Spec base_spec(int W, uint64_t seed) {
  V2Spec s;
  s.W = W;
  s.seed = seed;
  s.shared_num = 1;  // torch_npu's default: means "none" without shared-expert ranks
  return s;
}

// A quantization case: dispatch quant_mode, expand_x dtype, smoothing.
struct QuantCase {
  int mode;
  std::optional<DType> y;
  V2Spec::Smooth smooth;
};

// base_spec with that quantization and, on 3 ranks or more with every other seed, one shared-expert rank
// (2 experts per routed rank, top-3).
V2Spec quant_spec(int W, uint64_t seed, const QuantCase& m) {
  V2Spec s = base_spec(W, seed);
  s.quant_mode = m.mode;
  s.y_dtype = m.y;
  s.smooth = m.smooth;
  s.shared_ranks = W >= 3 && seed % 2 ? 1 : 0;
  s.E = 2 * (W - s.shared_ranks);
  s.K = std::min(s.E, 3);
  return s;
}

}  // namespace

MR_CASE("v2_ep_round_trip", {}) {
  // EP only (no TP, shared experts or quantization): tagged rows in (local expert, source, sender order),
  // counts of both types, identity experts and distinct outputs, windows that move in rounds.
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10);
  const int W = ctx.size;
  uint64_t seed = 100;
  for (int L : {1, 3})
    for (int K : {1, 2, 8}) {
      const int E = L * W;
      if (K > E) continue;
      for (int64_t H : {int64_t{8}, int64_t{128}, int64_t{1000}}) {
        V2Spec s = base_spec(W, ++seed);
        s.E = E;
        s.K = K;
        s.H = H;
        s.bs = 1 + static_cast<int64_t>(seed % 23);
        s.dtype = seed % 2 ? DType::bf16 : DType::f16;
        s.token_nums_type = static_cast<int>(seed % 2);
        s.expert_scales = seed % 3 != 0;
        V2Run run;
        run.spec = s;
        run.experts = seed % 2 ? V2Run::Experts::identity : V2Run::Experts::distinct;
        run_v2(g, run);
      }
    }
}

MR_CASE("v2_ep_global_bs", {}) {
  // global_bs > 0: Bs varies per rank (0 included); capacities follow global_bs; tp_world_size 1.
  V2Groups g = make_v2_groups(ctx, 0, 1 << 20);
  const int W = ctx.size;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    V2Spec s = base_spec(W, 200 + seed);
    s.E = 2 * W;
    s.K = std::min(3, s.E);
    s.H = 64;
    s.global_bs = 16 * W;
    s.T = seed % 2 ? 1 : 0;
    s.routing = seed % 3 == 0 ? V2Spec::Routing::one_rank : V2Spec::Routing::uniform;
    s.skew_rank = static_cast<int>(seed % W);
    V2Run run;
    run.spec = s;
    run.experts = seed % 2 ? V2Run::Experts::identity : V2Run::Experts::distinct;
    run_v2(g, run);
  }
}

MR_CASE("v2_zero_tokens", {}) {
  // Bs = 0 on every rank: every call is still collective; outputs are zero-filled tensors of the exact
  // shapes.
  V2Groups g = make_v2_groups(ctx, 0);
  V2Spec s = base_spec(ctx.size, 300);
  s.E = ctx.size;
  s.K = 1;
  s.H = 16;
  s.bs = 0;
  V2Run run;
  run.spec = s;
  run.rms_norm = true;
  run_v2(g, run);
}

MR_CASE("v2_caller_buffers", {}) {
  // Caller *_out buffers (larger than needed) are written in their valid part only.
  V2Groups g = make_v2_groups(ctx, 0);
  V2Spec s = base_spec(ctx.size, 400);
  s.E = 2 * ctx.size;
  s.K = 2;
  s.H = 32;
  s.bs = 9;
  V2Run run;
  run.spec = s;
  run.caller_buffers = true;
  run_v2(g, run);
}

MR_CASE("v2_shared_experts", {false, 2}) {
  // Shared-expert ranks first with replicas: every active token goes to every shared expert, source r using
  // replica s·R + r % R; shared rows are unweighted in combine. Includes the spec's (W, Sr, S) = (8,4,2),
  // (8,3,1), (6,2,2) when the world has that size, and shared_expert_x with no shared ranks.
  V2Groups g = make_v2_groups(ctx, 0, 512 << 10);
  const int W = ctx.size;
  std::vector<std::pair<int, int>> layouts = {{1, 1}, {2, 2}, {2, 1}, {3, 1}, {4, 2}, {4, 4}};
  uint64_t seed = 500;
  for (auto [Sr, S] : layouts) {
    if (Sr >= W) continue;
    for (int L : {1, 2}) {
      V2Spec s = base_spec(W, ++seed);
      s.shared_ranks = Sr;
      s.shared_num = S;
      s.E = L * (W - Sr);
      s.K = std::min(s.E, 1 + static_cast<int>(seed % 3));
      s.H = seed % 2 ? 48 : 136;
      s.bs = 3 + static_cast<int64_t>(seed % 11);
      s.dtype = seed % 3 ? DType::bf16 : DType::f16;
      s.mask_dims = static_cast<int>(seed % 3);
      s.global_bs = seed % 4 == 1 ? 16 * W : 0;
      V2Run run;
      run.spec = s;
      run.experts = seed % 2 ? V2Run::Experts::identity : V2Run::Experts::distinct;
      run.rms_norm = seed % 3 == 0;
      run_v2(g, run);
    }
  }
  // No shared-expert ranks: shared_expert_x is added unweighted; shared_expert_num 0 and 1 both mean none.
  for (int num : {0, 1}) {
    V2Spec s = base_spec(W, ++seed);
    s.shared_num = num;
    s.E = 2 * W;
    s.K = 2;
    s.H = 64;
    s.bs = 7;
    V2Run run;
    run.spec = s;
    run.experts = V2Run::Experts::identity;
    run.shared_x = true;
    run.rms_norm = true;
    run_v2(g, run);
  }
}

MR_CASE("v2_masks", {}) {
  // 1-D true-prefix masks (none, some, all active) and 2-D masks (partly and fully masked tokens, masked ids
  // set to -1, out of range or duplicated: never read), with fixed and varying Bs.
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10);
  const int W = ctx.size;
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    V2Spec s = base_spec(W, 600 + seed);
    s.mask_dims = seed % 2 ? 1 : 2;
    s.E = (seed % 3 + 1) * W;
    s.K = std::min(s.E, 4);
    s.H = 40;
    s.bs = 12;
    s.global_bs = seed > 4 ? 12 * W : 0;
    s.mask_prob = seed % 4 == 0 ? 0.2 : 0.7;
    V2Run run;
    run.spec = s;
    run.experts = seed % 2 ? V2Run::Experts::identity : V2Run::Experts::distinct;
    run.rms_norm = seed % 4 == 3;
    run_v2(g, run);
  }
}

MR_CASE("v2_tp_pairs", {false, 2}) {
  // tp_world_size = 2 on a W × 2 grid (world rank = ep·2 + tp): the EP exchange first, then the pair's
  // all-gather with own rows first; combine reduces the pair's rows first (identity experts return half a
  // row on each TP rank, so the sum is exact). Shared ranks, masks, global_bs, quantization, comm_quant 2 and
  // the fused RMSNorm ride along.
  V2Groups g = make_v2_groups(ctx, 2, 160 << 10);
  const int W = ctx.size / 2;
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    V2Spec s = base_spec(W, 700 + seed);
    s.T = 2;
    s.shared_ranks = W >= 2 && seed % 3 == 0 ? 1 : 0;
    s.E = W - s.shared_ranks;
    s.K = 1;
    s.H = seed % 2 ? 64 : 200;
    s.bs = 2 + static_cast<int64_t>(seed % 7);
    s.dtype = seed % 4 == 1 || seed == 6 ? DType::f16 : DType::bf16;
    s.mask_dims = static_cast<int>(seed % 3);
    s.global_bs = seed % 4 == 2 ? 10 * W : 0;
    s.tagged = true;
    V2Run run;
    run.experts = seed % 2 ? V2Run::Experts::identity : V2Run::Experts::distinct;
    run.rms_norm = seed % 3 == 1;
    if (seed == 6) {
      s.quant_mode = 2;
      run.experts = V2Run::Experts::distinct;
    }
    if (seed == 8) {
      s.H = 64;
      run.comm_quant = 2;
    }
    run.spec = s;
    run_v2(g, run);
  }
}

MR_CASE("v2_quant_modes", {}) {
  // quant_mode 1-4 with every output dtype and smoothing kind (scalar, (H,), per-destination (S+E, H) table
  // with shared experts), all-zero rows: expand_x and dynamic_scales bit for bit against the quantizers.
  V2Groups g = make_v2_groups(ctx, 0, 512 << 10);
  const int W = ctx.size;
  const QuantCase modes[] = {
      {1, std::nullopt, V2Spec::Smooth::scalar}, {1, DType::i8, V2Spec::Smooth::vector},
      {1, std::nullopt, V2Spec::Smooth::table},  {2, std::nullopt, V2Spec::Smooth::none},
      {2, DType::f8e4m3, V2Spec::Smooth::table}, {2, DType::f8e5m2, V2Spec::Smooth::none},
      {3, std::nullopt, V2Spec::Smooth::none},   {3, DType::f8e5m2, V2Spec::Smooth::table},
      {4, std::nullopt, V2Spec::Smooth::none},   {4, DType::f8e5m2, V2Spec::Smooth::none},
      {2, DType::i8, V2Spec::Smooth::table},
  };
  uint64_t seed = 800;
  for (const QuantCase& m : modes) {
    V2Spec s = quant_spec(W, ++seed, m);
    s.H = seed % 3 == 0 ? 300 : (seed % 3 == 1 ? 128 : 40);
    s.bs = 6;
    s.dtype = seed % 2 ? DType::bf16 : DType::f16;
    s.tagged = seed % 4 == 0;
    s.zero_rows = 4;
    s.mask_dims = static_cast<int>(seed % 3);
    V2Run run;
    run.spec = s;
    run.rms_norm = seed % 5 == 0;
    run_v2(g, run);
  }
}

MR_CASE("v2_push_and_pull", {}) {
  // One node: senders push rows into expand_x / dynamic_scales that lie in the receivers' output arenas
  // (allocated outputs, or caller buffers from moe::output_buffer), and stage them for pulling as soon as
  // one rank's do not (private caller buffers, or arena buffers on even ranks only); combine reads the
  // expert outputs in place when every rank's lie in its arena, and copies them into the origins' windows
  // otherwise. Every path bit for bit, for every format, per-destination smoothing tables and shared
  // experts; the copy counters say which path ran.
  V2Groups g = make_v2_groups(ctx, 0, 512 << 10);
  const int W = ctx.size;
  const QuantCase modes[] = {
      {0, std::nullopt, V2Spec::Smooth::none}, {1, std::nullopt, V2Spec::Smooth::table},
      {2, std::nullopt, V2Spec::Smooth::none}, {2, DType::f8e4m3, V2Spec::Smooth::table},
      {3, std::nullopt, V2Spec::Smooth::none}, {4, DType::f8e5m2, V2Spec::Smooth::none},
  };
  using Place = V2Run::Place;
  uint64_t seed = 900;
  for (const QuantCase& m : modes)
    for (int variant = 0; variant < 4; ++variant) {
      V2Spec s = quant_spec(W, ++seed, m);
      s.H = seed % 2 ? 256 : 72;  // rows of whole cache lines (streaming stores) and not
      s.bs = 7;
      s.zero_rows = 5;  // tokens 0 and 5 all zeros, the others distinct
      s.mask_dims = static_cast<int>(seed % 3);
      V2Run run;
      run.spec = s;
      run.caller_buffers = variant > 0;
      run.place = variant == 1   ? Place::arena
                  : variant == 2 ? Place::private_memory
                                 : Place::arena_even_ranks;
      const bool all_arena = variant <= 1 || (variant == 3 && W == 1);
      run.expect_push = all_arena;
      // Combine: expert outputs placed the same way; compressed rows (comm_quant 2) always go through the
      // windows.
      run.combine_place = run.place;
      if (variant == 0) run.combine_place = Place::arena;
      run.comm_quant = variant == 1 && m.mode % 2 ? 2 : 0;
      run.expect_in_place = all_arena && run.comm_quant == 0;
      run_v2(g, run, epcomm::detail::cat("mode ", m.mode, " variant ", variant, ": "));
    }
}

MR_CASE("v2_output_buffer", {false, 1}) {
  // moe::output_buffer: a tensor of the group's output arena (one node), released back to it; negative
  // dimensions are an InvalidUsage naming the shape.
  V2Groups g = make_v2_groups(ctx, 0);
  Tensor t = moe::output_buffer(*g.ep, DType::bf16, {5, 64});
  REQUIRE(t.defined() && t.dtype() == DType::bf16 && t.dim() == 2 && t.size(0) == 5 && t.size(1) == 64 &&
              t.is_contiguous(),
          "output_buffer returned ", shape_str(t.shape()));
  std::memset(t.data(), 0x5A, t.nbytes());  // writable
  expect_error(
      [&] {
        moe::output_buffer(*g.ep, DType::bf16, {-1, 4});
      },
      ErrorCode::InvalidUsage, {"output_buffer", "shape", "[-1, 4]"});
}

MR_CASE("v2_comm_quant", {}) {
  // combine comm_quant_mode 2 (int8 in groups of 8, bf16/fp16 scales): the origin's sum of the decoded rows
  // against the spec's arithmetic, with shared experts, masks and all-zero expert rows.
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10);
  const int W = ctx.size;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    V2Spec s = base_spec(W, 900 + seed);
    s.shared_ranks = W >= 2 && seed % 2 ? 1 : 0;
    s.E = W - s.shared_ranks;
    s.K = std::min(s.E, 2);
    s.H = seed % 2 ? 64 : 1000;
    s.bs = 7;
    s.dtype = seed % 3 ? DType::bf16 : DType::f16;
    s.mask_dims = static_cast<int>(seed % 3);
    s.zero_rows = 3;
    V2Run run;
    run.spec = s;
    run.comm_quant = 2;
    run.experts = seed % 2 ? V2Run::Experts::identity : V2Run::Experts::distinct;
    run.rms_norm = seed % 3 == 0;
    run_v2(g, run);
  }
}

MR_CASE("v2_add_rms_norm", {}) {
  // combine_add_rms_norm: x = residual + combine sum (one rounding), rstd from the fp64 mean square, y with
  // the intermediate rounding; bf16 and fp16, several eps, masked tokens give zeros.
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10);
  const int W = ctx.size;
  const float eps[] = {1e-6f, 0.0f, 0.5f};
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    V2Spec s = base_spec(W, 1000 + seed);
    s.E = 2 * W;
    s.K = 2;
    s.H = seed % 2 ? 96 : 7;
    s.bs = 5;
    s.dtype = seed % 2 ? DType::bf16 : DType::f16;
    s.mask_dims = static_cast<int>(seed % 3);
    V2Run run;
    run.spec = s;
    run.rms_norm = true;
    run.norm_eps = eps[seed % 3];
    run.shared_x = seed % 2 == 0;
    run_v2(g, run);
  }
}

MR_CASE("v2_quant_identity", {}) {
  // Quantized identity round trip (docs/distribute-v2.md): dispatch in modes 2-4, dequantize expand_x
  // (docs/quant.md) into bf16 expert outputs, combine: calc_diff to x·Σw + S·x below 3e-3 (int8) or 2e-3
  // (fp8).
  V2Groups g = make_v2_groups(ctx, 0, 1 << 20);
  const int W = ctx.size;
  struct Mode {
    int mode;
    DType y;
    double limit;
  };
  const Mode modes[] = {
      {2, DType::i8, 3e-3}, {2, DType::f8e4m3, 2e-3}, {3, DType::f8e4m3, 2e-3}, {4, DType::f8e4m3, 2e-3}};
  uint64_t seed = 1100;
  for (const Mode& m : modes) {
    V2Spec s = base_spec(W, ++seed);
    s.quant_mode = m.mode;
    s.y_dtype = m.y;
    s.shared_ranks = W >= 2 ? 1 : 0;
    s.E = 2 * (W - s.shared_ranks);
    s.K = std::min(s.E, 2);
    s.H = 256;
    s.bs = 16;
    s.tagged = false;
    const V2Problem P = make_v2_problem(s);
    moe::DispatchV2Args a = dispatch_args(P, ctx.rank, 0);
    moe::DispatchV2Result d = moe::dispatch_v2(*g.ep, nullptr, a);
    const int64_t n = d.ep_recv_counts.data_as<int32_t>()[d.ep_recv_counts.numel() - 1];
    const int64_t rows = d.expand_x.size(0), H = s.H;
    std::vector<uint8_t> out(static_cast<size_t>(rows * H) * 2, 0);
    std::vector<float> f(static_cast<size_t>(H));
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* q = d.expand_x.data_as<uint8_t>() + i * H;
      if (m.mode == 2 && m.y == DType::i8)
        quant::dequant_int8_per_token(reinterpret_cast<const int8_t*>(q),
                                      d.dynamic_scales.data_as<float>()[i], H, f.data());
      else if (m.mode == 2)
        quant::dequant_fp8_per_token(quant::Fp8Format::e4m3, q, d.dynamic_scales.data_as<float>()[i], H,
                                     f.data());
      else if (m.mode == 3)
        quant::dequant_fp8_per_group128(quant::Fp8Format::e4m3, q,
                                        d.dynamic_scales.data_as<float>() + i * (H / 128), H, f.data());
      else
        quant::dequant_mx(quant::MxElem::e4m3, q,
                          d.dynamic_scales.data_as<uint8_t>() + i * d.dynamic_scales.size(1), H, f.data());
      for (int64_t h = 0; h < H; ++h) store_rounded(DType::bf16, f[h], out.data() + (i * H + h) * 2);
    }
    moe::CombineV2Args c = combine_args(P, ctx.rank, 0, d, out);
    Tensor x = moe::combine_v2(*g.ep, nullptr, c);
    const V2Rank& r = P.at(ctx.rank, 0);
    std::vector<double> got, exact;
    for (int64_t t = 0; t < r.bs; ++t) {
      double wsum = 0;
      for (int k = 0; k < s.K; ++k) wsum += r.weights[t * s.K + k];
      for (int64_t h = 0; h < H; ++h) {
        const double xv = load_f32(s.dtype, r.x.data(), t * H + h);
        exact.push_back(xv * wsum + s.S() * xv);
        got.push_back(load_f32(s.dtype, x.data_as<uint8_t>(), t * H + h));
      }
    }
    const double diff = calc_diff(got, exact);
    REQUIRE(diff < m.limit, "mode ", m.mode, " ", dtype_name(m.y), ": calc_diff = ", diff, " >= ", m.limit);
  }
}

MR_CASE("v2_worked_example", {false, 3}) {
  // The worked example of docs/distribute-v2.md, checked literally: 3 ranks, 1 shared rank, 4 MoE experts.
  if (ctx.size != 3) throw Skip("the worked example has 3 ranks");
  V2Groups g = make_v2_groups(ctx, 0);
  const int32_t ids_of[3][4] = {{1, 2, 3, 0}, {0, 3, 2, 1}, {1, 3, -1, -1}};
  std::vector<uint16_t> x(2 * 8, 0x3F80);  // bf16 1.0
  std::vector<int32_t> ids(ids_of[ctx.rank], ids_of[ctx.rank] + 4);
  std::vector<uint8_t> mask = {1, 0};
  moe::DispatchV2Args a;
  a.x = Tensor::wrap(x.data(), DType::bf16, {2, 8});
  a.expert_ids = Tensor::wrap(ids.data(), DType::i32, {2, 2});
  if (ctx.rank == 2) a.x_active_mask = Tensor::wrap(mask.data(), DType::boolean, {2});
  a.ep_world_size = 3;
  a.ep_rank_id = ctx.rank;
  a.moe_expert_num = 4;
  a.shared_expert_num = 1;
  a.shared_expert_rank_num = 1;
  a.expert_token_nums_type = 1;
  moe::DispatchV2Result d = moe::dispatch_v2(*g.ep, nullptr, a);
  const std::vector<std::vector<int32_t>> assist = {{0, 0, 2, 0, 1, 2, 1, 0, 2, 1, 1, 2, 2, 0, 2},
                                                    {0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 2, 0, 0},
                                                    {0, 0, 1, 1, 1, 0, 0, 1, 0, 1, 0, 1, 2, 0, 1}};
  const std::vector<std::vector<int32_t>> counts = {{2, 4, 5}, {1, 2, 2, 3, 4, 5}, {1, 2, 2, 3, 4, 5}};
  const std::vector<std::vector<int64_t>> nums = {{5}, {2, 3}, {2, 3}};
  const std::vector<int64_t> capacity = {6, 12, 12};
  std::vector<int32_t> got_assist(d.assist_info_for_combine.data_as<int32_t>(),
                                  d.assist_info_for_combine.data_as<int32_t>() + 15);
  check_equal("assist", got_assist, assist[ctx.rank], 3);
  check_equal("ep_recv_counts",
              std::vector<int32_t>(d.ep_recv_counts.data_as<int32_t>(),
                                   d.ep_recv_counts.data_as<int32_t>() + d.ep_recv_counts.numel()),
              counts[ctx.rank]);
  check_equal("expert_token_nums",
              std::vector<int64_t>(d.expert_token_nums.data_as<int64_t>(),
                                   d.expert_token_nums.data_as<int64_t>() + d.expert_token_nums.numel()),
              nums[ctx.rank]);
  REQUIRE(d.expand_x.size(0) == capacity[ctx.rank], "A = ", d.expand_x.size(0));
  REQUIRE(d.assist_info_for_combine.numel() == 128 * capacity[ctx.rank], "assist size");
}

namespace {

// W = 2, one expert per rank, every token to expert 0: rank 0 receives rank 0's row, then rank 1's.
struct OneExpert {
  std::vector<uint8_t> data, scales;  // rank 0's first two rows
};
OneExpert one_expert_dispatch(V2Groups& g, int rank, DType dt, const std::vector<float>& row, int mode,
                              std::optional<DType> y, std::vector<float> scales = {}) {
  const int64_t H = static_cast<int64_t>(row.size());
  std::vector<uint8_t> x(row.size() * 2);
  for (size_t h = 0; h < row.size(); ++h) store_rounded(dt, row[h], x.data() + 2 * h);
  for (size_t h = 0; h < row.size(); ++h)
    REQUIRE(load_f32(dt, x.data(), static_cast<int64_t>(h)) == row[h] || row[h] != row[h], "vector element ",
            h, " is not exact in ", dtype_name(dt));
  int32_t id = 0;
  moe::DispatchV2Args a;
  a.x = Tensor::wrap(x.data(), dt, {1, H});
  a.expert_ids = Tensor::wrap(&id, DType::i32, {1, 1});
  a.ep_world_size = 2;
  a.ep_rank_id = rank;
  a.moe_expert_num = 2;
  a.quant_mode = mode;
  a.y_dtype = y;
  if (!scales.empty())
    a.scales = Tensor::wrap(scales.data(), DType::f32, {static_cast<int64_t>(scales.size())});
  moe::DispatchV2Result d = moe::dispatch_v2(*g.ep, nullptr, a);
  OneExpert out;
  if (rank == 0) {
    const size_t db = static_cast<size_t>(H) * dtype_size(d.expand_x.dtype());
    out.data.assign(d.expand_x.data_as<uint8_t>(), d.expand_x.data_as<uint8_t>() + 2 * db);
    const size_t sb = d.dynamic_scales.nbytes() / static_cast<size_t>(d.dynamic_scales.size(0));
    out.scales.assign(d.dynamic_scales.data_as<uint8_t>(), d.dynamic_scales.data_as<uint8_t>() + 2 * sb);
  }
  return out;
}

std::vector<uint8_t> bytes_of(std::initializer_list<int> v) {
  std::vector<uint8_t> b;
  for (int x : v) b.push_back(static_cast<uint8_t>(x));
  return b;
}
std::vector<uint8_t> f32_bytes(std::initializer_list<uint32_t> bits) {
  std::vector<uint8_t> b(bits.size() * 4);
  size_t i = 0;
  for (uint32_t u : bits) std::memcpy(b.data() + 4 * i++, &u, 4);
  return b;
}

}  // namespace

MR_CASE("v2_quant_vectors", {false, 2}) {
  // docs/quant.md's vectors through a W = 2, one-expert dispatch (modes 1-4), and combine comm_quant_mode 2
  // against the values its docs/distribute-v2.md arithmetic gives by hand; all-zero rows and groups included.
  if (ctx.size != 2) throw Skip("a two-rank case");
  V2Groups g = make_v2_groups(ctx, 0);
  const int r = ctx.rank;
  const std::vector<float> row1 = {127, 2.5f, 3.5f, -2.5f, 0.5f, -0.5f, 1.5f, 126.5f};
  const std::vector<float> row3 = {0.76953125f, -2.671875f, -0.1943359375f, -2.15625f,
                                   3.34375f,    -3.625f,    -1.8125f,       -1.9609375f};
  const std::vector<float> zeros(8, 0.0f);
  {  // int8 per-token (docs/distribute-v2.md rows 1 and 3).
    OneExpert o = one_expert_dispatch(g, r, DType::bf16, r == 0 ? row1 : row3, 2, DType::i8);
    if (r == 0) {
      check_equal("int8 codes", o.data,
                  bytes_of({127, 2, 4, -2, 0, 0, 2, 126, 27, -94, -7, -76, 117, -127, -63, -69}));
      check_equal("int8 scales", o.scales, f32_bytes({0x3f800000u, 0x3ce9d3a8u}));
    }
  }
  {  // int8 all-zero row: codes 0, scale 0.
    OneExpert o = one_expert_dispatch(g, r, DType::bf16, r == 0 ? zeros : row1, 2, std::nullopt);
    if (r == 0) check_equal("zero-row scales", o.scales, f32_bytes({0u, 0x3f800000u}));
  }
  {  // fp8 per-token e4m3 and e5m2 (docs/distribute-v2.md r2), and per-group-128 a3 (one group).
    OneExpert o = one_expert_dispatch(g, r, DType::bf16, row3, 2, DType::f8e4m3);
    if (r == 0) {
      check_equal("e4m3 codes", std::vector<uint8_t>(o.data.begin(), o.data.begin() + 8),
                  bytes_of({0x6c, 0xfa, 0xdc, 0xf8, 0x7d, 0xfe, 0xf6, 0xf7}));
      check_equal("e4m3 scales", o.scales, f32_bytes({0x3c049249u, 0x3c049249u}));
    }
    o = one_expert_dispatch(g, r, DType::bf16, row3, 2, DType::f8e5m2);
    if (r == 0) {
      check_equal("e5m2 codes", std::vector<uint8_t>(o.data.begin(), o.data.begin() + 8),
                  bytes_of({0x72, 0xf9, 0xea, 0xf8, 0x7a, 0xfb, 0xf7, 0xf8}));
      check_equal("e5m2 scales", o.scales, f32_bytes({0x38849249u, 0x38849249u}));
    }
    o = one_expert_dispatch(g, r, DType::bf16, r == 0 ? row3 : zeros, 3, std::nullopt);
    if (r == 0) {
      check_equal("group codes", std::vector<uint8_t>(o.data.begin(), o.data.begin() + 8),
                  bytes_of({0x6c, 0xfa, 0xdc, 0xf8, 0x7d, 0xfe, 0xf6, 0xf7}));
      check_equal("group zero codes", std::vector<uint8_t>(o.data.begin() + 8, o.data.end()),
                  bytes_of({0, 0, 0, 0, 0, 0, 0, 0}));
      check_equal("group scales", o.scales, f32_bytes({0x3c049249u, 0u}));
    }
  }
  {  // MXFP8 e4m3 FLOOR (docs/distribute-v2.md: the Ascend doc block, and vector D) from fp16 rows; scales
     // padded to 2 bytes.
    std::vector<float> b1(32, 0.0f);
    b1[1] = 8;
    b1[2] = 64;
    b1[3] = 512;
    std::vector<float> d(32);
    for (int i = 0; i < 32; ++i) d[i] = static_cast<float>((((i % 16) * (i % 16)) % 17) - 8) * 60.25f;
    OneExpert o = one_expert_dispatch(g, r, DType::f16, r == 0 ? b1 : d, 4, std::nullopt);
    if (r == 0) {
      std::vector<uint8_t> want(64, 0);
      want[1] = 0x48;
      want[2] = 0x60;
      want[3] = 0x78;
      const uint8_t dcodes[16] = {0xfe, 0xfd, 0xf7, 0x67, 0x7e, 0x00, 0xfb, 0x7d,
                                  0x79, 0x79, 0x7d, 0xfb, 0x00, 0x7e, 0x67, 0xf7};
      for (int i = 0; i < 32; ++i) want[32 + i] = dcodes[i % 16];
      check_equal("mxfp8 codes", o.data, want);
      check_equal("mxfp8 scales", o.scales, bytes_of({0x80, 0, 0x7f, 0}));
    }
  }
  {  // Static int8 with a scalar: int8_sat(RNE(x · 0.5), -128, 127).
    OneExpert o =
        one_expert_dispatch(g, r, DType::bf16, {3, -3, 1, 255, -512, 0.5f, 0, 7}, 1, std::nullopt, {0.5f});
    if (r == 0)
      check_equal("static codes", std::vector<uint8_t>(o.data.begin(), o.data.begin() + 8),
                  bytes_of({2, -2, 0, 127, -128, 0, 0, 4}));
  }
  {  // combine comm_quant_mode 2: the row comes back through int8 groups of 8 (hand-computed
     // docs/distribute-v2.md values).
    const std::vector<float> y0 = {127, 1, -0.5f, 63.5f, 0, 0, 0, 0};
    const std::vector<float> y1 = {3, -1.5f, 0.25f, 2.75f, 0, 0, 0, 1};
    const std::vector<float>& mine = r == 0 ? y0 : y1;
    std::vector<uint8_t> x(16);
    for (int h = 0; h < 8; ++h) store_rounded(DType::bf16, mine[h], x.data() + 2 * h);
    int32_t id = 0;
    float w = 1.0f;
    moe::DispatchV2Args a;
    a.x = Tensor::wrap(x.data(), DType::bf16, {1, 8});
    a.expert_ids = Tensor::wrap(&id, DType::i32, {1, 1});
    a.ep_world_size = 2;
    a.ep_rank_id = r;
    a.moe_expert_num = 2;
    moe::DispatchV2Result d = moe::dispatch_v2(*g.ep, nullptr, a);
    moe::CombineV2Args c;
    c.expand_x = d.expand_x;  // identity experts
    c.expert_ids = a.expert_ids;
    c.assist_info_for_combine = d.assist_info_for_combine;
    c.ep_send_counts = d.ep_recv_counts;
    c.expert_scales = Tensor::wrap(&w, DType::f32, {1, 1});
    c.ep_world_size = 2;
    c.ep_rank_id = r;
    c.moe_expert_num = 2;
    c.comm_quant_mode = 2;
    Tensor out = moe::combine_v2(*g.ep, nullptr, c);
    const std::vector<uint16_t> want0 = {0x42fe, 0x3f80, 0x0000, 0x4280, 0, 0, 0, 0};
    const std::vector<uint16_t> want1 = {0x4040, 0xbfc2, 0x3e85, 0x4030, 0, 0, 0, 0x3f7f};
    check_equal("comm_quant 2 row",
                std::vector<uint16_t>(out.data_as<uint16_t>(), out.data_as<uint16_t>() + 8),
                r == 0 ? want0 : want1);
  }
}
