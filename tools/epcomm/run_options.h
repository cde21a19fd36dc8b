// tools/epcomm/run_options.h — the flags demo and bench share (shape, order, dtype, quant, launcher), their
// validation, and running one body on every local rank with the exit-status rules of the tool.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "epcomm/bootstrap.h"
#include "epcomm/launch.h"
#include "epcomm/tensor.h"
#include "epcomm/types.h"
#include "flags.h"

namespace epcomm::cli {

// How the ranks start: forked processes or threads of this process, or (bench --bootstrap mpi) one rank per
// MPI process started by mpirun.
enum class Launcher { fork, threads, mpi };

// How a command's ranks start and wait (--launcher, --timeout, --quiet: every command that starts ranks has
// them).
struct LaunchFlags {
  Launcher launcher = Launcher::fork;
  std::optional<double> timeout_s;  // none: EPCOMM_TIMEOUT_S, else 100
  bool quiet = false;
  LaunchBind bind = LaunchBind::cores;  // --bind: each rank on its own share of the CPUs (LaunchBind)
};

// Validated values of the shared flags. Invariants: experts % ranks == 0, 1 <= topk <= experts.
struct RunOptions {
  int ranks = 4;
  int64_t tokens = 256;  // per rank
  int64_t hidden = 1024;
  int experts = 32;
  int topk = 4;
  std::optional<ReceiveOrder> order;  // none: the command's default
  DType dtype = DType::bf16;
  uint64_t seed = 1;
  int iters = 1;
  std::optional<QuantMode> quant;  // none: rows are copied as they are (plain)
  int64_t num_nvl_bytes = 0;       // 0: the library default (64 MiB)
  int64_t num_rdma_bytes = 0;      // internode staging per rank; 0: the library default (64 MiB)
  int ranks_per_node = 0;          // 0: EPCOMM_RANKS_PER_NODE, else one node per host
  Launcher launcher = Launcher::fork;
  std::optional<double> timeout_s;  // none: EPCOMM_TIMEOUT_S, else 100
  int64_t expert_alignment = 1;     // DispatchArgs::expert_alignment (bench --expert-alignment)
  bool quiet = false;
  LaunchBind bind = LaunchBind::cores;

  int local_experts() const { return experts / ranks; }
  // Whether dispatch quantizes the rows (a --quant mode other than bf16, which copies bf16 rows).
  bool quantizes() const { return quant && *quant != QuantMode::bf16; }
  // Payload bytes of one dispatched row: H * elem, or the quantized data and scale bytes
  // (docs/normal-mode.md).
  int64_t dispatch_row_bytes() const;
  std::string quant_name() const { return quant ? quant_mode_name(*quant) : "none"; }
};

// Defaults of one command, shown in its --help.
struct RunDefaults {
  int ranks;
  int64_t tokens, hidden;
  int experts, topk, iters;
  std::string order;        // "" = the command decides (bench: both)
  bool token_list = false;  // --tokens takes a comma-separated list (bench sweeps it)
};

// What a command changes in how read_run_flags reads the shared flags.
struct RunFlagRules {
  std::optional<int> ranks;  // the rank count when --ranks does not choose it (mpirun's world size)
  bool token_list = false;   // --tokens may be a comma-separated list; RunOptions::tokens gets the first
};

void add_run_flags(FlagParser& parser, const RunDefaults& defaults);
// What the bench reports as `bind`: "cores" when run_ranks bound this job's ranks (LaunchBind::cores and
// at least as many CPUs as ranks), else "none" (also under mpirun, which binds as it is told).
const char* ranks_bind_name();
// --launcher, --timeout and --quiet alone (add_run_flags adds them too), for the commands with flags of
// their own (--api distribute-v2, low-latency).
void add_launch_flags(FlagParser& parser);
LaunchFlags read_launch_flags(const FlagParser& parser);
// The RunOptions that run_ranks needs to start `ranks` ranks as `launch` says.
RunOptions launch_options(const LaunchFlags& launch, int ranks);
// Reads and cross-checks the shared flags; checks the quant mode against the library's quantizers (so
// "not supported yet" is reported before any rank starts). Throws UsageError.
RunOptions read_run_flags(const FlagParser& parser, const RunFlagRules& rules = {});

// The body of one rank; returns its exit status.
using RankBody = std::function<int(std::unique_ptr<Bootstrap>)>;

// Runs `body` on this process's rank (its bootstrap already made, e.g. over MPI) with the error rules of
// run_ranks; returns the rank's exit status.
int run_this_rank(const std::string& command, std::unique_ptr<Bootstrap> bootstrap, const RankBody& body);

// The world size of the MPI job that started this process (mpirun/mpiexec of Open MPI, MPICH or Intel MPI,
// srun with PMI or PMIx: OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_SIZE... in the environment), or 0 when no
// MPI launcher started it.
int mpi_launched_world_size();

// Runs `body` on opts.ranks local ranks (forked processes or threads). Throws UsageError when an MPI
// launcher started this process as one of several (each would run a separate job of its own). Inside, an
// epcomm::Error escaping the body becomes exit status 2 for InvalidUsage (printed by rank 0 only, since every
// rank raises it) and 1 otherwise (printed by every rank). The tool's status: 2 if any rank returned 2, else
// 1 if any rank failed or died, else 0.
int run_ranks(const std::string& command, const RunOptions& opts, const RankBody& body);

}  // namespace epcomm::cli
