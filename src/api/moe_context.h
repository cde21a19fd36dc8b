// api/moe_context.h — the communication context a Group carries for the operator family: its transport
// (one shared-memory segment per rank; across nodes also the lanes and the network), the per-group call
// sequence number and the failed state.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "engine/internode.h"
#include "engine/protocol.h"
#include "epcomm/moe/distribute_v2.h"
#include "transport/network.h"
#include "transport/transport.h"

namespace epcomm::moe {

struct GroupContext {
  // Across nodes (null inter on one node); declared before the transport, destroyed after it.
  std::unique_ptr<engine::Internode> inter;
  std::unique_ptr<Bootstrap> node_bootstrap;
  std::unique_ptr<Transport> transport;
  std::unique_ptr<Network> network;  // destroyed first: its region lives in the transport's segments
  engine::SegmentLayout layout;
  int rank = 0, size = 1;
  double timeout_s = 100;
  uint64_t seq = 0;    // last sequence number issued
  std::string failed;  // non-empty: a call failed after data moved; later calls raise Aborted quoting it
  std::mutex call;     // one call in flight per group
  ~GroupContext() {
    if (network && !failed.empty()) network->abandon();  // peers may never answer
  }
};

// The group's context, created collectively with default options when it has none yet.
GroupContext& context_of(Group& group);

}  // namespace epcomm::moe
