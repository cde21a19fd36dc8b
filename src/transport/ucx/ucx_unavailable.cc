// transport/ucx/ucx_unavailable.cc — make_ucx_network for builds without UCX (EPCOMM_WITH_UCX=OFF, or
// libucx-dev missing at configure time): says so, instead of failing to link.
#include "common/check.h"
#include "transport/network.h"

namespace epcomm {

std::unique_ptr<Network> make_ucx_network(Bootstrap&, const NetworkOptions&) {
  EPCOMM_THROW(SystemError, "epcomm was built without UCX (install libucx-dev and reconfigure)");
}

}  // namespace epcomm
