// tools/epcomm/api_flag.cc — the --api flag of bench and demo, which picks the API family they exercise.
#include <cstring>
#include <string>

#include "flags.h"
#include "subcommands.h"

namespace epcomm::cli {

std::string take_api_flag(int& argc, char** argv) {
  std::string api = "normal";
  int out = 0;
  for (int i = 0; i < argc; ++i) {
    const char* a = argv[i];
    if (std::strcmp(a, "--api") == 0) {
      if (i + 1 >= argc) throw UsageError("--api: missing value (normal, distribute-v2 or low-latency)");
      api = argv[++i];
      continue;
    }
    if (std::strncmp(a, "--api=", 6) == 0) {
      api = a + 6;
      continue;
    }
    argv[out++] = argv[i];
  }
  argc = out;
  if (api != "normal" && api != "distribute-v2" && api != "low-latency")
    throw UsageError(bad_value("api", "normal, distribute-v2 or low-latency", api));
  return api;
}

}  // namespace epcomm::cli
