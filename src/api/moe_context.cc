// api/moe_context.cc — creating a group's operator-family context, and the group helpers of
// epcomm/moe/distribute_v2.h (split, the ep × tp grid).
#include "api/moe_context.h"

#include <algorithm>
#include <cstring>

#include "common/check.h"
#include "common/env.h"

namespace epcomm::moe {
namespace {

constexpr int64_t kDefaultSegmentBytes = 64ll << 20;

void create_context(Group& group, const GroupContextOptions& options) {
  const std::string pre = detail::cat("epcomm[rank ", group.rank(), "] moe group context: ");
  EPCOMM_CHECK(group.size() <= engine::kMaxRanks, pre, "argument: at most ", engine::kMaxRanks,
               " ranks are supported, got ", group.size());
  const double timeout = options.timeout_s ? *options.timeout_s : env::timeout_s();
  EPCOMM_CHECK(timeout > 0, pre, "argument: timeout_s: expected > 0, got ", timeout);
  const int64_t bytes = options.segment_bytes ? options.segment_bytes : kDefaultSegmentBytes;
  const int64_t minimum = static_cast<int64_t>(engine::control_bytes(group.size())) + 4 * engine::kAlign;
  EPCOMM_CHECK(bytes >= minimum, pre, "argument: segment_bytes = ", bytes,
               " is below the control part plus 256 bytes (", minimum, " bytes for ", group.size(),
               " ranks)");
  // Every rank must use the same segment size: agree first, so that every rank raises the same error.
  std::vector<std::byte> mine(sizeof(int64_t));
  std::memcpy(mine.data(), &bytes, sizeof(bytes));
  auto all = group.bootstrap().all_gather(mine);
  std::string sizes;
  bool differ = false;
  for (int r = 0; r < group.size(); ++r) {
    int64_t b;
    std::memcpy(&b, all.data() + r * sizeof(int64_t), sizeof(b));
    sizes += detail::cat(r ? ", " : "", "rank ", r, " = ", b);
    differ |= b != bytes;
  }
  EPCOMM_CHECK(!differ, pre, "mismatch: ranks disagree on segment_bytes: ", sizes);
  // The operator family runs on one host's shared memory (docs/internode.md: across nodes only the
  // normal-mode Buffer for now). Every rank sees the same host list, so every rank raises the same error.
  for (int r = 1; r < group.size(); ++r)
    EPCOMM_CHECK(group.hosts()[r] == group.hosts()[0], pre,
                 "argument: the ranks span several hosts (rank 0 on '", group.hosts()[0], "', rank ", r,
                 " on '", group.hosts()[r],
                 "'); the distribute-v2 operators across nodes (comm_alg=\"hierarchy\") are not supported by "
                 "epcomm yet: use the normal-mode Buffer across nodes, or one group per host");
  auto ctx = std::make_shared<GroupContext>();
  ctx->rank = group.rank();
  ctx->size = group.size();
  ctx->timeout_s = timeout;
  ctx->transport = make_shm_transport(group.bootstrap(), static_cast<size_t>(bytes), group.next_instance());
  ctx->layout = engine::carve(static_cast<size_t>(bytes), group.size());
  group.moe_context() = std::move(ctx);
}

}  // namespace

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

double group_timeout_s(Group& group) {
  return group.moe_context() ? group.moe_context()->timeout_s : env::timeout_s();
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
