// tools/epcomm/bench_v2.cc — `epcomm bench --api distribute-v2`: times dispatch_v2 and combine_v2 in the
// decode shape over local ranks and prints one JSON object per operation and rank count (rank 0, stdout).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "bench_measure.h"
#include "epcomm/moe/distribute_v2.h"
#include "flags.h"
#include "numerics.h"
#include "quant/block.h"
#include "rank_tools.h"
#include "report.h"
#include "run_options.h"
#include "subcommands.h"
#include "v2_flags.h"

namespace epcomm::cli {
namespace {

const char* kEpilog =
    "Each rank holds --tokens tokens of random values routed to --topk distinct experts drawn uniformly\n"
    "(weights uniform in [0.05, 1)); with --shared-expert-ranks > 0 those ranks serve one shared expert.\n"
    "For each rank count it runs --warmup untimed and --iters timed iterations of dispatch_v2, then of\n"
    "combine_v2 (expert outputs = the dispatched rows, dequantized once). Outputs go to caller buffers\n"
    "allocated once (no zero-fill inside the timed calls): the first call's outputs, which lie in the\n"
    "group's output arena with --outputs arena (one node; the senders write rows straight into them) and\n"
    "in private memory with --outputs private (rows staged and pulled). A bootstrap barrier precedes every\n"
    "timed call;\n"
    "an iteration's time runs from the last rank's call to the last rank's return (timing: span; ranks on\n"
    "several hosts: the slowest rank's own time, timing: slowest_rank), as in `epcomm bench --help`. The "
    "first iteration is checked outside the timings: every\n"
    "rank's row count equals the selections routed to it, and combine returns x·Σw (+ x per shared expert)\n"
    "within calc_diff < 3e-3 (quantized) or 1e-5.\n\n"
    "Output: one JSON object per line, fields api, op, ranks, tokens, hidden, topk, experts,\n"
    "shared_expert_ranks, dtype, quant_mode, comm_quant_mode, outputs (arena: every rank's outputs lay in\n"
    "its output arena, so dispatch_v2 pushed; private: staged pull), combine_input (arena: origins read\n"
    "the expert outputs in place; private: copied into windows), output_reserve_bytes, launcher, iters,\n"
    "warmup, selections,\n"
    "row_bytes, bytes_per_rank, time_us_median, time_us_min, time_us_p99, time_us_max, first_iter_ratio\n"
    "(the group's first call, before the warm-up, timed as the others, over the median), p99_ratio,\n"
    "timing,\n"
    "rank_time_us_median, start_skew_us_median, gbps_per_rank,\n"
    "gbps, memcpy_gbps, ratio_to_memcpy, verified, segment_bytes, nodes, network_bytes, network_gbps.\n\n"
    "Byte formula (as the accelerator libraries count it, per (token, expert) selection):\n"
    "  selections     = tokens x topk (each rank's own tokens; shared experts not counted)\n"
    "  dispatch bytes = selections x row_bytes, row_bytes = H x elem of expand_x + scale bytes per row\n"
    "  combine bytes  = selections x H x 2 (bf16/fp16 rows; comm_quant_mode 2 still counts 2 bytes)\n"
    "  gbps_per_rank  = bytes_per_rank / time_us_median / 1e3;  gbps = ranks x gbps_per_rank\n"
    "  memcpy_gbps: every rank memcpy's its bytes_per_rank of the line at once, aggregate bytes / slowest\n"
    "  time, median of 5, the better of two blocks with fresh buffers (the other benches' measurement);\n"
    "  ratio_to_memcpy = gbps / memcpy_gbps.\n"
    "Across nodes (--ranks-per-node P, or EPCOMM_RANKS_PER_NODE; set UCX_TLS=tcp on one host):\n"
    "  nodes: nodes the group spans; network_bytes: bytes all ranks handed to the network in one call\n"
    "  (rows, metadata, signals; mean of the timed calls); network_gbps = network_bytes / time_us_median / "
    "1e3.\n\n"
    "Exit status: 0 when every check passed, 1 when one failed or a runtime error, 2 a usage error.\n";

struct V2BenchOptions {
  std::vector<int> ranks;
  int64_t tokens = 128, hidden = 7168;
  int topk = 8, experts = 256, shared_ranks = 0, quant_mode = 2, comm_quant = 0, iters = 20, warmup = 3;
  DType dtype = DType::bf16;
  uint64_t seed = 1;
  int64_t segment_bytes = 0;
  int ranks_per_node = 0;         // 0: EPCOMM_RANKS_PER_NODE, else one node per host
  int64_t num_rdma_bytes = 0;     // across nodes: lanes per rank (0 = 64 MiB)
  bool arena = true;              // --outputs arena: the group context's output arena
  bool combine_in_arena = false;  // --combine-input arena: the expert outputs from moe::output_buffer
  int64_t output_reserve = -1;  // --output-reserve: GroupContextOptions::num_output_reserve_bytes; -1 = auto
  LaunchFlags launch;
};

size_t scale_bytes_of(int mode, int64_t H) {
  switch (mode) {
    case 2:
      return 4;
    case 3:
      return 4 * static_cast<size_t>((H + 127) / 128);
    case 4:
      return static_cast<size_t>(((H + 31) / 32 + 1) / 2 * 2);
    default:
      return 0;
  }
}

// --output-reserve auto: what one iteration keeps in the arena, at most W·T·K rows of expand_x and its
// scales (T·A <= that) and, with --combine-input arena, as many expert-output rows; +2% and a page.
int64_t reserve_bytes(const V2BenchOptions& o, int W) {
  if (o.output_reserve >= 0) return o.output_reserve;
  const int64_t rows = static_cast<int64_t>(W) * o.tokens * o.topk;
  const int64_t elem = o.quant_mode == 0 ? static_cast<int64_t>(dtype_size(o.dtype)) : 1;
  int64_t bytes = rows * (o.hidden * elem + static_cast<int64_t>(scale_bytes_of(o.quant_mode, o.hidden)));
  if (o.combine_in_arena) bytes += rows * o.hidden * 2;
  return bytes + bytes / 50 + 4096;
}

// Token t's experts on rank r: topk distinct MoE experts, uniform, from the seed.
std::vector<int32_t> routing_of(const V2BenchOptions& o, int r) {
  return uniform_routing(o.seed, r, o.tokens, o.topk, o.experts);
}

// Row i of expand_x dequantized to fp32 (docs/quant.md).
void dequant_row(const V2BenchOptions& o, const moe::DispatchV2Result& d, int64_t i, float* out) {
  const int64_t H = o.hidden;
  const uint8_t* q =
      d.expand_x.data_as<uint8_t>() + i * H * static_cast<int64_t>(dtype_size(d.expand_x.dtype()));
  switch (o.quant_mode) {
    case 0:
      load_row(o.dtype, q, H, out);
      return;
    case 1:
      for (int64_t h = 0; h < H; ++h) out[h] = static_cast<float>(reinterpret_cast<const int8_t*>(q)[h]);
      return;
    case 2:
      quant::dequant_int8_per_token(reinterpret_cast<const int8_t*>(q), d.dynamic_scales.data_as<float>()[i],
                                    H, out);
      return;
    case 3:
      quant::dequant_fp8_per_group128(quant::Fp8Format::e4m3, q,
                                      d.dynamic_scales.data_as<float>() + i * d.dynamic_scales.size(1), H,
                                      out);
      return;
    case 4:
      quant::dequant_mx(quant::MxElem::e4m3, q,
                        d.dynamic_scales.data_as<uint8_t>() + i * d.dynamic_scales.size(1), H, out);
      return;
  }
}

struct Counts {
  int64_t rows = 0, ok = 1;
};

int bench_rank_v2(const V2BenchOptions& o, int W, std::unique_ptr<Bootstrap> bootstrap) {
  auto group = Group::create(std::move(bootstrap));
  const int r = group->rank();
  Bootstrap& bs = group->bootstrap();
  Progress progress("epcomm bench", r == 0 && !o.launch.quiet);
  moe::GroupContextOptions co;
  co.segment_bytes = o.segment_bytes;
  co.timeout_s = o.launch.timeout_s;
  co.ranks_per_node = o.ranks_per_node;
  co.num_rdma_bytes = o.num_rdma_bytes;
  if (!o.arena) co.num_output_arena_bytes = 0;
  co.num_output_reserve_bytes = o.arena ? reserve_bytes(o, W) : 0;
  moe::init_group_context(*group, co);
  const int nodes = moe::group_num_nodes(*group);
  const int64_t T = o.tokens, H = o.hidden;
  const int K = o.topk;
  progress.phase("generating tokens and routing");
  const size_t row = static_cast<size_t>(H) * dtype_size(o.dtype);
  std::vector<std::byte> x(static_cast<size_t>(T) * row);
  for (int64_t t = 0; t < T; ++t) make_token(o.seed, r, t, H, o.dtype, x.data() + t * row);
  std::vector<int32_t> ids = routing_of(o, r);
  RandomStream ws(o.seed, StreamKind::weights, static_cast<uint64_t>(r));
  std::vector<float> weights(static_cast<size_t>(T * K));
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = 0.525f + 0.475f * ws.uniform(i);

  moe::DispatchV2Args a;
  a.x = Tensor::wrap(x.data(), o.dtype, {T, H});
  a.expert_ids = Tensor::wrap(ids.data(), DType::i32, {T, K});
  a.group_ep = "ep";
  a.ep_world_size = W;
  a.ep_rank_id = r;
  a.moe_expert_num = o.experts;
  a.shared_expert_num = o.shared_ranks > 0 ? 1 : 0;
  a.shared_expert_rank_num = o.shared_ranks;
  a.quant_mode = o.quant_mode;
  // Caller buffers, allocated once: the first call returns zero-filled outputs we keep reusing.
  moe::DispatchV2Result d = moe::dispatch_v2(*group, nullptr, a);
  a.expand_x_out = d.expand_x;
  a.dynamic_scales_out = d.dynamic_scales;
  a.assist_info_for_combine_out = d.assist_info_for_combine;
  a.expert_token_nums_out = d.expert_token_nums;
  a.ep_recv_counts_out = d.ep_recv_counts;
  a.tp_recv_counts_out = d.tp_recv_counts;
  a.expand_scales_out = d.expand_scales;

  // Expert outputs: the dispatched rows, dequantized once.
  const int64_t n_own = d.ep_recv_counts.data_as<int32_t>()[d.ep_recv_counts.numel() - 1];
  // Combine reads only the first n_own rows.
  Tensor experts_out =
      o.combine_in_arena ? moe::output_buffer(*group, o.dtype, {n_own, H}) : empty(o.dtype, {n_own, H});
  std::memset(experts_out.data(), 0, experts_out.nbytes());
  std::vector<float> f(static_cast<size_t>(H));
  for (int64_t i = 0; i < n_own; ++i) {
    dequant_row(o, d, i, f.data());
    store_row(o.dtype, f.data(), H, experts_out.data_as<std::byte>() + i * row);
  }
  moe::CombineV2Args c;
  c.expand_x = experts_out;
  c.expert_ids = a.expert_ids;
  c.assist_info_for_combine = d.assist_info_for_combine;
  c.ep_send_counts = d.ep_recv_counts;
  std::vector<float> w = weights;
  c.expert_scales = Tensor::wrap(w.data(), DType::f32, {T, K});
  c.group_ep = "ep";
  c.ep_world_size = W;
  c.ep_rank_id = r;
  c.moe_expert_num = o.experts;
  c.shared_expert_num = a.shared_expert_num;
  c.shared_expert_rank_num = o.shared_ranks;
  c.comm_quant_mode = o.comm_quant;
  // The caller's output buffer, reused by every call as a serving loop reuses it: its first-touch page
  // faults belong to its allocation, not to the first combine_v2 (first_iter_ratio).
  c.x_out = empty(o.dtype, {T, H});
  std::memset(c.x_out->data(), 0, c.x_out->nbytes());

  // The byte formula of --help, per operation (dispatch, combine): what each rank's calls count.
  const int64_t selections = T * K;
  const int64_t elem = o.quant_mode == 0 ? static_cast<int64_t>(dtype_size(o.dtype)) : 1;
  const int64_t row_bytes_of[2] = {H * elem + static_cast<int64_t>(scale_bytes_of(o.quant_mode, H)), H * 2};
  progress.phase("measuring the memcpy rate");
  // The same bytes per rank as each operation counts, one thread (the other benches' reference).
  const double mgbps_of[2] = {concurrent_memcpy_gbps(bs, selections * row_bytes_of[0], 1),
                              concurrent_memcpy_gbps(bs, selections * row_bytes_of[1], 1)};
  progress.phase(std::to_string(o.warmup) + " warmup + " + std::to_string(o.iters) + " timed iterations");
  std::vector<double> times(static_cast<size_t>(2 * o.iters), 0.0), starts = times;
  std::vector<double> net(2,
                          0.0);  // bytes this rank handed to the network per timed call (dispatch, combine)
  Counts counts;
  // This rank's time in the group's first dispatch_v2 and combine_v2, then when each began.
  std::vector<double> first(4, 0.0);
  for (int it = -o.warmup; it < o.iters; ++it) {
    bs.barrier();
    const int64_t n0 = moe::group_network_counters(*group).network_bytes;
    const double t0d = now_s();
    moe::dispatch_v2(*group, nullptr, a);
    const double td = now_s() - t0d;
    const int64_t n1 = moe::group_network_counters(*group).network_bytes;
    bs.barrier();
    const double t0c = now_s();
    Tensor y = moe::combine_v2(*group, nullptr, c);
    const double tc = now_s() - t0c;
    const int64_t n2 = moe::group_network_counters(*group).network_bytes;
    if (it >= 0) {
      times[it] = td;
      times[o.iters + it] = tc;
      starts[it] = t0d;
      starts[o.iters + it] = t0c;
      net[0] += static_cast<double>(n1 - n0) / o.iters;
      net[1] += static_cast<double>(n2 - n1) / o.iters;
    }
    if (it == -o.warmup) {  // checked once, outside the timings
      first = {td, tc, t0d, t0c};
      counts.rows = n_own;
      int64_t expected = 0;  // selections routed to this rank
      const int L = o.experts / (W - o.shared_ranks);
      for (int s = 0; s < W; ++s) {
        if (r < o.shared_ranks) {
          if (s % o.shared_ranks == r % o.shared_ranks) expected += T;
          continue;
        }
        for (int32_t e : routing_of(o, s)) expected += o.shared_ranks + e / L == r;
      }
      double num = 0, den = 0;
      for (int64_t t = 0; t < T; ++t) {
        double wsum = 0;
        for (int k = 0; k < K; ++k) wsum += weights[t * K + k];
        if (o.shared_ranks > 0) wsum += 1.0;
        for (int64_t h = 0; h < H; ++h) {
          const double xv = load_elem(o.dtype, x.data(), t * H + h);
          const double av = load_elem(o.dtype, y.data(), t * H + h) + 1, bv = xv * wsum + 1;
          num += av * bv;
          den += av * av + bv * bv;
        }
      }
      const double diff = den > 0 ? 1 - 2 * num / den : 0;
      const double limit = o.quant_mode == 0 && o.comm_quant == 0 ? 1e-5 : 3e-3;
      if (expected != n_own || !(diff < limit)) {
        std::fprintf(stderr,
                     "epcomm bench: distribute-v2 verification failed on rank %d: rows %lld (expected %lld), "
                     "calc_diff %.3g (limit %.3g)\n",
                     r, static_cast<long long>(n_own), static_cast<long long>(expected), diff, limit);
        counts.ok = 0;
      }
    }
  }
  const auto all_times = all_gather_values(bs, times);
  const auto all_starts = all_gather_values(bs, starts);
  const bool one_clock = one_host(group->hosts());
  const auto all_net = all_gather_values(bs, net);
  const auto all_first = all_gather_values(bs, first);
  const moe::GroupCopyCounters copies = moe::group_copy_counters(*group);
  const auto all_counts =
      all_gather_values(bs, std::vector<int64_t>{counts.rows, counts.ok, copies.dispatch_staged_tokens,
                                                 copies.dispatch_pushed_tokens, copies.combine_copied_rows,
                                                 copies.combine_in_place_rows});
  bool verified = true, pushed = false, staged = false;
  for (int s = 0; s < W; ++s) {
    verified = verified && all_counts[6 * s + 1] == 1;
    staged = staged || all_counts[6 * s + 2] > 0;
    pushed = pushed || all_counts[6 * s + 3] > 0;
  }
  pushed = pushed && !staged;  // every call pushed
  bool in_place = false, copied = false;
  for (int s = 0; s < W; ++s) {
    copied = copied || all_counts[6 * s + 4] > 0;
    in_place = in_place || all_counts[6 * s + 5] > 0;
  }
  in_place = in_place && !copied;  // every combine read the rows in place
  if (r == 0) {
    for (int op = 0; op < 2; ++op) {
      const Timing tm = collective_timing(op_slice(all_starts, W, 2, o.iters, op),
                                          op_slice(all_times, W, 2, o.iters, op), W, o.iters, one_clock);
      const int64_t row_bytes = row_bytes_of[op];
      const int64_t bytes = selections * row_bytes;
      const double mgbps = mgbps_of[op];
      const double med = tm.median;
      const double per = med > 0 ? static_cast<double>(bytes) / med / 1e3 : 0.0;
      double net_bytes = 0;                           // all ranks, one call
      std::vector<double> first_starts, first_times;  // the group's first call, timed as the others
      for (int s = 0; s < W; ++s) {
        net_bytes += all_net[2 * static_cast<size_t>(s) + op];
        first_times.push_back(all_first[4 * static_cast<size_t>(s) + op]);
        first_starts.push_back(all_first[4 * static_cast<size_t>(s) + 2 + op]);
      }
      const double first_us = collective_timing(first_starts, first_times, W, 1, one_clock).median;
      JsonLine j;
      j.add("api", "distribute-v2")
          .add("op", op == 0 ? "dispatch_v2" : "combine_v2")
          .add("ranks", W)
          .add("tokens", T)
          .add("hidden", H)
          .add("topk", K)
          .add("experts", o.experts)
          .add("shared_expert_ranks", o.shared_ranks)
          .add("dtype", dtype_name(o.dtype))
          .add("quant_mode", o.quant_mode)
          .add("comm_quant_mode", o.comm_quant)
          .add("outputs", pushed ? "arena" : "private")
          .add("combine_input", in_place ? "arena" : "private")
          .add("output_reserve_bytes", o.arena ? reserve_bytes(o, W) : 0)
          .add("launcher", o.launch.launcher == Launcher::fork ? "fork" : "threads")
          .add("bind", ranks_bind_name())
          .add("iters", o.iters)
          .add("warmup", o.warmup)
          .add("selections", selections)
          .add("row_bytes", row_bytes)
          .add("bytes_per_rank", bytes)
          .add("time_us_median", med, 1)
          .add("time_us_min", tm.min, 1)
          .add("time_us_p99", tm.p99, 1)
          .add("time_us_max", tm.max, 1)
          .add("first_iter_ratio", med > 0 ? first_us / med : 0.0, 2)
          .add("p99_ratio", med > 0 ? tm.p99 / med : 0.0, 2)
          .add("timing", one_clock ? "span" : "slowest_rank")
          .add("rank_time_us_median", tm.rank_median, 1)
          .add("start_skew_us_median", tm.skew_median, 1)
          .add("gbps_per_rank", per, 3)
          .add("gbps", per * W, 3)
          .add("memcpy_gbps", mgbps, 3)
          .add("ratio_to_memcpy", mgbps > 0 ? per * W / mgbps : 0.0, 4)
          .add("verified", verified)
          .add("segment_bytes", o.segment_bytes ? o.segment_bytes : int64_t{64} << 20)
          .add("nodes", nodes)
          .add("network_bytes", static_cast<int64_t>(net_bytes))
          .add("network_gbps", med > 0 ? net_bytes / med / 1e3 : 0.0, 3);
      std::printf("%s\n", j.str().c_str());
    }
    std::fflush(stdout);
  }
  progress.phase("done");
  return verified ? kExitOk : kExitFail;
}

}  // namespace

int run_bench_v2(int argc, char** argv) {
  FlagParser p(
      "epcomm bench --api distribute-v2", "epcomm bench --api distribute-v2 [flags]",
      "Times dispatch_v2 and combine_v2 (docs/distribute-v2.md) between local ranks in the decode shape;\n"
      "prints one JSON object per line (rank 0, stdout) per operation and rank count.");
  p.add("api", "NAME", "normal", "distribute-v2 selects this benchmark (removed before parsing)");
  p.add("ranks", "N[,N...]", "2,4,8", "rank counts to run, one after the other");
  p.add("tokens", "T", "128", "tokens per rank (Bs)");
  p.add("hidden", "H", "7168", "hidden size");
  p.add("topk", "K", "8", "experts per token");
  p.add("experts", "E", "256", "MoE experts (a multiple of ranks - shared-expert-ranks)");
  p.add("shared-expert-ranks", "N", "0", "shared-expert ranks (one shared expert, N replicas)");
  add_v2_quant_flag(p, "2",
                    "dispatch quant_mode: 0|none, 2|int8 (per-token int8), 3 (per-group-128 fp8 e4m3), "
                    "4|mx_fp8_e4m3 (MXFP8 e4m3); not 1 (static int8 needs a scales input)");
  p.add("comm-quant-mode", "M", "0", "combine comm_quant_mode 0 or 2");
  p.add("dtype", "bf16|f16", "bf16", "token dtype");
  p.add("iters", "N", "20", "timed iterations");
  p.add("warmup", "N", "3", "untimed iterations before the timed ones");
  p.add("seed", "S", "1", "random seed");
  add_v2_segment_flag(p, "64M");
  p.add("ranks-per-node", "P", "0",
        "split the ranks into nodes of P that talk over UCX (virtual nodes; 0: EPCOMM_RANKS_PER_NODE, else "
        "by host)");
  p.add("num-rdma-bytes", "BYTES", "64M", "across nodes: lanes per rank (K, M, G suffixes)");
  p.add("outputs", "arena|private", "arena",
        "where the outputs live: arena = the group's output arena (GroupContextOptions::"
        "num_output_arena_bytes, one node: dispatch_v2 writes rows straight into the receivers' outputs), "
        "private = none (rows staged and pulled)");
  p.add("combine-input", "arena|private", "private",
        "where combine_v2's expand_x (the expert outputs) lives: arena = moe::output_buffer (one node, with "
        "--outputs arena: the origins read every row in place), private = ordinary memory (rows copied into "
        "the origins' windows)");
  p.add(
      "output-reserve", "auto|B", "auto",
      "GroupContextOptions::num_output_reserve_bytes (K/M/G suffixes): arena memory faulted in on every rank "
      "when the group is created, so that the first call's rows land on pages that exist; auto = the outputs "
      "of one iteration (expand_x and its scales, and the expert outputs with --combine-input arena), +2%; "
      "0 = none");
  add_launch_flags(p);
  p.set_epilog(kEpilog);
  if (!p.parse(argc, argv)) {
    std::fputs(p.help().c_str(), stdout);
    return kExitOk;
  }
  V2BenchOptions o;
  o.ranks = parse_rank_counts(p.str("ranks"));
  o.tokens = p.integer("tokens", 0, 1 << 20);
  o.hidden = p.integer("hidden", 1, 1 << 20);
  o.topk = static_cast<int>(p.integer("topk", 1, 1024));
  o.experts = static_cast<int>(p.integer("experts", 1, 16000));
  o.shared_ranks = static_cast<int>(p.integer("shared-expert-ranks", 0, 1023));
  o.quant_mode = v2_quant_mode(p, {0, 2, 3, 4}, "0, 2, 3 or 4 (mode 1 needs scales)");
  o.comm_quant = static_cast<int>(p.integer("comm-quant-mode", 0, 2));
  if (o.comm_quant == 1) throw UsageError(bad_value("comm-quant-mode", "0 or 2", "1"));
  o.dtype = p.choice("dtype", {"bf16", "f16"}) == "bf16" ? DType::bf16 : DType::f16;
  o.iters = static_cast<int>(p.integer("iters", 1, 1000000));
  o.warmup = static_cast<int>(p.integer("warmup", 0, 1000000));
  o.seed = static_cast<uint64_t>(p.integer("seed", 0, INT64_MAX));
  o.segment_bytes = p.given("num-nvl-bytes") ? p.bytes("num-nvl-bytes") : 0;
  o.ranks_per_node = static_cast<int>(p.integer("ranks-per-node", 0, 1024));
  o.num_rdma_bytes = p.given("num-rdma-bytes") ? p.bytes("num-rdma-bytes") : 0;
  o.arena = p.choice("outputs", {"arena", "private"}) == "arena";
  o.combine_in_arena = p.choice("combine-input", {"arena", "private"}) == "arena";
  if (p.str("output-reserve") != "auto") o.output_reserve = p.bytes("output-reserve");
  o.launch = read_launch_flags(p);
  if (o.topk > o.experts) throw UsageError(bad_value("topk", "<= experts", std::to_string(o.topk)));
  for (int W : o.ranks) {
    if (o.shared_ranks >= W || o.experts % (W - o.shared_ranks) != 0)
      throw UsageError("--experts " + std::to_string(o.experts) +
                       " must be a multiple of ranks - shared-expert-ranks = " +
                       std::to_string(W - o.shared_ranks) + " (ranks " + std::to_string(W) + ")");
    if (o.ranks_per_node > 0 && W % o.ranks_per_node != 0)
      throw UsageError("--ranks-per-node " + std::to_string(o.ranks_per_node) + " must divide --ranks " +
                       std::to_string(W));
  }
  int status = kExitOk;
  for (int W : o.ranks) {
    const RunOptions ro = launch_options(o.launch, W);
    const int s = run_ranks("epcomm bench", ro, [&](std::unique_ptr<Bootstrap> bs) {
      return bench_rank_v2(o, W, std::move(bs));
    });
    status = std::max(status, s);
  }
  return status;
}

}  // namespace epcomm::cli
