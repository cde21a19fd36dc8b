// tools/epcomm/main.cc — the `epcomm` command line: picks a subcommand, prints the global help (with the
// environment variables the library reads), and turns usage errors into exit status 2.
#include <cstdio>
#include <cstring>
#include <string>

#include "common/env.h"
#include "epcomm/error.h"
#include "epcomm/version.h"
#include "flags.h"
#include "subcommands.h"

namespace {

using epcomm::cli::kExitOk;
using epcomm::cli::kExitUsage;

struct Command {
  const char* name;
  const char* summary;
  int (*run)(int argc, char** argv);
};

const Command kCommands[] = {
    {"demo",
     "one MoE layer forward over local ranks, checked against a dense reference (PASS/FAIL);\n"
     "           --api distribute-v2: through dispatch_v2/combine_v2 with a shared expert",
     epcomm::cli::run_demo},
    {"bench",
     "time dispatch and combine; one JSON object per line on stdout, beside the memcpy limit;\n"
     "           mpirun -n R epcomm bench --bootstrap mpi: also the MPI_Alltoallv baseline;\n"
     "           --plot FILE.svg: GB/s against tokens per rank (--tokens 256,1024,...);\n"
     "           --api distribute-v2: dispatch_v2/combine_v2 in the decode shape",
     epcomm::cli::run_bench},
};

void print_help(FILE* out) {
  std::fprintf(out,
               "usage: epcomm <command> [flags]\n"
               "       epcomm <command> --help\n"
               "       epcomm --version\n\n"
               "epcomm %s: Mixture-of-Experts expert-parallel dispatch and combine between local ranks.\n\n"
               "commands:\n",
               epcomm::version());
  for (const Command& c : kCommands) std::fprintf(out, "  %-8s %s\n", c.name, c.summary);
  std::fprintf(out, "  %-8s %s\n", "help", "this text, or 'help <command>' for a command's flags");
  std::fprintf(out, "\nenvironment (read by the library in every rank):\n");
  for (int i = 0; i < epcomm::env::kNumKnobs; ++i) {
    const auto& k = epcomm::env::kKnobs[i];
    std::fprintf(out, "  %-32s default %-5s %s\n", k.name, k.default_value, k.meaning);
  }
  std::fprintf(out, "\nexit status: 0 success, 1 a failed check or runtime error, 2 a usage error.\n");
}

const Command* find(const char* name) {
  for (const Command& c : kCommands)
    if (std::strcmp(c.name, name) == 0) return &c;
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    print_help(stderr);
    return kExitUsage;
  }
  const std::string first = argv[1];
  if (first == "--help" || first == "-h" || (first == "help" && argc == 2)) {
    print_help(stdout);
    return kExitOk;
  }
  if (first == "--version" || first == "version") {
    std::printf("epcomm %s\n", epcomm::version());
    return kExitOk;
  }
  const bool help_of = first == "help";
  const char* name = help_of ? argv[2] : argv[1];
  const Command* cmd = find(name);
  if (!cmd) {
    std::fprintf(stderr, "epcomm: unknown command '%s' (commands: demo, bench; see 'epcomm --help')\n", name);
    return kExitUsage;
  }
  try {
    if (help_of) {
      char help_flag[] = "--help";
      char* args[] = {help_flag};
      return cmd->run(1, args);
    }
    return cmd->run(argc - 2, argv + 2);
  } catch (const epcomm::cli::UsageError& e) {
    std::fprintf(stderr, "epcomm %s: %s\n", cmd->name, e.what());
    return kExitUsage;
  } catch (const epcomm::Error& e) {
    std::fprintf(stderr, "epcomm %s: error: %s\n", cmd->name, e.what());
    return e.code() == epcomm::ErrorCode::InvalidUsage ? kExitUsage : epcomm::cli::kExitFail;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epcomm %s: error: %s\n", cmd->name, e.what());
    return epcomm::cli::kExitFail;
  }
}
