// engine/segment.cc — placing the regions of a rank's segment.
#include "engine/segment.h"

namespace epcomm::engine {

namespace {
size_t page(size_t n) {
  return (n + 4095) / 4096 * 4096;
}
}  // namespace

size_t min_engine_bytes(int num_ranks) {
  return control_bytes(num_ranks) + 4 * kAlign;
}

size_t min_lane_bytes(int ranks_per_node, int num_ranks) {
  return lane_overhead_bytes(ranks_per_node, num_ranks) + 4096;
}

SegmentMap map_segment(const SegmentRequest& r) {
  SegmentMap m;
  m.engine = carve(r.engine_bytes, r.num_ranks);
  size_t end = r.engine_bytes;
  if (r.num_nodes > 1) {
    const size_t lane_bytes = r.lanes_bytes / static_cast<size_t>(r.num_nodes) / 4096 * 4096;
    m.lane = carve_lane(lane_bytes, r.ranks_per_node, r.num_ranks);
    m.lanes_offset = page(r.engine_bytes);
    m.lanes_bytes = lane_bytes * static_cast<size_t>(r.num_nodes);
    end = m.lanes_offset + m.lanes_bytes;
  }
  // The combine-input area, then the dispatch-input area, each on its own pages.
  m.combine_input_offset = page(end);
  m.combine_input_bytes = r.combine_input_bytes;
  m.dispatch_input_offset = m.combine_input_offset + page(r.combine_input_bytes);
  m.dispatch_input_bytes = r.dispatch_input_bytes;
  if (r.dispatch_input_bytes)
    m.total = m.dispatch_input_offset + r.dispatch_input_bytes;
  else if (r.combine_input_bytes)
    m.total = m.combine_input_offset + r.combine_input_bytes;
  else
    m.total = end;
  return m;
}

}  // namespace epcomm::engine
