// transport/ucx/ucx_util.cc — small UCX helpers (see ucx_util.h).
#include "transport/ucx/ucx_util.h"

#include <algorithm>
#include <thread>

#include "epcomm/bootstrap.h"

namespace epcomm::ucx {

std::string status_text(ucs_status_t status) {
  return detail::cat(ucs_status_string(status), " (UCX status ", static_cast<int>(status), ")");
}

Clock::time_point deadline_after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

ucs_status_t wait_request(ucs_status_ptr_t req, Clock::time_point deadline) {
  if (req == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
  ucs_status_t st;
  int polls = 0;
  while ((st = ucp_request_check_status(req)) == UCS_INPROGRESS) {
    if (Clock::now() > deadline) {
      ucp_request_free(req);  // UCX releases it when it completes
      return UCS_ERR_TIMED_OUT;
    }
    // Yield first (a bandwidth measurement waits here), then sleep so that a slow peer costs no CPU.
    if (++polls < 1000)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ucp_request_free(req);
  return st;
}

std::vector<std::byte> as_bytes(const void* p, size_t n) {
  const auto* b = static_cast<const std::byte*>(p);
  return std::vector<std::byte>(b, b + n);
}

std::vector<std::vector<std::byte>> gather_blobs(Bootstrap& bootstrap, std::vector<std::byte> blob,
                                                 const std::vector<size_t>& lengths) {
  const size_t width = std::max<size_t>(1, *std::max_element(lengths.begin(), lengths.end()));
  blob.resize(width);
  std::vector<std::byte> all = bootstrap.all_gather(blob);
  std::vector<std::vector<std::byte>> out(lengths.size());
  for (size_t r = 0; r < lengths.size(); ++r)
    out[r].assign(all.begin() + r * width, all.begin() + r * width + lengths[r]);
  return out;
}

}  // namespace epcomm::ucx
