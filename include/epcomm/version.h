// epcomm/version.h — the library version.
#pragma once

namespace epcomm {
const char* version();
}
