// engine/segment.h — the one function that places every region of a rank's shared segment: the engine's
// control words, peer cells, header ring and data area; across nodes one lane per node (the network's
// region); then a Buffer's shared combine-input and dispatch-input areas. Every size check, minimum and size
// hint comes from the same functions (control_bytes, lane_overhead_bytes), so they cannot disagree.
// (The output arena is a mapping of its own, made by the transport: transport/transport.h, ArenaRequest.)
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/internode.h"
#include "engine/protocol.h"

namespace epcomm::engine {

struct SegmentRequest {
  size_t engine_bytes = 0;  // control words, peer cells, header ring and data area (num_nvl_bytes)
  int num_ranks = 1;
  int num_nodes = 1, ranks_per_node = 1;
  size_t lanes_bytes = 0;  // across nodes: all lanes together (num_rdma_bytes), split evenly per node
  size_t combine_input_bytes = 0, dispatch_input_bytes = 0;
};

// Offsets from the start of the segment. Regions are page-aligned where a mapping or a network
// registration may start (lanes, input areas).
struct SegmentMap {
  SegmentLayout engine;     // [0, engine_bytes)
  size_t lanes_offset = 0;  // num_nodes lanes of lane.bytes each (num_nodes > 1)
  size_t lanes_bytes = 0;   // lane.bytes * num_nodes, or 0 on one node
  LaneLayout lane;          // inside every lane
  size_t combine_input_offset = 0, combine_input_bytes = 0;
  size_t dispatch_input_offset = 0, dispatch_input_bytes = 0;
  size_t total = 0;  // bytes of every rank's segment
};

SegmentMap map_segment(const SegmentRequest& r);
// The smallest engine part (the control part plus 256 bytes of data area) and the smallest lane (its
// control part plus one page) that map_segment's callers accept.
size_t min_engine_bytes(int num_ranks);
size_t min_lane_bytes(int ranks_per_node, int num_ranks);

}  // namespace epcomm::engine
