// api/group.cc — Group: a bootstrap plus the host of every rank.
#include <unistd.h>

#include <cstring>

#include "common/check.h"
#include "epcomm/group.h"

namespace epcomm {

std::shared_ptr<Group> Group::create(std::unique_ptr<Bootstrap> bootstrap) {
  EPCOMM_CHECK(bootstrap != nullptr, "Group::create: bootstrap must not be null");
  auto g = std::shared_ptr<Group>(new Group());
  g->rank_ = bootstrap->rank();
  g->size_ = bootstrap->size();
  constexpr size_t kHost = 256;
  std::vector<std::byte> mine(kHost, std::byte{0});
  char host[kHost] = {0};
  gethostname(host, kHost - 1);
  std::memcpy(mine.data(), host, strnlen(host, kHost - 1));
  auto all = bootstrap->all_gather(mine);
  for (int r = 0; r < g->size_; ++r) {
    const char* h = reinterpret_cast<const char*>(all.data()) + r * kHost;
    g->hosts_.emplace_back(h, strnlen(h, kHost));
  }
  g->bootstrap_ = std::move(bootstrap);
  return g;
}

}  // namespace epcomm
