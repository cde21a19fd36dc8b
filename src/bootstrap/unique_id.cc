// bootstrap/unique_id.cc — host-unique identifiers.
#include "bootstrap/unique_id.h"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <random>

namespace epcomm::bootstrap_detail {

std::string make_host_unique_id(const std::string& prefix) {
  static std::atomic<uint64_t> counter{0};
  uint64_t random;
  {
    // random_device is not guaranteed to be thread-safe; ids are rare, so a lock costs nothing.
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    std::random_device rd;
    random = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }

  char buf[96];
  std::snprintf(buf, sizeof(buf), "-%ld-%llu-%016llx", static_cast<long>(getpid()),
                static_cast<unsigned long long>(counter.fetch_add(1)),
                static_cast<unsigned long long>(random));
  return prefix + buf;
}

}  // namespace epcomm::bootstrap_detail
