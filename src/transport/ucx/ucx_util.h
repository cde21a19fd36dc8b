// transport/ucx/ucx_util.h — small UCX helpers shared by the files of transport/ucx/: status checks that
// name the call and the UCX status, bounded request waits, and blob exchange through the Bootstrap.
#pragma once

#include <ucp/api/ucp.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "common/check.h"

namespace epcomm {
class Bootstrap;
}

namespace epcomm::ucx {

using Clock = std::chrono::steady_clock;

// "Connection reset by remote peer (UCX status -25)": the shape every UCX error of epcomm quotes.
std::string status_text(ucs_status_t status);

inline bool is_request(ucs_status_ptr_t p) {
  return p != nullptr && !UCS_PTR_IS_ERR(p);
}

Clock::time_point deadline_after(double seconds);
double seconds_since(Clock::time_point t);

// Polls a request until it leaves UCS_INPROGRESS (another thread progresses the worker) or the deadline
// passes; frees it either way. Returns its status, or UCS_ERR_TIMED_OUT. Yields, then sleeps: no hot spin.
ucs_status_t wait_request(ucs_status_ptr_t req, Clock::time_point deadline);

std::vector<std::byte> as_bytes(const void* p, size_t n);

// Collective: every rank contributes `blob` (lengths differ: worker addresses, packed keys), padded to the
// longest of `lengths` (every rank's length, known from an earlier round); returns every rank's blob.
std::vector<std::vector<std::byte>> gather_blobs(Bootstrap& bootstrap, std::vector<std::byte> blob,
                                                 const std::vector<size_t>& lengths);

}  // namespace epcomm::ucx

// For UCX calls returning ucs_status_t: anything but UCS_OK throws SystemError naming the call.
#define EPCOMM_CHECK_UCS(call)                                                                   \
  do {                                                                                           \
    ucs_status_t epcomm_status_ = (call);                                                        \
    if (epcomm_status_ != UCS_OK)                                                                \
      EPCOMM_THROW(SystemError, #call, " failed: ", ::epcomm::ucx::status_text(epcomm_status_)); \
  } while (0)
