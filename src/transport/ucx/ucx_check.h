// transport/ucx/ucx_check.h — UCX status checks that name the call, UCX's message and the status number.
// Only transport/ucx/ includes this (it pulls in the UCX headers).
#pragma once

#include <ucp/api/ucp.h>

#include <string>

#include "common/check.h"

namespace epcomm::ucx {

// "Connection reset by remote peer (UCX status -25)": the shape every UCX error of epcomm quotes.
inline std::string status_text(ucs_status_t status) {
  return detail::cat(ucs_status_string(status), " (UCX status ", static_cast<int>(status), ")");
}

}  // namespace epcomm::ucx

// For UCX calls returning ucs_status_t: anything but UCS_OK throws SystemError naming the call.
#define EPCOMM_CHECK_UCS(call)                                                                   \
  do {                                                                                           \
    ucs_status_t epcomm_status_ = (call);                                                        \
    if (epcomm_status_ != UCS_OK)                                                                \
      EPCOMM_THROW(SystemError, #call, " failed: ", ::epcomm::ucx::status_text(epcomm_status_)); \
  } while (0)
