// multirank/cases_v2_errors.cc — one test per rule of docs/distribute-v2.md (every rank makes the same
// bad call: InvalidUsage naming the parameter, then the group is still usable), cross-rank mismatches
// (docs/distribute-v2.md), a peer whose checks fail, and liveness (docs/distribute-v2.md): a missing,
// sleeping or killed rank is named, never a hang.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "api/moe_context.h"
#include "multirank/round_trip.h"
#include "multirank/v2_harness.h"
#include "support/check.h"
#include "support/rng.h"

using namespace epcomm;
using namespace epcomm::testing;
using namespace epcomm::testing::v2;
using Clock = std::chrono::steady_clock;

// The table below leaves trailing members at their defaults on purpose.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace {

V2Spec small_spec(int W) {
  V2Spec s;
  s.W = W;
  s.E = 2 * W;
  s.K = 2;
  s.H = 16;
  s.bs = 5;
  s.seed = 77;
  return s;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct ErrorCase {
  const char* name;
  // Edits the spec before the problem is made (optional).
  std::function<void(V2Spec&)> spec;
  // Edits this rank's dispatch arguments (dispatch errors), or null.
  std::function<void(moe::DispatchV2Args&, const V2Problem&, std::vector<std::vector<uint8_t>>&)> dispatch;
  // Edits this rank's combine arguments (combine errors, after a good dispatch), or null.
  std::function<void(moe::CombineAddRmsNormArgs&, const V2Problem&, std::vector<std::vector<uint8_t>>&)>
      combine;
  std::vector<const char*> keywords;
  bool rms_norm = false;
  int tp_world_size = 0;
  moe::OpOptions options;
};

using Keep = std::vector<std::vector<uint8_t>>;

Tensor wrap_bytes(Keep& keep, std::vector<uint8_t> bytes, DType dt, Shape shape) {
  keep.push_back(std::move(bytes));
  return Tensor::wrap(keep.back().data(), dt, std::move(shape));
}

void run_error_case(RankCtx& ctx, const ErrorCase& ec) {
  V2Groups g = make_v2_groups(ctx, ec.tp_world_size, 256 << 10, 20);
  V2Spec s = small_spec(g.ep->size());
  s.T = ec.tp_world_size;
  if (ec.tp_world_size == 2) s.E = s.W;  // L = 1
  s.K = std::min(s.K, s.E);
  if (ec.spec) ec.spec(s);
  const V2Problem P = make_v2_problem(s);
  const int ep = g.ep_rank, tp = g.tp_rank;
  Keep keep;
  keep.reserve(64);
  std::vector<std::string> keywords(ec.keywords.begin(), ec.keywords.end());
  auto check = [&](const std::function<void()>& fn, const char* op) {
    std::vector<const char*> kw;
    const std::string opname = epcomm::detail::cat(op, "#");
    kw.push_back(opname.c_str());
    for (auto& k : keywords) kw.push_back(k.c_str());
    try {
      fn();
    } catch (const Error& e) {
      std::string msg = e.what();
      REQUIRE(e.code() == ErrorCode::InvalidUsage, "expected InvalidUsage, got ", error_code_name(e.code()),
              ": ", msg);
      for (const char* k : kw) REQUIRE(msg.find(k) != std::string::npos, "message lacks '", k, "': ", msg);
      return;
    }
    REQUIRE(false, "expected epcomm::Error(InvalidUsage) from ", op, ", nothing was thrown");
  };
  if (ec.dispatch) {
    moe::DispatchV2Args a = dispatch_args(P, ep, tp);
    ec.dispatch(a, P, keep);
    check([&] { moe::dispatch_v2(*g.ep, g.tp.get(), a, ec.options); }, "dispatch_v2");
  } else {
    moe::DispatchV2Args a = dispatch_args(P, ep, tp);
    moe::DispatchV2Result d = moe::dispatch_v2(*g.ep, g.tp.get(), a);
    const int64_t rows = d.expand_x.size(0);
    std::vector<uint8_t> out(static_cast<size_t>(rows * s.H) * 2, 0);
    for (size_t i = 0; i < out.size(); i += 2) out[i + 1] = 0x3F;  // ~0.5: finite rows
    moe::CombineAddRmsNormArgs c;
    static_cast<moe::CombineV2Args&>(c) = combine_args(P, ep, tp, d, out);
    const V2Rank& r = P.at(ep, tp);
    if (ec.rms_norm) {
      c.residual_x = Tensor::wrap(const_cast<uint8_t*>(r.residual.data()), s.dtype, {r.bs, 1, s.H});
      c.gamma = Tensor::wrap(const_cast<uint8_t*>(P.gamma.data()), s.dtype, {s.H});
    }
    ec.combine(c, P, keep);
    if (ec.rms_norm)
      check([&] { moe::combine_add_rms_norm(*g.ep, g.tp.get(), c, ec.options); }, "combine_add_rms_norm");
    else
      check([&] { moe::combine_v2(*g.ep, g.tp.get(), c, ec.options); }, "combine_v2");
  }
  // Nothing moved: the group is still usable.
  V2Run run;
  run.spec = small_spec(g.ep->size());
  run.spec.T = ec.tp_world_size;
  if (ec.tp_world_size == 2) run.spec.E = run.spec.W;
  run.spec.K = std::min(run.spec.K, run.spec.E);
  run_v2(g, run, "after the error: ");
}

using DA = moe::DispatchV2Args;
using CA = moe::CombineAddRmsNormArgs;
using P_ = V2Problem;

std::vector<ErrorCase>& error_cases() {
  static std::vector<ErrorCase> v = {
      // Groups and layout.
      {"ep_world_size", {}, [](DA& a, const P_&, Keep&) { a.ep_world_size += 1; }, {}, {"ep_world_size"}},
      {"ep_rank_id",
       {},
       [](DA& a, const P_&, Keep&) { a.ep_rank_id = (a.ep_rank_id + 1) % a.ep_world_size + 7; },
       {},
       {"ep_rank_id"}},
      {"tp_world_size",
       {},
       [](DA& a, const P_&, Keep&) { a.tp_world_size = 3; },
       {},
       {"tp_world_size", "got 3"}},
      {"tp_group_missing",
       {},
       [](DA& a, const P_&, Keep&) { a.tp_world_size = 2; },
       {},
       {"tp_group", "null"}},
      {"tp_rank_id", {}, [](DA& a, const P_&, Keep&) { a.tp_rank_id = 1; }, {}, {"tp_rank_id", "expected 0"}},
      {"expert_shard_type",
       {},
       [](DA& a, const P_&, Keep&) { a.expert_shard_type = 1; },
       {},
       {"expert_shard_type"}},
      {"shared_rank_num_range",
       {},
       [](DA& a, const P_&, Keep&) { a.shared_expert_rank_num = a.ep_world_size; },
       {},
       {"shared_expert_rank_num", "[0, ep_world_size"}},
      {"shared_num_without_ranks",
       {},
       [](DA& a, const P_&, Keep&) { a.shared_expert_num = 2; },
       {},
       {"shared_expert_num", "expected 0 or 1"}},
      {"shared_num_zero",
       {},
       [](DA& a, const P_&, Keep&) {
         a.shared_expert_rank_num = 1;
         a.shared_expert_num = 0;
       },
       {},
       {"shared_expert_num", ">= 1"}},
      {"moe_expert_num_multiple",
       {},
       [](DA& a, const P_&, Keep&) { a.moe_expert_num += 1; },
       {},
       {"moe_expert_num"}},
      // Tensors.
      {"x_dtype",
       {},
       [](DA& a, const P_&, Keep& k) {
         a.x = wrap_bytes(k, std::vector<uint8_t>(a.x.nbytes() * 2), DType::f32, a.x.shape());
       },
       {},
       {"x: dtype f32"}},
      {"x_not_2d",
       {},
       [](DA& a, const P_&, Keep&) { a.x = Tensor::wrap(a.x.data(), a.x.dtype(), {a.x.numel()}); },
       {},
       {"x: expected a 2-D"}},
      {"expert_ids_dtype",
       {},
       [](DA& a, const P_&, Keep& k) {
         a.expert_ids =
             wrap_bytes(k, std::vector<uint8_t>(a.expert_ids.nbytes() * 2), DType::i64, a.expert_ids.shape());
       },
       {},
       {"expert_ids: dtype i64"}},
      {"expert_ids_rows",
       {},
       [](DA& a, const P_&, Keep&) {
         a.expert_ids =
             Tensor::wrap(a.expert_ids.data(), DType::i32, {a.expert_ids.size(0) - 1, a.expert_ids.size(1)});
       },
       {},
       {"expert_ids", "rows, expected Bs"}},
      {"k_above_e",
       {},
       [](DA& a, const P_&, Keep& k) {
         const int64_t K = a.moe_expert_num + 1;
         a.expert_ids = wrap_bytes(k, std::vector<uint8_t>(static_cast<size_t>(a.x.size(0) * K) * 4),
                                   DType::i32, {a.x.size(0), K});
       },
       {},
       {"K = ", "[1, moe_expert_num"}},
      {"expert_id_out_of_range",
       {},
       [](DA& a, const P_&, Keep&) { a.expert_ids.data_as<int32_t>()[3] = 1000; },
       {},
       {"token 1, slot 1: expert id 1000 outside [0,"}},
      {"expert_id_negative_active",
       {},
       [](DA& a, const P_&, Keep&) { a.expert_ids.data_as<int32_t>()[0] = -1; },
       {},
       {"token 0, slot 0: expert id -1 outside"}},
      {"expert_ids_repeated",
       {},
       [](DA& a, const P_&, Keep&) {
         int32_t* ids = a.expert_ids.data_as<int32_t>();
         ids[5] = ids[4];
       },
       {},
       {"token 2: slots 0 and 1 both select expert"}},
      {"mask_not_prefix",
       {},
       [](DA& a, const P_&, Keep& k) {
         a.x_active_mask = wrap_bytes(k, {1, 0, 1, 1, 0}, DType::boolean, {5});
       },
       {},
       {"x_active_mask: token 2 is true after token 1 is false"}},
      {"mask_shape",
       {},
       [](DA& a, const P_&, Keep& k) {
         a.x_active_mask = wrap_bytes(k, std::vector<uint8_t>(6, 1), DType::boolean, {6});
       },
       {},
       {"x_active_mask: shape"}},
      {"mask_dtype",
       {},
       [](DA& a, const P_&, Keep& k) {
         a.x_active_mask = wrap_bytes(k, std::vector<uint8_t>(5, 1), DType::u8, {5});
       },
       {},
       {"x_active_mask: dtype u8"}},
      {"expert_scales_shape",
       {},
       [](DA& a, const P_&, Keep&) {
         a.expert_scales = Tensor::wrap(a.expert_scales->data(), DType::f32, {a.x.size(0), 1});
       },
       {},
       {"expert_scales: shape"}},
      {"global_bs_multiple",
       {},
       [](DA& a, const P_&, Keep&) { a.global_bs = 10 * a.ep_world_size + 1; },
       {},
       {"global_bs", "multiple of ep_world_size"}},
      {"global_bs_too_small",
       {},
       [](DA& a, const P_&, Keep&) { a.global_bs = a.ep_world_size; },
       {},
       {"global_bs: Bs = 5 exceeds"}},
      // Quantization.
      {"quant_mode_range",
       {},
       [](DA& a, const P_&, Keep&) { a.quant_mode = 5; },
       {},
       {"quant_mode", "got 5"}},
      {"scales_with_mode0",
       {},
       [](DA& a, const P_&, Keep& k) { a.scales = wrap_bytes(k, std::vector<uint8_t>(4), DType::f32, {1}); },
       {},
       {"scales: must be absent with quant_mode 0"}},
      {"scales_with_mode4",
       {},
       [](DA& a, const P_&, Keep& k) {
         a.quant_mode = 4;
         a.scales = wrap_bytes(k, std::vector<uint8_t>(4), DType::f32, {1});
       },
       {},
       {"scales: must be absent with quant_mode 4"}},
      {"static_without_scales",
       {},
       [](DA& a, const P_&, Keep&) { a.quant_mode = 1; },
       {},
       {"scales", "needs scales"}},
      {"scales_shape_mode2",
       {},
       [](DA& a, const P_&, Keep& k) {
         a.quant_mode = 2;
         a.scales = wrap_bytes(k, std::vector<uint8_t>(16 * 4), DType::f32, {16});
       },
       {},
       {"scales: shape [16]", "(shared_expert_num + moe_expert_num, H)"}},
      {"y_dtype_mode0",
       {},
       [](DA& a, const P_&, Keep&) { a.y_dtype = DType::i8; },
       {},
       {"y_dtype: i8 is not allowed with quant_mode 0"}},
      {"y_dtype_mode3",
       {},
       [](DA& a, const P_&, Keep&) {
         a.quant_mode = 3;
         a.y_dtype = DType::i8;
       },
       {},
       {"y_dtype: i8 is not allowed with quant_mode 3"}},
      {"expert_token_nums_type",
       {},
       [](DA& a, const P_&, Keep&) { a.expert_token_nums_type = 2; },
       {},
       {"expert_token_nums_type"}},
      {"reserved_elastic_info",
       {},
       [](DA& a, const P_&, Keep& k) {
         a.elastic_info = wrap_bytes(k, std::vector<uint8_t>(4), DType::i32, {1});
       },
       {},
       {"elastic_info: not supported by epcomm yet"}},
      {"reserved_zero_expert_num",
       {},
       [](DA& a, const P_&, Keep&) { a.zero_expert_num = 1; },
       {},
       {"zero_expert_num: not supported by epcomm yet"}},
      {"reserved_x_dtype",
       {},
       [](DA& a, const P_&, Keep&) { a.x_dtype = DType::f8e4m3; },
       {},
       {"x_dtype: not supported by epcomm yet"}},
      {"strict_product_name",
       {},
       [](DA&, const P_&, Keep&) {},
       {},
       {"strict_hardware_limits", "\"B5\""},
       false,
       0,
       moe::OpOptions{"B5", 200, std::nullopt}},
      {"num_threads_negative",
       {},
       [](DA&, const P_&, Keep&) {},
       {},
       {"argument: num_threads", "expected >= 0, got -1"},
       false,
       0,
       moe::OpOptions{"", 200, std::nullopt, -1}},
      {"caller_buffer_dtype",
       {},
       [](DA& a, const P_&, Keep& k) {
         a.expand_x_out = wrap_bytes(k, std::vector<uint8_t>(1 << 16), DType::f32, {64, 16});
       },
       {},
       {"expand_x_out: dtype f32"}},
      {"caller_buffer_shape",
       {},
       [](DA& a, const P_&, Keep& k) {
         a.ep_recv_counts_out = wrap_bytes(k, std::vector<uint8_t>(4), DType::i32, {1});
       },
       {},
       {"ep_recv_counts_out: shape"}},
      // Combine.
      {"comm_quant_mode",
       {},
       {},
       [](CA& c, const P_&, Keep&) { c.comm_quant_mode = 1; },
       {"comm_quant_mode"}},
      {"comm_quant_h",
       [](V2Spec& s) { s.H = 12; },
       {},
       [](CA& c, const P_&, Keep&) { c.comm_quant_mode = 2; },
       {"H % 8"}},
      {"expand_x_rows",
       {},
       {},
       [](CA& c, const P_&, Keep&) {
         c.expand_x = Tensor::wrap(c.expand_x.data(), c.expand_x.dtype(), {0, c.expand_x.size(1)});
       },
       {"expand_x: 0 rows"}},
      {"expand_x_dtype",
       {},
       {},
       [](CA& c, const P_&, Keep& k) {
         c.expand_x =
             wrap_bytes(k, std::vector<uint8_t>(c.expand_x.nbytes() * 2), DType::f32, c.expand_x.shape());
       },
       {"expand_x: dtype f32"}},
      {"ep_send_counts_size",
       {},
       {},
       [](CA& c, const P_&, Keep& k) {
         c.ep_send_counts = wrap_bytes(k, std::vector<uint8_t>(4), DType::i32, {1});
       },
       {"ep_send_counts", "expected ep_world_size"}},
      {"assist_slot",
       {},
       {},
       [](CA& c, const P_&, Keep& k) {
         std::vector<uint8_t> b(c.assist_info_for_combine.nbytes());
         std::memcpy(b.data(), c.assist_info_for_combine.data(), b.size());
         reinterpret_cast<int32_t*>(b.data())[2] = 99;
         c.assist_info_for_combine =
             wrap_bytes(k, std::move(b), DType::i32, c.assist_info_for_combine.shape());
       },
       {"assist_info_for_combine: row 0", "slot 99 outside"}},
      {"assist_rank",
       {},
       {},
       [](CA& c, const P_&, Keep& k) {
         std::vector<uint8_t> b(c.assist_info_for_combine.nbytes());
         std::memcpy(b.data(), c.assist_info_for_combine.data(), b.size());
         reinterpret_cast<int32_t*>(b.data())[0] = -3;
         c.assist_info_for_combine =
             wrap_bytes(k, std::move(b), DType::i32, c.assist_info_for_combine.shape());
       },
       {"assist_info_for_combine: row 0", "source rank -3"}},
      {"assist_duplicate",
       {},
       {},
       [](CA& c, const P_&, Keep& k) {
         std::vector<uint8_t> b(c.assist_info_for_combine.nbytes());
         std::memcpy(b.data(), c.assist_info_for_combine.data(), b.size());
         int32_t* v = reinterpret_cast<int32_t*>(b.data());
         v[3] = v[0];
         v[4] = v[1];
         v[5] = v[2];
         c.assist_info_for_combine =
             wrap_bytes(k, std::move(b), DType::i32, c.assist_info_for_combine.shape());
       },
       {"duplicate row"}},
      {"expert_scales_missing",
       {},
       {},
       [](CA& c, const P_&, Keep&) { c.expert_scales = Tensor(); },
       {"expert_scales", "None"}},
      {"shared_x_with_shared_ranks",
       [](V2Spec& s) {
         s.shared_ranks = 1;
         s.E = s.W - 1;
         s.K = 1;
       },
       {},
       [](CA& c, const P_& p, Keep&) {
         c.shared_expert_x =
             Tensor::wrap(const_cast<uint8_t*>(p.ranks[0].x.data()), p.spec.dtype, {5, p.spec.H});
       },
       {"shared_expert_x: only allowed when shared_expert_rank_num = 0"}},
      {"shared_x_shape",
       {},
       {},
       [](CA& c, const P_& p, Keep& k) {
         c.shared_expert_x =
             wrap_bytes(k, std::vector<uint8_t>(6 * p.spec.H * 2), p.spec.dtype, {6, p.spec.H});
       },
       {"shared_expert_x: shape"}},
      {"reserved_activation_scale",
       {},
       {},
       [](CA& c, const P_&, Keep& k) {
         c.activation_scale = wrap_bytes(k, std::vector<uint8_t>(4), DType::f32, {1});
       },
       {"activation_scale: not supported by epcomm yet"}},
      {"reserved_out_dtype",
       {},
       {},
       [](CA& c, const P_&, Keep&) { c.out_dtype = 1; },
       {"out_dtype: not supported by epcomm yet"}},
      {"combine_mask_differs",
       {},
       {},
       [](CA& c, const P_&, Keep& k) {
         c.x_active_mask = wrap_bytes(k, {1, 1, 1, 0, 0}, DType::boolean, {5});
       },
       {"expects", "rows", "differ from the dispatch"}},
      {"residual_shape",
       {},
       {},
       [](CA& c, const P_& p, Keep&) {
         c.residual_x = Tensor::wrap(c.residual_x.data(), p.spec.dtype, {5, p.spec.H});
       },
       {"residual_x: shape"},
       true},
      {"gamma_shape",
       {},
       {},
       [](CA& c, const P_&, Keep&) { c.gamma = Tensor::wrap(c.gamma.data(), c.gamma.dtype(), {4}); },
       {"gamma: shape"},
       true},
      {"norm_eps", {}, {}, [](CA& c, const P_&, Keep&) { c.norm_eps = -1.0f; }, {"norm_eps"}, true},
      // TP (a 2 × W grid).
      {"tp_needs_one_expert",
       [](V2Spec& s) { s.E = 2 * s.W; },
       [](DA&, const P_&, Keep&) {},
       {},
       {"tp_world_size = 2 requires one expert per MoE rank"},
       false,
       2},
      {"tp_send_counts",
       {},
       {},
       [](CA& c, const P_&, Keep& k) {
         c.tp_send_counts = wrap_bytes(k, std::vector<uint8_t>(12), DType::i32, {3});
       },
       {"tp_send_counts: shape"},
       false,
       2},
  };
  return v;
}

struct RegisterErrors {
  RegisterErrors() {
    static std::vector<std::string> names;
    names.reserve(error_cases().size());
    for (const ErrorCase& ec : error_cases()) {
      names.push_back(std::string("v2_error.") + ec.name);
      CaseInfo info;
      info.min_ranks = ec.tp_world_size == 2 ? 2 : 1;
      const ErrorCase* p = &ec;
      info.body = [p](RankCtx& ctx) { run_error_case(ctx, *p); };
      cases()[names.back()] = info;
    }
  }
} register_errors;

}  // namespace

MR_CASE("v2_mismatch", {false, 2}) {
  // Ranks disagree on H, then the last rank calls combine_v2 while the others call dispatch_v2: every rank
  // raises InvalidUsage naming the peer, the field, its value and ours; the group stays usable.
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10, 20);
  const int W = ctx.size, last = W - 1;
  V2Spec s = small_spec(W);
  if (ctx.rank == last) s.H = 24;
  V2Problem P = make_v2_problem(s);
  moe::DispatchV2Args a = dispatch_args(P, ctx.rank, 0);
  expect_error([&] { moe::dispatch_v2(*g.ep, nullptr, a); }, ErrorCode::InvalidUsage,
               {"dispatch_v2#1", "mismatch", "H (hidden size)",
                ctx.rank == last ? "= 16 (ours 24)" : "= 24 (ours 16)"});
  V2Run run;
  run.spec = small_spec(W);
  run_v2(g, run, "after the mismatch: ");
}

MR_CASE("v2_duplicate_across_ranks", {false, 2}) {
  // Rank 1 relabels its last row for ep rank 0 as (t', k'), the first slot whose row rank 0 keeps for
  // itself (combine reads those in place, they fill no slot): rank 0 raises InvalidUsage naming rank 1 and
  // the slot. Rank 1 may finish first or see the failure; either way nobody hangs.
  REQUIRE(ctx.size == 2, "two ranks, got ", ctx.size);
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10, 20);
  V2Spec s = small_spec(2);
  const V2Problem P = make_v2_problem(s);
  moe::DispatchV2Args a = dispatch_args(P, ctx.rank, 0);
  moe::DispatchV2Result d = moe::dispatch_v2(*g.ep, nullptr, a);
  std::vector<uint8_t> out(static_cast<size_t>(d.expand_x.size(0) * s.H) * 2, 0);
  for (size_t i = 0; i < out.size(); i += 2) out[i + 1] = 0x3F;
  moe::CombineV2Args c = combine_args(P, ctx.rank, 0, d, out);
  std::vector<int32_t> assist(
      c.assist_info_for_combine.data_as<int32_t>(),
      c.assist_info_for_combine.data_as<int32_t>() + c.assist_info_for_combine.numel());
  int64_t own_t = -1, own_k = -1;  // rank 0's first slot served by rank 0
  const V2Rank& r0 = P.at(0, 0);
  for (int64_t t = 0; t < r0.bs && own_t < 0; ++t)
    for (int k = 0; k < s.K && own_t < 0; ++k)
      if (r0.ids[t * s.K + k] / s.L() == 0) own_t = t, own_k = k;
  int64_t last = -1;  // rank 1's row for rank 0 with the largest (t, k), among its n_own rows
  const int64_t n_own = c.ep_send_counts.data_as<int32_t>()[c.ep_send_counts.numel() - 1];
  auto key = [&](int64_t i) { return assist[3 * i + 1] * s.K + assist[3 * i + 2]; };
  for (int64_t i = 0; i < n_own; ++i)
    if (assist[3 * i] == 0 && (last < 0 || key(i) > key(last))) last = i;
  if (ctx.rank == 1) {
    REQUIRE(own_t >= 0 && last >= 0 && own_t * s.K + own_k < key(last),
            "seed 77 must give rank 0 an own slot before rank 1's last row for it");
    assist[3 * last + 1] = static_cast<int32_t>(own_t);
    assist[3 * last + 2] = static_cast<int32_t>(own_k);
    c.assist_info_for_combine = Tensor::wrap(assist.data(), DType::i32, c.assist_info_for_combine.shape());
    try {
      moe::combine_v2(*g.ep, nullptr, c);
    } catch (const Error&) {  // rank 0's failure notice may arrive first
    }
    return;
  }
  expect_error([&] { moe::combine_v2(*g.ep, nullptr, c); }, ErrorCode::InvalidUsage,
               {"ep rank 1 and this rank both return a row",
                epcomm::detail::cat("(t=", own_t, ", slot=", own_k, ")").c_str(), "duplicate row"});
}

MR_CASE("v2_peer_validation_abort", {false, 2}) {
  // Rank 1 passes an out-of-range expert id: it raises InvalidUsage, every other rank raises Aborted naming
  // ep rank 1 at once (far below the deadline), and the next call works.
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10, 30);
  V2Problem P = make_v2_problem(small_spec(ctx.size));
  moe::DispatchV2Args a = dispatch_args(P, ctx.rank, 0);
  std::vector<int32_t> bad(a.expert_ids.data_as<int32_t>(),
                           a.expert_ids.data_as<int32_t>() + a.expert_ids.numel());
  bad[0] = 12345;
  if (ctx.rank == 1) a.expert_ids = Tensor::wrap(bad.data(), DType::i32, a.expert_ids.shape());
  auto t0 = Clock::now();
  if (ctx.rank == 1)
    expect_error([&] { moe::dispatch_v2(*g.ep, nullptr, a); }, ErrorCode::InvalidUsage,
                 {"epcomm[ep 1] dispatch_v2#1", "expert id 12345"});
  else
    expect_error([&] { moe::dispatch_v2(*g.ep, nullptr, a); }, ErrorCode::Aborted,
                 {"peer failure", "ep rank 1", "expert id 12345"});
  REQUIRE(seconds_since(t0) < 10, "abort took ", seconds_since(t0), " s");
  V2Run run;
  run.spec = small_spec(ctx.size);
  run_v2(g, run, "after the abort: ");
}

MR_CASE("v2_timeout_missing_rank", {false, 2}) {
  // The last rank skips a combine_v2 after a good dispatch: the others raise Timeout (or Aborted quoting the
  // first timeout) naming it within timeout + 1 s; later calls raise Aborted (the group failed).
  const double timeout = 2.0;
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10, timeout);
  const int missing = ctx.size - 1;
  V2Problem P = make_v2_problem(small_spec(ctx.size));
  moe::DispatchV2Args a = dispatch_args(P, ctx.rank, 0);
  moe::DispatchV2Result d = moe::dispatch_v2(*g.ep, nullptr, a);
  if (ctx.rank == missing) {
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(timeout * 1000) + 1500));
    return;
  }
  std::vector<uint8_t> out(static_cast<size_t>(d.expand_x.size(0) * 16) * 2, 0);
  moe::CombineV2Args c = combine_args(P, ctx.rank, 0, d, out);
  auto t0 = Clock::now();
  try {
    moe::combine_v2(*g.ep, nullptr, c);
    REQUIRE(false, "combine_v2 must fail without ep rank ", missing);
  } catch (const Error& e) {
    check_names_missing(e, ctx, "ep rank", missing, 1);
  }
  const double took = seconds_since(t0);
  REQUIRE(took >= timeout * 0.9 && took < timeout + 1, "timeout after ", took, " s");
  expect_error([&] { moe::dispatch_v2(*g.ep, nullptr, a); }, ErrorCode::Aborted,
               {"failed earlier", "timeout"});
}

MR_CASE("v2_live_ranks", {false, 3}) {
  // OpOptions::live_ranks: rank 0 takes no part (it sleeps past the deadline) while the others run round
  // trips among themselves (call rank i = group rank i + 1), checked against the reference for W = size - 1;
  // a failure among them names group ranks; malformed lists and counts that ignore them are InvalidUsage.
  const double timeout = 1.0;
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10, timeout);
  if (ctx.rank == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(timeout * 1000) + 1500));
    return;
  }
  std::vector<int> live;
  for (int r = 1; r < ctx.size; ++r) live.push_back(r);
  V2Groups among = g;
  among.ep_rank = ctx.rank - 1;
  for (uint64_t seed : {1, 2}) {
    V2Run run;
    run.spec = small_spec(ctx.size - 1);
    run.spec.seed = seed;
    run.options.live_ranks = live;
    run_v2(among, run, "live ranks: ");
  }
  // Call rank 0 (group rank 1) passes an out-of-range expert id: the others name group rank 1.
  V2Problem P = make_v2_problem(small_spec(ctx.size - 1));
  moe::DispatchV2Args a = dispatch_args(P, ctx.rank - 1, 0);
  std::vector<int32_t> bad(a.expert_ids.data_as<int32_t>(),
                           a.expert_ids.data_as<int32_t>() + a.expert_ids.numel());
  bad[0] = 12345;
  moe::OpOptions o;
  o.live_ranks = live;
  if (ctx.rank == 1) {
    a.expert_ids = Tensor::wrap(bad.data(), DType::i32, a.expert_ids.shape());
    expect_error([&] { moe::dispatch_v2(*g.ep, nullptr, a, o); }, ErrorCode::InvalidUsage,
                 {"expert id 12345"});
  } else {
    expect_error([&] { moe::dispatch_v2(*g.ep, nullptr, a, o); }, ErrorCode::Aborted,
                 {"peer failure", "ep rank 1 failed", "expert id 12345"});
  }
  // A call among them again (it ends only once all of them have left the failed one, whose headers the
  // failing calls below, which wait for nobody, could otherwise overwrite before a slow peer read them).
  V2Run again;
  again.spec = small_spec(ctx.size - 1);
  again.options.live_ranks = live;
  run_v2(among, again, "after the failure: ");
  // Arguments (each rank alone: the list leaves out the others).
  a = dispatch_args(P, ctx.rank - 1, 0);
  moe::OpOptions alone;
  alone.live_ranks = {ctx.rank};
  expect_error([&] { moe::dispatch_v2(*g.ep, nullptr, a, alone); }, ErrorCode::InvalidUsage,
               {"argument: ep_world_size: expected the number of live_ranks 1, got"});
  moe::OpOptions without_me;
  without_me.live_ranks = {ctx.rank == 1 ? 2 : 1};
  expect_error([&] { moe::dispatch_v2(*g.ep, nullptr, a, without_me); }, ErrorCode::InvalidUsage,
               {"argument: live_ranks: must include this rank"});
  moe::OpOptions unordered;
  unordered.live_ranks = {ctx.rank, ctx.rank};
  expect_error([&] { moe::dispatch_v2(*g.ep, nullptr, a, unordered); }, ErrorCode::InvalidUsage,
               {"argument: live_ranks: expected ascending ranks in [0, "});
}

MR_CASE("v2_left_early", {false, 3}) {
  // Ranks disagree on the live ranks of a call: rank 0 runs it among {0, 1}, ranks 1 and 2 alone, then two
  // round trips among {1, 2}. Rank 1's header of the second one lands in the slot rank 0 still watches:
  // rank 0 raises Aborted naming rank 1 at once instead of waiting out the deadline.
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10, 30);
  if (ctx.rank == 0) {
    V2Problem P = make_v2_problem(small_spec(2));
    moe::DispatchV2Args a = dispatch_args(P, 0, 0);
    moe::OpOptions o;
    o.live_ranks = {0, 1};
    auto t0 = Clock::now();
    expect_error([&] { moe::dispatch_v2(*g.ep, nullptr, a, o); }, ErrorCode::Aborted,
                 {"peer failure: ep rank 1 is already at call #", "it left this call"});
    REQUIRE(seconds_since(t0) < 10, "took ", seconds_since(t0), " s");
    return;
  }
  V2Groups alone = g;
  alone.ep_rank = 0;
  V2Run solo;
  solo.spec = small_spec(1);
  solo.combine = false;
  solo.options.live_ranks = {ctx.rank};
  run_v2(alone, solo, "alone: ");
  V2Groups pair = g;
  pair.ep_rank = ctx.rank - 1;
  V2Run two;
  two.spec = small_spec(2);
  two.combine = false;
  two.options.live_ranks = {1, 2};
  run_v2(pair, two, "among 1 and 2: ");
  run_v2(pair, two, "among 1 and 2 again: ");
}

MR_CASE("v2_agree_on_mask", {false, 3}) {
  // moe::agree_on_mask: all arrive (nothing masked); a masked rank returns at once while the others agree;
  // the last rank comes after the deadline: the others mask it, and it raises Timeout naming them.
  const double timeout = 1.0;
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10, timeout);
  const int last = ctx.size - 1;
  std::vector<int32_t> none(ctx.size, 0);
  REQUIRE(moe::agree_on_mask(*g.ep, none) == none, "all arrived, yet a rank was masked");
  std::vector<int32_t> first = none;
  first[0] = 1;
  REQUIRE(moe::agree_on_mask(*g.ep, first) == first, "rank 0 masked beforehand: the mask changed");
  if (ctx.rank == last) {
    std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<int>(timeout * 1000) + 1500));
    expect_error([&] { moe::agree_on_mask(*g.ep, none); }, ErrorCode::Timeout,
                 {"agree_on_mask", "missed the low-latency deadline of ranks"});
    return;
  }
  auto t0 = Clock::now();
  std::vector<int32_t> want = none;
  want[last] = 1;
  REQUIRE(moe::agree_on_mask(*g.ep, none) == want, "rank ", last, " did not come, yet it is not masked");
  REQUIRE(seconds_since(t0) < timeout + 1.5, "the agreement took ", seconds_since(t0), " s");
  expect_error([&] { moe::agree_on_mask(*g.ep, {1}); }, ErrorCode::InvalidUsage,
               {"argument: masked: expected ", "entries (one per rank), got 1"});
}

MR_CASE("v2_per_call_timeout", {false, 2}) {
  // OpOptions::timeout overrides the group's deadline (60 s here): rank 0 sleeps 3 s before calling, the
  // others give up after 1 s naming ep rank 0.
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10, 60);
  V2Problem P = make_v2_problem(small_spec(ctx.size));
  moe::DispatchV2Args a = dispatch_args(P, ctx.rank, 0);
  if (ctx.rank == 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(3000));
    return;
  }
  moe::OpOptions o;
  o.timeout = std::chrono::milliseconds(1000);
  auto t0 = Clock::now();
  try {
    moe::dispatch_v2(*g.ep, nullptr, a, o);
    REQUIRE(false, "dispatch_v2 must time out");
  } catch (const Error& e) {
    std::string m = e.what();
    REQUIRE(e.code() == ErrorCode::Timeout || e.code() == ErrorCode::Aborted, "got ",
            error_code_name(e.code()), ": ", m);
    REQUIRE(m.find("ep rank 0") != std::string::npos, "message: ", m);
  }
  REQUIRE(seconds_since(t0) < 2.5, "took ", seconds_since(t0), " s");
}

MR_CASE("v2_kill_rank", {true, 2, 1}) {
  // Rank 1 dies (SIGKILL) during a stream of large dispatches and combines: every other rank fails with
  // Timeout or Aborted naming ep rank 1 within the deadline.
  const double timeout = 3.0;
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10, timeout);
  V2Spec s = small_spec(ctx.size);
  s.H = 2048;
  s.bs = 256;
  s.K = 4;
  s.E = 4 * ctx.size;
  V2Problem P = make_v2_problem(s);
  moe::DispatchV2Args a = dispatch_args(P, ctx.rank, 0);
  if (ctx.rank == 1) {
    std::thread killer([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      kill(getpid(), SIGKILL);
    });
    killer.detach();
    for (int i = 0; i < 100000; ++i) moe::dispatch_v2(*g.ep, nullptr, a);
    REQUIRE(false, "rank 1 should have been killed");
  }
  auto t0 = Clock::now();
  try {
    for (int i = 0; i < 100000; ++i) moe::dispatch_v2(*g.ep, nullptr, a);
    REQUIRE(false, "the calls must fail once rank 1 is dead");
  } catch (const Error& e) {
    std::string m = e.what();
    REQUIRE(e.code() == ErrorCode::Timeout || e.code() == ErrorCode::Aborted, "got ",
            error_code_name(e.code()), ": ", m);
    REQUIRE(m.find("ep rank 1") != std::string::npos, "error does not name ep rank 1: ", m);
  }
  REQUIRE(seconds_since(t0) < timeout + 5, "failure took ", seconds_since(t0), " s");
}

MR_CASE("v2_strict_limits", {false, 2}) {
  // strict_hardware_limits: a real A3 decode configuration runs; each rule rejects the first value past its
  // boundary with "exceeds <product> limit" (every rank raises, nothing moves), and accepts the boundary.
  if (ctx.size != 2) throw Skip("the limits below are worked out for ep_world_size = 2");
  V2Groups g = make_v2_groups(ctx, 0, 4 << 20, 20);
  auto a3_spec = [] {
    V2Spec s = small_spec(2);
    s.H = 7168;
    s.bs = 16;
    s.K = 8;
    s.E = 16;
    s.quant_mode = 2;
    s.expert_scales = false;
    s.shared_num = 0;
    s.tagged = false;
    return s;
  };
  auto options = [](const char* product, int64_t mb = 200) {
    moe::OpOptions o;
    o.strict_hardware_limits = product;
    o.hccl_buffsize_mb = mb;
    return o;
  };
  {  // Accepted: dispatch, combine and combine_add_rms_norm on A3 (bf16, no shared experts, tp <= 1).
    V2Run run;
    run.spec = a3_spec();
    run.options = options("A3");
    run.rms_norm = true;
    run_v2(g, run, "A3 decode: ");
  }
  auto dispatch_fails = [&](const V2Spec& s, const moe::OpOptions& o, const char* rule,
                            const std::function<void(moe::DispatchV2Args&)>& edit = {}) {
    const V2Problem P = make_v2_problem(s);
    moe::DispatchV2Args a = dispatch_args(P, ctx.rank, 0);
    if (edit) edit(a);
    expect_error([&] { moe::dispatch_v2(*g.ep, nullptr, a, o); }, ErrorCode::InvalidUsage,
                 {"dispatch_v2#", "exceeds", o.strict_hardware_limits.c_str(), rule});
  };
  auto dispatch_runs = [&](const V2Spec& s, const moe::OpOptions& o) {
    V2Run run;
    run.spec = s;
    run.options = o;
    run.combine = false;
    run_v2(g, run, "boundary: ");
  };
  {  // H in [1024, 8192].
    V2Spec s = a3_spec();
    s.H = 1023;
    dispatch_fails(s, options("A3"), "H = 1023 outside [1024, 8192]");
    s.H = 1024;
    dispatch_runs(s, options("A3"));
    s.H = 8193;
    dispatch_fails(s, options("A3"), "H = 8193");
  }
  {  // Bs <= 512, K <= 16, E <= 1024.
    V2Spec s = a3_spec();
    s.H = 1024;
    s.bs = 513;
    dispatch_fails(s, options("A3"), "Bs = 513 outside [1, 512]");
    s.bs = 4;
    s.E = 34;
    s.K = 17;
    dispatch_fails(s, options("A3"), "K = 17 outside [1, 16]");
    s.K = 16;
    dispatch_runs(s, options("A3"));
    s.E = 1026;
    s.K = 2;
    dispatch_fails(s, options("A3"), "moe_expert_num = 1026");
  }
  {  // Support limits: quant mode, expert_scales on dispatch, comm_alg, group names, fullmesh_v2 masks.
    V2Spec s = a3_spec();
    s.H = 1024;
    s.bs = 4;
    s.quant_mode = 1;
    s.smooth = V2Spec::Smooth::scalar;
    dispatch_fails(s, options("A3"), "quant_mode 1 not in {0, 2}");
    s = a3_spec();
    s.H = 1024;
    s.expert_scales = true;
    dispatch_fails(s, options("A3"), "expert_scales on dispatch must be absent");
    dispatch_runs(s, options(""));  // no product: no limits
    s.expert_scales = false;
    dispatch_fails(s, options("A3"), "comm_alg", [](moe::DispatchV2Args& a) { a.comm_alg = "ring"; });
    dispatch_fails(s, options("A3"), "group_ep length 0", [](moe::DispatchV2Args& a) { a.group_ep = ""; });
    s.mask_dims = 2;
    dispatch_fails(s, options("A3"), "fullmesh_v2 takes no 2-D",
                   [](moe::DispatchV2Args& a) { a.comm_alg = "fullmesh_v2"; });
  }
  {  // The A3 window: 2·(maxBs·D·W·L + maxBs·C·(K+S)) = 14336·512 = 7·2^20 bytes exactly.
    V2Spec s = a3_spec();
    s.H = 1024;
    s.bs = 512;
    s.E = 2;
    s.K = 1;
    s.quant_mode = 0;
    dispatch_runs(s, options("A3", 7));
    dispatch_fails(s, options("A3", 6), "window");
  }
  {  // A2: H % 32, no shared experts; 950: comm_quant 2 is not one of its modes.
    V2Spec s = a3_spec();
    s.H = 1000;
    s.bs = 4;
    dispatch_fails(s, options("A2"), "H = 1000 is not a multiple of 32");
    s.H = 1024;
    dispatch_runs(s, options("A2"));
    s.shared_ranks = 1;
    s.shared_num = 1;
    s.E = 8;
    dispatch_fails(s, options("A2"), "no shared experts");
    s = a3_spec();
    s.H = 1024;
    s.bs = 4;
    s.quant_mode = 3;
    dispatch_runs(s, options("950"));
    V2Run run;
    run.spec = s;
    run.options = options("950");
    run.comm_quant = 2;
    try {
      run_v2(g, run);
      REQUIRE(false, "comm_quant_mode 2 must exceed the 950 limits");
    } catch (const Error& e) {
      REQUIRE(std::string(e.what()).find("exceeds 950 limit: comm_quant_mode 2") != std::string::npos,
              e.what());
    }
  }
  {  // combine_add_rms_norm on A3 needs bf16.
    V2Spec s = a3_spec();
    s.H = 1024;
    s.bs = 4;
    s.quant_mode = 0;
    s.dtype = DType::f16;
    V2Run run;
    run.spec = s;
    run.options = options("A3");
    run.rms_norm = true;
    try {
      run_v2(g, run);
      REQUIRE(false, "fp16 combine_add_rms_norm must exceed the A3 limits");
    } catch (const Error& e) {
      REQUIRE(std::string(e.what()).find("exceeds A3 limit: combine_add_rms_norm needs bf16") !=
                  std::string::npos,
              e.what());
    }
  }
  V2Run run;
  run.spec = small_spec(2);
  run_v2(g, run, "after the strict checks: ");
}

MR_CASE("v2_tp_peer_abort", {false, 4}) {
  // On a W × 2 grid, the last world rank passes an out-of-range id: it raises InvalidUsage; its EP group
  // raises Aborted naming it (ep rank), its TP peer raises Aborted naming it (tp rank), and the other ranks
  // raise Aborted because their own TP peers could not finish. Every group stays usable.
  V2Groups g = make_v2_groups(ctx, 2, 256 << 10, 20);
  V2Spec s = small_spec(g.ep->size());
  s.T = 2;
  s.E = s.W;
  s.K = 1;
  V2Problem P = make_v2_problem(s);
  moe::DispatchV2Args a = dispatch_args(P, g.ep_rank, g.tp_rank);
  std::vector<int32_t> bad(a.expert_ids.data_as<int32_t>(),
                           a.expert_ids.data_as<int32_t>() + a.expert_ids.numel());
  bad[0] = 999;
  const int culprit = ctx.size - 1;
  if (ctx.rank == culprit) a.expert_ids = Tensor::wrap(bad.data(), DType::i32, a.expert_ids.shape());
  if (ctx.rank == culprit)
    expect_error([&] { moe::dispatch_v2(*g.ep, g.tp.get(), a); }, ErrorCode::InvalidUsage, {"expert id 999"});
  else
    expect_error([&] { moe::dispatch_v2(*g.ep, g.tp.get(), a); }, ErrorCode::Aborted, {"peer failure"});
  V2Run run;
  run.spec = s;
  run_v2(g, run, "after the TP abort: ");
}

MR_CASE("v2_shuffled_timing", {}) {
  // Ranks arrive in a different, random order at every call (sleeps of 0-20 ms): outputs stay bit-identical
  // to the reference (arrival order only changes which source is served first).
  V2Groups g = make_v2_groups(ctx, 0, 160 << 10, 20);
  for (uint64_t it = 0; it < 4; ++it) {
    std::this_thread::sleep_for(
        std::chrono::milliseconds(hash_mix(it, static_cast<uint64_t>(ctx.rank)) % 21));
    V2Spec s = small_spec(ctx.size);
    s.seed = 1300;
    s.H = 300;
    s.bs = 40;
    s.E = 3 * ctx.size;
    s.K = std::min(4, s.E);
    V2Run run;
    run.spec = s;
    run.rms_norm = it % 2 == 1;
    run_v2(g, run);
  }
}

MR_CASE("v2_warm_up_at_creation", {}) {
  // A one-node group context ends its creation with a dispatch_v2 and two combine_v2 of one token
  // (EPCOMM_WARMUP; docs/design.md, "Warm-up"). In the .small variant (a 143360-byte segment: 4 KiB of data
  // past the control part) the last of them, the combine of private expert outputs, raises InvalidUsage
  // (capacity) on every rank: the warm-up stops there and the context is created all the same. Either way the
  // caller sees no trace: the copy counters start at zero, the first call is numbered #1 in its messages, and
  // the calls after it are the reference's.
  const char* small_bytes = std::getenv("EPCOMM_TEST_SMALL_SEGMENT");
  V2Groups g = make_v2_groups(ctx, 0, small_bytes ? std::atoll(small_bytes) : 16 << 20, 30);
  const moe::GroupContext& c = *g.ep->moe_context();
  if (!c.inter)
    REQUIRE(c.seq_shown_base == 3u, "calls made at creation: ", c.seq_shown_base,
            " (expected dispatch_v2 and two combine_v2)");
  const moe::GroupCopyCounters n = moe::group_copy_counters(*g.ep);
  REQUIRE(n.dispatch_staged_tokens == 0 && n.dispatch_pushed_tokens == 0 && n.combine_copied_rows == 0 &&
              n.combine_in_place_rows == 0,
          "copy counters after creation: staged ", n.dispatch_staged_tokens, " pushed ",
          n.dispatch_pushed_tokens, " copied rows ", n.combine_copied_rows, " in place ",
          n.combine_in_place_rows);
  V2Problem P = make_v2_problem(small_spec(ctx.size));
  moe::DispatchV2Args a = dispatch_args(P, ctx.rank, 0);
  std::vector<int32_t> bad(static_cast<size_t>(a.expert_ids.numel()), 12345);
  a.expert_ids = Tensor::wrap(bad.data(), DType::i32, a.expert_ids.shape());
  const std::string first = epcomm::detail::cat("epcomm[ep ", ctx.rank, "] dispatch_v2#1: ");
  expect_error([&] { moe::dispatch_v2(*g.ep, nullptr, a); }, ErrorCode::InvalidUsage,
               {first.c_str(), "expert id 12345"});
  V2Run run;
  run.spec = small_spec(ctx.size);
  run_v2(g, run, "after creation: ");
}
