// transport/ucx/ucx_link.cc — raw put bandwidth between two ranks (see ucx_link.h).
#include "transport/ucx/ucx_link.h"

#include <cstring>
#include <string>
#include <vector>

#include "epcomm/bootstrap.h"
#include "transport/ucx/ucx_util.h"

namespace epcomm::ucx {
namespace {

// Source and destination halves of one registered allocation, with its packed remote key.
class LinkBuffer {
 public:
  LinkBuffer(ucp_context_h context, size_t bytes) : context_(context), memory_(2 * bytes, 1), bytes_(bytes) {
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    mp.address = memory_.data();
    mp.length = memory_.size();
    EPCOMM_CHECK_UCS(ucp_mem_map(context_, &mp, &memh_));
    void* packed = nullptr;
    size_t packed_bytes = 0;
    ucs_status_t st = ucp_rkey_pack(context_, memh_, &packed, &packed_bytes);
    if (st != UCS_OK) {
      ucp_mem_unmap(context_, memh_);
      EPCOMM_THROW(SystemError, "ucp_rkey_pack failed: ", status_text(st));
    }
    rkey_ = as_bytes(packed, packed_bytes);
    ucp_rkey_buffer_release(packed);
  }
  ~LinkBuffer() { ucp_mem_unmap(context_, memh_); }
  LinkBuffer(const LinkBuffer&) = delete;
  LinkBuffer& operator=(const LinkBuffer&) = delete;

  const uint8_t* source() const { return memory_.data(); }
  uint64_t target_address() const { return reinterpret_cast<uint64_t>(memory_.data() + bytes_); }
  const std::vector<std::byte>& rkey() const { return rkey_; }

 private:
  ucp_context_h context_;
  std::vector<uint8_t> memory_;
  size_t bytes_;
  ucp_mem_h memh_ = nullptr;
  std::vector<std::byte> rkey_;
};

struct Target {
  uint64_t address;
  uint64_t rkey_bytes;
};

// Puts and flushes over `ep` into (address, rkey); returns the seconds taken, or throws naming the partner.
double timed_puts(ucp_ep_h ep, int partner, const LinkBuffer& buf, uint64_t address,
                  const std::vector<std::byte>& packed_rkey, size_t bytes, int iterations, double timeout_s) {
  ucp_rkey_h rkey = nullptr;
  EPCOMM_CHECK_UCS(ucp_ep_rkey_unpack(ep, packed_rkey.data(), &rkey));
  const auto deadline = deadline_after(timeout_s);
  const auto t0 = Clock::now();
  ucs_status_t st = UCS_OK;
  for (int i = 0; i < iterations && st == UCS_OK; ++i) {
    ucp_request_param_t rp{};
    ucs_status_ptr_t req = ucp_put_nbx(ep, buf.source(), bytes, address, rkey, &rp);
    if (UCS_PTR_IS_ERR(req)) st = UCS_PTR_STATUS(req);
    if (is_request(req)) ucp_request_free(req);  // the flush tells when it is done
    if (st == UCS_OK) st = wait_request(ucp_ep_flush_nbx(ep, &rp), deadline);
  }
  const double s = seconds_since(t0);
  ucp_rkey_destroy(rkey);
  if (st != UCS_OK)
    EPCOMM_THROW(SystemError, "measure_link_gbps: put to rank ", partner, " failed: ", status_text(st));
  return s;
}

}  // namespace

double measure_put_gbps(ucp_context_h context, Bootstrap& bootstrap, ucp_ep_h ep, int partner, size_t bytes,
                        int iterations, double timeout_s) {
  LinkBuffer buf(context, bytes);
  Target mine{buf.target_address(), buf.rkey().size()};
  std::vector<std::byte> all = bootstrap.all_gather(as_bytes(&mine, sizeof mine));
  std::vector<Target> targets(bootstrap.size());
  std::vector<size_t> lengths(bootstrap.size());
  for (int r = 0; r < bootstrap.size(); ++r) {
    std::memcpy(&targets[r], all.data() + r * sizeof(Target), sizeof(Target));
    lengths[r] = targets[r].rkey_bytes;
  }
  auto rkeys = gather_blobs(bootstrap, buf.rkey(), lengths);
  bootstrap.barrier();  // start together: both directions share the link
  double gbps = 0;
  std::string error;
  if (ep) {
    try {
      double s = timed_puts(ep, partner, buf, targets[partner].address, rkeys[partner], bytes, iterations,
                            timeout_s);
      gbps = static_cast<double>(bytes) * iterations / s / 1e9;
    } catch (const Error& e) {
      error = e.what();  // raised after the last barrier, so that the others are not left waiting
    }
  }
  bootstrap.barrier();  // nobody unmaps its buffer while its partner still puts into it
  if (!error.empty()) EPCOMM_THROW(SystemError, error);
  return gbps;
}

}  // namespace epcomm::ucx
