// epcomm/moe/distribute_v2.h — the operator family dispatch_v2 / combine_v2 / combine_add_rms_norm
// (docs/distribute-v2.md): CANN's aclnnMoeDistribute*V2 semantics on CPUs, running on epcomm's engine.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "epcomm/error.h"
#include "epcomm/group.h"
#include "epcomm/tensor.h"

namespace epcomm::moe {

// epcomm has one tensor type: a Tensor is a (possibly non-owning) view. Inputs are read, never written;
// caller output buffers (`*_out`) are written in place.
using TensorView = Tensor;

// ---- Groups and their communication context ------------------------------------------------------------
//
// The operators run on a Group (the EP group) and, with tp_world_size = 2, on a second Group of size 2 (the
// TP pair). Each Group used by these operators owns one communication context: a shared-memory segment per
// rank, a per-group call sequence number and a failed state (docs/distribute-v2.md). It is created
// collectively on the group's first call, or beforehand with init_group_context (recommended: a rank that
// misses the very first call is then reported by the operators' deadline instead of the bootstrap's). It
// lives as long as the Group. Calls on one group are made from one thread at a time, in the same order on
// every rank.
//
// Across nodes (comm_alg = "hierarchy", docs/internode.md): when the group's ranks span hosts (or virtual
// nodes, ranks_per_node / EPCOMM_RANKS_PER_NODE), ranks on one node share memory and the nodes talk over UCX,
// each token crossing the network once per destination node; results are bitwise those of one node. A TP
// pair must sit on one node.

struct GroupContextOptions {
  int64_t segment_bytes = 0;        // per rank; 0 = 64 MiB. Larger transfers move in rounds.
  std::optional<double> timeout_s;  // the group's default deadline; default: EPCOMM_TIMEOUT_S, else 100
  // Node partition: P > 0 makes nodes of P consecutive ranks (it must divide the group size); 0 takes
  // EPCOMM_RANKS_PER_NODE (a group of at most that many ranks is one node), else one node per host.
  int ranks_per_node = 0;
  int64_t num_rdma_bytes = 0;  // across nodes: the lanes per rank, split evenly over the nodes; 0 = 64 MiB
  // One node: address space of each rank's output arena, which dispatch_v2's expand_x and dynamic_scales are
  // carved from (and output_buffer's tensors), so that senders write every row straight into its final place
  // (docs/distribute-v2.md, "Output arena"). -1 = EPCOMM_OUTPUT_ARENA, else the physical memory; 0 = none
  // (rows are staged and pulled). Pages exist only where outputs were written.
  int64_t num_output_arena_bytes = -1;
  // Output memory of the arena written through when the context is created, and mapped by every peer then,
  // so that the first calls' rows land on pages that exist on every rank (size it for the outputs one call
  // keeps alive: expand_x and its scales, and expert outputs from output_buffer). 0 = none.
  int64_t num_output_reserve_bytes = 0;
};
// Collective over `group`. Throws InvalidUsage when the group already has a context.
void init_group_context(Group& group, const GroupContextOptions& options = {});
// The group's default deadline in seconds (creates nothing; the default when no context exists yet).
double group_timeout_s(Group& group);
// Number of nodes the group's context spans (1 on one node; 0 when the group has no context yet).
int group_num_nodes(Group& group);

// Across nodes: what this rank handed to the network for the group since its context was created. rows:
// dispatch_v2 token records sent to other nodes (one per distinct (token, destination node)) plus combine_v2
// rows sent back as proxy; row_bytes: their payload bytes; network_bytes / network_writes: everything,
// metadata and signals included. All zero on one node or without a context.
struct GroupNetworkCounters {
  int64_t rows = 0, row_bytes = 0, network_bytes = 0, network_writes = 0;
};
GroupNetworkCounters group_network_counters(Group& group);

// What this rank's dispatch_v2 and combine calls did with their rows since the group's context was created:
// shows whether the output arena is in use (docs/distribute-v2.md, "Output arena"). Zero without a context.
struct GroupCopyCounters {
  int64_t dispatch_staged_tokens = 0;  // tokens whose payload it staged (quantized) for receivers to pull
  int64_t dispatch_pushed_tokens = 0;  // tokens whose rows it wrote straight into receivers' expand_x
  int64_t combine_copied_rows = 0;     // combine rows it copied (or compressed) into other origins' windows
  int64_t combine_in_place_rows = 0;   // combine rows other origins read in place from its expand_x
};
GroupCopyCounters group_copy_counters(Group& group);

// Collective over `parent`: the ranks with the same `color` form a new Group, ranked by (key, parent rank).
// All ranks must be on one host (a local bootstrap named after the parent's unique id).
std::shared_ptr<Group> split_group(Group& parent, int color, int key);

// The ep × tp grid of docs/distribute-v2.md over `world` (size W·T, T = max(tp_world_size, 1)): world rank w
// is ep rank w / T and tp rank w % T (TP pairs are adjacent ranks). `tp` is null when T = 1. Collective over
// `world`.
struct EpTpGroups {
  std::shared_ptr<Group> ep, tp;
  int ep_rank = 0, tp_rank = 0;
};
EpTpGroups make_ep_tp_groups(Group& world, int tp_world_size);

// ---- Operators -----------------------------------------------------------------------------------------

struct OpOptions {
  std::string strict_hardware_limits;  // "", "A2", "A3" or "950" (docs/distribute-v2.md)
  int64_t hccl_buffsize_mb = 200;      // docs/distribute-v2.md window rule only; HCCL_BUFFSIZE is never read
  std::optional<std::chrono::milliseconds> timeout;  // default: the group's timeout
  // Copy threads per rank (as Config::num_threads of the normal mode): 0 takes the class default
  // (Buffer::set_num_threads, EPCOMM_NUM_THREADS), whose 0 means the host's hardware threads / the group's
  // ranks on it.
  int num_threads = 0;
  // Allocates the outputs the caller gives no *_out buffer for, once every argument has been checked;
  // default_allocator() when null.
  std::shared_ptr<Allocator> allocator;
  // The ranks of ep_group the call runs among, ascending, this rank included; empty: every rank. The other
  // ranks are neither sent to nor awaited (they may be gone). ep_world_size, ep_rank_id and moe_expert_num
  // then count the live ranks only: call rank i is ep_group rank live_ranks[i], and errors name ep_group
  // ranks. Every live rank passes the same list. One node, no TP pair (InvalidUsage otherwise). Low-latency
  // mode's ascend flavor runs its rank masks on it (docs/low-latency.md, "Masks and shrink").
  std::vector<int> live_ranks;
};

struct DispatchV2Args {
  TensorView x, expert_ids;  // (Bs,H) bf16|fp16; (Bs,K) int32
  std::optional<TensorView> scales, x_active_mask, expert_scales, elastic_info, performance_info;
  std::string group_ep, group_tp, comm_alg;  // accepted and ignored (checked in strict mode)
  int64_t ep_world_size = 0, ep_rank_id = 0, moe_expert_num = 0, tp_world_size = 0, tp_rank_id = 0,
          expert_shard_type = 0, shared_expert_num = 1, shared_expert_rank_num = 0, quant_mode = 0,
          global_bs = 0, expert_token_nums_type = 1, zero_expert_num = 0, copy_expert_num = 0,
          const_expert_num = 0;
  std::optional<DType> y_dtype;                // expand_x type for quant modes 1-4 (docs/distribute-v2.md)
  std::optional<DType> x_dtype, scales_dtype;  // reserved: must be absent
  std::optional<TensorView> expand_x_out, dynamic_scales_out, assist_info_for_combine_out,
      expert_token_nums_out, ep_recv_counts_out, tp_recv_counts_out, expand_scales_out;
};

// Outputs in the operator's order (docs/distribute-v2.md). Absent caller buffers are allocated with the exact
// shape and zero-filled; given ones are the same tensors, written in their valid part only.
struct DispatchV2Result {
  Tensor expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums, ep_recv_counts, tp_recv_counts,
      expand_scales;
};

// Collective and blocking over ep_group (and tp_group when tp_world_size = 2; may be null otherwise).
// Throws epcomm::Error: InvalidUsage (bad or mismatched arguments), Timeout, Aborted (docs/distribute-v2.md).
// When every rank's expand_x (and dynamic_scales) lie in its output arena (one node: the allocated outputs,
// or caller buffers from output_buffer), the senders write each row straight into them: one copy per row.
DispatchV2Result dispatch_v2(Group& ep_group, Group* tp_group, const DispatchV2Args& args,
                             const OpOptions& options = {});

// A contiguous, uninitialized tensor in this rank's output arena of ep_group's context, for the *_out
// buffers of dispatch_v2 (expand_x_out, dynamic_scales_out), so that the senders write rows straight into
// it; from `allocator` (default_allocator() when null) when the context has no arena (across nodes,
// num_output_arena_bytes = 0) or no room left. The arena's memory goes back when the tensor is released.
// Collective when the group has no context yet (it creates one with default options, as the first call does).
Tensor output_buffer(Group& ep_group, DType dtype, const Shape& shape,
                     const std::shared_ptr<Allocator>& allocator = nullptr);

struct CombineV2Args {
  TensorView expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales;
  std::optional<TensorView> tp_send_counts, x_active_mask, activation_scale, weight_scale, group_list,
      expand_scales, shared_expert_x, elastic_info, ori_x, const_expert_alpha_1, const_expert_alpha_2,
      const_expert_v, performance_info;
  std::string group_ep, group_tp, comm_alg;
  int64_t ep_world_size = 0, ep_rank_id = 0, moe_expert_num = 0, tp_world_size = 0, tp_rank_id = 0,
          expert_shard_type = 0, shared_expert_num = 1, shared_expert_rank_num = 0, global_bs = 0,
          out_dtype = 0, comm_quant_mode = 0, group_list_type = 0, zero_expert_num = 0, copy_expert_num = 0,
          const_expert_num = 0;
  std::optional<TensorView> x_out;  // (Bs,H); (Bs,1,H) for combine_add_rms_norm
};

// Returns x (Bs,H) in the expand_x dtype. Collective and blocking like dispatch_v2.
Tensor combine_v2(Group& ep_group, Group* tp_group, const CombineV2Args& args, const OpOptions& options = {});

struct CombineAddRmsNormArgs : CombineV2Args {
  TensorView residual_x, gamma;  // (Bs,1,H), (H,); dtype of expand_x
  float norm_eps = 1e-6f;
  std::optional<TensorView> y_out, rstd_out;
};
struct CombineAddRmsNormResult {
  Tensor y, rstd, x;  // (Bs,1,H), (Bs,1,1) fp32, (Bs,1,H)
};
CombineAddRmsNormResult combine_add_rms_norm(Group& ep_group, Group* tp_group,
                                             const CombineAddRmsNormArgs& args,
                                             const OpOptions& options = {});

// The shrink agreement round of low-latency mode's ascend flavor (docs/low-latency.md, "Masks and shrink"):
// collective among the ranks of ep_group that `masked` ([size] of 0 / 1) leaves unmasked, on one node. Each
// says it arrived and waits for the others up to the timeout (a peer whose process is gone is not waited
// for), then each publishes the set it saw and waits for the sets of those ranks; the agreed live set is the
// intersection. Returns `masked` with the ranks outside it added (a warning names them). Raises Timeout when
// the others masked this rank. A rank masked in `masked` returns it unchanged at once (it still uses up the
// group's call number, so that its calls stay in step with its peers'). Uses o.timeout only.
std::vector<int32_t> agree_on_mask(Group& ep_group, const std::vector<int32_t>& masked,
                                   const OpOptions& o = {});

// For callers that check arguments before they can build the argument struct (a language binding): makes the
// call `op` ("dispatch_v2", "combine_v2" or "combine_add_rms_norm") fail on every rank instead of leaving
// this rank one call behind its peers. Takes the call's sequence number on ep_group (and on tp_group when
// tp_world_size = 2), publishes a failed header there so that the peers' same call raises Aborted quoting
// `message`, and throws Error(code, "<prefix><message>") here. The groups stay usable. `live_ranks`: the
// call's OpOptions::live_ranks.
[[noreturn]] void fail_call(Group& ep_group, Group* tp_group, const std::string& op, int64_t tp_world_size,
                            ErrorCode code, const std::string& message,
                            const std::vector<int>& live_ranks = {});

}  // namespace epcomm::moe
