// tools/epcomm/run_options.cc — shared flags of demo and bench, and the rank launcher with its exit rules.
// Cross-flag checks (E % R, K <= E, quant vs dtype) happen here, before any rank starts.
#include "run_options.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "epcomm/error.h"
#include "epcomm/launch.h"
#include "quant/row.h"

namespace epcomm::cli {

namespace {

const QuantMode kQuantModes[] = {QuantMode::bf16,
                                 QuantMode::int8,
                                 QuantMode::pertoken_fp8_e4m3,
                                 QuantMode::pergroup_fp8_e4m3,
                                 QuantMode::mx_fp8_e4m3,
                                 QuantMode::mx_fp8_e5m2,
                                 QuantMode::mx_fp4_e2m1};

DType parse_dtype(const FlagParser& p) {
  std::string d = p.choice("dtype", {"bf16", "f16", "f32"});
  return d == "bf16" ? DType::bf16 : d == "f16" ? DType::f16 : DType::f32;
}

std::optional<QuantMode> parse_quant(const FlagParser& p) {
  if (!p.given("quant")) return std::nullopt;
  std::vector<std::string> names;
  for (QuantMode m : kQuantModes) names.push_back(quant_mode_name(m));
  std::string name = p.choice("quant", names);
  for (QuantMode m : kQuantModes)
    if (name == quant_mode_name(m)) return m;
  return std::nullopt;
}

}  // namespace

int64_t RunOptions::dispatch_row_bytes() const {
  if (quantizes())
    return static_cast<int64_t>(quant::row_data_bytes(*quant, hidden) +
                                quant::row_scale_bytes(*quant, hidden));
  return hidden * static_cast<int64_t>(dtype_size(dtype));
}

void add_run_flags(FlagParser& p, const RunDefaults& d) {
  p.add("ranks", "R", std::to_string(d.ranks), "number of local ranks (processes or threads)");
  p.add("tokens", d.token_list ? "T[,T...]" : "T", std::to_string(d.tokens),
        d.token_list ? "tokens per rank; a comma-separated list measures each (e.g. 256,1024,4096,16384)"
                     : "tokens per rank");
  p.add("hidden", "H", std::to_string(d.hidden), "hidden size (elements per token row)");
  p.add("experts", "E", std::to_string(d.experts), "number of experts (a multiple of --ranks)");
  p.add("topk", "K", std::to_string(d.topk), "experts per token (<= --experts)");
  p.add("order", "expert_major|rank_major", d.order,
        std::string("receive order of dispatch (docs/normal-mode.md)") +
            (d.order.empty() ? " (default: both, one after the other)" : ""));
  p.add("dtype", "bf16|f16|f32", "bf16", "element type of the tokens and of the expert outputs");
  p.add("seed", "S", "1", "seed of every generated input (equal on all ranks)");
  p.add("iters", "N", std::to_string(d.iters), "timed iterations of dispatch and combine");
  p.add("quant", "MODE", "",
        "DispatchArgs::quant_mode: bf16|int8|pertoken_fp8_e4m3|pergroup_fp8_e4m3|"
        "mx_fp8_e4m3|mx_fp8_e5m2|mx_fp4_e2m1 (default: none, rows copied as they are)");
  p.add("num-nvl-bytes", "B", "0", "shared-memory segment per rank, K/M/G suffixes allowed; 0 = 64 MiB");
  p.add(
      "ranks-per-node", "P", "0",
      "node partition: P > 0 makes nodes of P consecutive ranks, which talk over UCX only (virtual nodes on "
      "one host; set UCX_TLS=tcp to force TCP); 0 = EPCOMM_RANKS_PER_NODE, else one node per host");
  p.add("num-rdma-bytes", "B", "0", "internode staging memory per rank (one lane per node); 0 = 64 MiB");
  add_launch_flags(p);
}

void add_launch_flags(FlagParser& p) {
  p.add("launcher", "fork|threads", "fork", "ranks as forked processes (real shared memory) or threads");
  p.add("timeout", "SECONDS", "", "deadline of every wait on a peer (default: EPCOMM_TIMEOUT_S, else 100)");
  p.add_switch("quiet", "no progress lines on stderr");
  p.add("bind", "cores|none", "cores",
        "cores: when the CPUs this process may use are at least as many as the ranks, each rank (and its "
        "copy threads) runs on its own equal share of them, as mpirun --bind-to core; none: where the "
        "kernel puts them (ranks that share a CPU wait on each other through the scheduler)");
}

static bool g_ranks_bound = false;  // run_ranks: whether the ranks of this job are bound (ranks_bind_name)

const char* ranks_bind_name() {
  return g_ranks_bound ? "cores" : "none";
}

// The launch flags' part of RunOptions.
void apply_launch_flags(const LaunchFlags& launch, RunOptions& o) {
  o.launcher = launch.launcher;
  o.timeout_s = launch.timeout_s;
  o.quiet = launch.quiet;
  o.bind = launch.bind;
}

LaunchFlags read_launch_flags(const FlagParser& p) {
  LaunchFlags l;
  l.launcher = p.choice("launcher", {"fork", "threads"}) == "fork" ? Launcher::fork : Launcher::threads;
  if (p.given("timeout")) l.timeout_s = p.seconds("timeout");
  l.quiet = p.on("quiet");
  l.bind = p.choice("bind", {"cores", "none"}) == "cores" ? LaunchBind::cores : LaunchBind::none;
  return l;
}

RunOptions launch_options(const LaunchFlags& launch, int ranks) {
  RunOptions o;
  o.ranks = ranks;
  apply_launch_flags(launch, o);
  return o;
}

RunOptions read_run_flags(const FlagParser& p, const RunFlagRules& rules) {
  RunOptions o;
  o.ranks = rules.ranks ? *rules.ranks : static_cast<int>(p.integer("ranks", 1, 1024));
  o.tokens = rules.token_list ? p.integer_list("tokens", 0, int64_t{1} << 30).front()
                              : p.integer("tokens", 0, int64_t{1} << 30);
  o.hidden = p.integer("hidden", 1, int64_t{1} << 24);
  o.experts = static_cast<int>(p.integer("experts", 1, 1 << 20));
  o.topk = static_cast<int>(p.integer("topk", 1, 1024));
  if (o.experts % o.ranks != 0)
    throw UsageError(bad_value("experts", "a multiple of --ranks (" + std::to_string(o.ranks) + ")",
                               std::to_string(o.experts)));
  if (o.topk > o.experts)
    throw UsageError(
        bad_value("topk", "at most --experts (" + std::to_string(o.experts) + ")", std::to_string(o.topk)));
  if (p.given("order") || !p.str("order").empty())
    o.order = p.choice("order", {"expert_major", "rank_major"}) == "expert_major" ? ReceiveOrder::expert_major
                                                                                  : ReceiveOrder::rank_major;
  o.dtype = parse_dtype(p);
  o.seed = static_cast<uint64_t>(p.integer("seed", 0, INT64_MAX));
  o.iters = static_cast<int>(p.integer("iters", 1, 1000000));
  o.quant = parse_quant(p);
  o.num_nvl_bytes = p.bytes("num-nvl-bytes");
  o.num_rdma_bytes = p.bytes("num-rdma-bytes");
  o.ranks_per_node = static_cast<int>(p.integer("ranks-per-node", 0, 1024));
  if (o.ranks_per_node > 0 && o.ranks % o.ranks_per_node != 0)
    throw UsageError(bad_value("ranks-per-node", "a divisor of --ranks (" + std::to_string(o.ranks) + ")",
                               std::to_string(o.ranks_per_node)));
  apply_launch_flags(read_launch_flags(p), o);

  if (o.quant) {
    const char* name = quant_mode_name(*o.quant);
    if (*o.quant == QuantMode::bf16 && o.dtype != DType::bf16)
      throw UsageError(std::string("--quant bf16: expected --dtype bf16, got '") + dtype_name(o.dtype) + "'");
    try {  // The quantizers decide what they support; ask them before any rank starts.
      quant::check_hidden(*o.quant, o.hidden);
      (void)o.dispatch_row_bytes();
    } catch (const Error& e) {
      throw UsageError(std::string("--quant ") + name + ": " + e.what());
    }
  }
  return o;
}

int run_this_rank(const std::string& command, std::unique_ptr<Bootstrap> bootstrap, const RankBody& body) {
  const int rank = bootstrap->rank();
  try {
    return body(std::move(bootstrap));
  } catch (const Error& e) {
    const bool usage = e.code() == ErrorCode::InvalidUsage;
    if (!usage || rank == 0)
      std::fprintf(stderr, "%s: error (rank %d): %s\n", command.c_str(), rank, e.what());
    return usage ? kExitUsage : kExitFail;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error (rank %d): %s\n", command.c_str(), rank, e.what());
    return kExitFail;
  }
}

int mpi_launched_world_size() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"}) {
    const char* v = std::getenv(name);
    if (v && *v) return std::max(1, std::atoi(v));
  }
  return 0;
}

int run_ranks(const std::string& command, const RunOptions& opts, const RankBody& body) {
  if (const int world = mpi_launched_world_size(); world > 1)
    throw UsageError(
        command + ": this process is one of " + std::to_string(world) +
        " started by an MPI launcher, but it starts its own ranks (--ranks " + std::to_string(opts.ranks) +
        "), so every process would run a separate job; run it without "
        "mpirun" +
        (command == "epcomm bench"
             ? std::string(", or with --bootstrap mpi (the default under mpirun when the tool links MPI)")
             : std::string()));
  RankFn fn = [&](std::unique_ptr<Bootstrap> bootstrap) -> int {
    return run_this_rank(command, std::move(bootstrap), body);
  };
  LaunchOptions lo;
  lo.bind = opts.bind;
  g_ranks_bound = !launch_cpu_share(opts.bind, 0, opts.ranks).empty();  // (the ranks inherit it)
  if (opts.timeout_s) {
    lo.bootstrap_timeout = std::chrono::milliseconds(static_cast<int64_t>(*opts.timeout_s * 1000));
    lo.timeout = std::max(lo.timeout, lo.bootstrap_timeout * 3);
  }
  auto exits =
      opts.launcher == Launcher::fork ? launch_local(opts.ranks, fn, lo) : launch_threads(opts.ranks, fn, lo);
  int status = kExitOk;
  bool usage = false;
  for (const RankExit& e : exits) {
    if (e.signal)
      std::fprintf(stderr, "%s: rank %d was killed by signal %d\n", command.c_str(), e.rank, e.signal);
    if (e.exit_code == kExitUsage && !e.signal) usage = true;
    if (e.exit_code != 0) status = kExitFail;
  }
  return usage ? kExitUsage : status;
}

}  // namespace epcomm::cli
