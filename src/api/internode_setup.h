// api/internode_setup.h — what a Buffer and an operator-family group context both build when their ranks span
// nodes (spec/normal-mode.md §6): the node partition, a shared-memory transport over this node's ranks whose
// segments also carry one lane per node, and the network to this rank's rail peers.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/internode.h"
#include "epcomm/bootstrap.h"
#include "epcomm/buffer.h"
#include "transport/network.h"
#include "transport/transport.h"

namespace epcomm::detail {

// The node of every rank: consecutive blocks of `ranks_per_node` ranks when it is > 0 (it must divide the
// group size), else one node per host (Group::hosts). `pre` starts the error messages.
std::vector<int> node_partition(Group& group, int ranks_per_node, const std::string& pre);

// Everything a multi-node communicator owns, in destruction order (network first: its region lives in the
// transport's segments; the transport before the node bootstrap it was made with).
struct InternodeParts {
  std::unique_ptr<engine::Internode> inter;
  std::unique_ptr<Bootstrap> node_bootstrap;  // the ranks of this node
  std::unique_ptr<Transport> transport;       // this node's segments: `segment_bytes`, then the lanes
  std::unique_ptr<Network> network;           // to the rail peers on the other nodes
  size_t extra_offset = 0;                    // where the segment's `extra_bytes` start (after the lanes)
};

// Collective over the group. `node_of_rank` from node_partition (at least two nodes); `rdma_bytes` is the
// lanes' total (0 = 64 MiB), split evenly across the nodes; `rdma_name` names that size in errors
// ("num_rdma_bytes"); `peer_word` names peers in network errors ("ep rank"); `extra_bytes` more follow the
// lanes in every segment (a Buffer's combine-input area). Throws InvalidUsage for unequal node sizes or lanes
// below the minimum.
InternodeParts setup_internode(Group& group, const std::vector<int>& node_of_rank, size_t segment_bytes,
                               int64_t rdma_bytes, const char* rdma_name, double timeout_s,
                               const std::string& pre, const std::string& peer_word = "rank",
                               size_t extra_bytes = 0);

}  // namespace epcomm::detail
