// engine/internode.h — what the engine needs to run across nodes (docs/normal-mode.md): the node
// partition, the Network, and the lanes every segment carries for the other nodes.
//
// Two-hop model. Rank s on node a talks over the network only to its rail peers: the ranks with its local
// index on the other nodes. The rail peer p of s on node n is s's *proxy* there: p's segment holds a lane
// for node a, where s's header, failure notice and dispatch windows land (written by the network), and
// where the ranks of node n acknowledge what they pulled and write their combine copies of s's tokens. Seen
// from node n, s lives in p's lane: OpContext maps control(s), header(s), data(s), cell(s, d) there, so the
// intranode code paths serve remote sources unchanged. The proxy forwards acknowledgements and reduced
// combine partials back to s, which receives them in its own lane for node n.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/protocol.h"
#include "transport/network.h"

namespace epcomm::engine {

struct Topology {
  int rank = 0, size = 1, num_nodes = 1, ranks_per_node = 1;
  std::vector<int> node_of, local_index;     // [R]
  std::vector<std::vector<int>> node_ranks;  // [M][P], ascending

  int node() const { return node_of[rank]; }
  bool is_local(int r) const { return node_of[r] == node_of[rank]; }
  // The rank of this node that stands in for remote rank r (same local index).
  int proxy_of(int r) const { return node_ranks[node()][local_index[r]]; }
  // This rank's rail peer on node n.
  int rail(int n) const { return node_ranks[n][local_index[rank]]; }
};

// The first bytes of a lane.
struct alignas(64) LaneControl {
  Control mirror;       // the remote source's control words (failed/message, stage_ready) + our
                        // combine_open for its tokens
  PeerCell from_proxy;  // in the origin's lane: ack (dispatch windows pulled on that node) and done
                        // (combine partials of a window arrived), written by the proxy over the network
  std::atomic<uint64_t>
      meta_ready;                  // in the proxy's lane: combine routing of window w arrived: pack(seq, w+1)
  std::atomic<uint64_t> released;  // in the origin's lane: the last call the rail peer there has finished
                                   // (its lane for us is free again: data of the next call may go)
};

// Offsets inside one lane. readers: one PeerCell per local index (acks/dones of the node's ranks for the
// mirrored source). Data: dispatch windows (two halves) or, in combine, the copy window, the routing the
// origin sends and the partials the proxy sends back.
struct LaneLayout {
  size_t readers = 0, headers = 0, header_bytes = 0, data = 0, data_bytes = 0, bytes = 0;
};
LaneLayout carve_lane(size_t lane_bytes, int ranks_per_node, int num_ranks);
// The smallest lane that leaves `data_bytes` for data.
size_t lane_overhead_bytes(int ranks_per_node, int num_ranks);

struct Internode {
  Topology topo;
  Network* net = nullptr;
  size_t lanes_offset = 0;  // in every segment; the Network's region starts here
  LaneLayout lane;          // one lane per node (own node's lane unused); lane.bytes each
  // What this rank sent over the network as rows (for the dedup checks and statistics).
  uint64_t rows_sent = 0, row_bytes_sent = 0;
  uint64_t last_ticket = 0;  // of the latest network write

  size_t lane_offset(int node) const { return static_cast<size_t>(node) * lane.bytes; }  // in the region
};

// Dispatch window layout in a lane half (compact, written by one network write): a 64-byte-aligned block with
// the entry count and the entries' token indices, then the entries' routing metadata, then their rows.
struct CompactWindow {
  size_t meta_off, rows_off, bytes;
};
inline CompactWindow compact_window(int64_t count, size_t meta_stride, size_t row_stride) {
  CompactWindow c;
  c.meta_off = align64(8 + 4 * static_cast<size_t>(count));
  c.rows_off = c.meta_off + static_cast<size_t>(count) * meta_stride;
  c.bytes = c.rows_off + static_cast<size_t>(count) * row_stride;
  return c;
}
inline size_t compact_window_max(int64_t window, size_t meta_stride, size_t row_stride) {
  return compact_window(window, meta_stride, row_stride).bytes;
}

}  // namespace epcomm::engine
