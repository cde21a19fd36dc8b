// bootstrap/launch.cc — launch_local (forked processes) and launch_threads (threads of this process).
#include "epcomm/launch.h"

#include <sched.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <mutex>
#include <system_error>
#include <thread>

#include "bootstrap/deadline.h"
#include "bootstrap/in_process.h"
#include "bootstrap/unique_id.h"
#include "common/check.h"
#include "common/env.h"
#include "common/log.h"

namespace epcomm {
namespace {

using namespace std::chrono_literals;
using bootstrap_detail::Deadline;
using bootstrap_detail::format_ranks;

std::chrono::milliseconds bootstrap_timeout(const LaunchOptions& opts) {
  if (opts.bootstrap_timeout.count() > 0) return opts.bootstrap_timeout;
  return std::chrono::milliseconds(std::max<int64_t>(1, static_cast<int64_t>(env::timeout_s() * 1000.0)));
}

void check_launch_args(const char* who, int num_ranks, const RankFn& fn, const LaunchOptions& opts) {
  EPCOMM_CHECK_GE(num_ranks, 1, who, ": bad number of ranks");
  EPCOMM_CHECK(static_cast<bool>(fn), who, ": the rank function is empty");
  EPCOMM_CHECK_GT(opts.timeout.count(), 0, who, ": the timeout must be positive (ms)");
}

// Binds the calling thread (rank `rank`) to `cpus` (nothing when empty); a failure leaves it unbound and
// logs a warning.
void bind_to(const std::vector<int>& cpus, int rank) {
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  if (sched_setaffinity(0, sizeof set, &set) == 0) return;
  const int err = errno;
  EPCOMM_LOG(warn, rank, "launch: could not bind the rank to its ", cpus.size(), " CPUs (", cpus.front(),
             " to ", cpus.back(), ", LaunchBind::cores): ", std::strerror(err), "; it runs unbound");
}

// Builds the rank's bootstrap and runs fn; an escaping exception becomes exit code 1 and one stderr line.
template <typename MakeBootstrap>
int run_rank(int rank, const RankFn& fn, const MakeBootstrap& make_bootstrap, bool quiet) noexcept {
  const char* what = nullptr;
  std::string message;
  try {
    return fn(make_bootstrap());
  } catch (const std::exception& e) {
    try {
      message = e.what();
      what = message.c_str();
    } catch (...) {
      what = "(exception message lost: out of memory)";
    }
  } catch (...) {
    what = "unknown exception (not derived from std::exception)";
  }
  if (!quiet) std::fprintf(stderr, "[rank %d] %s\n", rank, what);
  return 1;
}

// ---- launch_local ----

// The forked children not yet reaped. Its destructor kills and reaps whatever is left, so no exit path of
// launch_local (an exception included) leaves a zombie or an orphan behind.
class Children {
 public:
  explicit Children(int num_ranks) : pids_(static_cast<size_t>(num_ranks), -1) {}
  Children(const Children&) = delete;
  Children& operator=(const Children&) = delete;
  ~Children() {
    for (size_t r = 0; r < pids_.size(); ++r) kill(static_cast<int>(r));
    for (size_t r = 0; r < pids_.size(); ++r)
      if (pids_[r] > 0) wait_blocking(static_cast<int>(r));
  }

  void add(int rank, pid_t pid) { pids_[rank] = pid; }
  bool running(int rank) const { return pids_[rank] > 0; }
  void kill(int rank) {
    if (pids_[rank] > 0) ::kill(pids_[rank], SIGKILL);
  }

  // Reaps `rank` if it has exited; true when it has (its exit is then in `exit`).
  bool try_reap(int rank, RankExit& exit) { return reap(rank, WNOHANG, exit); }

  void wait_blocking(int rank) {
    RankExit ignored{};
    wait_blocking(rank, ignored);
  }
  void wait_blocking(int rank, RankExit& exit) { reap(rank, 0, exit); }

 private:
  bool reap(int rank, int flags, RankExit& exit) {
    int status = 0;
    pid_t r;
    do {
      r = ::waitpid(pids_[rank], &status, flags);
    } while (r == -1 && errno == EINTR);
    if (r == 0) return false;
    pids_[rank] = -1;
    exit.rank = rank;
    if (r == -1) {
      // ECHILD: someone else reaped it (SIGCHLD set to SIG_IGN, or another waitpid(-1)); its status is lost.
      exit.exit_code = -1;
      exit.signal = 0;
    } else if (WIFSIGNALED(status)) {
      exit.signal = WTERMSIG(status);
      exit.exit_code = 128 + exit.signal;
    } else {
      exit.signal = 0;
      exit.exit_code = WEXITSTATUS(status);
    }
    return true;
  }

  std::vector<pid_t> pids_;
};

[[noreturn]] void child_main(pid_t parent, const std::string& job_id, int rank, int num_ranks,
                             const RankFn& fn, std::chrono::milliseconds timeout, bool quiet,
                             const std::vector<int>& cpus) {
  // A child must not outlive a launcher that was killed (a test timeout, say) and hold the host's cores.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(1);
  bind_to(cpus, rank);
  int code = run_rank(
      rank, fn, [&] { return make_local_bootstrap(job_id, rank, num_ranks, timeout); }, quiet);
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(code);
}

// ---- launch_threads ----

struct ThreadExits {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<bool> done;
  int num_done = 0;

  std::vector<int> not_done() {
    std::vector<int> ranks;
    for (size_t r = 0; r < done.size(); ++r)
      if (!done[r]) ranks.push_back(static_cast<int>(r));
    return ranks;
  }
};

}  // namespace

// The r-th of num_ranks equal groups of the calling thread's CPUs, consecutive in its mask (the CPUs left
// over by the division stay unused).
std::vector<int> launch_cpu_share(LaunchBind bind, int rank, int num_ranks) {
  cpu_set_t allowed;
  if (bind == LaunchBind::none || sched_getaffinity(0, sizeof allowed, &allowed) != 0) return {};
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  const size_t per = cpus.size() / static_cast<size_t>(num_ranks);
  if (per == 0) return {};
  return std::vector<int>(cpus.begin() + static_cast<std::ptrdiff_t>(per * rank),
                          cpus.begin() + static_cast<std::ptrdiff_t>(per * (rank + 1)));
}

std::vector<RankExit> launch_local(int num_ranks, const RankFn& fn, const LaunchOptions& opts) {
  check_launch_args("launch_local", num_ranks, fn, opts);
  const std::string job_id = bootstrap_detail::make_host_unique_id("job");
  const std::chrono::milliseconds timeout = bootstrap_timeout(opts);
  const Deadline deadline(opts.timeout);
  const pid_t parent = ::getpid();

  // Whatever sits in the stdio buffers now would otherwise be printed once by every child as well.
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);

  std::vector<RankExit> exits(static_cast<size_t>(num_ranks));
  Children children(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    const std::vector<int> cpus = launch_cpu_share(opts.bind, r, num_ranks);
    pid_t pid = ::fork();
    if (pid == 0) child_main(parent, job_id, r, num_ranks, fn, timeout, opts.quiet, cpus);
    if (pid < 0) {
      int err = errno;
      EPCOMM_THROW(SystemError, "launch_local: fork of rank ", r, " of ", num_ranks,
                   " failed: ", std::strerror(err), " (errno ", err, ")");
    }
    children.add(r, pid);
  }

  int num_running = num_ranks;
  auto nap = 1ms;
  while (num_running > 0) {
    for (int r = 0; r < num_ranks; ++r)
      if (children.running(r) && children.try_reap(r, exits[r])) --num_running;
    if (num_running == 0) break;
    if (deadline.expired()) {
      std::vector<int> stuck;
      for (int r = 0; r < num_ranks; ++r)
        if (children.running(r)) stuck.push_back(r);
      if (!opts.quiet)
        std::fprintf(stderr, "[launch_local] timeout after %lld ms: killing ranks %s\n",
                     static_cast<long long>(opts.timeout.count()), format_ranks(stuck).c_str());
      for (int r : stuck) children.kill(r);
      for (int r : stuck) children.wait_blocking(r, exits[r]);
      break;
    }
    std::this_thread::sleep_for(
        std::min<std::chrono::milliseconds>(nap, std::chrono::milliseconds(deadline.poll_ms())));
    nap = std::min(nap * 2, std::chrono::milliseconds(10));
  }
  return exits;
}

std::vector<RankExit> launch_threads(int num_ranks, const RankFn& fn, const LaunchOptions& opts) {
  check_launch_args("launch_threads", num_ranks, fn, opts);
  auto world = make_in_process_world(num_ranks, bootstrap_timeout(opts));
  const Deadline deadline(opts.timeout);

  std::vector<RankExit> exits(static_cast<size_t>(num_ranks));
  ThreadExits state;
  state.done.assign(static_cast<size_t>(num_ranks), false);
  std::vector<std::thread> threads;
  auto body = [&](int rank) {
    // A new thread starts with the launcher's mask, so its share is computed from that mask here.
    bind_to(launch_cpu_share(opts.bind, rank, num_ranks), rank);
    int code = run_rank(
        rank, fn, [&] { return make_in_process_bootstrap(world, rank); }, opts.quiet);
    std::lock_guard<std::mutex> lock(state.mu);
    exits[rank] = RankExit{rank, code, 0};
    state.done[rank] = true;
    ++state.num_done;
    state.cv.notify_all();
  };
  try {
    for (int r = 0; r < num_ranks; ++r) threads.emplace_back(body, r);
  } catch (const std::system_error& e) {
    // The started ranks wait for the missing ones; aborting the world releases them so they can be joined.
    world->abort(detail::cat("launch_threads: could not start rank ", threads.size(), ": ", e.what()));
    for (auto& t : threads) t.join();
    EPCOMM_THROW(SystemError, "launch_threads: could not start rank ", threads.size(), " of ", num_ranks,
                 ": ", e.what());
  }

  {
    std::unique_lock<std::mutex> lock(state.mu);
    auto all_done = [&] { return state.num_done == num_ranks; };
    if (!state.cv.wait_until(lock, deadline.at(), all_done)) {
      std::string reason = detail::cat("launch_threads: timeout after ", opts.timeout.count(), " ms; ranks ",
                                       format_ranks(state.not_done()), " had not returned");
      if (!opts.quiet) std::fprintf(stderr, "[launch_threads] %s: aborting the world\n", reason.c_str());
      world->abort(reason);
      if (!state.cv.wait_for(lock, 5s, all_done)) {
        std::fprintf(stderr,
                     "[launch_threads] ranks %s still run 5 s after the world was aborted; aborting\n",
                     format_ranks(state.not_done()).c_str());
        std::abort();
      }
    }
  }
  for (auto& t : threads) t.join();
  return exits;
}

}  // namespace epcomm
