// api/version.cc — the library version string.
#include "epcomm/version.h"

namespace epcomm {
const char* version() { return "0.1.0"; }
}  // namespace epcomm
