// engine/protocol.cc — segment carving and per-call window geometry.
#include "engine/protocol.h"

#include <algorithm>

namespace epcomm::engine {

const char* op_kind_name(OpKind op) {
  switch (op) {
    case OpKind::dispatch:
      return "dispatch";
    case OpKind::cached_dispatch:
      return "dispatch(cached)";
    case OpKind::combine:
      return "combine";
    case OpKind::dispatch_v2:
      return "dispatch_v2";
    case OpKind::combine_v2:
      return "combine_v2";
    case OpKind::combine_add_rms_norm:
      return "combine_add_rms_norm";
    case OpKind::low_latency_dispatch:
      return "low_latency_dispatch";
    case OpKind::low_latency_combine:
      return "low_latency_combine";
    case OpKind::low_latency_clean:
      return "low_latency_clean";
  }
  return "?";
}

static size_t header_slot_bytes(int num_ranks) {
  return align64(sizeof(HeaderData) + sizeof(int32_t) * (static_cast<size_t>(kMaxExperts) + num_ranks));
}

size_t control_bytes(int num_ranks) {
  size_t n =
      align64(sizeof(Control)) + align64(sizeof(PeerCell) * num_ranks) + 2 * header_slot_bytes(num_ranks);
  return (n + 4095) / 4096 * 4096;
}

SegmentLayout carve(size_t segment_bytes, int num_ranks) {
  SegmentLayout s;
  s.control = 0;
  s.cells = align64(sizeof(Control));
  s.headers = s.cells + align64(sizeof(PeerCell) * num_ranks);
  s.header_bytes = header_slot_bytes(num_ranks);
  s.data = control_bytes(num_ranks);
  s.data_bytes = segment_bytes > s.data ? segment_bytes - s.data : 0;
  s.total = segment_bytes;
  return s;
}

DispatchGeometry dispatch_geometry(size_t data_bytes, size_t row_bytes, size_t meta_bytes) {
  DispatchGeometry g;
  g.row_stride = align64(std::max<size_t>(row_bytes, 1));
  g.meta_stride = align64(std::max<size_t>(meta_bytes, 1));
  g.half_bytes = data_bytes / 2 / kAlign * kAlign;
  g.window = static_cast<int64_t>(g.half_bytes / (g.row_stride + g.meta_stride));
  return g;
}

size_t dispatch_min_data_bytes(size_t row_bytes, size_t meta_bytes) {
  return 2 * (align64(std::max<size_t>(row_bytes, 1)) + align64(std::max<size_t>(meta_bytes, 1)));
}

CombineGeometry combine_geometry(size_t data_bytes, size_t row_bytes, int slots, size_t weight_bytes) {
  CombineGeometry g;
  g.row_stride = align64(std::max<size_t>(row_bytes, 1));
  g.weight_stride = weight_bytes ? align64(weight_bytes) : 0;
  g.slots = slots;
  size_t per_token = static_cast<size_t>(slots) * (g.row_stride + g.weight_stride);
  g.window = static_cast<int64_t>(data_bytes / per_token);
  return g;
}

size_t combine_min_data_bytes(size_t row_bytes, int slots, size_t weight_bytes) {
  return static_cast<size_t>(slots) *
         (align64(std::max<size_t>(row_bytes, 1)) + (weight_bytes ? align64(weight_bytes) : 0));
}

}  // namespace epcomm::engine
