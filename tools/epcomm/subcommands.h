// tools/epcomm/subcommands.h — entry points of the epcomm subcommands.
// Each takes the arguments after its name, prints its own --help, and returns the process exit status.
#pragma once

namespace epcomm::cli {

int run_demo(int argc, char** argv);
int run_bench(int argc, char** argv);

}  // namespace epcomm::cli
