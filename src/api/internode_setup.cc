// api/internode_setup.cc — node partition and the shared-memory + network setup of a multi-node communicator.
#include "api/internode_setup.h"

#include <algorithm>
#include <map>

#include "bootstrap/subgroup.h"
#include "common/check.h"

namespace epcomm::detail {

namespace {
constexpr int64_t kDefaultRdmaBytes = 64ll << 20;
}

std::vector<int> node_partition(Group& group, int ranks_per_node, const std::string& pre) {
  const int R = group.size(), P = ranks_per_node;
  EPCOMM_CHECK(P >= 0, pre, "argument: ranks_per_node: expected >= 0, got ", P);
  std::vector<int> node_of(R);
  if (P > 0) {
    EPCOMM_CHECK(R % P == 0, pre, "argument: ranks_per_node = ", P, " must divide the number of ranks ", R);
    for (int r = 0; r < R; ++r) node_of[r] = r / P;
    return node_of;
  }
  std::map<std::string, int> node_id;
  for (int r = 0; r < R; ++r) {
    auto it = node_id.emplace(group.hosts()[r], static_cast<int>(node_id.size())).first;
    node_of[r] = it->second;
  }
  return node_of;
}

InternodeParts setup_internode(Group& group, const std::vector<int>& node_of_rank,
                               const InternodeRequest& req, const std::string& pre) {
  const size_t segment_bytes = req.segment_bytes, extra_bytes = req.extra_bytes;
  const int64_t rdma_bytes = req.rdma_bytes;
  const char* rdma_name = req.rdma_name;
  InternodeParts parts;
  const int R = group.size(), rank = group.rank();
  const int M = *std::max_element(node_of_rank.begin(), node_of_rank.end()) + 1;
  engine::Topology& t = (parts.inter = std::make_unique<engine::Internode>())->topo;
  t.rank = rank;
  t.size = R;
  t.num_nodes = M;
  t.node_of = node_of_rank;
  t.node_ranks.assign(M, {});
  t.local_index.assign(R, 0);
  for (int r = 0; r < R; ++r) {
    t.local_index[r] = static_cast<int>(t.node_ranks[node_of_rank[r]].size());
    t.node_ranks[node_of_rank[r]].push_back(r);
  }
  std::string sizes;
  bool equal = true;
  for (int n = 0; n < M; ++n) {
    sizes += cat(n ? ", " : "", "node ", n, ": ", t.node_ranks[n].size());
    equal = equal && t.node_ranks[n].size() == t.node_ranks[0].size();
  }
  EPCOMM_CHECK(equal, pre, "argument: nodes must have equal numbers of ranks, got ", sizes);
  const int P = t.ranks_per_node = static_cast<int>(t.node_ranks[0].size());

  const int64_t rdma = rdma_bytes ? rdma_bytes : kDefaultRdmaBytes;
  const size_t lane_bytes = static_cast<size_t>(rdma / M) / 4096 * 4096;
  const size_t minimum = engine::lane_overhead_bytes(P, R) + 4096;
  EPCOMM_CHECK(lane_bytes >= minimum, pre, "capacity: ", rdma_name, " = ", rdma, " gives each of the ", M,
               " nodes a lane of ", lane_bytes, " bytes, below the minimum of ", minimum, " (", rdma_name,
               " >= ", minimum * M, ")");
  engine::Internode& in = *parts.inter;
  in.lane = engine::carve_lane(lane_bytes, P, R);
  in.lanes_offset = (segment_bytes + 4095) / 4096 * 4096;
  const size_t region = lane_bytes * M;

  parts.node_bootstrap =
      make_subgroup_bootstrap(group.bootstrap(), t.node_ranks[t.node()], cat("n", t.node()));
  // Virtual nodes share this host's cores: waiters may spin only if every rank *on the host* has a core.
  const int host_ranks = static_cast<int>(
      std::count(group.hosts().begin(), group.hosts().end(), group.hosts()[static_cast<size_t>(rank)]));
  parts.extra_offset = (in.lanes_offset + region + 4095) / 4096 * 4096;
  parts.transport = make_shm_transport(
      *parts.node_bootstrap, extra_bytes ? parts.extra_offset + extra_bytes : in.lanes_offset + region,
      group.next_instance(), host_ranks);

  NetworkOptions no;
  for (int n = 0; n < M; ++n)
    if (n != t.node()) no.peers.push_back(t.rail(n));
  no.region = parts.transport->segment(t.local_index[rank]) + in.lanes_offset;
  no.region_bytes = region;
  no.timeout_s = req.timeout_s;
  no.peer_word = req.peer_word;
  Transport* tp = parts.transport.get();
  // An arrival may concern any rank of this node (a mirrored header, window or failure): wake them all.
  no.on_arrival = [tp](int) {
    for (int l = 0; l < tp->size(); ++l) tp->notify(l);
  };
  parts.network = make_ucx_network(group.bootstrap(), no);
  in.net = parts.network.get();
  return parts;
}

}  // namespace epcomm::detail
