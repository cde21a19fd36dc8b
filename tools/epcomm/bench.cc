// tools/epcomm/bench.cc — `epcomm bench`: times dispatch and combine (local ranks, or one rank per MPI
// process with the MPI_Alltoallv baseline beside) and prints one JSON object per operation, receive order and
// token count (rank 0, stdout); progress goes to stderr; --plot draws the sweep as SVG.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "bench_baseline.h"
#include "bench_measure.h"
#include "bench_plot.h"
#include "bench_verify.h"
#include "epcomm/buffer.h"
#include "numerics.h"
#include "quant/block.h"
#include "quant_bench.h"
#include "rank_tools.h"
#include "report.h"
#include "subcommands.h"

namespace epcomm::cli {

namespace {

const char* kBenchEpilog =
    "Each rank holds --tokens tokens of random values; each token goes to --topk distinct experts drawn\n"
    "uniformly (weights uniform in [0.05, 1)). For each token count of --tokens (a list sweeps them, e.g.\n"
    "--tokens 256,1024,4096,16384) and each receive order (both unless --order is given) it runs --warmup\n"
    "untimed and --iters timed iterations of dispatch followed by combine (combine feeds the dispatched "
    "rows\n"
    "back as expert outputs). A bootstrap barrier precedes every timed call, and follows each dispatch (so\n"
    "that no rank's untimed work takes a core from a rank still in the call); an iteration's time runs from\n"
    "the last rank's call to the last rank's return (ranks on one host share one clock; across hosts: the\n"
    "slowest rank's own time). A collective cannot end before its last rank calls it, so this leaves out\n"
    "the skew with which the barrier released the ranks (start_skew_us_median; rank_time_us_median is the\n"
    "slowest rank's own time, that skew included). The first iteration is checked once, outside the\n"
    "timings, against plain code from the\n"
    "seed: every received row carries its source token (bitwise) in spec order with the right top-k ids and\n"
    "weights, and combine returns round(sum_k w_k x) (expert_major) or round(n_ranks x) (rank_major) within\n"
    "2u|expected| and the original weights bitwise.\n\n"
    "Ranks: --bootstrap local (default) starts --ranks ranks itself (--launcher fork|threads). Under MPI,\n"
    "one rank per MPI process (--ranks is the world size; this also measures the baseline):\n"
    "  mpirun -n 2 epcomm bench --bootstrap mpi\n"
    "  (as root: mpirun --allow-run-as-root -n 2 ...; ranks must share one host.)\n\n"
    "Phases: epcomm's iterations of every token count and order first; then (MPI) the baseline of each\n"
    "line; then the memcpy limit of each line; then rank 0 prints the lines. The baseline and the memcpy\n"
    "limit touch GBs of fresh memory, which slowed the next epcomm call 3-25x on the development VM, so no\n"
    "such measurement runs between two epcomm lines.\n\n"
    "Baseline (--bootstrap mpi only): the same operation as written without epcomm, on the same inputs,\n"
    "timed after all of epcomm's lines with its own warm-up and a barrier before each call.\n"
    "dispatch: MPI_Alltoall of the counts per (rank, expert); pack\n"
    "rows and their top-k ids and weights per destination (expert_major: one row per (token, slot), by\n"
    "local expert, token, slot; rank_major: one row per (token, destination rank), by token);\n"
    "MPI_Alltoallv of rows, ids and weights; unpack into epcomm's receive order (expert_major: blocks per\n"
    "local expert, sources in rank order, PAD rows to the alignment; rank_major lands in order). combine:\n"
    "pack per source, MPI_Alltoallv back (rank_major also the weights), then docs/normal-mode.md's fp32 "
    "reduction\n"
    "in canonical order (slot k, or destination rank), one rounding. Its first iteration must equal\n"
    "epcomm's first outputs bitwise (baseline_verified; compared through a 64-bit digest of every\n"
    "row). Its packing, unpacking and reduction run on the calling thread of each rank, whatever\n"
    "--threads says. Open MPI picks its transports (on one host: shared memory). Without MPI\n"
    "(--bootstrap local, or a quantizing --quant) the baseline fields are null.\n\n"
    "Output: one JSON object per line, fields op, order, ranks, tokens, hidden, topk, experts,\n"
    "expert_alignment, dtype, quant, cached, launcher (fork|threads|mpi), threads, iters, warmup, rows,\n"
    "row_bytes, bytes, bytes_bf16_equiv, time_us_median, time_us_min, time_us_p99, time_us_max, timing\n"
    "(span|slowest_rank), rank_time_us_median, start_skew_us_median, gbps,\n"
    "gbps_bf16_equiv, memcpy_gbps, ratio_to_memcpy, baseline_time_us_median, baseline_gbps,\n"
    "speedup_vs_baseline, baseline_verified, nodes, network_bytes, network_gbps, link_gbps, ratio_to_link,\n"
    "verified, dispatch_input, combine_input, segment_bytes, output_reserve_bytes, first_iter_us, "
    "first_iter_ratio, peak_rss_mb,\n"
    "peak_rss_mb_per_rank, pss_mb, dispatch_rows, combine_shared_tokens.\n\n"
    "first_iter_us: the time of the first (warm-up) iteration of this order and token count, as the others;\n"
    "first_iter_ratio = first_iter_us / time_us_median. On the first line it is the Buffer's first call.\n\n"
    "combine_input: where combine's x was and how it travelled (Buffer::copy_counters): shared when every\n"
    "combine read it in place from Buffer::get_combine_input (--combine-input shared: the Buffer gets\n"
    "num_combine_input_bytes for tokens x topk rows + 25%, and the dispatched rows are copied there "
    "untimed,\n"
    "as an expert would write its outputs), arena when x was the dispatched tensor itself (the default) and\n"
    "it was read in place from the holders' output arenas (by the origins, across nodes by each node's\n"
    "proxies), private when that tensor's rows were copied by their holders (no output arena), copy when\n"
    "x was an untimed copy of the dispatched rows into a fresh private tensor (--combine-input copy: what\n"
    "an expert that writes a new output tensor hands to combine; the holders copy its rows).\n"
    "dispatch_input: shared when every dispatch of the line had its receivers read the rows in place\n"
    "(Buffer::copy_counters; with --dispatch-input shared the tokens are written once, untimed, into\n"
    "Buffer::get_dispatch_input; with a quantizing --quant or several nodes they are not), else private.\n"
    "dispatch_rows: how the rows travelled, from the same counters: pushed (every sender wrote its rows\n"
    "straight into the receivers' recv_x in their output arenas, a quantizing --quant quantizing each\n"
    "token once: one node, x not in the shared dispatch input; the default), in_place (read in place from\n"
    "the shared dispatch input), staged (staged in the segment and copied out by the receivers: several\n"
    "nodes, EPCOMM_OUTPUT_ARENA=0), or mixed.\n"
    "combine_shared_tokens: tokens per combine (mean over the line's calls, all ranks) that a rank done\n"
    "with its own reduced for a slower one (direct combines; Buffer::copy_counters, "
    "EPCOMM_COMBINE_SHARING).\n\n"
    "Across nodes (--ranks-per-node P, or EPCOMM_RANKS_PER_NODE; with UCX_TLS=tcp virtual nodes on one host\n"
    "talk over TCP sockets): network_bytes = pairs x row_bytes (dispatch) or pairs x H x 4 (combine: f32\n"
    "partials), pairs = (token, other node that needs it) over all ranks; network_gbps = network_bytes /\n"
    "time_us_median / 1e3; link_gbps = the raw UCX put bandwidth of the same transport, every rank to its\n"
    "first rail peer at once, summed (Buffer::measure_link_gbps), the best of three; ratio_to_link =\n"
    "network_gbps / link_gbps.\n"
    "On one node these fields are null (nodes = 1).\n\n"
    "Byte formulas (aggregate over all ranks, payload only, no per-row metadata):\n"
    "  rows = rows received by all ranks, including each rank's rows from itself, PAD rows excluded;\n"
    "  bytes (dispatch) = rows x row_bytes,\n"
    "                     row_bytes = H x elem, or with a quantizing --quant the quantized data plus scale\n"
    "                     bytes of a row: the bytes that actually moved;\n"
    "  bytes (combine)  = rows (each received row is sent back once) x H x elem.\n"
    "  bytes_bf16_equiv = the same rows x H x 2: what they would weigh as bf16 (equals bytes for plain "
    "bf16).\n"
    "  gbps = bytes / time_us_median / 1e3 (moved bytes; GB/s, 1 GB = 1e9 bytes);\n"
    "  gbps_bf16_equiv = bytes_bf16_equiv / time_us_median / 1e3 (the rate of useful bf16-valued data).\n"
    "  memcpy_gbps: every rank concurrently copies, with plain memcpy from one private pre-touched buffer\n"
    "    into another, exactly as many bytes as it received (dispatch) or sent (combine) in the measured\n"
    "    operation, with `threads` threads; sum of those bytes / the slowest rank's time, median of 5, the "
    "better of two\n"
    "    blocks with fresh buffers.\n"
    "    (With threads > 1 the helpers exist before the clock starts; waking them is timed.)\n"
    "  ratio_to_memcpy = gbps / memcpy_gbps (1.0: as fast as copying each byte once).\n"
    "  baseline_gbps = the same bytes / the baseline's median time (its extra pack and unpack copies and\n"
    "    its metadata are not counted); speedup_vs_baseline = baseline median / epcomm median.\n"
    "  threads: copy threads per rank (--threads, or what 0 stands for: hardware threads / ranks).\n"
    "  peak_rss_mb: the largest, over ranks, peak resident set of a rank's process through epcomm's first\n"
    "    iteration of this order and token count (VmHWM reset before it and read after it, before the\n"
    "    baseline's and memcpy's buffers exist; where the reset is refused, since the process started);\n"
    "    peak_rss_mb_per_rank lists each rank's (with --launcher threads every rank reports the whole\n"
    "    process). MiB. It counts every page the process touched, the pages of peers' outputs it wrote\n"
    "    rows into included, so with pushed rows each rank also counts what it wrote for the others.\n"
    "  pss_mb: the largest, over ranks, proportional set size (/proc/self/smaps_rollup: a page shared by n\n"
    "    processes counts 1/n in each) right after epcomm's first iteration of the line, its outputs alive.\n"
    "    MiB. Summed over ranks it is the memory the ranks really hold.\n\n"
    "--plot FILE.svg: after the run, one SVG file: GB/s against tokens per rank (log2 axis) for epcomm,\n"
    "the baseline and memcpy_gbps, one panel per operation and order. Sweep --tokens to make it a curve.\n\n"
    "--quantizers: instead of dispatch and combine, the single-thread throughput of every block quantizer\n"
    "(docs/quant.md) and its dequantizer on a --tokens x --hidden bf16 matrix of random values (--hidden a\n"
    "multiple of 32), best of --iters passes each, one JSON line per algorithm and variant:\n"
    "  {\"op\": \"quantize\"|\"dequantize\", \"algo\", \"variant\" (default, or smooth|ue8m0|rceil), "
    "\"hidden\",\n"
    "   \"rows\", \"iters\", \"gbps_bf16_in\": rows x hidden x 2 bytes / best pass / 1e9, \"threads\": 1}\n"
    "  (for dequantize the same bf16-equivalent byte count of the elements produced). Target: at least\n"
    "  1 GB/s of bf16 input per core for every quantize algorithm (docs/quant.md); --tokens 4096 --hidden\n"
    "  7168 is the spec's matrix. Only --tokens, --hidden, --iters and --quiet apply.\n\n"
    "Exit status: 0 when every check passed, 1 when one failed (verified or baseline_verified false) or a\n"
    "runtime error, 2 a usage error.\n";

struct BenchOptions {
  RunOptions run;
  int warmup = 3;
  std::vector<ReceiveOrder> orders;
  std::vector<int64_t> tokens;  // per rank, one sweep point each
  int threads_flag = 0;         // --threads: Config::num_threads (0 = the library's default)
  int threads = 1;              // resolved: copy threads per rank, for epcomm and the memcpy limit
  std::string plot;             // --plot FILE.svg, or ""
  bool shared_input = false;    // --combine-input shared: combine reads x from Buffer::get_combine_input
  bool copy_input = false;      // --combine-input copy: x is a fresh private copy of the dispatched rows
  bool shared_dispatch_input = false;  // --dispatch-input shared: dispatch reads x from get_dispatch_input
  int64_t output_reserve = -1;         // --output-reserve: BufferOptions::num_output_reserve_bytes; -1 = auto
  bool cached = false;                 // --cached: the timed dispatches reuse one fresh dispatch's handle
};

// The baseline exists for plain rows under MPI; the reason it is null otherwise.
const char* baseline_absent_reason(const RunOptions& ro) {
  if (!have_mpi())
    return "baseline_gbps is null: the MPI_Alltoallv baseline needs a build with MPI (this one found none; "
           "install Open MPI, e.g. libopenmpi-dev openmpi-bin, reconfigure, then run it under mpirun with "
           "--bootstrap mpi)";
  if (ro.launcher != Launcher::mpi)
    return "baseline_gbps is null: the MPI_Alltoallv baseline needs one MPI process per rank: "
           "mpirun -n R epcomm bench --bootstrap mpi ...";
  if (ro.quantizes())
    return "baseline_gbps is null: the baseline moves plain rows; it has no quantizing --quant";
  return nullptr;
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

Inputs make_inputs(const RunOptions& ro, int r, Buffer& buffer) {
  const int64_t T = ro.tokens, H = ro.hidden;
  Inputs in;
  const size_t row_bytes = static_cast<size_t>(H) * dtype_size(ro.dtype);
  in.x.resize(static_cast<size_t>(T) * row_bytes);
  for (int64_t t = 0; t < T; ++t) make_token(ro.seed, r, t, H, ro.dtype, in.x.data() + t * row_bytes);
  in.routing = bench_routing(ro, r);
  in.x_t = Tensor::wrap(in.x.data(), ro.dtype, {T, H});
  in.ids_t = Tensor::wrap(in.routing.ids.data(), DType::i64, {T, ro.topk});
  in.weights_t = Tensor::wrap(in.routing.weights.data(), DType::f32, {T, ro.topk});
  in.layout = buffer.get_dispatch_layout(in.ids_t, ro.experts);
  return in;
}

// What one rank measured for one order: epcomm and, under MPI, the baseline, iteration by iteration.
struct OrderRun {
  std::vector<double> times, baseline_times;    // dispatch [iters], then combine [iters]
  std::vector<double> starts, baseline_starts;  // when each of those calls began (steady clock, seconds)
  int64_t rows = 0, dispatch_bytes = 0, combine_bytes = 0;
  int64_t ok = 1, baseline_dispatch_ok = 1, baseline_combine_ok = 1;
  int64_t shared_input = 0;           // 1: every combine read x from the shared combine-input area
  int64_t shared_dispatch_input = 0;  // 1: every dispatch's receivers read its rows in place (copy counters)
  int64_t pushed_dispatch = 0;        // 1: every dispatch pushed its rows into the receivers' outputs
  int64_t combine_in_place = 0;       // 1: no combine copied a row: the origins read every x in place
  int64_t shared_tokens = 0;          // other ranks' tokens this rank reduced in the combines (all calls)
  double pss_mb = 0;                  // after epcomm's first iteration, its outputs alive
  double first_s[2] = {0, 0};         // the first (warm-up) iteration's dispatch and combine times
  double first_start[2] = {0, 0};     // and when they began
  double peak_rss_mb = 0;             // after epcomm's first iteration, before the baseline's buffers exist
  int64_t net_pairs = 0;              // several nodes: (token, other node that needs it) pairs of this rank
  OutputDigests digests;              // under MPI: epcomm's first outputs, for the baseline's check
};

DispatchArgs dispatch_args(const RunOptions& ro, ReceiveOrder order, const Inputs& in,
                           const std::optional<Config>& config) {
  DispatchArgs da;
  da.x.data = in.x_t;
  da.topk_idx = in.ids_t;
  da.topk_weights = in.weights_t;
  da.num_tokens_per_rank = in.layout.num_tokens_per_rank;
  da.is_token_in_rank = in.layout.is_token_in_rank;
  da.num_tokens_per_expert = in.layout.num_tokens_per_expert;
  da.quant_mode = ro.quant;
  da.receive_order = order;
  da.expert_alignment = ro.expert_alignment;
  da.config = config;
  return da;
}

std::unique_ptr<AlltoallvBaseline> make_baseline(const RunOptions& ro, ReceiveOrder order, Bootstrap& bs,
                                                 const Inputs& in, Buffer& buffer) {
  BaselineInputs bi;
  if (buffer.num_nodes() > 1)  // the reduction then goes node by node (docs/normal-mode.md), as epcomm's does
    for (int r = 0; r < bs.size(); ++r) bi.node_of_rank.push_back(buffer.node_of(r));
  bi.rank = bs.rank();
  bi.ranks = bs.size();
  bi.tokens = ro.tokens;
  bi.hidden = ro.hidden;
  bi.topk = ro.topk;
  bi.experts = ro.experts;
  bi.dtype = ro.dtype;
  bi.order = order;
  bi.expert_alignment = ro.expert_alignment;
  bi.x = in.x.data();
  bi.ids = in.routing.ids.data();
  bi.weights = in.routing.weights.data();
  return std::make_unique<AlltoallvBaseline>(bi);
}

// Checks epcomm's first iteration against the seed and records its row and byte counts.
void check_first(const RunOptions& ro, ReceiveOrder order, int r, const std::string& name, const Inputs& in,
                 const DispatchResult& d, const CombineResult& c, OrderRun& run) {
  std::string why = verify_dispatch(ro, order, r, d);
  if (why.empty()) why = verify_combine(ro, order, r, in.x, in.routing, c);
  if (!why.empty()) {
    std::fprintf(stderr, "epcomm bench: %s: verification failed on rank %d: %s\n", name.c_str(), r,
                 why.c_str());
    run.ok = 0;
  }
  run.rows = 0;  // rows that moved: PAD rows (--expert-alignment) excluded
  for (int64_t n : d.handle->num_recv_rows_per_source()) run.rows += n;
  run.dispatch_bytes = run.rows * ro.dispatch_row_bytes();
  run.combine_bytes = run.rows * ro.hidden * static_cast<int64_t>(dtype_size(ro.dtype));
}

// --cached: the first cached dispatch's rows (and scales) must equal the fresh dispatch's, byte for byte.
void check_cached(int r, const std::string& name, const DispatchResult& fresh, const DispatchResult& cached,
                  OrderRun& run) {
  auto same = [](const Tensor& a, const Tensor& b) {
    return a.nbytes() == b.nbytes() && (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
  };
  const bool ok = same(fresh.recv_x.data, cached.recv_x.data) &&
                  fresh.recv_x.scales.has_value() == cached.recv_x.scales.has_value() &&
                  (!fresh.recv_x.scales || same(*fresh.recv_x.scales, *cached.recv_x.scales));
  if (!ok) {
    std::fprintf(stderr,
                 "epcomm bench: %s: the cached dispatch's recv_x differs from the fresh one's on rank %d\n",
                 name.c_str(), r);
    run.ok = 0;
  }
}

// Compares the baseline's first iteration with epcomm's (the digests of its first iteration's outputs).
void check_baseline(const RunOptions& ro, int r, const std::string& name, const AlltoallvBaseline& b,
                    OrderRun& run) {
  const std::string whys[2] = {compare_dispatch(b, run.digests, ro.topk),
                               compare_combine(b, run.digests, ro.topk)};
  for (const std::string& why : whys)
    if (!why.empty())
      std::fprintf(stderr, "epcomm bench: %s: the baseline differs from epcomm on rank %d: %s\n",
                   name.c_str(), r, why.c_str());
  run.baseline_dispatch_ok = whys[0].empty();
  run.baseline_combine_ok = whys[1].empty();
}

// --warmup + --iters iterations of epcomm's dispatch and combine. A barrier precedes every timed call. Under
// MPI (with_baseline) the first iteration's outputs are digested for the baseline, which runs after every
// epcomm line (run_baseline).
OrderRun run_order(const BenchOptions& o, ReceiveOrder order, Buffer& buffer, Bootstrap& bs, const Inputs& in,
                   bool with_baseline, Progress& progress) {
  const RunOptions& ro = o.run;
  const int r = bs.rank(), iters = ro.iters;
  std::optional<Config> config;
  if (o.threads_flag > 0) {
    config = Buffer::get_dispatch_config(ro.ranks);
    config->num_threads = o.threads_flag;
  }
  DispatchArgs da = dispatch_args(ro, order, in, config);
  if (o.shared_dispatch_input) {  // the tokens written once into the shared area, as the layer before would
    Tensor sx = buffer.get_dispatch_input(ro.tokens, ro.hidden, ro.dtype);
    if (sx.nbytes()) std::memcpy(sx.data(), in.x_t.data(), sx.nbytes());
    da.x.data = sx;
  }
  // --cached: one fresh dispatch, untimed, whose handle every timed dispatch of the line passes
  // (docs/normal-mode.md: x only; the layout, counts, ids and weights are not sent again). It stays alive:
  // the combines use its handle, ids and weights, and the cached rows are checked bitwise against its rows.
  std::optional<DispatchResult> fresh;
  if (o.cached) {
    bs.barrier();
    fresh = buffer.dispatch(da);
    DispatchArgs cached;
    cached.x = da.x;
    cached.handle = fresh->handle;
    cached.quant_mode = da.quant_mode;
    cached.receive_order = order;
    cached.config = config;
    da = cached;
  }
  const Buffer::CopyCounters copies_before = buffer.copy_counters();

  OrderRun run;
  run.times.assign(static_cast<size_t>(2 * iters), 0.0);
  run.baseline_times = run.times;
  run.starts = run.times;
  run.baseline_starts = run.times;
  const std::string name =
      std::string(receive_order_name(order)) + ", " + std::to_string(ro.tokens) + " tokens";
  progress.phase(name + ": " + std::to_string(o.warmup) + " warmup + " + std::to_string(iters) +
                 " timed iterations");
  for (int it = -o.warmup; it < iters; ++it) {
    const bool first = it == -o.warmup;
    bs.barrier();
    const double t0d = now_s();
    std::optional<DispatchResult> d = buffer.dispatch(da);
    const double td = now_s() - t0d;
    bs.barrier();  // every call ends before the untimed work below takes a core from a rank still in it
    const DispatchResult& layout = fresh ? *fresh : *d;  // handle, ids and weights (of the fresh dispatch)
    CombineArgs ca;
    ca.x = combine_input(ro, *d);
    if (o.copy_input) {  // a fresh private tensor, written untimed, as an expert's new output would be
      Tensor cx = empty(ca.x.dtype(), ca.x.shape());
      if (cx.nbytes()) std::memcpy(cx.data(), ca.x.data(), cx.nbytes());
      ca.x = cx;
    }
    if (o.shared_input) {  // the expert outputs written into the shared area (untimed, like the experts)
      // The area is sized for typical routing; a call whose rows exceed it uses the dispatched tensor.
      Tensor sx;
      if (ca.x.nbytes() <= static_cast<size_t>(buffer.num_combine_input_bytes()))
        sx = buffer.get_combine_input(*layout.handle, ca.x.dtype(), ro.hidden);
      if (sx.defined()) {
        if (sx.nbytes()) std::memcpy(sx.data(), ca.x.data(), sx.nbytes());
        ca.x = sx;
      }
      run.shared_input = first ? sx.defined() : run.shared_input && sx.defined();
    }
    ca.handle = layout.handle;
    ca.config = config;
    if (order == ReceiveOrder::rank_major) ca.topk_weights = layout.recv_topk_weights;
    bs.barrier();
    const double t0c = now_s();
    std::optional<CombineResult> c = buffer.combine(ca);
    const double tc = now_s() - t0c;
    ca = CombineArgs();
    if (it >= 0) {
      run.times[it] = td;
      run.times[iters + it] = tc;
      run.starts[it] = t0d;
      run.starts[iters + it] = t0c;
    }
    if (first) {  // checked once, outside the timings
      run.first_s[0] = td;
      run.first_s[1] = tc;
      run.first_start[0] = t0d;
      run.first_start[1] = t0c;
      progress.phase(name + ": verifying the first iteration");
      check_first(ro, order, r, name, in, layout, *c, run);
      if (fresh) check_cached(r, name, *fresh, *d, run);
      run.peak_rss_mb = peak_rss_mb();
      run.pss_mb = pss_mb();
      if (with_baseline) run.digests = digest_outputs(layout, *c, ro.hidden, ro.topk);
      if (o.warmup > 0) progress.phase(name + ": timing");
    }
  }
  // How the rows travelled, as counted by the library: every token of every call read in place, or pushed.
  const Buffer::CopyCounters copies_after = buffer.copy_counters();
  const int64_t all_tokens = static_cast<int64_t>(o.warmup + iters) * ro.tokens;
  run.shared_dispatch_input =
      copies_after.dispatch_in_place_tokens - copies_before.dispatch_in_place_tokens == all_tokens;
  run.pushed_dispatch =
      copies_after.dispatch_pushed_tokens - copies_before.dispatch_pushed_tokens == all_tokens;
  run.combine_in_place = copies_after.combine_copied_rows == copies_before.combine_copied_rows;
  run.shared_tokens = copies_after.combine_shared_tokens - copies_before.combine_shared_tokens;
  return run;
}

// The baseline's --warmup + --iters iterations of one order (after every epcomm line: its per-call
// allocations of GBs slowed the epcomm calls that followed them on the development VM), its first checked
// against epcomm's digests.
void run_baseline(const BenchOptions& o, ReceiveOrder order, Bootstrap& bs, const Inputs& in, Buffer& buffer,
                  OrderRun& run, Progress& progress) {
  const RunOptions& ro = o.run;
  const int r = bs.rank(), iters = ro.iters;
  const std::string name =
      std::string(receive_order_name(order)) + ", " + std::to_string(ro.tokens) + " tokens";
  std::unique_ptr<AlltoallvBaseline> baseline = make_baseline(ro, order, bs, in, buffer);
  progress.phase(name + ": the MPI_Alltoallv baseline, " + std::to_string(o.warmup) + " warmup + " +
                 std::to_string(iters) + " timed iterations");
  if (o.cached) {  // --cached: planned once, untimed; the timed dispatches move the rows on that plan
    bs.barrier();
    baseline->dispatch();
  }
  for (int it = -o.warmup; it < iters; ++it) {
    bs.barrier();
    const double t0d = now_s();
    if (o.cached)
      baseline->dispatch_cached();
    else
      baseline->dispatch();
    const double bd = now_s() - t0d;
    bs.barrier();
    const double t0c = now_s();
    baseline->combine(baseline->recv_x(),
                      order == ReceiveOrder::rank_major ? baseline->recv_topk_weights() : nullptr);
    const double bc = now_s() - t0c;
    if (it >= 0) {
      run.baseline_times[it] = bd;
      run.baseline_times[iters + it] = bc;
      run.baseline_starts[it] = t0d;
      run.baseline_starts[iters + it] = t0c;
    }
    if (it == -o.warmup) check_baseline(ro, r, name, *baseline, run);
  }
  run.digests = OutputDigests();
}

// Everything one order's JSON lines need, gathered at every rank.
struct OrderReport {
  std::vector<double> times, baseline_times;  // all ranks, rank-major
  std::vector<int64_t>
      counts;  // per rank: rows, dispatch bytes, combine bytes, ok, baseline dispatch/combine ok
  std::vector<double> peak_rss_mb;  // per rank
  std::vector<double> pss_mb;       // per rank
  std::vector<double> first_s;      // per rank: the first iteration's dispatch and combine seconds
  std::vector<double> first_start;  // per rank: when they began
  std::vector<double> starts, baseline_starts;  // all ranks, rank-major, as times
  bool one_clock = true;                        // every rank on one host: their steady clocks agree
  double memcpy_gbps[2] = {0, 0};               // dispatch, combine
  bool has_baseline = false;
  // Internode: per rank, (token, other node) pairs (rows over the network); all ranks' link GB/s summed.
  std::vector<int64_t> net_pairs;
  int nodes = 1;
  double link_gbps = 0;
};
constexpr int kCounts = 11;  // per rank: rows, bytes (2), ok, baseline ok (2), shared inputs (combine,
                             // dispatch), pushed rows, combine read in place, tokens reduced for others

const char* launcher_name(Launcher l) {
  return l == Launcher::fork ? "fork" : l == Launcher::threads ? "threads" : "mpi";
}

void print_lines(const BenchOptions& o, ReceiveOrder order, const OrderReport& rep, int64_t segment_bytes,
                 std::vector<PlotPoint>& plot) {
  const RunOptions& ro = o.run;
  const int R = ro.ranks, iters = ro.iters;
  int64_t rows = 0, dbytes = 0, cbytes = 0;
  bool verified = true, baseline_verified[2] = {true, true}, shared = true, shared_dispatch = true;
  int pushed = 0, in_place = 0;  // ranks whose every dispatch pushed / was read in place
  bool combine_in_place = true;
  int64_t shared_tokens = 0;  // all ranks, all calls of this line
  for (int s = 0; s < R; ++s) {
    shared_tokens += rep.counts[s * kCounts + 10];
    shared = shared && rep.counts[s * kCounts + 6] == 1;
    shared_dispatch = shared_dispatch && rep.counts[s * kCounts + 7] == 1;
    in_place += rep.counts[s * kCounts + 7] == 1;
    pushed += rep.counts[s * kCounts + 8] == 1;
    combine_in_place = combine_in_place && rep.counts[s * kCounts + 9] == 1;
    rows += rep.counts[s * kCounts + 0];
    dbytes += rep.counts[s * kCounts + 1];
    cbytes += rep.counts[s * kCounts + 2];
    verified = verified && rep.counts[s * kCounts + 3] == 1;
    for (int op = 0; op < 2; ++op)
      baseline_verified[op] = baseline_verified[op] && rep.counts[s * kCounts + 4 + op] == 1;
  }
  const double peak = *std::max_element(rep.peak_rss_mb.begin(), rep.peak_rss_mb.end());
  const double pss = *std::max_element(rep.pss_mb.begin(), rep.pss_mb.end());
  const char* rows_how = pushed == R              ? "pushed"
                         : in_place == R          ? "in_place"
                         : pushed + in_place == 0 ? "staged"
                                                  : "mixed";
  for (int op = 0; op < 2; ++op) {
    const Timing tm = collective_timing(op_slice(rep.starts, R, 2, iters, op),
                                        op_slice(rep.times, R, 2, iters, op), R, iters, rep.one_clock);
    // The first iteration, timed as the others.
    const double first_us = collective_timing(op_slice(rep.first_start, R, 2, 1, op),
                                              op_slice(rep.first_s, R, 2, 1, op), R, 1, rep.one_clock)
                                .median;
    const int64_t bytes = op == 0 ? dbytes : cbytes;
    const int64_t bf16_bytes = rows * ro.hidden * 2;  // the same rows as bf16, whatever moved
    const double gbps = tm.median > 0 ? static_cast<double>(bytes) / tm.median / 1e3 : 0.0;
    const double memcpy_gbps = rep.memcpy_gbps[op];
    JsonLine j;
    j.add("op", op == 0 ? "dispatch" : "combine")
        .add("order", receive_order_name(order))
        .add("ranks", R)
        .add("tokens", ro.tokens)
        .add("hidden", ro.hidden)
        .add("topk", ro.topk)
        .add("experts", ro.experts)
        .add("expert_alignment", ro.expert_alignment)
        .add("dtype", dtype_name(ro.dtype))
        .add("quant", ro.quant_name())
        .add("cached", o.cached)
        .add("launcher", launcher_name(ro.launcher))
        .add("bind", ranks_bind_name())
        .add("threads", o.threads)
        .add("iters", iters)
        .add("warmup", o.warmup)
        .add("rows", rows)
        .add("row_bytes",
             op == 0 ? ro.dispatch_row_bytes() : ro.hidden * static_cast<int64_t>(dtype_size(ro.dtype)))
        .add("bytes", bytes)
        .add("bytes_bf16_equiv", bf16_bytes)
        .add("time_us_median", tm.median, 1)
        .add("time_us_min", tm.min, 1)
        .add("time_us_p99", tm.p99, 1)
        .add("time_us_max", tm.max, 1)
        .add("timing", rep.one_clock ? "span" : "slowest_rank")
        .add("rank_time_us_median", tm.rank_median, 1)
        .add("start_skew_us_median", tm.skew_median, 1)
        .add("gbps", gbps, 3)
        .add("gbps_bf16_equiv", tm.median > 0 ? static_cast<double>(bf16_bytes) / tm.median / 1e3 : 0.0, 3)
        .add("memcpy_gbps", memcpy_gbps, 3)
        .add("ratio_to_memcpy", gbps > 0 && memcpy_gbps > 0 ? gbps / memcpy_gbps : 0.0, 3);
    PlotPoint pp{
        op == 0 ? "dispatch" : "combine", receive_order_name(order), ro.tokens, gbps, memcpy_gbps, {}};
    if (rep.has_baseline) {
      const Timing bt =
          collective_timing(op_slice(rep.baseline_starts, R, 2, iters, op),
                            op_slice(rep.baseline_times, R, 2, iters, op), R, iters, rep.one_clock);
      const double bgbps = bt.median > 0 ? static_cast<double>(bytes) / bt.median / 1e3 : 0.0;
      j.add("baseline_time_us_median", bt.median, 1)
          .add("baseline_gbps", bgbps, 3)
          .add("speedup_vs_baseline", tm.median > 0 ? bt.median / tm.median : 0.0, 3)
          .add("baseline_verified", baseline_verified[op]);
      pp.baseline_gbps = bgbps;
    } else {
      j.add_null("baseline_time_us_median")
          .add_null("baseline_gbps")
          .add_null("speedup_vs_baseline")
          .add_null("baseline_verified");
    }
    if (rep.nodes > 1) {  // network bytes: dispatch rows one way, f32 partials the other (docs/internode.md)
      int64_t pairs = 0;
      for (int64_t p : rep.net_pairs) pairs += p;
      const int64_t net = pairs * (op == 0 ? ro.dispatch_row_bytes() : ro.hidden * 4);
      const double net_gbps = tm.median > 0 ? static_cast<double>(net) / tm.median / 1e3 : 0.0;
      j.add("nodes", rep.nodes)
          .add("network_bytes", net)
          .add("network_gbps", net_gbps, 3)
          .add("link_gbps", rep.link_gbps, 3)
          .add("ratio_to_link", rep.link_gbps > 0 ? net_gbps / rep.link_gbps : 0.0, 3);
    } else {
      j.add("nodes", 1)
          .add_null("network_bytes")
          .add_null("network_gbps")
          .add_null("link_gbps")
          .add_null("ratio_to_link");
    }
    j.add("verified", verified)
        .add("dispatch_input", shared_dispatch ? "shared" : "private")
        .add("combine_input", shared && combine_in_place ? "shared"
                              : o.copy_input             ? "copy"
                              : combine_in_place         ? "arena"
                                                         : "private")
        .add("segment_bytes", segment_bytes)
        .add("output_reserve_bytes", o.output_reserve)
        .add("first_iter_us", first_us, 1)
        .add("first_iter_ratio", tm.median > 0 ? first_us / tm.median : 0.0, 2)
        .add("peak_rss_mb", peak, 1)
        .add("peak_rss_mb_per_rank", rep.peak_rss_mb, 1)
        .add("pss_mb", pss, 1)
        .add("dispatch_rows", rows_how)
        .add("combine_shared_tokens", static_cast<double>(shared_tokens) / std::max(1, o.warmup + iters), 1);
    std::printf("%s\n", j.str().c_str());
    plot.push_back(pp);
  }
  std::fflush(stdout);
}

// epcomm's iterations of one order at one token count (its peak resident set from a fresh window).
OrderRun measure_epcomm(const BenchOptions& o, ReceiveOrder order, Buffer& buffer, Bootstrap& bs,
                        const Inputs& in, bool with_baseline, Progress& progress) {
  const RunOptions& ro = o.run;
  bs.barrier();
  reset_peak_rss();
  bs.barrier();
  OrderRun run = run_order(o, order, buffer, bs, in, with_baseline, progress);
  if (buffer.num_nodes() > 1) {
    const int L = ro.experts / ro.ranks, me = bs.rank();
    for (int64_t t = 0; t < ro.tokens; ++t) {
      std::vector<int> seen;
      for (int k = 0; k < ro.topk; ++k) {
        const int64_t e = in.routing.ids[t * ro.topk + k];
        if (e < 0) continue;
        const int n = buffer.node_of(static_cast<int>(e / L));
        if (n != buffer.node_of(me) && std::find(seen.begin(), seen.end(), n) == seen.end())
          seen.push_back(n);
      }
      run.net_pairs += static_cast<int64_t>(seen.size());
    }
  }
  return run;
}

// One line's memcpy limit of the same byte counts, and every rank's figures gathered.
OrderReport report_order(const BenchOptions& o, ReceiveOrder order, Buffer& buffer, Bootstrap& bs,
                         const OrderRun& run, bool with_baseline, Progress& progress) {
  const RunOptions& ro = o.run;
  OrderReport rep;
  rep.has_baseline = with_baseline;
  progress.phase(std::string(receive_order_name(order)) + ", " + std::to_string(ro.tokens) +
                 " tokens: memcpy of the same byte counts");
  rep.memcpy_gbps[0] = concurrent_memcpy_gbps(bs, run.dispatch_bytes, o.threads);
  rep.memcpy_gbps[1] = concurrent_memcpy_gbps(bs, run.combine_bytes, o.threads);
  rep.times = all_gather_values(bs, run.times);
  rep.starts = all_gather_values(bs, run.starts);
  if (rep.has_baseline) {
    rep.baseline_times = all_gather_values(bs, run.baseline_times);
    rep.baseline_starts = all_gather_values(bs, run.baseline_starts);
  }

  rep.counts = all_gather_values(
      bs,
      std::vector<int64_t>{run.rows, run.dispatch_bytes, run.combine_bytes, run.ok, run.baseline_dispatch_ok,
                           run.baseline_combine_ok, run.shared_input, run.shared_dispatch_input,
                           run.pushed_dispatch, run.combine_in_place, run.shared_tokens});
  rep.peak_rss_mb = all_gather_values(bs, std::vector<double>{run.peak_rss_mb});
  rep.pss_mb = all_gather_values(bs, std::vector<double>{run.pss_mb});
  rep.first_s = all_gather_values(bs, std::vector<double>{run.first_s[0], run.first_s[1]});
  rep.first_start = all_gather_values(bs, std::vector<double>{run.first_start[0], run.first_start[1]});
  rep.nodes = buffer.num_nodes();
  if (rep.nodes > 1) rep.net_pairs = all_gather_values(bs, std::vector<int64_t>{run.net_pairs});
  return rep;
}

std::string shape_title(const BenchOptions& o) {
  const RunOptions& ro = o.run;
  std::string t = "epcomm bench: " + std::to_string(ro.ranks) + " ranks (" + launcher_name(ro.launcher) +
                  "), hidden " + std::to_string(ro.hidden) + ", top-" + std::to_string(ro.topk) + " of " +
                  std::to_string(ro.experts) + " experts, " + dtype_name(ro.dtype);
  if (ro.quant) t += ", quant " + ro.quant_name();
  return t;
}

int bench_rank(BenchOptions o, std::unique_ptr<Bootstrap> bootstrap) {
  RunOptions& ro = o.run;
  auto group = Group::create(std::move(bootstrap));
  const int r = group->rank();
  Bootstrap& bs = group->bootstrap();
  Progress progress("epcomm bench", r == 0 && !ro.quiet);
  BufferOptions bo;
  bo.num_nvl_bytes = ro.num_nvl_bytes;
  bo.num_rdma_bytes = ro.num_rdma_bytes;
  bo.ranks_per_node = ro.ranks_per_node;
  bo.timeout_s = ro.timeout_s;
  if (o.shared_input) {  // room for the expert outputs of typical routing at the largest --tokens (+25%)
    const int64_t T = *std::max_element(o.tokens.begin(), o.tokens.end());
    const int64_t rows = std::max<int64_t>(T * ro.topk, 1);
    bo.num_combine_input_bytes =
        (rows + rows / 4 + 64) * ro.hidden * static_cast<int64_t>(dtype_size(ro.dtype));
  }
  if (o.output_reserve < 0) {  // auto: the outputs of one dispatch + combine at the largest --tokens (+2%)
    const int64_t T = *std::max_element(o.tokens.begin(), o.tokens.end());
    const int64_t rows = T * ro.topk + T * ro.topk / 50 + 64,
                  elem = static_cast<int64_t>(dtype_size(ro.dtype));
    o.output_reserve =
        rows * (std::max<int64_t>(ro.dispatch_row_bytes(), ro.hidden * elem) + ro.topk * 12 + 12) +
        T * (ro.hidden * elem + ro.topk * 4);
    if (o.cached) o.output_reserve += rows * ro.dispatch_row_bytes();  // the fresh dispatch's rows stay alive
  }
  bo.num_output_reserve_bytes = o.output_reserve;
  if (o.shared_dispatch_input)  // room for the largest --tokens
    bo.num_dispatch_input_bytes =
        std::max<int64_t>(*std::max_element(o.tokens.begin(), o.tokens.end()) * ro.hidden *
                              static_cast<int64_t>(dtype_size(ro.dtype)),
                          1);
  Buffer buffer(group, bo);
  // Ranks of one host read one steady clock: an iteration then runs from the last rank's call to the last
  // rank's return (span_over_ranks).
  const bool one_clock = one_host(group->hosts());
  double link_gbps = 0;  // internode: the raw put bandwidth of the same transport, all ranks at once, summed
  if (buffer.num_nodes() > 1) {
    progress.phase("raw UCX put bandwidth to the rail peers");
    // Three measurements, the best counts: the link is what the transport can do, and on shared machines
    // noise only ever lowers it (one measurement moved by 20% from run to run), so the ratio stays honest.
    for (int rep = 0; rep < 3; ++rep) {
      double sum = 0;
      for (double v : all_gather_values(bs, std::vector<double>{buffer.measure_link_gbps()})) sum += v;
      link_gbps = std::max(link_gbps, sum);
    }
  }
  if (r == 0 && !ro.quiet)
    if (const char* why = baseline_absent_reason(ro)) std::fprintf(stderr, "epcomm bench: %s\n", why);

  // Three phases, so that no reference measurement runs between two of epcomm's lines: (1) epcomm, every
  // token count and order; (2) under MPI, the baseline of each line; (3) the memcpy limit of each line, then
  // the lines. The baseline and the memcpy limit touch GBs of fresh memory, and on the development VM
  // epcomm's next call after that ran 3-25x slower (its memory as slow as fresh); epcomm's first call of a
  // line then measured the VM, not epcomm.
  struct Line {
    int64_t tokens;
    ReceiveOrder order;
    OrderRun run;
  };
  std::vector<Line> lines;
  const bool with_baseline = baseline_absent_reason(ro) == nullptr;
  for (int64_t T : o.tokens) {
    ro.tokens = T;
    progress.phase(std::to_string(T) + " tokens per rank: generating tokens and routing");
    const Inputs in = make_inputs(ro, r, buffer);
    for (ReceiveOrder order : o.orders)
      lines.push_back({T, order, measure_epcomm(o, order, buffer, bs, in, with_baseline, progress)});
  }
  if (with_baseline)
    for (int64_t T : o.tokens) {
      ro.tokens = T;
      progress.phase(std::to_string(T) + " tokens per rank: the same tokens and routing for the baseline");
      const Inputs in = make_inputs(ro, r, buffer);  // the same bits: they derive from --seed
      for (Line& l : lines)
        if (l.tokens == T) run_baseline(o, l.order, bs, in, buffer, l.run, progress);
    }
  bool all_ok = true;
  std::vector<PlotPoint> plot;
  for (const Line& l : lines) {
    ro.tokens = l.tokens;
    OrderReport rep = report_order(o, l.order, buffer, bs, l.run, with_baseline, progress);
    rep.link_gbps = link_gbps;
    rep.one_clock = one_clock;
    for (int s = 0; s < ro.ranks; ++s)
      all_ok = all_ok && rep.counts[s * kCounts + 3] == 1 && rep.counts[s * kCounts + 4] == 1 &&
               rep.counts[s * kCounts + 5] == 1;
    if (r == 0) print_lines(o, l.order, rep, buffer.num_nvl_bytes(), plot);
  }
  if (r == 0 && !o.plot.empty()) {
    write_bench_svg(o.plot, shape_title(o),
                    "GB/s = payload bytes / median time (last rank's call to last rank's return); memcpy: "
                    "every rank copies the "
                    "same bytes at once, " +
                        std::to_string(o.threads) + " thread(s) per rank; iters " + std::to_string(ro.iters) +
                        ", warmup " + std::to_string(o.warmup),
                    plot);
    progress.phase("wrote " + o.plot);
  }
  progress.phase("done");
  return all_ok ? kExitOk : kExitFail;
}

// `epcomm bench --quantizers`: quant_bench.h on this thread, one JSON line per algorithm and variant.
int run_quantizer_bench(const FlagParser& p) {
  for (const char* name : {"ranks", "experts", "topk", "order", "dtype", "seed", "quant", "num-nvl-bytes",
                           "num-rdma-bytes", "ranks-per-node", "launcher", "bind", "timeout", "warmup",
                           "bootstrap", "threads", "plot", "expert-alignment", "cached"})
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
  const std::vector<QuantBenchResult> results = run_quant_benchmark(rows, hidden, iters);
  progress.phase("done");
  for (const QuantBenchResult& res : results) {
    // Names are "<algo>", "<algo>.<variant>" or "<algo>.dequant" (quant_bench.h).
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
  const std::string api = take_api_flag(argc, argv);
  if (api == "distribute-v2") return run_bench_v2(argc, argv);
  if (api == "low-latency") return run_bench_ll(argc, argv);
  FlagParser p(
      "epcomm bench", "epcomm bench [flags]\n       mpirun -n R epcomm bench [flags]",
      "Times dispatch and combine between ranks on this host; prints one JSON object per line (rank 0,\n"
      "stdout) for each operation, receive order and token count. Progress lines go to stderr. Under\n"
      "mpirun (--bootstrap mpi, the default there) it also times the MPI_Alltoallv baseline. With\n"
      "--quantizers it benchmarks the block quantizers instead.");
  p.add(
      "api", "normal|distribute-v2|low-latency", "normal",
      "API family; distribute-v2 times dispatch_v2/combine_v2 instead (see 'epcomm bench --api distribute-v2 "
      "--help'), low-latency the decode calls (see 'epcomm bench --api low-latency --help')");
  add_run_flags(p, {2, 4096, 7168, 256, 8, 20, "", true});
  p.add("warmup", "N", "3", "untimed iterations before the timed ones");
  p.add("expert-alignment", "A", "1",
        "DispatchArgs::expert_alignment: expert_major blocks padded with PAD rows to a multiple of A");
  p.add("bootstrap", "auto|local|mpi", "auto",
        "local: start --ranks ranks here (--launcher); mpi: this process is one rank of mpirun's world "
        "(also times the MPI_Alltoallv baseline); auto: mpi when an MPI launcher started this process "
        "(OMPI_COMM_WORLD_SIZE, PMI_SIZE or PMIX_SIZE is set), else local");
  p.add("threads", "N", "0",
        "copy threads per rank: Config::num_threads of dispatch and combine, and the "
        "memcpy limit's threads; 0 = the library default (hardware threads / ranks)");
  p.add("plot", "FILE.svg", "", "also draw GB/s against tokens per rank (epcomm, baseline, memcpy) as SVG");
  p.add(
      "combine-input", "shared|private|copy", "private",
      "where combine's x (the expert outputs) lives: shared = Buffer::get_combine_input (the ranks of the "
      "holder's node that reduce the rows read them in place), private = the dispatched tensor itself (in "
      "the output arena: read in place too), copy = a fresh private copy of it, written untimed (its holders "
      "copy the rows)");
  p.add("dispatch-input", "shared|private", "private",
        "where dispatch's x (the tokens) lives: shared = Buffer::get_dispatch_input (written there once, "
        "untimed; receivers read the rows in place on one node, nothing is staged), private = an ordinary "
        "buffer (staged once per call)");
  p.add_switch(
      "cached",
      "time cached dispatch: each line first runs one fresh dispatch (untimed) and every timed dispatch "
      "passes its handle (DispatchArgs::handle: x only, the layout reused); combine uses that handle. Under "
      "MPI the baseline likewise plans once and then moves only the rows");
  p.add("output-reserve", "auto|B", "auto",
        "BufferOptions::num_output_reserve_bytes: output memory faulted in when the Buffer is created, so "
        "that the first call does not pay first-touch page faults; auto = the outputs of one dispatch and "
        "combine at the largest --tokens (+2% rows; with --cached also the fresh dispatch's rows), 0 = none");
  p.add_switch("quantizers", "time the block quantizers instead of dispatch and combine (see below)");
  p.set_epilog(kBenchEpilog);
  if (!p.parse(argc, argv)) {
    std::fputs(p.help().c_str(), stdout);
    return kExitOk;
  }
  if (p.on("quantizers")) return run_quantizer_bench(p);
  const std::string boot = p.choice("bootstrap", {"auto", "local", "mpi"});
  const bool mpi = boot == "mpi" || (boot == "auto" && mpi_launched_world_size() > 0);
  if (mpi && p.given("launcher"))
    throw UsageError("--launcher: does not apply with --bootstrap mpi (mpirun starts the ranks)");
  if (mpi && p.given("bind"))
    throw UsageError("--bind: does not apply with --bootstrap mpi (mpirun binds the ranks: --bind-to core)");
  BenchOptions o;
  o.tokens = p.integer_list("tokens", 0, int64_t{1} << 30);
  o.warmup = static_cast<int>(p.integer("warmup", 0, 1000000));
  const int64_t alignment = p.integer("expert-alignment", 1, int64_t{1} << 20);
  o.threads_flag = static_cast<int>(p.integer("threads", 0, 1024));
  o.plot = p.str("plot");
  const std::string combine_in = p.choice("combine-input", {"shared", "private", "copy"});
  o.shared_input = combine_in == "shared";
  o.copy_input = combine_in == "copy";
  o.shared_dispatch_input = p.choice("dispatch-input", {"shared", "private"}) == "shared";
  o.cached = p.on("cached");
  if (p.str("output-reserve") != "auto") o.output_reserve = p.bytes("output-reserve");
  if (!o.plot.empty() && !std::ofstream(o.plot, std::ios::trunc))  // fail now, not after the run
    throw UsageError(bad_value("plot", "a file name that can be written", o.plot));
  if (!mpi) {
    o.run = read_run_flags(p, {std::nullopt, true});
    o.run.expert_alignment = alignment;
    o.threads = resolve_threads(o.threads_flag, o.run.ranks);
    o.orders = o.run.order ? std::vector<ReceiveOrder>{*o.run.order}
                           : std::vector<ReceiveOrder>{ReceiveOrder::expert_major, ReceiveOrder::rank_major};
    return run_ranks("epcomm bench", o.run,
                     [&](std::unique_ptr<Bootstrap> bs) { return bench_rank(o, std::move(bs)); });
  }
  // One rank per MPI process: the world decides the rank count; a usage error is printed by rank 0 only.
  const double timeout_s = p.given("timeout") ? p.seconds("timeout") : 100.0;
  std::unique_ptr<Bootstrap> bs =
      make_world_bootstrap(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
  const int world = bs->size(), rank = bs->rank();
  try {
    if (p.given("ranks") && p.integer("ranks", 1, 1024) != world)
      throw UsageError(bad_value(
          "ranks", "the MPI world size " + std::to_string(world) + " with --bootstrap mpi (or leave it out)",
          p.str("ranks")));
    o.run = read_run_flags(p, {world, true});
  } catch (const UsageError& e) {
    if (rank == 0) std::fprintf(stderr, "epcomm bench: %s\n", e.what());
    return kExitUsage;
  }
  o.run.launcher = Launcher::mpi;
  o.run.expert_alignment = alignment;
  o.threads = resolve_threads(o.threads_flag, o.run.ranks);
  o.orders = o.run.order ? std::vector<ReceiveOrder>{*o.run.order}
                         : std::vector<ReceiveOrder>{ReceiveOrder::expert_major, ReceiveOrder::rank_major};
  return run_this_rank("epcomm bench", std::move(bs),
                       [&](std::unique_ptr<Bootstrap> b) { return bench_rank(o, std::move(b)); });
}

}  // namespace epcomm::cli
