// multirank/v2_harness.cc — the distribute-v2 round trip checked against the reference.
#include "multirank/v2_harness.h"

#include <cmath>
#include <cstring>

#include "support/check.h"
#include "support/problem.h"
#include "support/ref_float.h"
#include "support/rng.h"

namespace epcomm::testing::v2 {

V2Groups make_v2_groups(RankCtx& ctx, int tp_world_size, int64_t segment_bytes, double timeout_s) {
  V2Groups g;
  g.T = tp_world_size;
  if (tp_world_size == 2) {
    if (ctx.size % 2) throw Skip("tp_world_size = 2 needs an even number of ranks");
    moe::EpTpGroups grid = moe::make_ep_tp_groups(*ctx.group, 2);
    g.ep = grid.ep;
    g.tp = grid.tp;
    g.ep_rank = grid.ep_rank;
    g.tp_rank = grid.tp_rank;
  } else {
    g.ep = ctx.group;
    g.ep_rank = ctx.rank;
  }
  moe::GroupContextOptions o;
  o.segment_bytes = segment_bytes;
  o.timeout_s = timeout_s;
  // Across (virtual) nodes the lanes are small too, so that windows move through them in rounds.
  o.num_rdma_bytes = 4 * segment_bytes;
  moe::init_group_context(*g.ep, o);
  if (g.tp) moe::init_group_context(*g.tp, o);
  return g;
}

namespace {

Tensor wrap(const void* p, DType dt, Shape shape) {
  return Tensor::wrap(const_cast<void*>(p), dt, std::move(shape));
}

template <typename T>
std::vector<T> values_of(const Tensor& t) {
  std::vector<T> v(static_cast<size_t>(t.numel()));
  if (!v.empty()) std::memcpy(v.data(), t.data(), v.size() * sizeof(T));
  return v;
}

void check_shape(const std::string& what, const Tensor& t, const Shape& want) {
  REQUIRE(t.shape() == want, what, ": shape ", shape_str(t.shape()), ", expected ", shape_str(want));
}

// The valid part of a caller buffer comes from the reference, the rest keeps the sentinel.
constexpr uint8_t kSentinel = 0xA5;

template <typename T>
std::vector<T> with_sentinel(const std::vector<T>& ref, size_t valid, size_t total) {
  std::vector<T> v(total);
  std::memset(v.data(), kSentinel, total * sizeof(T));
  if (valid > 0) std::memcpy(v.data(), ref.data(), valid * sizeof(T));
  return v;
}

struct CallerBuffer {
  std::vector<uint8_t> bytes;
  Tensor t;
  // Private memory, or (in_arena_of) a tensor of that group's output arena; filled with kSentinel.
  CallerBuffer(DType dt, Shape shape, int64_t extra_rows, Group* in_arena_of = nullptr) {
    if (!shape.empty()) shape[0] += extra_rows;
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    if (in_arena_of) {
      t = moe::output_buffer(*in_arena_of, dt, shape);
      if (t.nbytes()) std::memset(t.data(), kSentinel, t.nbytes());
      return;
    }
    bytes.assign(static_cast<size_t>(n) * dtype_size(dt), kSentinel);
    t = Tensor::wrap(bytes.data(), dt, shape);
  }
};

}  // namespace

moe::DispatchV2Args dispatch_args(const V2Problem& p, int ep, int tp) {
  const V2Spec& s = p.spec;
  const V2Rank& r = p.at(ep, tp);
  moe::DispatchV2Args a;
  a.x = wrap(r.x.data(), s.dtype, {r.bs, s.H});
  a.expert_ids = wrap(r.ids.data(), DType::i32, {r.bs, s.K});
  if (s.mask_dims == 1) a.x_active_mask = wrap(r.mask.data(), DType::boolean, {r.bs});
  if (s.mask_dims == 2) a.x_active_mask = wrap(r.mask.data(), DType::boolean, {r.bs, s.K});
  if (s.expert_scales) a.expert_scales = wrap(r.weights.data(), DType::f32, {r.bs, s.K});
  switch (s.smooth) {
    case V2Spec::Smooth::none:
      break;
    case V2Spec::Smooth::scalar:
      a.scales = wrap(p.scales.data(), DType::f32, {1});
      break;
    case V2Spec::Smooth::vector:
      a.scales = wrap(p.scales.data(), DType::f32, {s.H});
      break;
    case V2Spec::Smooth::table:
      a.scales = wrap(p.scales.data(), DType::f32, {s.S() + s.E, s.H});
      break;
  }
  a.group_ep = "ep";
  a.ep_world_size = s.W;
  a.ep_rank_id = ep;
  a.moe_expert_num = s.E;
  a.tp_world_size = s.T;
  a.tp_rank_id = s.T == 2 ? tp : 0;
  if (s.T == 2) a.group_tp = "tp";
  a.shared_expert_num = s.shared_num;
  a.shared_expert_rank_num = s.shared_ranks;
  a.quant_mode = s.quant_mode;
  a.global_bs = s.global_bs;
  a.expert_token_nums_type = s.token_nums_type;
  a.y_dtype = s.y_dtype;
  return a;
}

moe::CombineV2Args combine_args(const V2Problem& p, int ep, int tp, const moe::DispatchV2Result& d,
                                std::vector<uint8_t>& expert_out) {
  const V2Spec& s = p.spec;
  const V2Rank& r = p.at(ep, tp);
  moe::CombineV2Args c;
  const int64_t rows = static_cast<int64_t>(expert_out.size() / (static_cast<size_t>(s.H) * 2));
  c.expand_x = wrap(expert_out.data(), s.dtype, {rows, s.H});
  c.expert_ids = wrap(r.ids.data(), DType::i32, {r.bs, s.K});
  c.assist_info_for_combine = d.assist_info_for_combine;
  // Only the counts of this call: a caller buffer may be longer than W·T·L_p.
  const int64_t n_counts = static_cast<int64_t>(s.W) * s.Tp() * s.local_experts(ep);
  c.ep_send_counts = Tensor::wrap(d.ep_recv_counts.data(), DType::i32, {n_counts});
  c.expert_scales = wrap(r.weights.data(), DType::f32, {r.bs, s.K});
  if (s.T == 2) c.tp_send_counts = Tensor::wrap(d.tp_recv_counts.data(), DType::i32, {2});
  if (s.mask_dims == 1) c.x_active_mask = wrap(r.mask.data(), DType::boolean, {r.bs});
  if (s.mask_dims == 2) c.x_active_mask = wrap(r.mask.data(), DType::boolean, {r.bs, s.K});
  c.group_ep = "ep";
  c.ep_world_size = s.W;
  c.ep_rank_id = ep;
  c.moe_expert_num = s.E;
  c.tp_world_size = s.T;
  c.tp_rank_id = s.T == 2 ? tp : 0;
  if (s.T == 2) c.group_tp = "tp";
  c.shared_expert_num = s.shared_num;
  c.shared_expert_rank_num = s.shared_ranks;
  c.global_bs = s.global_bs;
  return c;
}

void run_v2(V2Groups& g, const V2Run& run, const std::string& where_in) {
  const V2Spec& s = run.spec;
  const V2Problem P = make_v2_problem(s);
  const int ep = g.ep_rank, tp = g.tp_rank, Tp = s.Tp();
  const int me = ep * Tp + tp;
  const std::string where = epcomm::detail::cat(
      where_in, "[seed ", s.seed, " ep ", ep, " tp ", tp, " W ", s.W, " T ", s.T, " E ", s.E, " K ", s.K,
      " Sr ", s.shared_ranks, " H ", s.H, " mode ", s.quant_mode, " mask ", s.mask_dims, "] ");
  const int W =
      run.options.live_ranks.empty() ? g.ep->size() : static_cast<int>(run.options.live_ranks.size());
  REQUIRE(W == s.W, where, "the call has ", W, " EP ranks");

  // ---- dispatch ----
  moe::DispatchV2Args a = dispatch_args(P, ep, tp);
  const V2DispatchRef ref = ref_dispatch_v2(P, ep, tp);
  const int Lp = s.local_experts(ep);
  const size_t scale_row = s.quant_mode <= 2 ? 4 : ref.scale_bytes;
  const DType scale_dt = s.quant_mode == 4 ? DType::u8 : DType::f32;
  const int64_t scale_cols =
      s.quant_mode <= 2 ? 0 : static_cast<int64_t>(ref.scale_bytes / (s.quant_mode == 3 ? 4 : 1));
  const Shape scale_shape = s.quant_mode <= 2 ? Shape{ref.rows} : Shape{ref.rows, scale_cols};
  std::vector<std::unique_ptr<CallerBuffer>> bufs;
  if (run.caller_buffers) {
    auto add = [&](std::optional<Tensor>& slot, DType dt, Shape shape, Group* arena = nullptr) {
      bufs.push_back(std::make_unique<CallerBuffer>(dt, shape, 3, arena));
      slot = bufs.back()->t;
    };
    const bool in_arena =
        run.place == V2Run::Place::arena || (run.place == V2Run::Place::arena_even_ranks && ep % 2 == 0);
    add(a.expand_x_out, ref.out_dtype, {ref.rows, s.H}, in_arena ? g.ep.get() : nullptr);
    add(a.dynamic_scales_out, scale_dt, scale_shape, in_arena ? g.ep.get() : nullptr);
    add(a.assist_info_for_combine_out, DType::i32, {s.capacity(ep) * 128});
    add(a.expert_token_nums_out, DType::i64, {Lp});
    add(a.ep_recv_counts_out, DType::i32, {static_cast<int64_t>(s.W) * Tp * Lp});
    add(a.tp_recv_counts_out, DType::i32, {s.T});
    add(a.expand_scales_out, DType::f32, {s.expert_scales ? ref.rows : 0});
  }
  const moe::GroupCopyCounters before = moe::group_copy_counters(*g.ep);
  moe::DispatchV2Result d = moe::dispatch_v2(*g.ep, g.tp.get(), a, run.options);
  if (run.expect_push) {  // (a rank without active tokens neither stages nor pushes)
    const moe::GroupCopyCounters after = moe::group_copy_counters(*g.ep);
    const int64_t pushed = after.dispatch_pushed_tokens - before.dispatch_pushed_tokens;
    const int64_t staged = after.dispatch_staged_tokens - before.dispatch_staged_tokens;
    const V2Rank& me = P.at(ep, tp);
    int64_t active = 0;
    for (int64_t t = 0; t < me.bs; ++t) active += me.active_tok(t, s.mask_dims, s.K);
    const bool ok =
        *run.expect_push ? staged == 0 && (active == 0 || pushed > 0) : pushed == 0 && staged == active;
    REQUIRE(ok, where, "dispatch_pushed_tokens grew by ", pushed, ", dispatch_staged_tokens by ", staged,
            " with ", active, " active tokens, expected ", *run.expect_push ? "a push" : "a staged pull");
  }

  const int64_t extra = run.caller_buffers ? 3 : 0;
  const int64_t valid = ref.n_own + ref.n_peer;
  auto expect_rows = [&](const char* name, const Tensor& t, const std::vector<uint8_t>& want,
                         size_t row_bytes, int64_t valid_rows, DType dt) {
    const size_t total = want.size() + static_cast<size_t>(extra) * row_bytes;
    const std::vector<uint8_t> w =
        extra ? with_sentinel(want, static_cast<size_t>(valid_rows) * row_bytes, total) : want;
    REQUIRE(t.nbytes() == w.size(), where, name, ": ", t.nbytes(), " bytes, expected ", w.size());
    check_rows_equal(where + name, tensor_bytes(t), w, row_bytes ? row_bytes : 1, dt);
  };
  check_shape(where + "expand_x", d.expand_x, {ref.rows + extra, s.H});
  expect_rows("expand_x", d.expand_x, ref.expand_x, ref.data_bytes, valid,
              s.quant_mode == 0 ? s.dtype : DType::u8);
  expect_rows("dynamic_scales", d.dynamic_scales, ref.dynamic_scales, scale_row,
              s.quant_mode >= 2 ? valid : 0, DType::u8);
  {
    const auto got = values_of<int32_t>(d.assist_info_for_combine);
    const auto want =
        extra ? with_sentinel(ref.assist, static_cast<size_t>(3 * ref.n_own), ref.assist.size() + 3)
              : ref.assist;
    check_equal(where + "assist_info_for_combine", got, want, 3);
  }
  check_equal(where + "expert_token_nums", values_of<int64_t>(d.expert_token_nums),
              extra ? with_sentinel(ref.expert_token_nums, ref.expert_token_nums.size(),
                                    ref.expert_token_nums.size() + 3)
                    : ref.expert_token_nums);
  check_equal(
      where + "ep_recv_counts", values_of<int32_t>(d.ep_recv_counts),
      extra ? with_sentinel(ref.ep_recv_counts, ref.ep_recv_counts.size(), ref.ep_recv_counts.size() + 3)
            : ref.ep_recv_counts);
  check_equal(
      where + "tp_recv_counts", values_of<int32_t>(d.tp_recv_counts),
      extra ? with_sentinel(ref.tp_recv_counts, ref.tp_recv_counts.size(), ref.tp_recv_counts.size() + 3)
            : ref.tp_recv_counts);
  {
    const auto got = values_of<float>(d.expand_scales);
    const auto want = extra
                          ? with_sentinel(ref.expand_scales, s.expert_scales ? static_cast<size_t>(valid) : 0,
                                          ref.expand_scales.size() + 3)
                          : ref.expand_scales;
    check_equal(where + "expand_scales", got, want);
  }
  // Tags prove the row order independently of the reference: row i carries (world rank of its source, t).
  if (s.quant_mode == 0 && s.tagged && s.H >= 4) {
    const auto assist = values_of<int32_t>(d.assist_info_for_combine);
    for (int64_t i = 0; i < ref.n_own; ++i) {
      if (s.zero_rows > 0 && assist[3 * i + 1] % s.zero_rows == 0) continue;  // an all-zero token
      auto tag = decode_row_tag(d.expand_x.data_as<uint8_t>() + i * ref.data_bytes, s.H, s.dtype);
      REQUIRE(tag && tag->rank == assist[3 * i] * Tp + tp && tag->token == assist[3 * i + 1], where, "row ",
              i, " carries ",
              describe_row_tag(d.expand_x.data_as<uint8_t>() + i * ref.data_bytes, s.H, s.dtype),
              ", assist says (", assist[3 * i], ", ", assist[3 * i + 1], ", ", assist[3 * i + 2], ")");
    }
  }
  if (!run.combine) return;

  // ---- combine ----
  std::vector<V2DispatchRef> refs(static_cast<size_t>(s.world()));
  for (int w = 0; w < s.world(); ++w) refs[w] = w == me ? ref : ref_dispatch_v2(P, w / Tp, w % Tp);
  std::vector<std::vector<uint8_t>> outs(static_cast<size_t>(s.world()));
  const size_t row = static_cast<size_t>(s.H) * 2;
  for (int w = 0; w < s.world(); ++w) {
    const int64_t n = refs[w].n_own + refs[w].n_peer;
    if (run.experts == V2Run::Experts::identity) {
      REQUIRE(s.quant_mode == 0, "identity experts need quant_mode 0");
      outs[w].assign(refs[w].expand_x.begin(), refs[w].expand_x.begin() + n * row);
      if (s.T == 2)  // each TP rank returns half the row (exact): the TP sum reproduces it
        for (int64_t i = 0; i < n * s.H; ++i)
          store_rounded(s.dtype, load_f32(s.dtype, outs[w].data(), i) * 0.5f, outs[w].data() + 2 * i);
    } else {
      outs[w].resize(static_cast<size_t>(n) * row);
      SplitMix64 gen(hash_mix(s.seed, 0xE0, static_cast<uint64_t>(w)));
      for (int64_t i = 0; i < n * s.H; ++i) {
        const float v =
            std::ldexp(static_cast<float>(64 + gen.below(64)) / 64.0f, static_cast<int>(gen.below(4)) - 2);
        store_rounded(s.dtype, gen.below(2) ? -v : v, outs[w].data() + 2 * i);
      }
    }
  }
  // This rank's expand_x: its rows, then NaN rows up to T·A that combine must never read.
  std::vector<uint8_t> mine = outs[me];
  mine.resize(static_cast<size_t>(ref.rows) * row, 0xFF);
  moe::CombineV2Args c = combine_args(P, ep, tp, d, mine);
  Tensor arena_x;  // combine's expand_x in the output arena (moe::output_buffer)
  if (run.combine_place == V2Run::Place::arena ||
      (run.combine_place == V2Run::Place::arena_even_ranks && ep % 2 == 0)) {
    arena_x = moe::output_buffer(*g.ep, s.dtype, c.expand_x.shape());
    if (!mine.empty()) std::memcpy(arena_x.data(), mine.data(), mine.size());
    c.expand_x = arena_x;
  }
  const moe::GroupCopyCounters before_combine = moe::group_copy_counters(*g.ep);
  c.comm_quant_mode = run.comm_quant;
  const V2Rank& r = P.at(ep, tp);
  if (run.shared_x) c.shared_expert_x = wrap(r.shared_x.data(), s.dtype, {r.bs, s.H});
  std::unique_ptr<CallerBuffer> xbuf;
  if (run.caller_buffers) {
    xbuf = std::make_unique<CallerBuffer>(s.dtype, Shape{r.bs, s.H}, 2);
    c.x_out = xbuf->t;
  }
  Tensor x = moe::combine_v2(*g.ep, g.tp.get(), c, run.options);
  if (run.expect_in_place) {
    const moe::GroupCopyCounters after = moe::group_copy_counters(*g.ep);
    const int64_t copied = after.combine_copied_rows - before_combine.combine_copied_rows;
    const int64_t in_place = after.combine_in_place_rows - before_combine.combine_in_place_rows;
    REQUIRE(*run.expect_in_place ? copied == 0 : in_place == 0, where, "combine_copied_rows grew by ", copied,
            ", combine_in_place_rows by ", in_place, ", expected ",
            *run.expect_in_place ? "rows read in place" : "rows copied");
  }
  const V2CombineAcc acc = ref_combine_acc(P, refs, outs, ep, tp, run.comm_quant, run.shared_x);
  const std::vector<uint8_t> want = ref_round(P, acc);
  check_shape(where + "combine x", x, {r.bs + (run.caller_buffers ? 2 : 0), s.H});
  check_rows_equal(where + "combine x", tensor_bytes(x),
                   run.caller_buffers ? with_sentinel(want, want.size(), want.size() + 2 * row) : want, row,
                   s.dtype);

  if (run.experts == V2Run::Experts::identity && run.comm_quant == 0) {
    // x·Σw + S·x (+ shared_expert_x), compared loosely (the exact order is the reference's business).
    std::vector<double> got, exact;
    for (int64_t t = 0; t < r.bs; ++t) {
      if (!acc.active[t]) continue;
      double wsum = 0;
      for (int k = 0; k < s.K; ++k)
        if (r.active_slot(t, k, s.mask_dims, s.K)) wsum += r.weights[t * s.K + k];
      for (int64_t h = 0; h < s.H; ++h) {
        const double xv = load_f32(s.dtype, r.x.data(), t * s.H + h);
        double e = xv * wsum + s.S() * xv;
        if (run.shared_x) e += load_f32(s.dtype, r.shared_x.data(), t * s.H + h);
        exact.push_back(e);
        got.push_back(load_f32(s.dtype, x.data_as<uint8_t>(), t * s.H + h));
      }
    }
    const double diff = calc_diff(got, exact);
    REQUIRE(diff < 1e-5, where, "identity round trip: calc_diff = ", diff);
  }

  if (run.rms_norm) {
    moe::CombineAddRmsNormArgs n;
    static_cast<moe::CombineV2Args&>(n) = c;
    n.x_out.reset();
    n.residual_x = wrap(r.residual.data(), s.dtype, {r.bs, 1, s.H});
    n.gamma = wrap(P.gamma.data(), s.dtype, {s.H});
    n.norm_eps = run.norm_eps;
    moe::CombineAddRmsNormResult nr = moe::combine_add_rms_norm(*g.ep, g.tp.get(), n, run.options);
    const V2NormRef nref = ref_add_rms_norm(P, acc, r.residual, run.norm_eps);
    check_shape(where + "rms y", nr.y, {r.bs, 1, s.H});
    check_shape(where + "rms rstd", nr.rstd, {r.bs, 1, 1});
    check_shape(where + "rms x", nr.x, {r.bs, 1, s.H});
    check_rows_equal(where + "rms y", tensor_bytes(nr.y), nref.y, row, s.dtype);
    check_rows_equal(where + "rms x", tensor_bytes(nr.x), nref.x, row, s.dtype);
    check_equal(where + "rms rstd", values_of<float>(nr.rstd), nref.rstd);
  }
}

}  // namespace epcomm::testing::v2
