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

// Collective calls (all_gather, barrier) must be made by every rank in the same order. Not thread-safe.
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
// Bootstrap per rank (from the rank's own thread or before starting it).
class InProcessWorld;
std::shared_ptr<InProcessWorld> make_in_process_world(int size, std::chrono::milliseconds timeout = std::chrono::seconds(100));
std::unique_ptr<Bootstrap> make_in_process_bootstrap(std::shared_ptr<InProcessWorld> world, int rank);

// Processes on one host: rank 0 listens on an abstract Unix-domain socket named from `job_id`
// (leaves no file behind), the others connect to it. `job_id` must be equal on all ranks and unique on the
// host (for example the launcher's pid and a random number).
std::unique_ptr<Bootstrap> make_local_bootstrap(const std::string& job_id, int rank, int size,
                                                std::chrono::milliseconds timeout = std::chrono::seconds(100));

// Built from two callbacks (the Python front fills them from a torch.distributed group).
// `all_gather(bytes)` must return size * bytes.size() bytes, rank-major.
using AllGatherFn = std::function<std::vector<std::byte>(const std::vector<std::byte>&)>;
using BarrierFn = std::function<void()>;
std::unique_ptr<Bootstrap> make_callback_bootstrap(int rank, int size, AllGatherFn all_gather, BarrierFn barrier);

}  // namespace epcomm
