// api/moe_context.cc — creating a group's operator-family context, and the group helpers of
// epcomm/moe/distribute_v2.h (split, the ep × tp grid).
#include "api/moe_context.h"

#include <algorithm>
#include <cstring>

#include "api/arena_allocator.h"
#include "api/setup_log.h"
#include "common/check.h"
#include "common/env.h"
#include "common/log.h"

namespace epcomm::moe {
namespace {

void create_context(Group& group, const GroupContextOptions& options) {
  const std::string pre = detail::cat("epcomm[rank ", group.rank(), "] moe group context: ");
  try {
    log::level();  // a bad EPCOMM_LOG fails here, not in a call
  } catch (const Error& e) {
    EPCOMM_THROW(InvalidUsage, pre, e.what());
  }
  epcomm::detail::CommRequest req;
  req.what = "group";
  req.pre = pre;
  req.segment_bytes = options.segment_bytes;
  req.segment_name = "segment_bytes";
  req.rdma_bytes = options.num_rdma_bytes;
  req.timeout_s = options.timeout_s ? *options.timeout_s : env::timeout_s();
  req.peer_word = "ep rank";
  // Node partition: explicit, or EPCOMM_RANKS_PER_NODE (a group no larger than P is one node, so that a TP
  // pair or a small EP group stays whole), or by host.
  req.ranks_per_node = options.ranks_per_node;
  if (req.ranks_per_node == 0 && env::ranks_per_node() > 0)
    req.ranks_per_node = std::min(env::ranks_per_node(), group.size());
  EPCOMM_CHECK(options.num_output_arena_bytes >= -1, pre,
               "argument: num_output_arena_bytes: expected >= 0, or -1 for auto, got ",
               options.num_output_arena_bytes);
  EPCOMM_CHECK(options.num_output_reserve_bytes >= 0, pre,
               "argument: num_output_reserve_bytes: expected >= 0, got ", options.num_output_reserve_bytes);
  req.arena = {epcomm::detail::arena_bytes_for(options.num_output_arena_bytes),
               static_cast<size_t>(options.num_output_reserve_bytes)};
  auto ctx = std::make_shared<GroupContext>();
  ctx->open(group, req);
  EPCOMM_LOG(
      info, group.rank(), "moe group context: ",
      epcomm::detail::describe_ranks(group.rank(), ctx->node_of_rank, *ctx->transport, ctx->network.get()),
      "; segment ", detail::bytes_str(ctx->segment_bytes), "; output arena ",
      ctx->arena() ? detail::cat(detail::bytes_str(static_cast<int64_t>(ctx->arena()->bytes())), " (reserve ",
                                 detail::bytes_str(options.num_output_reserve_bytes), ")")
                   : std::string("none"),
      ctx->network ? detail::cat(", rdma lanes ", detail::bytes_str(options.num_rdma_bytes)) : std::string(),
      "; timeout ", ctx->timeout_s, " s");
  group.moe_context() = std::move(ctx);
  // Across nodes the network counters would count the warm-up, and the first calls there pay more than
  // page faults anyway: one node only.
  GroupContext& c = *group.moe_context();
  if (c.inter) return;
  c.run_warm_up([&] { epcomm::detail::warm_up_group(group); });
  c.counters.reset();  // the counters count the caller's calls only
}

}  // namespace

std::shared_ptr<Allocator> GroupContext::output_allocator(const std::shared_ptr<Allocator>& user) const {
  std::shared_ptr<Allocator> u = user ? user : default_allocator();
  if (auto a = arena()) return std::make_shared<epcomm::detail::ArenaAllocator>(std::move(a), std::move(u));
  return u;
}

GroupContext& context_of(Group& group) {
  if (!group.moe_context()) create_context(group, {});
  return *group.moe_context();
}

void init_group_context(Group& group, const GroupContextOptions& options) {
  EPCOMM_CHECK(
      !group.moe_context(), "epcomm[rank ", group.rank(),
      "] init_group_context: argument: the group already has a context (created by an earlier call)");
  create_context(group, options);
}

Tensor output_buffer(Group& ep_group, DType dtype, const Shape& shape,
                     const std::shared_ptr<Allocator>& allocator) {
  for (int64_t d : shape)
    EPCOMM_CHECK(d >= 0, "epcomm[rank ", ep_group.rank(), "] output_buffer: argument: shape ",
                 shape_str(shape), ": dimensions must be >= 0");
  return empty(dtype, shape, context_of(ep_group).output_allocator(allocator).get());
}

double group_timeout_s(Group& group) {
  return group.moe_context() ? group.moe_context()->timeout_s : env::timeout_s();
}

int group_num_nodes(Group& group) {
  const GroupContext* c = group.moe_context().get();
  if (!c) return 0;
  return c->inter ? c->inter->topo.num_nodes : 1;
}

GroupNetworkCounters group_network_counters(Group& group) {
  GroupNetworkCounters out;
  GroupContext* c = group.moe_context().get();
  if (!c || !c->inter || !c->network) return out;
  std::lock_guard<std::mutex> lock(c->call);  // not while a call runs
  out.rows = static_cast<int64_t>(c->inter->rows_sent);
  out.row_bytes = static_cast<int64_t>(c->inter->row_bytes_sent);
  const NetworkCounters n = c->network->counters();
  out.network_bytes = static_cast<int64_t>(n.payload_bytes);
  out.network_writes = static_cast<int64_t>(n.writes);
  return out;
}

GroupCopyCounters group_copy_counters(Group& group) {
  GroupCopyCounters out;
  GroupContext* c = group.moe_context().get();
  if (!c) return out;
  out.dispatch_staged_tokens = c->counters.dispatch_staged_tokens.load(std::memory_order_relaxed);
  out.dispatch_pushed_tokens = c->counters.dispatch_pushed_tokens.load(std::memory_order_relaxed);
  out.combine_copied_rows = c->counters.combine_copied_rows.load(std::memory_order_relaxed);
  out.combine_in_place_rows = c->counters.combine_in_place_rows.load(std::memory_order_relaxed);
  return out;
}

std::shared_ptr<Group> split_group(Group& parent, int color, int key) {
  struct Entry {
    int32_t color, key;
  } mine{color, key};
  std::vector<std::byte> bytes(sizeof(Entry));
  std::memcpy(bytes.data(), &mine, sizeof(Entry));
  auto all = parent.bootstrap().all_gather(bytes);
  std::vector<std::pair<int, int>> members;  // (key, parent rank) of our color
  for (int r = 0; r < parent.size(); ++r) {
    Entry e;
    std::memcpy(&e, all.data() + r * sizeof(Entry), sizeof(Entry));
    if (e.color == color) members.emplace_back(e.key, r);
  }
  std::sort(members.begin(), members.end());
  int sub_rank = 0;
  for (size_t i = 0; i < members.size(); ++i)
    if (members[i].second == parent.rank()) sub_rank = static_cast<int>(i);
  // Equal on the members, unique on the host: the parent's id, which split this is, and the color.
  const std::string job =
      detail::cat(parent.bootstrap().unique_id(), "-s", parent.next_instance(), "c", color);
  auto bs = make_local_bootstrap(job, sub_rank, static_cast<int>(members.size()),
                                 std::chrono::milliseconds(static_cast<int64_t>(env::timeout_s() * 1000)));
  return Group::create(std::move(bs));
}

EpTpGroups make_ep_tp_groups(Group& world, int tp_world_size) {
  EPCOMM_CHECK(tp_world_size >= 0 && tp_world_size <= 2,
               "make_ep_tp_groups: tp_world_size: expected 0, 1 or 2, got ", tp_world_size);
  const int T = std::max(tp_world_size, 1);
  EPCOMM_CHECK(world.size() % T == 0, "make_ep_tp_groups: the world size ", world.size(),
               " is not a multiple of tp_world_size ", T);
  EpTpGroups g;
  g.ep_rank = world.rank() / T;
  g.tp_rank = world.rank() % T;
  g.ep = split_group(world, g.tp_rank, g.ep_rank);
  if (T == 2) g.tp = split_group(world, g.ep_rank, g.tp_rank);
  return g;
}

}  // namespace epcomm::moe
