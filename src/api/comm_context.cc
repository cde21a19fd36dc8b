// api/comm_context.cc — opening a communication context (agreement, node partition, segments, lanes and
// network) and the one failure policy of its calls.
#include "api/comm_context.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "bootstrap/subgroup.h"
#include "common/check.h"
#include "common/log.h"

namespace epcomm::detail {

namespace {

constexpr int64_t kDefaultSegmentBytes = 64ll << 20;
constexpr int64_t kDefaultRdmaBytes = 64ll << 20;
constexpr size_t kTextBytes = 32;  // an agreed string, NUL-padded

// Every rank must use the same sizes: they are exchanged in one all_gather, then every rank raises the same
// error, listing each rank's value.
void agree(Group& group, const std::vector<std::pair<const char*, int64_t>>& ints,
           const std::vector<std::pair<const char*, std::string>>& texts, const std::string& pre) {
  const size_t stride = ints.size() * sizeof(int64_t) + texts.size() * kTextBytes;
  std::vector<std::byte> mine(stride);
  for (size_t f = 0; f < ints.size(); ++f) std::memcpy(mine.data() + f * 8, &ints[f].second, 8);
  for (size_t f = 0; f < texts.size(); ++f) {
    const std::string& s = texts[f].second;
    EPCOMM_CHECK(s.size() < kTextBytes, pre, "argument: ", texts[f].first, ": expected at most ",
                 kTextBytes - 1, " characters, got '", s, "'");
    std::memcpy(mine.data() + ints.size() * 8 + f * kTextBytes, s.data(), s.size());
  }
  const auto all = group.bootstrap().all_gather(mine);
  auto compare = [&](const char* name, size_t offset, size_t bytes, auto value) {
    std::string per_rank;
    bool differ = false;
    for (int r = 0; r < group.size(); ++r) {
      const std::byte* p = all.data() + static_cast<size_t>(r) * stride + offset;
      per_rank += cat(r ? ", " : "", "rank ", r, " = ", value(p));
      differ |= std::memcmp(p, mine.data() + offset, bytes) != 0;
    }
    EPCOMM_CHECK(!differ, pre, "mismatch: ranks disagree on ", name, ": ", per_rank);
  };
  for (size_t f = 0; f < ints.size(); ++f)
    compare(ints[f].first, f * 8, 8, [](const std::byte* p) {
      int64_t v;
      std::memcpy(&v, p, 8);
      return v;
    });
  for (size_t f = 0; f < texts.size(); ++f)
    compare(texts[f].first, ints.size() * 8 + f * kTextBytes, kTextBytes,
            [](const std::byte* p) { return std::string(reinterpret_cast<const char*>(p)); });
}

// The topology of a multi-node context; InvalidUsage unless every node has as many ranks.
engine::Topology topology(int rank, const std::vector<int>& node_of, const std::string& pre) {
  engine::Topology t;
  const int R = static_cast<int>(node_of.size());
  const int M = *std::max_element(node_of.begin(), node_of.end()) + 1;
  t.rank = rank;
  t.size = R;
  t.num_nodes = M;
  t.node_of = node_of;
  t.node_ranks.assign(M, {});
  t.local_index.assign(R, 0);
  for (int r = 0; r < R; ++r) {
    t.local_index[r] = static_cast<int>(t.node_ranks[node_of[r]].size());
    t.node_ranks[node_of[r]].push_back(r);
  }
  std::string sizes;
  bool equal = true;
  for (int n = 0; n < M; ++n) {
    sizes += cat(n ? ", " : "", "node ", n, ": ", t.node_ranks[n].size());
    equal = equal && t.node_ranks[n].size() == t.node_ranks[0].size();
  }
  EPCOMM_CHECK(equal, pre, "argument: nodes must have equal numbers of ranks, got ", sizes);
  t.ranks_per_node = static_cast<int>(t.node_ranks[0].size());
  return t;
}

}  // namespace

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

void CommContext::open(Group& group, const CommRequest& req) {
  const std::string& pre = req.pre;
  what_ = req.what;
  rank = group.rank();
  num_ranks = group.size();
  timeout_s = req.timeout_s;
  EPCOMM_CHECK(num_ranks <= engine::kMaxRanks, pre, "argument: at most ", engine::kMaxRanks,
               " ranks are supported, got ", num_ranks);
  EPCOMM_CHECK(timeout_s > 0, pre, "argument: timeout_s: expected > 0, got ", timeout_s);
  EPCOMM_CHECK(req.segment_bytes >= 0, pre, "argument: ", req.segment_name, ": expected >= 0, got ",
               req.segment_bytes);
  EPCOMM_CHECK(req.rdma_bytes >= 0, pre, "argument: ", req.rdma_name, ": expected >= 0, got ",
               req.rdma_bytes);
  std::vector<std::pair<const char*, int64_t>> ints = {{req.segment_name, req.segment_bytes},
                                                       {req.rdma_name, req.rdma_bytes},
                                                       {"ranks_per_node", req.ranks_per_node}};
  ints.insert(ints.end(), req.agree.begin(), req.agree.end());
  agree(group, ints, req.agree_text, pre);
  segment_bytes = req.segment_bytes ? req.segment_bytes : kDefaultSegmentBytes;
  const int64_t minimum = static_cast<int64_t>(engine::min_engine_bytes(num_ranks));
  EPCOMM_CHECK(segment_bytes >= minimum, pre, "capacity: ", req.segment_name, " = ", segment_bytes,
               " is below the control part of the segment plus 256 bytes (", minimum, " bytes for ",
               num_ranks, " ranks)");
  node_of_rank = node_partition(group, req.ranks_per_node, pre);
  num_nodes = *std::max_element(node_of_rank.begin(), node_of_rank.end()) + 1;
  engine::SegmentRequest sr;
  sr.engine_bytes = static_cast<size_t>(segment_bytes);
  sr.num_ranks = num_ranks;
  sr.combine_input_bytes = static_cast<size_t>(req.combine_input_bytes);
  sr.dispatch_input_bytes = static_cast<size_t>(req.dispatch_input_bytes);
  if (num_nodes > 1) {
    connect_nodes(group, req);
  } else {
    segment = engine::map_segment(sr);
    transport = make_shm_transport(group.bootstrap(), segment.total, group.next_instance(), 0, req.arena);
  }
}

// Across nodes (docs/normal-mode.md): equal node sizes, a shared-memory transport over this node's ranks
// whose segments also hold one lane per node (and, for Buffers, whose output arenas this node's ranks map),
// and the network to this rank's rail peers.
void CommContext::connect_nodes(Group& group, const CommRequest& req) {
  const std::string& pre = req.pre;
  inter = std::make_unique<engine::Internode>();
  engine::Topology& t = inter->topo = topology(rank, node_of_rank, pre);
  const int M = t.num_nodes, P = t.ranks_per_node, R = num_ranks;
  const int64_t rdma = req.rdma_bytes ? req.rdma_bytes : kDefaultRdmaBytes;
  engine::SegmentRequest sr;
  sr.engine_bytes = static_cast<size_t>(segment_bytes);
  sr.num_ranks = R;
  sr.num_nodes = M;
  sr.ranks_per_node = P;
  sr.lanes_bytes = static_cast<size_t>(rdma);
  sr.combine_input_bytes = static_cast<size_t>(req.combine_input_bytes);
  sr.dispatch_input_bytes = static_cast<size_t>(req.dispatch_input_bytes);
  segment = engine::map_segment(sr);
  const size_t lane_bytes = segment.lane.bytes, minimum = engine::min_lane_bytes(P, R);
  EPCOMM_CHECK(lane_bytes >= minimum, pre, "capacity: ", req.rdma_name, " = ", rdma, " gives each of the ", M,
               " nodes a lane of ", lane_bytes, " bytes, below the minimum of ", minimum, " (", req.rdma_name,
               " >= ", minimum * M, ")");
  inter->lane = segment.lane;
  inter->lanes_offset = segment.lanes_offset;

  node_bootstrap = make_subgroup_bootstrap(group.bootstrap(), t.node_ranks[t.node()], cat("n", t.node()));
  // Virtual nodes share this host's cores: waiters may spin only if every rank *on the host* has a core.
  const int host_ranks = static_cast<int>(
      std::count(group.hosts().begin(), group.hosts().end(), group.hosts()[static_cast<size_t>(rank)]));
  // The ranks of a node only read each other's outputs (a combine's rows in place); nobody writes rows there.
  ArenaRequest arena = req.arena_across_nodes ? req.arena : ArenaRequest{};
  arena.peers_write = false;
  transport = make_shm_transport(*node_bootstrap, segment.total, group.next_instance(), host_ranks, arena);

  NetworkOptions no;
  for (int n = 0; n < M; ++n)
    if (n != t.node()) no.peers.push_back(t.rail(n));
  no.region = own_segment() + segment.lanes_offset;
  no.region_bytes = segment.lanes_bytes;
  no.timeout_s = req.timeout_s;
  no.peer_word = req.peer_word;
  Transport* tp = transport.get();
  // An arrival may concern any rank of this node (a mirrored header, window or failure): wake them all.
  no.on_arrival = [tp](int) {
    for (int l = 0; l < tp->size(); ++l) tp->notify(l);
  };
  network = make_ucx_network(group.bootstrap(), no);
  inter->net = network.get();
}

void CommContext::close() noexcept {
  if (network && !failed().empty()) network->abandon();  // peers may never answer
  network.reset();                                       // before the segments its region lives in
  transport.reset();
  node_bootstrap.reset();
}

engine::OpContext CommContext::op_context(uint64_t s, engine::OpKind kind, double timeout) const {
  engine::OpContext ctx(*transport, segment.engine, s, kind, timeout, inter.get());
  name_call(ctx);
  return ctx;
}

void CommContext::name_call(engine::OpContext& ctx) const {
  ctx.number_calls_after(seq_shown_base);
  if (warming_up) ctx.mark_warm_up();
}

void CommContext::run_warm_up(const std::function<void()>& calls) {
  struct Marked {  // until the calls end or throw
    bool& on;
    explicit Marked(bool& flag) : on(flag) { on = true; }
    ~Marked() { on = false; }
  } marked(warming_up);
  calls();
  seq_shown_base = seq;
}

uint8_t* CommContext::own_segment() const {
  return transport->segment(inter ? inter->topo.local_index[rank] : rank);
}

std::string CommContext::failed() const {
  std::lock_guard<std::mutex> lk(failed_mutex_);
  return failed_message_;
}

void CommContext::mark_failed(const std::string& message) {
  std::lock_guard<std::mutex> lk(failed_mutex_);
  if (failed_message_.empty()) {
    failed_message_ = message;
    EPCOMM_LOG(error, rank, "the ", what_, " failed, later calls raise Aborted: ", message);
  }
}

void run_call(CommContext& c, engine::OpContext& ctx,
              const std::function<void(const std::function<void()>& moving)>& body) {
  bool moving = false;
  try {
    body([&moving] { moving = true; });
    ctx.release_lanes();  // across nodes: this call is over here, the peers' next one may send
  } catch (const Error& e) {
    if (moving || e.code() == ErrorCode::Timeout || e.code() == ErrorCode::Internal ||
        ctx.saw_peer_failure()) {
      c.mark_failed(e.what());
      ctx.publish_failure(e.what());
    } else {
      ctx.release_lanes();  // the context stays usable: the peers' next call may come
    }
    throw;
  } catch (const std::exception& e) {
    const std::string msg = cat(ctx.prefix(), "internal error: ", e.what());
    c.mark_failed(msg);
    ctx.publish_failure(msg);
    throw Error(ErrorCode::Internal, msg);
  }
}

}  // namespace epcomm::detail
