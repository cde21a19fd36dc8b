// tools/epcomm/demo.cc — `epcomm demo`: one MoE layer forward over local ranks (route, dispatch, SwiGLU
// experts, combine), checked against a dense single-process reference, with timings and load balance.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "demo_model.h"
#include "epcomm/buffer.h"
#include "numerics.h"
#include "report.h"
#include "subcommands.h"

namespace epcomm::cli {

namespace {

const char* kDemoEpilog =
    "What it does: every rank regenerates its tokens x from --seed, routes them (x @ W_router, softmax over\n"
    "the experts in fp32, top-k; weights = the chosen softmax probabilities renormalized to sum to 1), runs\n"
    "get_dispatch_layout and dispatch, applies each local expert (SwiGLU, fp32 math, bf16-valued weights) "
    "to\n"
    "the rows it received, and combines:\n"
    "  expert_major  each row is one (token, expert) pair; combine applies the top-k weights;\n"
    "  rank_major    each row is one (token, rank); the rank weights its experts' outputs and sums the\n"
    "                experts sharing the row (DeepEP), combine sums the ranks.\n"
    "Rank 0 then computes the whole layer densely in one process and compares element by element.\n\n"
    "With a quantizing --quant MODE the check's reference quantizes and dequantizes every token the same\n"
    "way before its experts, so PASS/FAIL stays a check of communication. The report adds a section \"extra\n"
    "error from quantization\" that the check does not use: the layer runs once more without quantization,\n"
    "and both outputs and the quantized reference are measured against the UNQUANTIZED dense reference:\n"
    "max abs, max rel (normwise: max|err| / max|ref|), rms and rel rms (rms(err) / rms(ref)) error, then\n"
    "the quantized run's errors over the plain run's (what the mode costs).\n\n"
    "Bytes (aggregate over all ranks, payload only, no metadata):\n"
    "  dispatch = received rows (including those from the rank itself) x row bytes (H x elem, or the\n"
    "             quantized row with its scales: the bytes that moved); with --quant also bf16-equivalent\n"
    "             bytes = received rows x H x 2;\n"
    "  combine  = rows sent back (one per received row) x H x elem.\n"
    "  GB/s = bytes / time / 1e9, time = the slowest rank's, median over --iters.\n\n"
    "Exit status: 0 PASS, 1 FAIL or a runtime error, 2 a bad flag or an argument the library rejected.\n";

// Per-rank numbers gathered at every rank: fixed-size records so that all_gather can carry them.
enum Count : int { kRecvRows, kRecvBytes, kSentBytes, kSegmentBytes, kNumCounts };

struct RankOutput {
  std::vector<double> times;              // dispatch [iters], combine [iters], experts
  std::vector<int64_t> counts;            // Count..., then pairs per local expert [L]
  std::vector<std::byte> combined;        // [T, H] in the dtype
  std::vector<std::byte> plain_combined;  // quantizing modes: the same layer without quantization, [T, H]
};

// Applies the local experts to the received rows; returns the combine input [n, H] in the dtype.
Tensor run_experts(const DemoOptions& o, int rank, const DispatchResult& d) {
  const int64_t H = o.run.hidden, n = d.recv_x.data.size(0);
  const int K = o.run.topk, L = o.run.local_experts();
  std::vector<float> in(static_cast<size_t>(n * H)), out(static_cast<size_t>(n * H), 0.0f);
  for (int64_t i = 0; i < n; ++i) recv_row_f32(d.recv_x, o.run.quant, H, i, in.data() + i * H);
  if (o.order == ReceiveOrder::expert_major) {
    // Rows come in one block per local expert, in list order (expert_alignment 1: no PAD rows).
    int64_t off = 0;
    for (int j = 0; j < L; ++j) {
      const int64_t cnt = (*d.num_recv_tokens_per_expert_list)[j];
      if (cnt)
        Expert(o.run.seed, rank * L + j, o.shape()).forward(in.data() + off * H, cnt, out.data() + off * H);
      off += cnt;
    }
  } else {
    const int64_t* ids = d.recv_topk_idx->data_as<int64_t>();
    const float* w = d.recv_topk_weights->data_as<float>();
    std::vector<int64_t> rows;
    std::vector<float> xin, y;
    for (int j = 0; j < L; ++j) {
      rows.clear();
      for (int64_t i = 0; i < n; ++i)
        if (std::find(ids + i * K, ids + (i + 1) * K, j) != ids + (i + 1) * K) rows.push_back(i);
      if (rows.empty()) continue;
      const int64_t m = static_cast<int64_t>(rows.size());
      xin.resize(static_cast<size_t>(m * H));
      y.resize(static_cast<size_t>(m * H));
      for (int64_t r = 0; r < m; ++r) std::copy_n(in.data() + rows[r] * H, H, xin.data() + r * H);
      Expert(o.run.seed, rank * L + j, o.shape()).forward(xin.data(), m, y.data());
      for (int64_t r = 0; r < m; ++r)
        for (int k = 0; k < K; ++k)
          if (ids[rows[r] * K + k] == j) {
            const float wk = w[rows[r] * K + k];
            float* o_row = out.data() + rows[r] * H;
            const float* y_row = y.data() + r * H;
            for (int64_t h = 0; h < H; ++h) o_row[h] += wk * y_row[h];
          }
    }
  }
  Tensor x = empty(o.run.dtype, {n, H});
  store_row(o.run.dtype, out.data(), n * H, x.data());
  return x;
}

RankOutput run_layer(const DemoOptions& o, const std::shared_ptr<Group>& group, Progress& progress) {
  const int r = group->rank(), iters = o.run.iters;
  const int64_t T = o.run.tokens, H = o.run.hidden;
  const int K = o.run.topk, L = o.run.local_experts();
  progress.phase("generating tokens, router and routing");
  Router router(o.run.seed, o.shape());
  RankInputs in = make_rank_inputs(o, router, r);
  Tensor x = Tensor::wrap(in.x.data(), o.run.dtype, {T, H});
  Tensor topk_idx = Tensor::wrap(in.topk_idx.data(), DType::i64, {T, K});
  Tensor topk_weights = Tensor::wrap(in.topk_weights.data(), DType::f32, {T, K});

  BufferOptions bo;
  bo.num_nvl_bytes = o.run.num_nvl_bytes;
  bo.num_rdma_bytes = o.run.num_rdma_bytes;
  bo.ranks_per_node = o.run.ranks_per_node;
  bo.timeout_s = o.run.timeout_s;
  bo.receive_order = o.order;
  progress.phase("creating the Buffer (collective)");
  Buffer buffer(group, bo);
  LayoutResult layout = buffer.get_dispatch_layout(topk_idx, o.run.experts);

  DispatchArgs da;
  da.x.data = x;
  da.topk_idx = topk_idx;
  da.topk_weights = topk_weights;
  da.num_tokens_per_rank = layout.num_tokens_per_rank;
  da.is_token_in_rank = layout.is_token_in_rank;
  da.num_tokens_per_expert = layout.num_tokens_per_expert;
  da.quant_mode = o.run.quant;
  da.receive_order = o.order;

  RankOutput out;
  out.times.assign(static_cast<size_t>(2 * iters + 1), 0.0);
  progress.phase("dispatch");
  DispatchResult first;
  for (int it = 0; it < iters; ++it) {
    group->bootstrap().barrier();
    const double t0 = now_s();
    DispatchResult d = buffer.dispatch(da);
    out.times[it] = now_s() - t0;
    if (it == 0) first = std::move(d);
  }

  progress.phase("experts: SwiGLU on the received rows");
  double t0 = now_s();
  CombineArgs ca;
  ca.x = run_experts(o, r, first);
  out.times[2 * iters] = now_s() - t0;
  ca.handle = first.handle;
  if (o.order == ReceiveOrder::rank_major) ca.topk_weights = first.recv_topk_weights;

  progress.phase("combine");
  CombineResult combined;
  for (int it = 0; it < iters; ++it) {
    group->bootstrap().barrier();
    t0 = now_s();
    CombineResult c = buffer.combine(ca);
    out.times[iters + it] = now_s() - t0;
    if (it == 0) combined = std::move(c);
  }

  if (o.run.quantizes()) {
    // The same layer once more without quantization, untimed: the baseline of the extra-error report.
    progress.phase("the same layer without quantization (baseline of the extra error)");
    DemoOptions plain = o;
    plain.run.quant.reset();
    da.quant_mode.reset();
    DispatchResult pd = buffer.dispatch(da);
    CombineArgs pca;
    pca.x = run_experts(plain, r, pd);
    pca.handle = pd.handle;
    if (o.order == ReceiveOrder::rank_major) pca.topk_weights = pd.recv_topk_weights;
    CombineResult pc = buffer.combine(pca);
    const std::byte* px = pc.combined_x.data_as<std::byte>();
    out.plain_combined.assign(px, px + pc.combined_x.nbytes());
  }

  const int64_t n = first.recv_x.data.size(0);
  out.counts.assign(kNumCounts, 0);
  out.counts[kRecvRows] = n;
  out.counts[kRecvBytes] = n * o.run.dispatch_row_bytes();
  out.counts[kSentBytes] = static_cast<int64_t>(ca.x.nbytes());
  out.counts[kSegmentBytes] = buffer.num_nvl_bytes();
  auto pairs = first.handle->num_recv_pairs_per_expert();
  pairs.resize(static_cast<size_t>(L), 0);
  out.counts.insert(out.counts.end(), pairs.begin(), pairs.end());
  const std::byte* cx = combined.combined_x.data_as<std::byte>();
  out.combined.assign(cx, cx + combined.combined_x.nbytes());
  return out;
}

// Prints a ratio of two errors ("12.3x"); "-" when the baseline is 0.
std::string ratio_text(double num, double den) {
  char buf[32];
  if (den > 0)
    std::snprintf(buf, sizeof(buf), "%.3gx", num / den);
  else
    std::snprintf(buf, sizeof(buf), "%s", num > 0 ? "inf" : "-");
  return buf;
}

// The "extra error from quantization" section: every number against the unquantized dense reference.
void print_quant_cost(const DemoOptions& o, const QuantCost& q) {
  const std::string mode = o.run.quant_name();
  const char* dt = dtype_name(o.run.dtype);
  std::printf("extra error from quantization (--quant %s; informational, the check below does not use it):\n",
              mode.c_str());
  std::printf(
      "  against      the dense reference WITHOUT quantization (tokens as %s, fp32 weighted sum, rounded\n"
      "               once to %s); every row below is measured against it\n",
      dt, dt);
  std::printf(
      "  columns      max rel = max|err| / max|ref| (normwise); rms = sqrt(mean(err^2)); "
      "rel rms = rms / rms(ref)\n");
  std::printf("  %-22s %12s %12s %12s %12s\n", "", "max abs err", "max rel err", "rms err", "rel rms err");
  auto row = [](const char* name, const ErrorStats& s, const std::string& what) {
    std::printf("  %-22s %12.3e %12.3e %12.3e %12.3e   %s\n", name, s.max_abs_err, s.max_rel_err(),
                s.rms_err(), s.rel_rms_err(), what.c_str());
  };
  row("plain run", q.plain, std::string("same layer, ") + dt + " dispatch: rounding only");
  row("quantized run", q.quantized, "this run (checked below)");
  row("quantized reference", q.reference, "dense: quantization alone");
  std::printf("  %-22s %12s %12s %12s %12s   %s\n", "quantized / plain",
              ratio_text(q.quantized.max_abs_err, q.plain.max_abs_err).c_str(),
              ratio_text(q.quantized.max_rel_err(), q.plain.max_rel_err()).c_str(),
              ratio_text(q.quantized.rms_err(), q.plain.rms_err()).c_str(),
              ratio_text(q.quantized.rel_rms_err(), q.plain.rel_rms_err()).c_str(), "what the mode costs");
  std::printf("\n");
}

// The report of rank 0: configuration, timings, load balance and the check. Returns the exit status.
int report(const DemoOptions& o, const std::vector<double>& times, const std::vector<int64_t>& counts,
           const CheckResult& check, double reference_s, const QuantCost* quant_cost) {
  const int R = o.run.ranks, iters = o.run.iters, L = o.run.local_experts();
  const int64_t T = o.run.tokens;
  const size_t per_rank_counts = kNumCounts + static_cast<size_t>(L);
  const size_t per_rank_times = 2 * static_cast<size_t>(iters) + 1;
  std::vector<double> dispatch_t, combine_t, experts_t;
  for (int s = 0; s < R; ++s) {
    const double* t = times.data() + s * per_rank_times;
    dispatch_t.insert(dispatch_t.end(), t, t + iters);
    combine_t.insert(combine_t.end(), t + iters, t + 2 * iters);
    experts_t.push_back(t[2 * iters]);
  }
  int64_t dispatch_bytes = 0, combine_bytes = 0, recv_rows = 0;
  std::vector<std::pair<std::string, int64_t>> per_rank, per_expert;
  for (int s = 0; s < R; ++s) {
    const int64_t* c = counts.data() + s * per_rank_counts;
    dispatch_bytes += c[kRecvBytes];
    recv_rows += c[kRecvRows];
    combine_bytes += c[kSentBytes];
    per_rank.emplace_back("rank " + std::to_string(s), c[kRecvRows]);
  }
  // Per expert, or per group of consecutive experts when there are many.
  const int E = o.run.experts, group_size = (E + 63) / 64;
  for (int e0 = 0; e0 < E; e0 += group_size) {
    int64_t v = 0;
    const int e1 = std::min(E, e0 + group_size);
    for (int e = e0; e < e1; ++e) v += counts[(e / L) * per_rank_counts + kNumCounts + e % L];
    std::string label = group_size == 1 ? "expert " + std::to_string(e0)
                                        : "experts " + std::to_string(e0) + "-" + std::to_string(e1 - 1);
    const int r0 = e0 / L, r1 = (e1 - 1) / L;
    label += r0 == r1 ? " (rank " + std::to_string(r0) + ")"
                      : " (ranks " + std::to_string(r0) + "-" + std::to_string(r1) + ")";
    per_expert.emplace_back(label, v);
  }

  const double td = median(max_over_ranks(dispatch_t, R, iters));
  const double tc = median(max_over_ranks(combine_t, R, iters));
  const double te = *std::max_element(experts_t.begin(), experts_t.end());
  const bool pass = check.failures == 0;
  const char* order = receive_order_name(o.order);
  std::printf("epcomm demo: one MoE layer forward over %d local ranks (%s)\n", R,
              o.run.launcher == Launcher::fork ? "forked processes" : "threads");
  int rpn = o.run.ranks_per_node;
  if (rpn == 0)
    if (const char* v = std::getenv("EPCOMM_RANKS_PER_NODE")) rpn = std::atoi(v);
  if (rpn > 0 && rpn < R)
    std::printf("  nodes        %d virtual nodes of %d ranks (ranks_per_node): UCX between nodes\n", R / rpn,
                rpn);
  std::printf("  tokens       %lld per rank (%lld total), hidden %lld, dtype %s, quant %s\n",
              static_cast<long long>(T), static_cast<long long>(T * R), static_cast<long long>(o.run.hidden),
              dtype_name(o.run.dtype), o.run.quant_name().c_str());
  std::printf("  experts      %d (%d per rank), top-%d, SwiGLU intermediate %lld, seed %llu\n", E, L,
              o.run.topk, static_cast<long long>(o.intermediate),
              static_cast<unsigned long long>(o.run.seed));
  std::printf("  router       softmax over experts in fp32, top-%d, weights renormalized to sum to 1\n",
              o.run.topk);
  std::printf("  order        %s: %s\n", order,
              o.order == ReceiveOrder::expert_major
                  ? "one row per (token, expert); combine applies the top-k weights"
                  : "one row per (token, rank); ranks weight and sum their experts, combine sums ranks");
  std::printf("  segment      %s of shared memory per rank\n\n",
              format_bytes(static_cast<double>(counts[kSegmentBytes])).c_str());

  std::printf("timings (slowest rank, %s):\n", iters == 1
                                                   ? "one cold call each; --iters N for the median of N"
                                                   : ("median of " + std::to_string(iters)).c_str());
  std::printf("  dispatch     %-12s %12s  %7.2f GB/s   received rows incl. local, all ranks\n",
              format_seconds(td).c_str(), format_bytes(static_cast<double>(dispatch_bytes)).c_str(),
              static_cast<double>(dispatch_bytes) / td / 1e9);
  if (o.run.quantizes()) {
    const double bf16_bytes = static_cast<double>(recv_rows) * static_cast<double>(o.run.hidden) * 2.0;
    std::printf(
        "   bf16 equiv  %-12s %12s  %7.2f GB/s   the same rows counted as H x 2 bytes (above: moved)\n", "",
        format_bytes(bf16_bytes).c_str(), bf16_bytes / td / 1e9);
  }
  std::printf("  combine      %-12s %12s  %7.2f GB/s   rows sent back, all ranks\n",
              format_seconds(tc).c_str(), format_bytes(static_cast<double>(combine_bytes)).c_str(),
              static_cast<double>(combine_bytes) / tc / 1e9);
  std::printf("  experts      %-12s (compute, not communication)\n", format_seconds(te).c_str());
  std::printf("  reference    %-12s (rank 0, single process)\n\n", format_seconds(reference_s).c_str());

  std::printf("%s\n", bar_chart(o.order == ReceiveOrder::expert_major
                                    ? "rows received per rank ((token, expert) pairs)"
                                    : "rows received per rank ((token, rank) rows)",
                                per_rank)
                          .c_str());
  std::printf("%s\n", bar_chart("(token, expert) pairs per expert", per_expert).c_str());

  if (quant_cost) print_quant_cost(o, *quant_cost);

  if (o.run.quantizes())
    std::printf(
        "check against the dense single-process reference WITH the same quantization (each token quantized\n"
        "and dequantized with %s before its experts; fp32 weighted sum, rounded once to %s):\n",
        o.run.quant_name().c_str(), dtype_name(o.run.dtype));
  else
    std::printf("check against the dense single-process reference (fp32 weighted sum, rounded once to %s):\n",
                dtype_name(o.run.dtype));
  std::printf("  tolerance    %s\n", tolerance_formula(o).c_str());
  std::printf("  elements     %lld, outside tolerance %lld\n", static_cast<long long>(check.elements),
              static_cast<long long>(check.failures));
  std::printf("  max abs err  %.3e   max rel err %.3e (normwise: max |err| / max |ref|, max |ref| = %.3g)\n",
              check.max_abs_err, check.max_abs_ref > 0 ? check.max_abs_err / check.max_abs_ref : 0.0,
              check.max_abs_ref);
  if (check.worst_token >= 0)
    std::printf("  worst err/tol %.3f at rank %lld token %lld column %lld\n", check.worst_ratio,
                static_cast<long long>(check.worst_token / std::max<int64_t>(T, 1)),
                static_cast<long long>(check.worst_token % std::max<int64_t>(T, 1)),
                static_cast<long long>(check.worst_col));
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  std::fflush(stdout);
  return pass ? kExitOk : kExitFail;
}

int demo_rank(const DemoOptions& o, std::unique_ptr<Bootstrap> bootstrap) {
  auto group = Group::create(std::move(bootstrap));
  const int r = group->rank();
  Progress progress("epcomm demo", r == 0 && !o.run.quiet);
  RankOutput out = run_layer(o, group, progress);
  progress.phase("gathering results at rank 0");
  Bootstrap& bs = group->bootstrap();
  auto times = all_gather_values(bs, out.times);
  auto counts = all_gather_values(bs, out.counts);
  auto combined = all_gather_values(bs, out.combined);
  std::vector<std::byte> plain_combined;
  if (o.run.quantizes()) plain_combined = all_gather_values(bs, out.plain_combined);
  if (r != 0) return kExitOk;
  const double t0 = now_s();
  std::vector<float> reference;
  CheckResult check =
      check_against_reference(o, combined, progress, o.run.quantizes() ? &reference : nullptr);
  const double reference_s = now_s() - t0;
  std::optional<QuantCost> cost;
  if (o.run.quantizes()) cost = quantization_cost(o, combined, plain_combined, reference, progress);
  progress.phase("done");
  return report(o, times, counts, check, reference_s, cost ? &*cost : nullptr);
}

}  // namespace

int run_demo(int argc, char** argv) {
  const std::string api = take_api_flag(argc, argv);
  if (api == "distribute-v2") return run_demo_v2(argc, argv);
  if (api == "low-latency") return run_demo_ll(argc, argv);
  FlagParser p("epcomm demo", "epcomm demo [flags]",
               "Runs one Mixture-of-Experts layer forward over local ranks and checks it against a dense\n"
               "single-process reference; prints PASS/FAIL, timings and load balance.");
  p.add("api", "normal|distribute-v2|low-latency", "normal",
        "API family; distribute-v2 runs the layer through dispatch_v2/combine_v2 instead (see 'epcomm demo "
        "--api distribute-v2 --help'), low-latency a decode loop through low_latency_dispatch/combine");
  add_run_flags(p, {4, 256, 1024, 32, 4, 1, "expert_major"});
  p.add("intermediate", "I", "256", "inner width of each SwiGLU expert");
  p.set_epilog(kDemoEpilog);
  if (!p.parse(argc, argv)) {
    std::fputs(p.help().c_str(), stdout);
    return kExitOk;
  }
  DemoOptions o;
  o.run = read_run_flags(p);
  o.intermediate = p.integer("intermediate", 1, 1 << 20);
  o.order = o.run.order.value_or(ReceiveOrder::expert_major);
  return run_ranks("epcomm demo", o.run,
                   [&](std::unique_ptr<Bootstrap> bs) { return demo_rank(o, std::move(bs)); });
}

}  // namespace epcomm::cli
