// transport/ucx/ucx_link.h — raw put bandwidth between two ranks (behind Network::measure_link_gbps):
// a registered buffer per rank, its packed remote key sent through the Bootstrap, puts and flushes.
#pragma once

#include <ucp/api/ucp.h>

#include <cstddef>

namespace epcomm {
class Bootstrap;
}

namespace epcomm::ucx {

// Collective over every rank of `bootstrap`. Puts `bytes` into `partner`'s buffer over `ep`, `iterations`
// times, each followed by a flush, and returns this rank's GB/s (1e9 bytes/s). A rank without a partner
// (ep null) takes part in the exchanges and returns 0. Waits are bounded by timeout_s; another thread
// progresses the worker.
double measure_put_gbps(ucp_context_h context, Bootstrap& bootstrap, ucp_ep_h ep, int partner, size_t bytes,
                        int iterations, double timeout_s);

}  // namespace epcomm::ucx
