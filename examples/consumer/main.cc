// examples/consumer/main.cc — a program built outside the epcomm tree against the installed package
// (find_package(epcomm) or pkg-config epcomm): 2 forked ranks on this host run one dispatch and combine.
#include "epcomm/launch.h"
#include "round_trip.h"

int main() {
  int failed = 0;
  for (const auto& r : epcomm::launch_local(2, round_trip)) failed |= r.exit_code != 0;
  return failed;
}
