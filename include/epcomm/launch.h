// epcomm/launch.h — runs one function as every rank of a job on this host: forked processes or threads.
// For tests, examples and the `epcomm` tool; a real job gets its ranks from its own launcher (MPI, torchrun).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "epcomm/bootstrap.h"

namespace epcomm {

// Where a launcher's ranks run. none: where the kernel puts them. cores: when the CPUs the launching thread
// may use (its affinity mask) are at least as many as the ranks, rank r is bound to the r-th of num_ranks
// equal groups of them (consecutive in the mask; a rank's copy threads inherit its group), as
// `mpirun --bind-to core` does; with fewer CPUs than ranks nothing is bound. Unbound ranks that share a CPU
// wait for each other through the kernel's scheduler, which may keep them together for many calls.
enum class LaunchBind { none, cores };

struct LaunchOptions {
  // How long the launcher waits for all ranks before giving up on them (see each launcher for what that
  // means).
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};
  // true: the launcher prints nothing itself (neither ranks' escaping exceptions nor its timeout reports).
  // What the ranks print is untouched.
  bool quiet = false;
  // The deadline of every wait inside the ranks' bootstraps (connect, all_gather, barrier). Zero means
  // EPCOMM_TIMEOUT_S (default 100 s). Keep it below `timeout` so a stuck collective reports who is missing
  // before the launcher gives up.
  std::chrono::milliseconds bootstrap_timeout{0};
  LaunchBind bind = LaunchBind::none;
};

// The CPUs that rank `rank` of `num_ranks` is bound to under `bind`, out of the calling thread's affinity
// mask; empty when nothing is bound (LaunchBind::none, or fewer CPUs than ranks).
std::vector<int> launch_cpu_share(LaunchBind bind, int rank, int num_ranks);

struct RankExit {
  int rank;
  int exit_code;  // fn's return value (only its low 8 bits survive a process exit); 128 + signal when killed
  int signal;     // the signal that killed the rank, 0 when it exited
};

// The body of a rank. It owns the Bootstrap it is given (destroying it closes the rank's connections) and
// returns the rank's exit code, 0 for success. An exception escaping it counts as exit code 1; its what()
// goes to stderr as "[rank r] <what>".
using RankFn = std::function<int(std::unique_ptr<Bootstrap>)>;

// Forks `num_ranks` processes on this host. Each child builds a local Bootstrap (make_local_bootstrap with a
// fresh job id, rank r of num_ranks), calls fn with it, flushes stdio and leaves with _exit(code): no atexit
// handlers, static destructors or test-framework state of the parent run a second time. Children inherit a
// copy of the caller's memory, so fn reports through its exit code (or files, or output), never through the
// caller's variables. Only the calling thread exists in a child: call this from a process whose other
// threads hold no locks fn needs.
//
// Blocks until every child exits. When `opts.timeout` passes first, the remaining children are killed with
// SIGKILL and reported with signal 9. Every child is reaped before return, on every path (no zombies); other
// children of the caller are left alone (a child reaped behind the launcher's back, e.g. with SIGCHLD
// ignored, reports exit_code -1). Children are SIGKILLed if the launching thread dies first. Returns one
// RankExit per rank, in rank order. Throws Error(InvalidUsage) for num_ranks < 1 and Error(SystemError) when
// fork fails (already forked children are killed and reaped first). Not collective. Call it from one thread
// at a time: a child holds a copy of only the thread that forked it, so concurrent launches (or other busy
// threads) risk locks held forever.
std::vector<RankExit> launch_local(int num_ranks, const RankFn& fn, const LaunchOptions& opts = {});

// The same contract with ranks as threads of this process, each given an in-process Bootstrap of one fresh
// world. fn runs concurrently on num_ranks threads, so what it touches in the caller must be thread-safe.
// Exceptions are caught per rank (exit code 1, message on stderr unless quiet); signal is always 0.
//
// Blocks until every thread returns. A thread cannot be killed: when `opts.timeout` passes, the world is
// aborted, so every rank blocked in a collective throws Error(Aborted) and returns; a thread still running
// 5 s later (stuck outside the bootstrap) makes the launcher print which ranks hang and call std::abort(),
// because returning would leave threads that use `fn` and the caller's stack.
std::vector<RankExit> launch_threads(int num_ranks, const RankFn& fn, const LaunchOptions& opts = {});

}  // namespace epcomm
