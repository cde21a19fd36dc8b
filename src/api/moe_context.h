// api/moe_context.h — the communication context a Group carries for the operator family: a
// detail::CommContext (api/comm_context.h: transport, across nodes the lanes and the network, the segment
// map, the per-group call sequence number, the failed state) plus the lock that keeps one call in flight and
// the group's copy threads.
#pragma once

#include <memory>
#include <mutex>

#include "api/comm_context.h"
#include "engine/op_context.h"
#include "engine/workers.h"
#include "epcomm/moe/distribute_v2.h"
#include "tensor/output_arena.h"

namespace epcomm::moe {

struct GroupContext : epcomm::detail::CommContext {
  std::mutex call;             // one call in flight per group
  engine::WorkerPool workers;  // copy threads (OpOptions::num_threads), started when a call first needs them
  engine::CopyCounters counters;         // group_copy_counters
  std::vector<uint8_t> payload_scratch;  // dispatch_v2: tokens quantized while the headers travel
  // This rank's output arena (one node, num_output_arena_bytes > 0), or null.
  std::shared_ptr<OutputArena> arena() const { return transport ? transport->output_arena() : nullptr; }
  // `user` (default_allocator() when null) behind the arena when there is one.
  std::shared_ptr<Allocator> output_allocator(const std::shared_ptr<Allocator>& user) const;
};

// The group's context, created collectively with default options when it has none yet.
GroupContext& context_of(Group& group);

}  // namespace epcomm::moe

namespace epcomm::detail {
// The round trips a one-node group context makes when it is created (api/warm_up.cc; EPCOMM_WARMUP).
void warm_up_group(Group& group);
}  // namespace epcomm::detail
