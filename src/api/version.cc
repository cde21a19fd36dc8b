// api/version.cc — the library version string.
#include "epcomm/version.h"

namespace epcomm {
// EPCOMM_VERSION_STRING is the `project(epcomm VERSION ...)` of CMakeLists.txt, the one place it is written.
const char* version() {
  return EPCOMM_VERSION_STRING;
}
}  // namespace epcomm
