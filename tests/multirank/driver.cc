// multirank/driver.cc — `multirank_tests --case NAME --launcher thread|fork --np N`: runs one registered
// case on N ranks and exits 0 (pass), 1 (fail) or 77 (skipped). `--list` prints the case names.
#include "multirank/driver.h"

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>

#include "epcomm/launch.h"
#ifdef EPCOMM_HAVE_MPI
#include "epcomm/bootstrap_mpi.h"
#endif

namespace epcomm::testing {

std::map<std::string, CaseInfo>& cases() {
  static std::map<std::string, CaseInfo> m;
  return m;
}

}  // namespace epcomm::testing

using namespace epcomm;
using namespace epcomm::testing;

static int usage() {
  std::cerr
      << "usage: multirank_tests --case NAME --launcher thread|fork|mpi --np N | --list  (mpi: run "
         "under mpirun)\n"
         "       multirank_tests --case NAME --launcher tcp --np N --rank R --endpoint tcp://A.B.C.D:PORT "
         "(one rank; a script starts them all)\n";
  return 2;
}

// Segments of this run: their names carry the launcher's pid (bootstrap unique ids start with it).
static int count_shm_entries() {
  int n = 0;
  std::string mark = "-";  // (appended: GCC 12 warns a false -Wrestrict on "-" + std::string)
  mark += std::to_string(getpid()) + "-";
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d))
      if (std::strncmp(e->d_name, "epcomm-", 7) == 0 && std::strstr(e->d_name, mark.c_str())) ++n;
    closedir(d);
  }
  return n;
}

int main(int argc, char** argv) {
  std::string name, launcher = "thread", endpoint;
  int np = 2, rank = -1;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--list") {
      for (auto& [n, _] : cases()) std::cout << n << "\n";
      return 0;
    }
    if (i + 1 >= argc) return usage();
    if (a == "--case")
      name = argv[++i];
    else if (a == "--launcher")
      launcher = argv[++i];
    else if (a == "--np")
      np = std::atoi(argv[++i]);
    else if (a == "--rank")
      rank = std::atoi(argv[++i]);
    else if (a == "--endpoint")
      endpoint = argv[++i];
    else
      return usage();
  }
  auto it = cases().find(name);
  if (it == cases().end()) {
    std::cerr << "unknown case '" << name << "' (see --list)\n";
    return 2;
  }
  const CaseInfo& info = it->second;
  if (info.fork_only && launcher != "fork") {
    std::cerr << "skipped: case " << name << " needs forked ranks\n";
    return 77;
  }
  if (np < info.min_ranks) {
    std::cerr << "skipped: case " << name << " needs at least " << info.min_ranks << " ranks\n";
    return 77;
  }
  // Every test runs with poisoned outputs: a row nobody wrote holds 0xFF bytes and fails the comparison.
  setenv("EPCOMM_POISON_OUTPUTS", "1", 1);

  auto fn = [&](std::unique_ptr<Bootstrap> bs) -> int {
    RankCtx ctx;
    ctx.rank = bs->rank();
    ctx.size = bs->size();
    ctx.launcher = launcher;
    ctx.group = Group::create(std::move(bs));
    try {
      info.body(ctx);
    } catch (const Skip& s) {
      std::fprintf(stderr, "[rank %d] skipped: %s\n", ctx.rank, s.what());
      return 77;
    }
    return 0;
  };
  if (launcher == "tcp") {  // this process is rank --rank of --np, started by a script (other namespaces)
    int rc = 0;
    try {
      rc = fn(make_local_bootstrap(endpoint, rank, np, std::chrono::seconds(60)));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[rank %d] %s\n", rank, e.what());
      rc = 1;
    }
    if (rc == 0) std::printf("PASS %s.tcp.rank%d\n", name.c_str(), rank);
    return rc;
  }
  if (launcher == "mpi") {  // this process is one rank of an mpirun job
#ifdef EPCOMM_HAVE_MPI
    int rc = 0;
    try {
      rc = fn(make_mpi_bootstrap(std::chrono::seconds(120)));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[mpi] %s\n", e.what());
      rc = 1;
    }
    if (rc == 0) std::printf("PASS %s.mpi\n", name.c_str());
    return rc;
#else
    std::cerr << "skipped: built without MPI\n";
    return 77;
#endif
  }
  LaunchOptions opts;
  opts.timeout = std::chrono::seconds(240);
  auto exits = launcher == "fork" ? launch_local(np, fn, opts) : launch_threads(np, fn, opts);
  int rc = 0;
  bool skipped = false;
  for (const RankExit& e : exits) {
    if (e.rank == info.killed_rank) {
      if (e.signal != SIGKILL) {
        std::fprintf(stderr, "rank %d was expected to be killed, but exited with %d\n", e.rank, e.exit_code);
        rc = 1;
      }
      continue;
    }
    if (e.exit_code == 77) {
      skipped = true;
    } else if (e.exit_code != 0 || e.signal != 0) {
      std::fprintf(stderr, "rank %d failed (exit %d, signal %d)\n", e.rank, e.exit_code, e.signal);
      rc = 1;
    }
  }
  const int shm_after = count_shm_entries();
  if (shm_after > 0) {
    std::fprintf(stderr, "FAIL: %d epcomm entries of this run left in /dev/shm\n", shm_after);
    rc = 1;
  }
  if (rc == 0 && skipped) return 77;
  if (rc == 0) std::printf("PASS %s.%s.np%d\n", name.c_str(), launcher.c_str(), np);
  return rc;
}
