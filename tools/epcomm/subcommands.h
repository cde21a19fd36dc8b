// tools/epcomm/subcommands.h — entry points of the epcomm subcommands.
// Each takes the arguments after its name, prints its own --help, and returns the process exit status.
#pragma once

#include <string>

namespace epcomm::cli {

int run_demo(int argc, char** argv);
int run_bench(int argc, char** argv);

// The operator family (docs/distribute-v2.md): `epcomm bench|demo --api distribute-v2`.
int run_demo_v2(int argc, char** argv);
int run_bench_v2(int argc, char** argv);
// Low-latency mode (docs/low-latency.md): `epcomm demo --api low-latency`.
int run_demo_ll(int argc, char** argv);
int run_bench_ll(int argc, char** argv);
// Removes --api NAME (or --api=NAME) from argv and returns NAME: "normal" (the default) or "distribute-v2";
// anything else is a UsageError.
std::string take_api_flag(int& argc, char** argv);

}  // namespace epcomm::cli
