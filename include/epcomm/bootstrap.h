// epcomm/bootstrap.h — out-of-band setup messaging between the ranks of a group.
// A Bootstrap moves opaque bytes while Buffers are being created; it never carries payload.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace epcomm {

// Collective calls (all_gather, barrier) must be made by every rank in the same order. Not thread-safe: one
// thread per rank uses its Bootstrap. Every collective blocks until all ranks arrive or its deadline (the
// timeout given at creation, counted from the call) passes.
//
// Errors (in-process and local bootstraps): Timeout names the operation, the timeout and the ranks that did
// not arrive; ranks that disagree (different lengths, barrier against all_gather) get InvalidUsage naming the
// rank and both values; a rank that exits or dies mid-job gives Aborted naming it. Every rank of the
// collective gets the same error. After any error the Bootstrap is failed for good: later calls throw
// Aborted quoting the first error (the ranks no longer agree on which collective comes next).
class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank contributes `bytes` (same length on every rank); returns size() * bytes.size() bytes,
  // rank-major. Throws epcomm::Error(Timeout) naming the missing ranks when the deadline passes.
  virtual std::vector<std::byte> all_gather(const std::vector<std::byte>& bytes) = 0;
  virtual void barrier() = 0;
  // A string equal on every rank of the group and unique on this host; used to name shared memory.
  virtual const std::string& unique_id() const = 0;
};

// Threads of one process, one Bootstrap per thread. Create a shared InProcessWorld once, then one
// Bootstrap per rank (from the rank's own thread or before starting it). The world is thread-safe and shared
// by its Bootstraps (each holds a reference); at most one live Bootstrap per rank. unique_id() is unique per
// world on this host (pid, counter, random bits). Creation is not collective and does not block.
class InProcessWorld;
std::shared_ptr<InProcessWorld> make_in_process_world(
    int size, std::chrono::milliseconds timeout = std::chrono::seconds(100));
std::unique_ptr<Bootstrap> make_in_process_bootstrap(std::shared_ptr<InProcessWorld> world, int rank);

// Processes on one host: rank 0 listens on an abstract Unix-domain socket named from `job_id`
// (leaves no file behind), the others connect to it. `job_id` must be equal on all ranks and unique on the
// host (for example the launcher's pid and a random number).
// Creation is collective and blocking: rank 0 binds the name (Error(InvalidUsage) if another live job holds
// it) and waits for every rank; the others retry connecting until the deadline. Rank 0 keeps the name until
// its Bootstrap is destroyed. A connect timeout names the ranks that never connected (on rank 0 and on every
// connected rank), or says that rank 0 is not listening. Ranks other than 0 wait up to min(timeout, 2 s)
// longer than rank 0 for its verdict, so their errors name the culprit too. unique_id() is derived from
// job_id (equal on every rank). No SIGPIPE is ever raised.
// A job_id of the form "tcp://A.B.C.D:PORT" puts rank 0's listener on that TCP address instead, for ranks on
// different hosts or network namespaces (hosts of the same byte order); everything else is the same.
std::unique_ptr<Bootstrap> make_local_bootstrap(
    const std::string& job_id, int rank, int size,
    std::chrono::milliseconds timeout = std::chrono::seconds(100));

// Built from two callbacks (the Python front fills them from a torch.distributed group).
// `all_gather(bytes)` must return size * bytes.size() bytes, rank-major; any other size throws
// Error(InvalidUsage) naming expected and actual. Deadlines are the callbacks' business. Creation is
// collective: it calls all_gather once to agree on unique_id() (rank 0's host-unique id). The Bootstrap owns
// the callbacks.
using AllGatherFn = std::function<std::vector<std::byte>(const std::vector<std::byte>&)>;
using BarrierFn = std::function<void()>;
std::unique_ptr<Bootstrap> make_callback_bootstrap(int rank, int size, AllGatherFn all_gather,
                                                   BarrierFn barrier);

}  // namespace epcomm
