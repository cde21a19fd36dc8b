// api/internode_setup.h — what a Buffer and an operator-family group context both build when their ranks span
// nodes (docs/normal-mode.md): the node partition, a shared-memory transport over this node's ranks whose
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

// What a communicator asks of setup_internode.
struct InternodeRequest {
  size_t segment_bytes = 0;                  // the engine's own bytes of every segment (before the lanes)
  int64_t rdma_bytes = 0;                    // the lanes' total, split evenly across the nodes; 0 = 64 MiB
  const char* rdma_name = "num_rdma_bytes";  // names that size in errors
  double timeout_s = 100;                    // deadline of every network wait
  std::string peer_word = "rank";            // names peers in network errors ("ep rank" for group contexts)
  size_t extra_bytes = 0;                    // more bytes after the lanes (a Buffer's shared input areas)
};

// Collective over the group. `node_of_rank` from node_partition (at least two nodes); `pre` starts the
// error messages. Throws InvalidUsage for unequal node sizes or lanes below the minimum.
InternodeParts setup_internode(Group& group, const std::vector<int>& node_of_rank,
                               const InternodeRequest& req, const std::string& pre);

}  // namespace epcomm::detail
