// tools/epcomm/demo_v2.cc — `epcomm demo --api distribute-v2`: one MoE layer forward through dispatch_v2 and
// combine_v2 (docs/distribute-v2.md) with a shared expert on the first rank(s), checked against a dense
// single-process reference.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "epcomm/moe/distribute_v2.h"
#include "flags.h"
#include "moe_model.h"
#include "numerics.h"
#include "rank_tools.h"
#include "report.h"
#include "run_options.h"
#include "subcommands.h"
#include "v2_flags.h"

namespace epcomm::cli {
namespace {

const char* kEpilog =
    "What it does: ranks [0, S_r) are shared-expert ranks (one shared expert, S_r replicas), the others "
    "hold\n"
    "--experts / (ranks - S_r) routed experts each. Every rank regenerates its tokens from --seed, routes "
    "them\n"
    "(softmax over the routed experts, top-k, weights renormalized), calls dispatch_v2 (quant_mode 0, or 2 "
    "=\n"
    "per-token int8), applies its experts (SwiGLU, fp32 math) to the rows it received — the shared expert "
    "to\n"
    "every row on a shared rank — and calls combine_v2 with the routing weights:\n"
    "  out = round(sum_k w_k expert_k(x) + shared(x))   (the shared expert is not weighted).\n"
    "Rank 0 then computes the layer densely in one process from the same (dequantized) token values and\n"
    "compares element by element within 2u(sum_k w_k|y_k| + |shared| + |out|), u the dtype's unit "
    "roundoff.\n\n"
    "Exit status: 0 PASS, 1 FAIL or a runtime error, 2 a bad flag or an argument the library rejected.\n";

struct DemoV2Options {
  int ranks = 4, experts = 6, topk = 2, shared_ranks = 1, quant_mode = 0;
  int64_t tokens = 32, hidden = 256, intermediate = 128;
  int64_t segment_bytes = 0;  // 0: 64 MiB
  DType dtype = DType::bf16;
  uint64_t seed = 1;
  LaunchFlags launch;
  MoeShape shape() const { return {hidden, intermediate, experts + 1, topk}; }  // + the shared expert
};

// Routing over the routed experts only: the router of an (experts)-wide layer.
struct Tokens {
  std::vector<std::byte> x;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Tokens make_tokens(const DemoV2Options& o, int r) {
  Tokens in;
  const int64_t T = o.tokens, H = o.hidden;
  const size_t row = static_cast<size_t>(H) * dtype_size(o.dtype);
  in.x.resize(static_cast<size_t>(T) * row);
  Router router(o.seed, {H, o.intermediate, o.experts, o.topk});
  std::vector<float> xf(static_cast<size_t>(H));
  std::vector<int64_t> ids(static_cast<size_t>(o.topk));
  std::vector<float> w(static_cast<size_t>(o.topk));
  for (int64_t t = 0; t < T; ++t) {
    make_token(o.seed, r, t, H, o.dtype, in.x.data() + t * row);
    load_row(o.dtype, in.x.data() + t * row, H, xf.data());
    router.route(xf.data(), ids.data(), w.data());
    for (int k = 0; k < o.topk; ++k) {
      in.ids.push_back(static_cast<int32_t>(ids[k]));
      in.weights.push_back(w[k]);
    }
  }
  return in;
}

// The token's values as every expert sees them: x, or x quantized (per-token int8) and dequantized.
void seen(const DemoV2Options& o, const std::byte* row, float* out) {
  seen_token_f32(o.quant_mode == 2 ? std::optional<QuantMode>(QuantMode::int8) : std::nullopt, o.dtype, row,
                 o.hidden, out);
}

int demo_rank_v2(const DemoV2Options& o, std::unique_ptr<Bootstrap> bootstrap) {
  auto group = Group::create(std::move(bootstrap));
  const int r = group->rank(), W = o.ranks, Sr = o.shared_ranks;
  Bootstrap& bs = group->bootstrap();
  Progress progress("epcomm demo", r == 0 && !o.launch.quiet);
  moe::GroupContextOptions co;
  co.timeout_s = o.launch.timeout_s;
  co.segment_bytes = o.segment_bytes;
  moe::init_group_context(*group, co);
  const int64_t T = o.tokens, H = o.hidden;
  const int K = o.topk, L = o.experts / (W - Sr);
  const size_t row = static_cast<size_t>(H) * dtype_size(o.dtype);
  progress.phase("tokens and routing");
  Tokens in = make_tokens(o, r);

  moe::DispatchV2Args a;
  a.x = Tensor::wrap(in.x.data(), o.dtype, {T, H});
  a.expert_ids = Tensor::wrap(in.ids.data(), DType::i32, {T, K});
  a.group_ep = "ep";
  a.ep_world_size = W;
  a.ep_rank_id = r;
  a.moe_expert_num = o.experts;
  a.shared_expert_num = Sr > 0 ? 1 : 0;
  a.shared_expert_rank_num = Sr;
  a.quant_mode = o.quant_mode;
  progress.phase("dispatch_v2");
  double t0 = now_s();
  moe::DispatchV2Result d = moe::dispatch_v2(*group, nullptr, a);
  const double t_dispatch = now_s() - t0;

  // Experts: blocks of rows per local expert (expert_token_nums, type 1), or the shared expert for all rows.
  progress.phase("experts");
  const int64_t n = d.ep_recv_counts.data_as<int32_t>()[d.ep_recv_counts.numel() - 1];
  std::vector<float> xin(static_cast<size_t>(n * H)), yout(static_cast<size_t>(n * H), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* q =
        d.expand_x.data_as<uint8_t>() + i * H * static_cast<int64_t>(dtype_size(d.expand_x.dtype()));
    if (o.quant_mode == 2) {
      const float s = d.dynamic_scales.data_as<float>()[i];
      for (int64_t h = 0; h < H; ++h)
        xin[i * H + h] = static_cast<float>(reinterpret_cast<const int8_t*>(q)[h]) * s;
    } else {
      load_row(o.dtype, q, H, xin.data() + i * H);
    }
  }
  const MoeShape shape = o.shape();
  if (r < Sr) {
    if (n) Expert(o.seed, o.experts, shape).forward(xin.data(), n, yout.data());
  } else {
    int64_t off = 0;
    for (int el = 0; el < L; ++el) {
      const int64_t cnt = d.expert_token_nums.data_as<int64_t>()[el];
      if (cnt)
        Expert(o.seed, (r - Sr) * L + el, shape).forward(xin.data() + off * H, cnt, yout.data() + off * H);
      off += cnt;
    }
  }
  Tensor expert_out = empty(o.dtype, {d.expand_x.size(0), H});
  std::memset(expert_out.data(), 0, expert_out.nbytes());
  store_row(o.dtype, yout.data(), n * H, expert_out.data());

  moe::CombineV2Args c;
  c.expand_x = expert_out;
  c.expert_ids = a.expert_ids;
  c.assist_info_for_combine = d.assist_info_for_combine;
  c.ep_send_counts = d.ep_recv_counts;
  c.expert_scales = Tensor::wrap(in.weights.data(), DType::f32, {T, K});
  c.group_ep = "ep";
  c.ep_world_size = W;
  c.ep_rank_id = r;
  c.moe_expert_num = o.experts;
  c.shared_expert_num = a.shared_expert_num;
  c.shared_expert_rank_num = Sr;
  progress.phase("combine_v2");
  t0 = now_s();
  Tensor out = moe::combine_v2(*group, nullptr, c);
  const double t_combine = now_s() - t0;

  std::vector<std::byte> mine(out.data_as<std::byte>(), out.data_as<std::byte>() + out.nbytes());
  const auto all = all_gather_values(bs, mine);
  const auto rows = all_gather_values(bs, std::vector<int64_t>{n});
  const auto times = all_gather_values(bs, std::vector<double>{t_dispatch, t_combine});
  if (r != 0) return kExitOk;

  progress.phase("dense reference");
  std::vector<Expert> experts;
  for (int e = 0; e <= o.experts; ++e) experts.emplace_back(o.seed, e, shape);
  const double u = unit_roundoff(o.dtype);
  int64_t failures = 0, checked = 0;
  double max_err = 0, worst = 0;
  std::vector<float> xs(static_cast<size_t>(H)), y(static_cast<size_t>(H)), sh(static_cast<size_t>(H));
  for (int s = 0; s < W; ++s) {
    Tokens ts = make_tokens(o, s);
    for (int64_t t = 0; t < T; ++t) {
      seen(o, ts.x.data() + t * row, xs.data());
      std::vector<double> ref(static_cast<size_t>(H), 0.0), mag(static_cast<size_t>(H), 0.0);
      for (int k = 0; k < K; ++k) {
        experts[ts.ids[t * K + k]].forward(xs.data(), 1, y.data());
        const float w = ts.weights[t * K + k];
        for (int64_t h = 0; h < H; ++h) {
          const double v = round_to(o.dtype, y[h]);
          ref[h] += w * v;
          mag[h] += std::fabs(w * v);
        }
      }
      if (Sr > 0) {
        experts[o.experts].forward(xs.data(), 1, sh.data());
        for (int64_t h = 0; h < H; ++h) {
          const double v = round_to(o.dtype, sh[h]);
          ref[h] += v;
          mag[h] += std::fabs(v);
        }
      }
      for (int64_t h = 0; h < H; ++h) {
        const double got = load_elem(o.dtype, all.data() + static_cast<size_t>(s) * T * row, t * H + h);
        const double err = std::fabs(got - ref[h]);
        const double tol = 2 * u * (mag[h] + std::fabs(ref[h])) + 1e-30;
        max_err = std::max(max_err, err);
        worst = std::max(worst, err / tol);
        failures += err > tol;
        ++checked;
      }
    }
  }
  std::printf(
      "epcomm demo --api distribute-v2: %d ranks (%d shared-expert rank%s, %d routed experts, %d per MoE "
      "rank), "
      "%lld tokens per rank, H %lld, top-%d, %s, quant_mode %d\n",
      W, Sr, Sr == 1 ? "" : "s", o.experts, L, static_cast<long long>(T), static_cast<long long>(H), K,
      dtype_name(o.dtype), o.quant_mode);
  for (int s = 0; s < W; ++s)
    std::printf("  rank %d (%s): %lld rows, dispatch_v2 %s, combine_v2 %s\n", s,
                s < Sr ? "shared expert" : "routed experts", static_cast<long long>(rows[s]),
                format_seconds(times[2 * s]).c_str(), format_seconds(times[2 * s + 1]).c_str());
  std::printf(
      "  checked %lld elements against the dense reference: max |err| %.3g, worst err/tolerance %.3g\n",
      static_cast<long long>(checked), max_err, worst);
  std::printf("%s\n", failures == 0 ? "PASS" : "FAIL");
  std::fflush(stdout);
  return failures == 0 ? kExitOk : kExitFail;
}

}  // namespace

int run_demo_v2(int argc, char** argv) {
  FlagParser p(
      "epcomm demo --api distribute-v2", "epcomm demo --api distribute-v2 [flags]",
      "One MoE layer forward through dispatch_v2 / combine_v2 with a shared expert, checked against a\n"
      "dense reference (PASS/FAIL).");
  p.add("api", "NAME", "normal", "distribute-v2 selects this demo");
  p.add("ranks", "N", "4", "local ranks (ep_world_size)");
  p.add("tokens", "T", "32", "tokens per rank");
  p.add("hidden", "H", "256", "hidden size");
  p.add("intermediate", "I", "128", "expert inner width");
  p.add("experts", "E", "6", "routed experts (a multiple of ranks - shared-expert-ranks)");
  p.add("topk", "K", "2", "routed experts per token");
  p.add("shared-expert-ranks", "N", "1", "ranks serving the shared expert (0: none)");
  add_v2_quant_flag(p, "0", "dispatch quant_mode: 0|none, or 2|int8 (per-token int8)");
  p.add("dtype", "bf16|f16", "bf16", "token dtype");
  p.add("seed", "S", "1", "random seed");
  add_v2_segment_flag(p, "64M");
  add_launch_flags(p);
  p.set_epilog(kEpilog);
  if (!p.parse(argc, argv)) {
    std::fputs(p.help().c_str(), stdout);
    return kExitOk;
  }
  DemoV2Options o;
  o.ranks = static_cast<int>(p.integer("ranks", 1, 1024));
  o.tokens = p.integer("tokens", 0, 1 << 20);
  o.hidden = p.integer("hidden", 1, 1 << 16);
  o.intermediate = p.integer("intermediate", 1, 1 << 16);
  o.experts = static_cast<int>(p.integer("experts", 1, 4096));
  o.topk = static_cast<int>(p.integer("topk", 1, 64));
  o.shared_ranks = static_cast<int>(p.integer("shared-expert-ranks", 0, 1023));
  o.quant_mode = v2_quant_mode(p, {0, 2}, "0 or 2");
  o.segment_bytes = p.given("num-nvl-bytes") ? p.bytes("num-nvl-bytes") : 0;
  o.dtype = p.choice("dtype", {"bf16", "f16"}) == "bf16" ? DType::bf16 : DType::f16;
  o.seed = static_cast<uint64_t>(p.integer("seed", 0, INT64_MAX));
  o.launch = read_launch_flags(p);
  if (o.shared_ranks >= o.ranks)
    throw UsageError(bad_value("shared-expert-ranks", "< ranks", std::to_string(o.shared_ranks)));
  if (o.experts % (o.ranks - o.shared_ranks) != 0)
    throw UsageError(bad_value(
        "experts", "a multiple of ranks - shared-expert-ranks = " + std::to_string(o.ranks - o.shared_ranks),
        std::to_string(o.experts)));
  if (o.topk > o.experts) throw UsageError(bad_value("topk", "<= experts", std::to_string(o.topk)));
  const RunOptions ro = launch_options(o.launch, o.ranks);
  return run_ranks("epcomm demo", ro,
                   [&](std::unique_ptr<Bootstrap> bs) { return demo_rank_v2(o, std::move(bs)); });
}

}  // namespace epcomm::cli
