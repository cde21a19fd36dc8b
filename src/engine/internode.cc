// engine/internode.cc — lane carving.
#include "engine/internode.h"

namespace epcomm::engine {

static size_t lane_header_slot_bytes(int num_ranks) {
  return align64(sizeof(HeaderData) + sizeof(int32_t) * (static_cast<size_t>(kMaxExperts) + num_ranks));
}

size_t lane_overhead_bytes(int ranks_per_node, int num_ranks) {
  return align64(sizeof(LaneControl)) + align64(sizeof(PeerCell) * ranks_per_node) +
         2 * lane_header_slot_bytes(num_ranks);
}

LaneLayout carve_lane(size_t lane_bytes, int ranks_per_node, int num_ranks) {
  LaneLayout l;
  l.readers = align64(sizeof(LaneControl));
  l.headers = l.readers + align64(sizeof(PeerCell) * ranks_per_node);
  l.header_bytes = lane_header_slot_bytes(num_ranks);
  l.data = l.headers + 2 * l.header_bytes;
  l.data_bytes = lane_bytes > l.data ? (lane_bytes - l.data) / kAlign * kAlign : 0;
  l.bytes = lane_bytes;
  return l;
}

}  // namespace epcomm::engine
