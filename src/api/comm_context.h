// api/comm_context.h — the communication context that every collective object stands on: a Buffer (which
// adds its communication thread) and an operator-family group context (which adds its call lock). It owns
// the node partition, the shared-memory transport, across nodes the lanes and the network to the rail
// peers, the segment map (engine/segment.h), the call sequence number and the failed state, and applies the
// one failure policy of docs/errors.md (run_call).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/internode.h"
#include "engine/op_context.h"
#include "engine/segment.h"
#include "epcomm/group.h"
#include "transport/network.h"
#include "transport/transport.h"

namespace epcomm::detail {

// What an object asks of its context. Sizes are the user's options (0 = the default).
struct CommRequest {
  const char* what = "Buffer";  // names the object in messages: "Buffer", "group"
  std::string pre;              // starts the set-up error messages: "epcomm[rank 0] Buffer: "
  int64_t segment_bytes = 0;    // the engine's part of every segment; 0 = 64 MiB
  const char* segment_name = "num_nvl_bytes";
  int64_t rdma_bytes = 0;  // across nodes: the lanes' total; 0 = 64 MiB
  const char* rdma_name = "num_rdma_bytes";
  int ranks_per_node = 0;  // > 0: consecutive blocks of that many ranks per (virtual) node; 0: by host
  double timeout_s = 100;
  std::string peer_word = "rank";  // names peers in network errors ("ep rank" for group contexts)
  int64_t combine_input_bytes = 0, dispatch_input_bytes = 0;
  ArenaRequest arena;  // the output arenas: on one node, and across nodes when arena_across_nodes is set
  // Across nodes too (Buffers): each rank's output arena, mapped by the ranks of its node.
  bool arena_across_nodes = false;
  // More values every rank must agree on, compared with the sizes above in one exchange (mismatch errors
  // name each rank's value): integers, then strings.
  std::vector<std::pair<const char*, int64_t>> agree;
  std::vector<std::pair<const char*, std::string>> agree_text;
};

struct CommContext {
  int rank = 0, num_ranks = 1, num_nodes = 1;
  std::vector<int> node_of_rank;
  double timeout_s = 100;
  int64_t segment_bytes = 0;  // the engine's part, resolved
  engine::SegmentMap segment;
  // Destroyed in reverse order: the network first (its region lives in the transport's segments), then the
  // transport, then the node bootstrap it was made with; `inter` (which the network pointer lives in) last.
  std::unique_ptr<engine::Internode> inter;   // across nodes only
  std::unique_ptr<Bootstrap> node_bootstrap;  // across nodes only: the ranks of this node
  std::unique_ptr<Transport> transport;       // this node's ranks
  std::unique_ptr<Network> network;           // across nodes only: to the rail peers on the other nodes
  uint64_t seq = 0;                           // last sequence number issued
  uint64_t seq_shown_base = 0;                // calls made by the creation itself (messages count after)
  bool warming_up = false;                    // the creation's warm-up calls are running (api/warm_up.cc)

  CommContext() = default;
  CommContext(const CommContext&) = delete;
  CommContext& operator=(const CommContext&) = delete;
  ~CommContext() { close(); }

  // Collective over `group`: agrees on the sizes, partitions the nodes, maps the segments and connects the
  // network. Throws InvalidUsage (argument, mismatch, capacity) naming the option, or SystemError.
  void open(Group& group, const CommRequest& req);
  // Releases the network and the transport (abandoning the network when failed: peers may never answer).
  void close() noexcept;

  // The engine's view of one call on this context.
  engine::OpContext op_context(uint64_t s, engine::OpKind kind, double timeout) const;
  // Numbers `ctx`'s messages from the caller's first call, and marks a warm-up call as one.
  void name_call(engine::OpContext& ctx) const;
  // Call `s` as messages show it: counted from the caller's first call.
  uint64_t shown_seq(uint64_t s) const { return s > seq_shown_base ? s - seq_shown_base : 0; }
  // Runs the creation's warm-up calls (api/warm_up.cc): they are marked "(warm-up)" in messages while they
  // run, and the caller's calls are numbered from #1 after them.
  void run_warm_up(const std::function<void()>& calls);
  uint8_t* own_segment() const;
  std::string failed() const;
  void mark_failed(const std::string& message);

 private:
  const char* what_ = "Buffer";
  mutable std::mutex failed_mutex_;
  std::string failed_message_;  // non-empty: failed; later calls raise Aborted quoting it

  void connect_nodes(Group& group, const CommRequest& req);
};

// Runs one call's `body` (given a `moving()` to call once data starts to move) under the one failure policy
// of docs/errors.md. Errors found before data moved (validation, mismatch, capacity, a peer's failed
// header) leave the context usable. Once data moved, on a timeout, on a peer's failure and on an internal
// error, the context fails for good: later calls raise Aborted quoting the error, and the peers get its
// failure notice. Rethrows the error (a non-Error exception as Internal, "internal error: ...").
void run_call(CommContext& c, engine::OpContext& ctx,
              const std::function<void(const std::function<void()>& moving)>& body);

// The node of every rank: consecutive blocks of `ranks_per_node` ranks when it is > 0 (it must divide the
// group size), else one node per host (Group::hosts). `pre` starts the error messages.
std::vector<int> node_partition(Group& group, int ranks_per_node, const std::string& pre);

}  // namespace epcomm::detail
