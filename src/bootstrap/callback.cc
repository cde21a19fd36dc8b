// bootstrap/callback.cc — a Bootstrap over two caller-supplied functions (the Python front's torch group).
#include <cstring>
#include <utility>

#include "bootstrap/unique_id.h"
#include "common/check.h"
#include "epcomm/bootstrap.h"

namespace epcomm {
namespace {

// The group id travels in a fixed-size slot so that every rank contributes the same length.
constexpr size_t kIdSlotBytes = 64;

class CallbackBootstrap final : public Bootstrap {
 public:
  CallbackBootstrap(int rank, int size, AllGatherFn all_gather, BarrierFn barrier)
      : rank_(rank), size_(size), all_gather_(std::move(all_gather)), barrier_(std::move(barrier)) {
    unique_id_ = agree_on_unique_id();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  std::vector<std::byte> all_gather(const std::vector<std::byte>& bytes) override {
    std::vector<std::byte> out = all_gather_(bytes);
    const size_t expected = bytes.size() * static_cast<size_t>(size_);
    if (out.size() != expected)
      EPCOMM_THROW(InvalidUsage, "bootstrap all_gather (callback) on rank ", rank_,
                   ": the all_gather callback returned ", out.size(), " bytes, expected size * len = ", size_,
                   " * ", bytes.size(), " = ", expected, " bytes");
    return out;
  }

  void barrier() override { barrier_(); }
  const std::string& unique_id() const override { return unique_id_; }

 private:
  // Rank 0's host-unique id, broadcast through the callback itself, so shared memory names agree on every
  // rank.
  std::string agree_on_unique_id() {
    std::string mine = bootstrap_detail::make_host_unique_id("cb");
    EPCOMM_ASSERT(mine.size() < kIdSlotBytes, "unique id '", mine, "' does not fit its slot");
    std::vector<std::byte> slot(kIdSlotBytes, std::byte{0});
    std::memcpy(slot.data(), mine.data(), mine.size());
    std::vector<std::byte> all = all_gather(slot);
    const char* root = reinterpret_cast<const char*>(all.data());
    return std::string(root, strnlen(root, kIdSlotBytes));
  }

  int rank_;
  int size_;
  AllGatherFn all_gather_;
  BarrierFn barrier_;
  std::string unique_id_;
};

}  // namespace

std::unique_ptr<Bootstrap> make_callback_bootstrap(int rank, int size, AllGatherFn all_gather,
                                                   BarrierFn barrier) {
  EPCOMM_CHECK_GT(size, 0, "make_callback_bootstrap: bad group size");
  EPCOMM_CHECK(rank >= 0 && rank < size, "make_callback_bootstrap: rank ", rank,
               " is outside the group (expected 0 <= rank < ", size, ")");
  EPCOMM_CHECK(static_cast<bool>(all_gather), "make_callback_bootstrap: the all_gather callback is empty");
  EPCOMM_CHECK(static_cast<bool>(barrier), "make_callback_bootstrap: the barrier callback is empty");
  return std::make_unique<CallbackBootstrap>(rank, size, std::move(all_gather), std::move(barrier));
}

}  // namespace epcomm
