// tools/epcomm/bench_ll.cc — `epcomm bench --api low-latency`: times low_latency_dispatch,
// low_latency_combine and their round trip (docs/low-latency.md, DeepEP's layout) over local ranks in the
// decode shape, beside a memcpy of the same bytes, and prints one JSON object per operation and rank count
// (rank 0, stdout).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_measure.h"
#include "epcomm/buffer.h"
#include "flags.h"
#include "numerics.h"
#include "rank_tools.h"
#include "report.h"
#include "run_options.h"
#include "subcommands.h"

namespace epcomm::cli {
namespace {

const char* kEpilog =
    "Each rank holds --tokens tokens (= num_max_dispatch_tokens_per_rank) of random bf16 values routed to\n"
    "--topk distinct experts drawn uniformly (weights uniform in [0.05, 1)). For each rank count it runs\n"
    "--warmup untimed and --iters timed iterations of low_latency_dispatch, then of low_latency_combine "
    "(the\n"
    "expert outputs are the dispatched rows, in the zero-copy combine buffer with --zero-copy), then of the\n"
    "round trip (dispatch then combine, no barrier between). A bootstrap barrier precedes and follows every\n"
    "timed call (so that no rank's untimed work takes a core from a rank still in the call); an iteration's\n"
    "time runs from the last rank's call to the last rank's return. first_iter_ratio is the\n"
    "first timed iteration over the median (no warm-up by default: the first call is part of the target;\n"
    "the Buffer's own one-token warm-up at creation, EPCOMM_WARMUP, is not timed).\n"
    "The first iteration's results are kept and checked after the timed iterations (a check between timed\n"
    "calls would leave the next one with cold caches): every valid row of every local expert equals its\n"
    "source token's row (bf16; the counts for fp8) and combine returns x * sum(w) within calc_diff < 1e-5\n"
    "(bf16) or 3e-3 (fp8). The expert outputs' buffer (without --zero-copy) is written once before the\n"
    "timings, as a serving loop reuses its buffer.\n\n"
    "--hook-compute-us US adds a fourth line (op low_latency_dispatch, hook true): a dispatch with\n"
    "return_recv_hook=True, US microseconds of busy computation on the calling thread, then hook(); its\n"
    "time runs from the call to the hook's return. compute_us is US; hook_overhead_ratio = (that median - "
    "US)\n"
    "/ the hookless dispatch median (the overlap target of docs/low-latency.md: <= 0.2 at US = 1000).\n\n"
    "Bytes (the decode target's formula): pairs received by all ranks x row bytes (codes + scales; combine:\n"
    "H x 2), gbps = bytes / time_us_median / 1e3; memcpy_gbps: every rank memcpy's its share of those bytes\n"
    "at once (the normal-mode bench's measurement; round trip: the dispatch bytes' memcpy then the\n"
    "combine bytes'); ratio_to_memcpy = gbps / memcpy_gbps.\n\n"
    "Output: one JSON object per line, fields api, op, flavor, format, hook, zero_copy, ranks, tokens, "
    "hidden,\n"
    "topk, experts, iters, warmup, pairs, row_bytes, bytes, time_us_median, time_us_min, time_us_p99,\n"
    "time_us_max, first_iter_ratio, p99_ratio, gbps, memcpy_gbps, ratio_to_memcpy, verified (hook line:\n"
    "also compute_us, hook_overhead_ratio).\n\n"
    "Exit status: 0 when every check passed, 1 when one failed or a runtime error, 2 a usage error.\n";

enum class LlFormat { bf16, fp8, fp8_pow2, ue8m0 };

struct LlBenchOptions {
  std::vector<int> ranks{2};
  int64_t tokens = 128, hidden = 7168;
  int topk = 8, experts = 256, iters = 50, warmup = 0;
  LlFormat format = LlFormat::bf16;
  bool zero_copy = false;
  double hook_compute_us = 0;  // > 0: also time dispatch + this much computation + hook()
  uint64_t seed = 1;
  LaunchFlags launch;
};

const char* format_name(LlFormat f) {
  switch (f) {
    case LlFormat::fp8:
      return "fp8";
    case LlFormat::fp8_pow2:
      return "fp8_pow2";
    case LlFormat::ue8m0:
      return "ue8m0";
    default:
      return "bf16";
  }
}

// What one rank sends and what the calls take, built once.
struct LlInputs {
  std::vector<std::byte> x;  // [T, H] bf16
  std::vector<int64_t> ids;  // [T, K]
  std::vector<float> w;      // [T, K]
  LowLatencyDispatchArgs dispatch;
};

void make_inputs(const LlBenchOptions& o, int r, LlInputs& in) {
  const int64_t T = o.tokens, H = o.hidden;
  in.x.resize(static_cast<size_t>(T * H * 2));
  for (int64_t t = 0; t < T; ++t) make_token(o.seed, r, t, H, DType::bf16, in.x.data() + t * H * 2);
  const std::vector<int32_t> ids = uniform_routing(o.seed, r, T, o.topk, o.experts);
  in.ids.assign(ids.begin(), ids.end());
  RandomStream ws(o.seed, StreamKind::weights, static_cast<uint64_t>(r));
  in.w.resize(in.ids.size());
  for (size_t i = 0; i < in.w.size(); ++i) in.w[i] = 0.525f + 0.475f * ws.uniform(i);
  LowLatencyDispatchArgs& a = in.dispatch;
  a.x = Tensor::wrap(in.x.data(), DType::bf16, {T, H});
  a.topk_idx = Tensor::wrap(in.ids.data(), DType::i64, {T, o.topk});
  a.num_max_dispatch_tokens_per_rank = T;
  a.num_experts = o.experts;
  a.use_fp8 = o.format != LlFormat::bf16;
  a.round_scale = o.format == LlFormat::fp8_pow2 || o.format == LlFormat::ue8m0;
  a.use_ue8m0 = o.format == LlFormat::ue8m0;
}

// The combine's x: the dispatched rows as bf16 (fp8 rows: zeros, the check then only counts rows), in
// `plain` (allocated once) or, with --zero-copy, in the handle's combine buffer.
Tensor expert_outputs(const LlBenchOptions& o, Buffer& buffer, const LowLatencyDispatchResult& d,
                      const Tensor& plain) {
  Tensor y = o.zero_copy ? buffer.low_latency_combine_buffer(*d.handle) : plain;
  const int64_t RT = d.recv_x.size(1), row = o.hidden * 2;
  for (int64_t j = 0; j < d.recv_x.size(0); ++j) {
    const int64_t n = d.recv_count.data_as<int32_t>()[j];
    std::byte* dst = y.data_as<std::byte>() + j * RT * row;
    if (o.format == LlFormat::bf16)
      std::memcpy(dst, d.recv_x.data_as<std::byte>() + j * RT * row, static_cast<size_t>(n * row));
    else
      std::memset(dst, 0, static_cast<size_t>(n * row));
  }
  return y;
}

// Rows: every valid row of every local expert is its source token's row (bf16), and the counts add up to
// the pairs routed here. Combine: x * sum(w) for bf16 (calc_diff < 1e-5), zeros for fp8.
bool verify(const LlBenchOptions& o, int r, int W, const LowLatencyDispatchResult& d, const Tensor& out,
            const LlInputs& in) {
  const int L = o.experts / W;
  const int64_t RT = d.recv_x.size(1), H = o.hidden;
  int64_t expected = 0, got = 0;
  bool ok = true;
  std::vector<LlInputs> all(static_cast<size_t>(W));
  for (int s = 0; s < W; ++s) {
    make_inputs(o, s, all[s]);
    for (int64_t id : all[s].ids) expected += id / L == r;
  }
  for (int j = 0; j < L; ++j) {
    const int64_t n = d.recv_count.data_as<int32_t>()[j];
    got += n;
    for (int64_t i = 0; i < n && o.format == LlFormat::bf16; ++i) {
      int s = 0;  // the source rank from layout_range: rows of rank s start at its begin
      while (s + 1 < W && (d.layout_range.data_as<int64_t>()[j * W + s + 1] >> 32) <= i) ++s;
      const int64_t t = d.src_info.data_as<int32_t>()[j * RT + i];
      ok = ok && std::memcmp(d.recv_x.data_as<std::byte>() + (j * RT + i) * H * 2,
                             all[s].x.data() + t * H * 2, static_cast<size_t>(H * 2)) == 0;
    }
  }
  double num = 0, den = 0;
  for (int64_t t = 0; t < o.tokens; ++t) {
    double wsum = 0;
    for (int k = 0; k < o.topk; ++k) wsum += in.w[t * o.topk + k];
    if (o.format != LlFormat::bf16) wsum = 0;
    for (int64_t h = 0; h < H; ++h) {
      const double a = load_elem(DType::bf16, out.data(), t * H + h) + 1;
      const double b = load_elem(DType::bf16, in.x.data(), t * H + h) * wsum + 1;
      num += a * b;
      den += a * a + b * b;
    }
  }
  const double diff = den > 0 ? 1 - 2 * num / den : 0;
  if (!ok || got != expected || !(diff < 1e-5)) {
    std::fprintf(
        stderr,
        "epcomm bench: low-latency verification failed on rank %d: rows %s, %lld pairs (expected %lld), "
        "combine calc_diff %.3g\n",
        r, ok ? "ok" : "differ", static_cast<long long>(got), static_cast<long long>(expected), diff);
    return false;
  }
  return true;
}

// The timed operations: dispatch, combine, round trip, and with --hook-compute-us the hooked dispatch.
constexpr int kHookOp = 3;
int num_ops(const LlBenchOptions& o) {
  return o.hook_compute_us > 0 ? 4 : 3;
}

// Busy work on the calling thread for `us` microseconds (the computation a hook overlaps): a dependent
// integer recurrence, checked against the clock every 256 steps.
uint64_t compute_for(double us) {
  const double until = now_s() + us * 1e-6;
  uint64_t v = 88172645463325252ull;
  do
    for (int i = 0; i < 256; ++i) v ^= v << 13, v ^= v >> 7, v ^= v << 17;
  while (now_s() < until);
  return v;
}

struct Samples {
  std::vector<double> starts, times;  // [num_ops x iters]
  int64_t pairs = 0;                  // pairs this rank received
  bool ok = true;
  uint64_t sink = 0;  // the computation's result, so that it is not optimized away
};

LowLatencyCombineArgs combine_args(const LlInputs& in, const LlBenchOptions& o,
                                   const LowLatencyDispatchResult& d, const Tensor& y) {
  LowLatencyCombineArgs c;
  c.x = y;
  c.handle = d.handle;
  c.topk_idx = in.dispatch.topk_idx;
  c.topk_weights = Tensor::wrap(const_cast<float*>(in.w.data()), DType::f32, {o.tokens, o.topk});
  return c;
}

// `plain`: the expert outputs' buffer without --zero-copy.
void measure(const LlBenchOptions& o, int r, int W, Buffer& buffer, Bootstrap& bs, const LlInputs& in,
             const Tensor& plain, Samples& s) {
  const int nops = num_ops(o);
  s.starts.assign(static_cast<size_t>(nops * o.iters), 0.0);
  s.times = s.starts;
  // The first iteration's results, verified after the timings: verification between timed calls would
  // leave the next call with cold caches.
  std::optional<LowLatencyDispatchResult> first_dispatch;
  Tensor first_out;
  for (int it = -o.warmup; it < o.iters; ++it) {
    bs.barrier();
    double t0 = now_s();
    LowLatencyDispatchResult d = buffer.low_latency_dispatch(in.dispatch);
    const double td = now_s() - t0;
    // Every rank's call ends before any rank writes its expert outputs (untimed): with more ranks than
    // cores, a rank done early would otherwise take a core from the ranks still in the call.
    bs.barrier();
    const Tensor y = expert_outputs(o, buffer, d, plain);
    bs.barrier();
    const double t1 = now_s();
    const Tensor out = buffer.low_latency_combine(combine_args(in, o, d, y)).combined_x;
    const double tc = now_s() - t1;
    if (it == -o.warmup) {
      first_dispatch = d;
      first_out = out;
    }
    bs.barrier();
    const double t2 = now_s();
    LowLatencyDispatchResult d2 = buffer.low_latency_dispatch(in.dispatch);
    buffer.low_latency_combine(
        combine_args(in, o, d2, o.zero_copy ? buffer.low_latency_combine_buffer(*d2.handle) : y));
    const double trt = now_s() - t2;
    double t3 = 0, th = 0;
    if (nops > kHookOp) {  // dispatch with a receive hook, the computation, then the hook
      LowLatencyDispatchArgs ha = in.dispatch;
      ha.return_recv_hook = true;
      bs.barrier();
      t3 = now_s();
      LowLatencyDispatchResult dh = buffer.low_latency_dispatch(ha);
      s.sink += compute_for(o.hook_compute_us);
      dh.event.wait();
      th = now_s() - t3;
    }
    if (it < 0) continue;
    const double starts[4] = {t0, t1, t2, t3}, times[4] = {td, tc, trt, th};
    for (int op = 0; op < nops; ++op) {
      s.starts[static_cast<size_t>(op * o.iters + it)] = starts[op];
      s.times[static_cast<size_t>(op * o.iters + it)] = times[op];
    }
  }
  const LowLatencyDispatchResult& d = *first_dispatch;
  s.ok = verify(o, r, W, d, first_out, in);
  for (int j = 0; j < d.recv_count.size(0); ++j) s.pairs += d.recv_count.data_as<int32_t>()[j];
}

void report(const LlBenchOptions& o, int W, const std::vector<double>& starts,
            const std::vector<double>& times, int64_t pairs, bool verified, const double mgbps[2]) {
  static const char* kOps[4] = {"low_latency_dispatch", "low_latency_combine", "round_trip",
                                "low_latency_dispatch"};
  const int nops = num_ops(o);
  double hookless_median = 0;
  const int64_t G = o.hidden / 128;
  const int64_t drow = o.format == LlFormat::bf16    ? o.hidden * 2
                       : o.format == LlFormat::ue8m0 ? o.hidden + G
                                                     : o.hidden + 4 * G;
  for (int op = 0; op < nops; ++op) {
    const Timing tm = collective_timing(op_slice(starts, W, nops, o.iters, op),
                                        op_slice(times, W, nops, o.iters, op), W, o.iters, true);
    if (op == 0) hookless_median = tm.median;
    const int64_t row = op == 0 || op == kHookOp ? drow : op == 1 ? o.hidden * 2 : drow + o.hidden * 2;
    const int64_t bytes = pairs * row;
    const double gbps = tm.median > 0 ? static_cast<double>(bytes) / tm.median / 1e3 : 0.0;
    // round trip: a memcpy of the dispatch bytes followed by one of the combine bytes, at the rates measured
    const double m =
        op == kHookOp ? mgbps[0]
        : op < 2      ? mgbps[op]
        : mgbps[0] > 0 && mgbps[1] > 0
            ? static_cast<double>(bytes) / (pairs * drow / mgbps[0] + pairs * o.hidden * 2 / mgbps[1])
            : 0.0;
    // The first timed iteration, timed as the others (last rank's call to last rank's return).
    std::vector<double> first_starts, first_times;
    for (int s = 0; s < W; ++s) {
      const size_t at = static_cast<size_t>(s) * nops * o.iters + static_cast<size_t>(op) * o.iters;
      first_starts.push_back(starts[at]);
      first_times.push_back(times[at]);
    }
    const double first = collective_timing(first_starts, first_times, W, 1, true).median;
    JsonLine j;
    j.add("api", "low-latency")
        .add("op", kOps[op])
        .add("flavor", "deepep")
        .add("format", format_name(o.format));
    j.add("hook", op == kHookOp)
        .add("zero_copy", o.zero_copy)
        .add("ranks", W)
        .add("bind", ranks_bind_name())
        .add("tokens", o.tokens)
        .add("hidden", o.hidden);
    j.add("topk", o.topk).add("experts", o.experts).add("iters", o.iters).add("warmup", o.warmup);
    j.add("pairs", pairs).add("row_bytes", row).add("bytes", bytes).add("time_us_median", tm.median, 1);
    j.add("time_us_min", tm.min, 1).add("time_us_p99", tm.p99, 1).add("time_us_max", tm.max, 1);
    j.add("first_iter_ratio", tm.median > 0 ? first / tm.median : 0.0, 2);
    j.add("p99_ratio", tm.median > 0 ? tm.p99 / tm.median : 0.0, 2).add("gbps", gbps, 3);
    j.add("memcpy_gbps", m, 3).add("ratio_to_memcpy", m > 0 ? gbps / m : 0.0, 4).add("verified", verified);
    if (op == kHookOp)  // the overlap target: (call to hook return - computation) / the hookless dispatch
      j.add("compute_us", o.hook_compute_us, 1)
          .add("hook_overhead_ratio",
               hookless_median > 0 ? (tm.median - o.hook_compute_us) / hookless_median : 0.0, 3);
    std::printf("%s\n", j.str().c_str());
  }
  std::fflush(stdout);
}

int bench_rank_ll(const LlBenchOptions& o, int W, std::unique_ptr<Bootstrap> bootstrap) {
  auto group = Group::create(std::move(bootstrap));
  const int r = group->rank();
  Bootstrap& bs = group->bootstrap();
  Progress progress("epcomm bench", r == 0 && !o.launch.quiet);
  BufferOptions bo;
  bo.low_latency_mode = true;
  bo.timeout_s = o.launch.timeout_s;
  bo.num_rdma_bytes = Buffer::get_low_latency_rdma_size_hint(o.tokens, o.hidden, W, o.experts);
  // The expert outputs' buffer, written once before the Buffer exists, as a server allocates its buffers at
  // start-up and reuses them (else the first iteration pays its first-touch faults between the dispatch and
  // the combine).
  Tensor plain;
  if (!o.zero_copy) {
    plain = empty(DType::bf16, {o.experts / W, W * o.tokens, o.hidden});
    std::memset(plain.data(), 0, plain.nbytes());
  }
  Buffer buffer(group, bo);
  LlInputs in;
  make_inputs(o, r, in);
  progress.phase(std::to_string(o.warmup) + " warmup + " + std::to_string(o.iters) + " timed iterations");
  Samples s;
  measure(o, r, W, buffer, bs, in, plain, s);
  const auto starts = all_gather_values(bs, s.starts);
  const auto times = all_gather_values(bs, s.times);
  const auto pairs = all_gather_values(bs, std::vector<int64_t>{s.pairs, s.ok ? 1 : 0});
  int64_t total = 0;
  bool verified = true;
  for (int q = 0; q < W; ++q) {
    total += pairs[2 * q];
    verified = verified && pairs[2 * q + 1] == 1;
  }
  progress.phase("measuring the memcpy rate");
  const int64_t G = o.hidden / 128;
  const int64_t drow =
      o.format == LlFormat::bf16 ? o.hidden * 2 : o.hidden + (o.format == LlFormat::ue8m0 ? G : 4 * G);
  const double mgbps[2] = {concurrent_memcpy_gbps(bs, s.pairs * drow, 1),
                           concurrent_memcpy_gbps(bs, s.pairs * o.hidden * 2, 1)};
  if (r == 0) report(o, W, starts, times, total, verified, mgbps);
  progress.phase("done");
  return verified ? kExitOk : kExitFail;
}

LlBenchOptions parse_ll_options(FlagParser& p) {
  LlBenchOptions o;
  o.ranks = parse_rank_counts(p.str("ranks"));
  o.tokens = p.integer("tokens", 1, 1 << 16);
  o.hidden = p.integer("hidden", 128, 1 << 16);
  o.topk = static_cast<int>(p.integer("topk", 1, 32));
  o.experts = static_cast<int>(p.integer("experts", 1, 4096));
  o.iters = static_cast<int>(p.integer("iters", 1, 1 << 20));
  o.warmup = static_cast<int>(p.integer("warmup", 0, 1 << 20));
  const std::string f = p.choice("format", {"bf16", "fp8", "fp8_pow2", "ue8m0"});
  o.format = f == "fp8"        ? LlFormat::fp8
             : f == "fp8_pow2" ? LlFormat::fp8_pow2
             : f == "ue8m0"    ? LlFormat::ue8m0
                               : LlFormat::bf16;
  o.zero_copy = p.on("zero-copy");
  o.hook_compute_us = static_cast<double>(p.integer("hook-compute-us", 0, 1000000));
  o.seed = static_cast<uint64_t>(p.integer("seed", 0, INT64_MAX));
  o.launch = read_launch_flags(p);
  if (o.hidden % (o.format == LlFormat::ue8m0 ? 512 : 128) != 0)
    throw UsageError(bad_value("hidden",
                               o.format == LlFormat::ue8m0 ? "a multiple of 512" : "a multiple of 128",
                               std::to_string(o.hidden)));
  for (int W : o.ranks)
    if (o.experts % W != 0)
      throw UsageError(bad_value("experts", "a multiple of every rank count", std::to_string(o.experts)));
  if (o.topk > o.experts) throw UsageError(bad_value("topk", "<= experts", std::to_string(o.topk)));
  return o;
}

}  // namespace

int run_bench_ll(int argc, char** argv) {
  FlagParser p(
      "epcomm bench --api low-latency", "epcomm bench --api low-latency [flags]",
      "Times low_latency_dispatch, low_latency_combine and their round trip (docs/low-latency.md) in the\n"
      "decode shape over local ranks, beside a memcpy of the same bytes (JSON lines).");
  p.add("api", "NAME", "normal", "low-latency selects this benchmark");
  p.add("ranks", "N[,N...]", "2", "local rank counts, one run each");
  p.add("tokens", "T", "128", "tokens per rank = num_max_dispatch_tokens_per_rank");
  p.add("hidden", "H", "7168", "hidden size (a multiple of 128; of 512 with --format ue8m0)");
  p.add("topk", "K", "8", "distinct experts per token");
  p.add("experts", "E", "256", "experts (a multiple of every rank count)");
  p.add("format", "bf16|fp8|fp8_pow2|ue8m0", "bf16", "dispatch format (use_fp8, round_scale, use_ue8m0)");
  p.add_switch("zero-copy", "expert outputs in get_next_low_latency_combine_buffer (read in place)");
  p.add("hook-compute-us", "US", "0",
        "also time a dispatch with return_recv_hook, US microseconds of computation, then the hook");
  p.add("iters", "N", "50", "timed iterations");
  p.add("warmup", "N", "0", "untimed iterations first (0: the first call is measured)");
  p.add("seed", "S", "1", "random seed");
  add_launch_flags(p);
  p.set_epilog(kEpilog);
  if (!p.parse(argc, argv)) {
    std::fputs(p.help().c_str(), stdout);
    return kExitOk;
  }
  const LlBenchOptions o = parse_ll_options(p);
  int rc = kExitOk;
  for (int W : o.ranks) {
    const RunOptions ro = launch_options(o.launch, W);
    rc = std::max(rc, run_ranks("epcomm bench", ro, [&](std::unique_ptr<Bootstrap> bs) {
                    return bench_rank_ll(o, W, std::move(bs));
                  }));
  }
  return rc;
}

}  // namespace epcomm::cli
