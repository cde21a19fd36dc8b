// bootstrap/in_process.h — the shared state behind in-process bootstraps (ranks are threads of one process).
// Internal: the public entry points are make_in_process_world / make_in_process_bootstrap in
// epcomm/bootstrap.h.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "epcomm/bootstrap.h"
#include "epcomm/error.h"

namespace epcomm {

// One collective rendezvous shared by the `size` rank threads of a world. Thread-safe: every method may be
// called from any thread. Collectives are matched by generation: the last rank to arrive publishes the result
// and advances the generation, which releases the waiters.
//
// Any failure (a deadline, ranks that disagree, abort()) fails the world for good: the ranks waiting in that
// collective throw the failure itself, every later collective throws Error(Aborted) quoting it. A failed
// rendezvous cannot be resumed safely because the ranks no longer agree on which collective comes next.
class InProcessWorld {
 public:
  InProcessWorld(int size, std::chrono::milliseconds timeout);

  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const std::string& unique_id() const { return unique_id_; }

  // Each rank has at most one live Bootstrap; a second one for the same rank is a usage error.
  void claim_rank(int rank);
  void release_rank(int rank);

  // Blocks until every rank made the same collective `op` with the same byte count, then returns the
  // contributions rank-major. `op` is "all_gather" or "barrier" and names the call in error messages.
  std::vector<std::byte> collective(int rank, const char* op, const std::vector<std::byte>& bytes);

  // Fails the world with Error(Aborted, reason) and wakes every waiter. Idempotent: the first failure stays.
  void abort(const std::string& reason);

 private:
  [[noreturn]] void fail_locked(ErrorCode code, const std::string& message);
  std::vector<int> missing_ranks_locked() const;
  void complete_locked();  // the last rank arrived: judge, publish the result, release the waiters

  const int size_;
  const std::chrono::milliseconds timeout_;
  const std::string unique_id_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> claimed_;
  uint64_t generation_ = 0;  // collectives completed so far
  int num_arrived_ = 0;      // in the current collective
  std::vector<bool> arrived_;
  // The current collective's arrivals. They are judged only once every rank is in, against rank 0 (as the
  // local bootstrap does), so that every rank of a mismatched collective gets the same InvalidUsage.
  std::vector<const char*> ops_;
  std::vector<std::vector<std::byte>> contributions_;
  std::vector<std::byte> result_;  // of the last completed collective; waiters copy it out
  std::optional<Error> failure_;
};

}  // namespace epcomm
