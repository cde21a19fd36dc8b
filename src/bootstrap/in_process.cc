// bootstrap/in_process.cc — the in-process world and its per-thread Bootstrap.
#include "bootstrap/in_process.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "bootstrap/deadline.h"
#include "bootstrap/unique_id.h"
#include "common/check.h"

namespace epcomm {

using bootstrap_detail::Deadline;
using bootstrap_detail::format_ranks;

InProcessWorld::InProcessWorld(int size, std::chrono::milliseconds timeout)
    : size_(size),
      timeout_(timeout),
      unique_id_(bootstrap_detail::make_host_unique_id("ip")),
      claimed_(static_cast<size_t>(size), false),
      arrived_(static_cast<size_t>(size), false),
      ops_(static_cast<size_t>(size), nullptr),
      contributions_(static_cast<size_t>(size)) {}

void InProcessWorld::claim_rank(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  EPCOMM_CHECK(!claimed_[rank], "make_in_process_bootstrap: rank ", rank,
               " already has a live Bootstrap in this world (one per rank)");
  claimed_[rank] = true;
}

void InProcessWorld::release_rank(int rank) {
  std::lock_guard<std::mutex> lock(mu_);
  claimed_[rank] = false;
}

std::vector<int> InProcessWorld::missing_ranks_locked() const {
  std::vector<int> missing;
  for (int r = 0; r < size_; ++r)
    if (!arrived_[r]) missing.push_back(r);
  return missing;
}

void InProcessWorld::fail_locked(ErrorCode code, const std::string& message) {
  if (!failure_) failure_.emplace(code, message);
  cv_.notify_all();
  throw Error(code, message);
}

void InProcessWorld::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!failure_) failure_.emplace(ErrorCode::Aborted, reason);
  cv_.notify_all();
}

void InProcessWorld::complete_locked() {
  const size_t len = contributions_[0].size();
  for (int q = 1; q < size_; ++q) {
    if (std::strcmp(ops_[q], ops_[0]) != 0)
      fail_locked(ErrorCode::InvalidUsage,
                  detail::cat("bootstrap: rank ", q, " called ", ops_[q], " while rank 0 called ", ops_[0],
                              " (collectives out of order)"));
    if (contributions_[q].size() != len)
      fail_locked(ErrorCode::InvalidUsage,
                  detail::cat("bootstrap ", ops_[0], ": rank ", q, " contributed ", contributions_[q].size(),
                              " bytes but rank 0 contributed ", len,
                              " bytes (expected equal lengths on every rank)"));
  }
  result_.resize(len * static_cast<size_t>(size_));
  for (int q = 0; q < size_; ++q) {
    if (len > 0) std::memcpy(result_.data() + static_cast<size_t>(q) * len, contributions_[q].data(), len);
    contributions_[q].clear();
  }
  std::fill(arrived_.begin(), arrived_.end(), false);
  num_arrived_ = 0;
  ++generation_;
  cv_.notify_all();
}

std::vector<std::byte> InProcessWorld::collective(int rank, const char* op,
                                                  const std::vector<std::byte>& bytes) {
  const Deadline deadline(timeout_);
  std::unique_lock<std::mutex> lock(mu_);
  if (failure_)
    EPCOMM_THROW(Aborted, "bootstrap ", op, " on rank ", rank,
                 ": the in-process world failed earlier: ", failure_->what());
  EPCOMM_ASSERT(!arrived_[rank], "rank ", rank, " entered bootstrap ", op, " twice at once");

  ops_[rank] = op;
  contributions_[rank] = bytes;
  arrived_[rank] = true;
  if (++num_arrived_ == size_) {
    complete_locked();
    return result_;
  }

  // The generation cannot advance twice while this rank waits: the next collective needs this rank too.
  const uint64_t generation = generation_;
  bool released = cv_.wait_until(lock, deadline.at(), [&] { return generation_ != generation || failure_; });
  if (generation_ != generation) return result_;
  if (released) throw *failure_;
  fail_locked(ErrorCode::Timeout,
              detail::cat("bootstrap ", op, " timed out after ", timeout_.count(), " ms on rank ", rank,
                          ": ranks ", format_ranks(missing_ranks_locked()),
                          " did not arrive (in-process world of ", size_, " ranks)"));
}

namespace {

class InProcessBootstrap final : public Bootstrap {
 public:
  InProcessBootstrap(std::shared_ptr<InProcessWorld> world, int rank)
      : world_(std::move(world)), rank_(rank) {
    world_->claim_rank(rank_);
  }
  ~InProcessBootstrap() override { world_->release_rank(rank_); }

  int rank() const override { return rank_; }
  int size() const override { return world_->size(); }
  std::vector<std::byte> all_gather(const std::vector<std::byte>& bytes) override {
    return world_->collective(rank_, "all_gather", bytes);
  }
  void barrier() override { world_->collective(rank_, "barrier", {}); }
  const std::string& unique_id() const override { return world_->unique_id(); }

 private:
  std::shared_ptr<InProcessWorld> world_;
  int rank_;
};

}  // namespace

std::shared_ptr<InProcessWorld> make_in_process_world(int size, std::chrono::milliseconds timeout) {
  EPCOMM_CHECK_GT(size, 0, "make_in_process_world: bad world size");
  EPCOMM_CHECK_GT(timeout.count(), 0, "make_in_process_world: the timeout must be positive (ms)");
  return std::make_shared<InProcessWorld>(size, timeout);
}

std::unique_ptr<Bootstrap> make_in_process_bootstrap(std::shared_ptr<InProcessWorld> world, int rank) {
  EPCOMM_CHECK(world != nullptr, "make_in_process_bootstrap: world is null");
  EPCOMM_CHECK(rank >= 0 && rank < world->size(), "make_in_process_bootstrap: rank ", rank,
               " is outside the world (expected 0 <= rank < ", world->size(), ")");
  return std::make_unique<InProcessBootstrap>(std::move(world), rank);
}

}  // namespace epcomm
