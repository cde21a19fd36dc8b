// bootstrap/unique_id.h — identifiers unique on this host: job ids and group ids.
// Built from the pid, a per-process counter and random bits, so forks and restarts never collide.
#pragma once

#include <string>

namespace epcomm::bootstrap_detail {

// "<prefix>-<pid>-<counter>-<16 hex digits>"; thread-safe. Only [A-Za-z0-9-] besides the prefix.
std::string make_host_unique_id(const std::string& prefix);

}  // namespace epcomm::bootstrap_detail
