// api/moe_context.h — the communication context a Group carries for the operator family: its transport
// (one shared-memory segment per rank), the per-group call sequence number and the failed state.
#pragma once

#include <memory>
#include <mutex>
#include <string>

#include "engine/protocol.h"
#include "epcomm/moe/distribute_v2.h"
#include "transport/transport.h"

namespace epcomm::moe {

struct GroupContext {
  std::unique_ptr<Transport> transport;
  engine::SegmentLayout layout;
  int rank = 0, size = 1;
  double timeout_s = 100;
  uint64_t seq = 0;    // last sequence number issued
  std::string failed;  // non-empty: a call failed after data moved; later calls raise Aborted quoting it
  std::mutex call;     // one call in flight per group
};

// The group's context, created collectively with default options when it has none yet.
GroupContext& context_of(Group& group);

}  // namespace epcomm::moe
