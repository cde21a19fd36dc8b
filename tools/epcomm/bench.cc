// tools/epcomm/bench.cc — `epcomm bench`: times dispatch and combine over local ranks and prints one JSON
// object per operation and receive order (rank 0, stdout); progress goes to stderr.
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench_verify.h"
#include "epcomm/buffer.h"
#include "numerics.h"
#include "quant/bench.h"
#include "quant/block.h"
#include "rank_tools.h"
#include "report.h"
#include "subcommands.h"

namespace epcomm::cli {

namespace {

const char* kBenchEpilog =
    "Each rank holds --tokens tokens of random values; each token goes to --topk distinct experts drawn\n"
    "uniformly (weights uniform in [0.05, 1)). For each receive order (both unless --order is given) it "
    "runs\n"
    "--warmup untimed and --iters timed iterations of dispatch followed by combine (combine feeds the\n"
    "dispatched rows back as expert outputs). A bootstrap barrier precedes every timed call; an iteration's\n"
    "time is the slowest rank's. The first iteration is checked once, outside the timings, against plain\n"
    "code from the seed: every received row carries its source token (bitwise) in spec order with the right\n"
    "top-k ids and weights, and combine returns round(sum_k w_k x) (expert_major) or round(n_ranks x)\n"
    "(rank_major) within 2u|expected| and the original weights bitwise.\n\n"
    "Output: one JSON object per line, fields op, order, ranks, tokens, hidden, topk, experts, dtype, "
    "quant,\n"
    "launcher, iters, warmup, rows, row_bytes, bytes, bytes_bf16_equiv, time_us_median, time_us_min,\n"
    "time_us_p99, time_us_max, gbps, gbps_bf16_equiv, memcpy_gbps, ratio_to_memcpy, verified, segment_bytes, "
    "peak_rss_mb.\n\n"
    "Byte formula (aggregate over all ranks, payload only, no per-row metadata):\n"
    "  bytes (dispatch) = sum over ranks of received rows (including rows from the rank itself) x "
    "row_bytes,\n"
    "                     row_bytes = H x elem, or with a quantizing --quant the quantized data plus scale\n"
    "                     bytes of a row: the bytes that actually moved;\n"
    "  bytes (combine)  = sum over ranks of rows sent back (one per received row) x H x elem.\n"
    "  bytes_bf16_equiv = the same rows x H x 2: what they would weigh as bf16 (equals bytes for plain "
    "bf16).\n"
    "  gbps = bytes / time_us_median / 1e3 (moved bytes; GB/s, 1 GB = 1e9 bytes);\n"
    "  gbps_bf16_equiv = bytes_bf16_equiv / time_us_median / 1e3 (the rate of useful bf16-valued data).\n"
    "  memcpy_gbps: every rank memcpy's its own tokens (T x H x elem, at least 32 MiB) at the same time\n"
    "  into pre-touched memory; aggregate bytes / the slowest rank's time, median of 5 (the host's copy\n"
    "  rate, for scale).\n"
    "  ratio_to_memcpy = gbps / memcpy_gbps.\n"
    "  peak_rss_mb: the largest peak resident set over the ranks' processes so far (getrusage; with\n"
    "  --launcher threads it is the whole process), in MiB.\n\n"
    "--quantizers: instead of dispatch and combine, the single-thread throughput of every block quantizer\n"
    "(quant.md §3) and its dequantizer on a --tokens x --hidden bf16 matrix of random values (--hidden a\n"
    "multiple of 32), best of --iters passes each, one JSON line per algorithm and variant:\n"
    "  {\"op\": \"quantize\"|\"dequantize\", \"algo\", \"variant\" (default, or smooth|ue8m0|rceil), "
    "\"hidden\",\n"
    "   \"rows\", \"iters\", \"gbps_bf16_in\": rows x hidden x 2 bytes / best pass / 1e9, \"threads\": 1}\n"
    "  (for dequantize the same bf16-equivalent byte count of the elements produced). Target: at least\n"
    "  1 GB/s of bf16 input per core for every quantize algorithm (quant.md §7); --tokens 4096 --hidden\n"
    "  7168 is the spec's matrix. Only --tokens, --hidden, --iters and --quiet apply.\n\n"
    "Exit status: 0 when every check passed, 1 when one failed or a runtime error, 2 a usage error.\n";

struct BenchOptions {
  RunOptions run;
  int warmup = 3;
  std::vector<ReceiveOrder> orders;
};

// Aggregate copy rate of all ranks memcpy'ing at once (collective): each copies its own tokens, or
// kMinCopyBytes when that is more, so that the figure measures memory rather than cache.
constexpr size_t kMinCopyBytes = size_t{32} << 20;

double measure_memcpy_gbps(Bootstrap& bs, const std::vector<std::byte>& x) {
  std::vector<std::byte> scratch;
  if (x.size() < kMinCopyBytes) scratch.assign(kMinCopyBytes, std::byte{2});
  const std::vector<std::byte>& src = scratch.empty() ? x : scratch;
  std::vector<std::byte> dst(src.size(), std::byte{1});
  std::vector<double> times;
  for (int rep = 0; rep < 5; ++rep) {
    bs.barrier();
    const double t0 = now_s();
    std::memcpy(dst.data(), src.data(), src.size());
    times.push_back(now_s() - t0);
  }
  const auto all = all_gather_values(bs, times);
  const double t = median(max_over_ranks(all, bs.size(), 5));
  return t > 0 ? static_cast<double>(src.size()) * bs.size() / t / 1e9 : 0.0;
}

// The dispatched rows as the combine input: the rows themselves, or quantized rows dequantized to the dtype.
Tensor combine_input(const RunOptions& o, const DispatchResult& d) {
  if (!d.recv_x.scales) return d.recv_x.data;
  const int64_t n = d.recv_x.data.size(0), H = o.hidden;
  Tensor x = empty(o.dtype, {n, H});
  std::vector<float> row(static_cast<size_t>(H));
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(o.dtype);
  for (int64_t i = 0; i < n; ++i) {
    recv_row_f32(d.recv_x, o.quant, H, i, row.data());
    store_row(o.dtype, row.data(), H, static_cast<std::byte*>(x.data()) + i * row_bytes);
  }
  return x;
}

struct Inputs {
  std::vector<std::byte> x;
  Routing routing;
  Tensor x_t, ids_t, weights_t;
  LayoutResult layout;
};

// What one rank measured for one order.
struct OrderRun {
  std::vector<double> times;  // dispatch [iters], then combine [iters]
  int64_t rows = 0, dispatch_bytes = 0, combine_bytes = 0;
  int64_t ok = 1;
};

OrderRun run_order(const BenchOptions& o, ReceiveOrder order, Buffer& buffer, Bootstrap& bs, const Inputs& in,
                   Progress& progress) {
  const RunOptions& ro = o.run;
  const int r = bs.rank(), iters = ro.iters;
  DispatchArgs da;
  da.x.data = in.x_t;
  da.topk_idx = in.ids_t;
  da.topk_weights = in.weights_t;
  da.num_tokens_per_rank = in.layout.num_tokens_per_rank;
  da.is_token_in_rank = in.layout.is_token_in_rank;
  da.num_tokens_per_expert = in.layout.num_tokens_per_expert;
  da.quant_mode = ro.quant;
  da.receive_order = order;

  OrderRun run;
  run.times.assign(static_cast<size_t>(2 * iters), 0.0);
  const char* name = receive_order_name(order);
  progress.phase(std::string(name) + ": " + std::to_string(o.warmup) + " warmup + " + std::to_string(iters) +
                 " timed iterations");
  for (int it = -o.warmup; it < iters; ++it) {
    bs.barrier();
    double t0 = now_s();
    DispatchResult d = buffer.dispatch(da);
    const double td = now_s() - t0;
    CombineArgs ca;
    ca.x = combine_input(ro, d);
    ca.handle = d.handle;
    if (order == ReceiveOrder::rank_major) ca.topk_weights = d.recv_topk_weights;
    bs.barrier();
    t0 = now_s();
    CombineResult c = buffer.combine(ca);
    const double tc = now_s() - t0;
    if (it >= 0) {
      run.times[it] = td;
      run.times[iters + it] = tc;
    }
    if (it == -o.warmup) {  // the first iteration: checked once, outside the timings
      progress.phase(std::string(name) + ": verifying the first iteration");
      std::string why = verify_dispatch(ro, order, r, d);
      if (why.empty()) why = verify_combine(ro, order, r, in.x, in.routing, c);
      if (!why.empty()) {
        std::fprintf(stderr, "epcomm bench: %s: verification failed on rank %d: %s\n", name, r, why.c_str());
        run.ok = 0;
      }
      run.rows = d.recv_x.data.size(0);
      run.dispatch_bytes = run.rows * ro.dispatch_row_bytes();
      run.combine_bytes = static_cast<int64_t>(ca.x.nbytes());
      if (o.warmup > 0) progress.phase(std::string(name) + ": timing");
    }
  }
  return run;
}

void print_lines(const BenchOptions& o, ReceiveOrder order, const std::vector<double>& times,
                 const std::vector<int64_t>& counts, double memcpy_gbps, int64_t segment_bytes,
                 double peak_rss_mb) {
  const RunOptions& ro = o.run;
  const int R = ro.ranks, iters = ro.iters;
  int64_t rows = 0, dbytes = 0, cbytes = 0;
  bool verified = true;
  for (int s = 0; s < R; ++s) {
    rows += counts[s * 5 + 0];
    dbytes += counts[s * 5 + 1];
    cbytes += counts[s * 5 + 2];
    verified = verified && counts[s * 5 + 3] == 1;
  }
  for (int op = 0; op < 2; ++op) {
    std::vector<double> per_rank;
    for (int s = 0; s < R; ++s) {
      const double* t = times.data() + static_cast<size_t>(s) * 2 * iters + static_cast<size_t>(op) * iters;
      per_rank.insert(per_rank.end(), t, t + iters);
    }
    std::vector<double> us = max_over_ranks(per_rank, R, iters);
    for (double& v : us) v *= 1e6;
    const int64_t bytes = op == 0 ? dbytes : cbytes;
    const int64_t bf16_bytes = rows * ro.hidden * 2;  // the same rows as bf16, whatever moved
    const double med = median(us);
    JsonLine j;
    j.add("op", op == 0 ? "dispatch" : "combine")
        .add("order", receive_order_name(order))
        .add("ranks", R)
        .add("tokens", ro.tokens)
        .add("hidden", ro.hidden)
        .add("topk", ro.topk)
        .add("experts", ro.experts)
        .add("dtype", dtype_name(ro.dtype))
        .add("quant", ro.quant_name())
        .add("launcher", ro.launcher == Launcher::fork ? "fork" : "threads")
        .add("iters", iters)
        .add("warmup", o.warmup)
        .add("rows", rows)
        .add("row_bytes",
             op == 0 ? ro.dispatch_row_bytes() : ro.hidden * static_cast<int64_t>(dtype_size(ro.dtype)))
        .add("bytes", bytes)
        .add("bytes_bf16_equiv", bf16_bytes)
        .add("time_us_median", med, 1)
        .add("time_us_min", *std::min_element(us.begin(), us.end()), 1)
        .add("time_us_p99", percentile(us, 0.99), 1)
        .add("time_us_max", *std::max_element(us.begin(), us.end()), 1)
        .add("gbps", med > 0 ? static_cast<double>(bytes) / med / 1e3 : 0.0, 3)
        .add("gbps_bf16_equiv", med > 0 ? static_cast<double>(bf16_bytes) / med / 1e3 : 0.0, 3)
        .add("memcpy_gbps", memcpy_gbps, 3)
        .add("ratio_to_memcpy",
             med > 0 && memcpy_gbps > 0 ? static_cast<double>(bytes) / med / 1e3 / memcpy_gbps : 0.0, 3)
        .add("verified", verified)
        .add("segment_bytes", segment_bytes)
        .add("peak_rss_mb", peak_rss_mb, 1);
    std::printf("%s\n", j.str().c_str());
  }
  std::fflush(stdout);
}

int bench_rank(const BenchOptions& o, std::unique_ptr<Bootstrap> bootstrap) {
  const RunOptions& ro = o.run;
  auto group = Group::create(std::move(bootstrap));
  const int r = group->rank();
  Bootstrap& bs = group->bootstrap();
  Progress progress("epcomm bench", r == 0 && !ro.quiet);
  progress.phase("generating tokens and routing");
  const int64_t T = ro.tokens, H = ro.hidden;
  const int K = ro.topk;
  Inputs in;
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(ro.dtype);
  in.x.resize(static_cast<size_t>(T) * row_bytes);
  for (int64_t t = 0; t < T; ++t) make_token(ro.seed, r, t, H, ro.dtype, in.x.data() + t * row_bytes);
  in.routing = bench_routing(ro, r);
  in.x_t = Tensor::wrap(in.x.data(), ro.dtype, {T, H});
  in.ids_t = Tensor::wrap(in.routing.ids.data(), DType::i64, {T, K});
  in.weights_t = Tensor::wrap(in.routing.weights.data(), DType::f32, {T, K});

  BufferOptions bo;
  bo.num_nvl_bytes = ro.num_nvl_bytes;
  bo.timeout_s = ro.timeout_s;
  Buffer buffer(group, bo);
  in.layout = buffer.get_dispatch_layout(in.ids_t, ro.experts);
  progress.phase("measuring the memcpy rate");
  const double memcpy_gbps = measure_memcpy_gbps(bs, in.x);

  bool all_ok = true;
  for (ReceiveOrder order : o.orders) {
    OrderRun run = run_order(o, order, buffer, bs, in, progress);
    auto times = all_gather_values(bs, run.times);
    rusage usage{};
    getrusage(RUSAGE_SELF, &usage);  // peak resident set of this rank's process so far, in KiB
    auto counts = all_gather_values(
        bs, std::vector<int64_t>{run.rows, run.dispatch_bytes, run.combine_bytes, run.ok, usage.ru_maxrss});
    int64_t peak_kib = 0;
    for (int s = 0; s < ro.ranks; ++s) {
      all_ok = all_ok && counts[s * 5 + 3] == 1;
      peak_kib = std::max<int64_t>(peak_kib, counts[s * 5 + 4]);
    }
    if (r == 0) print_lines(o, order, times, counts, memcpy_gbps, buffer.num_nvl_bytes(), peak_kib / 1024.0);
  }
  progress.phase("done");
  return all_ok ? kExitOk : kExitFail;
}

// `epcomm bench --quantizers`: quant/bench.h on this thread, one JSON line per algorithm and variant.
int run_quantizer_bench(const FlagParser& p) {
  for (const char* name : {"ranks", "experts", "topk", "order", "dtype", "seed", "quant", "num-nvl-bytes",
                           "launcher", "timeout", "warmup"})
    if (p.given(name))
      throw UsageError(std::string("--quantizers: --") + name +
                       " does not apply (the quantizer benchmark reads --tokens, --hidden and --iters)");
  const int64_t rows = p.integer("tokens", 1, int64_t{1} << 24);
  const int64_t hidden = p.integer("hidden", 1, int64_t{1} << 24);
  if (hidden % quant::kMxBlock != 0)
    throw UsageError(bad_value("hidden",
                               "a multiple of 32 with --quantizers (the MX algorithms need whole blocks)",
                               std::to_string(hidden)));
  const int iters = static_cast<int>(p.integer("iters", 1, 1000000));
  Progress progress("epcomm bench", !p.on("quiet"));
  progress.phase("quantizers: " + std::to_string(rows) + " x " + std::to_string(hidden) + " bf16, best of " +
                 std::to_string(iters) + " passes per algorithm, one thread");
  const std::vector<quant::QuantBenchResult> results = quant::run_quant_benchmark(rows, hidden, iters);
  progress.phase("done");
  for (const quant::QuantBenchResult& res : results) {
    // Names are "<algo>", "<algo>.<variant>" or "<algo>.dequant" (quant/bench.h).
    const size_t dot = res.algo.find('.');
    const std::string algo = res.algo.substr(0, dot);
    const std::string suffix = dot == std::string::npos ? "" : res.algo.substr(dot + 1);
    const bool dequant = suffix == "dequant";
    JsonLine j;
    j.add("op", dequant ? "dequantize" : "quantize")
        .add("algo", algo)
        .add("variant", suffix.empty() || dequant ? std::string("default") : suffix)
        .add("hidden", hidden)
        .add("rows", rows)
        .add("iters", iters)
        .add("gbps_bf16_in", res.gbps_bf16_in, 3)
        .add("threads", 1);
    std::printf("%s\n", j.str().c_str());
  }
  std::fflush(stdout);
  return kExitOk;
}

}  // namespace

int run_bench(int argc, char** argv) {
  if (take_api_flag(argc, argv) == "distribute-v2") return run_bench_v2(argc, argv);
  FlagParser p(
      "epcomm bench", "epcomm bench [flags]",
      "Times dispatch and combine between local ranks; prints one JSON object per line (rank 0,\n"
      "stdout) for each operation and receive order. Progress lines go to stderr. With --quantizers it\n"
      "benchmarks the block quantizers instead.");
  add_run_flags(p, {2, 4096, 7168, 256, 8, 20, ""});
  p.add("warmup", "N", "3", "untimed iterations before the timed ones");
  p.add_switch("quantizers", "time the block quantizers instead of dispatch and combine (see below)");
  p.set_epilog(kBenchEpilog);
  if (!p.parse(argc, argv)) {
    std::fputs(p.help().c_str(), stdout);
    return kExitOk;
  }
  if (p.on("quantizers")) return run_quantizer_bench(p);
  BenchOptions o;
  o.run = read_run_flags(p);
  o.warmup = static_cast<int>(p.integer("warmup", 0, 1000000));
  if (o.run.order)
    o.orders = {*o.run.order};
  else
    o.orders = {ReceiveOrder::expert_major, ReceiveOrder::rank_major};
  return run_ranks("epcomm bench", o.run,
                   [&](std::unique_ptr<Bootstrap> bs) { return bench_rank(o, std::move(bs)); });
}

}  // namespace epcomm::cli
