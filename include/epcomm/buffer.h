// epcomm/buffer.h — the normal-mode Buffer: get_dispatch_layout, dispatch and combine (docs/normal-mode.md).
// A Buffer is created collectively over a Group and owns this rank's shared-memory segment and one
// communication thread. Its methods are called from one host thread at a time; separate Buffers are
// independent. dispatch and combine are collective: every rank calls them in the same order.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "epcomm/bootstrap.h"
#include "epcomm/config.h"
#include "epcomm/error.h"
#include "epcomm/event.h"
#include "epcomm/group.h"
#include "epcomm/low_latency.h"
#include "epcomm/tensor.h"
#include "epcomm/types.h"

namespace epcomm {

struct BufferOptions {
  int64_t num_nvl_bytes = 0;      // this rank's shared-memory segment; 0 = 64 MiB. Equal on all ranks.
  int64_t num_rdma_bytes = 0;     // internode staging (unused on one node); equal on all ranks.
  bool low_latency_mode = false;  // enables the low-latency calls (docs/low-latency.md)
  bool enable_shrink = false;     // low-latency shrink (docs/low-latency.md); set_low_latency_shrink too
  ReceiveOrder receive_order = ReceiveOrder::expert_major;
  int ranks_per_node = 0;                // 0 = one node per host
  std::optional<double> timeout_s;       // default: env EPCOMM_TIMEOUT_S, else 100
  std::shared_ptr<Allocator> allocator;  // for every output; default_allocator() when null
  // Shared-memory area for expert outputs (get_combine_input); 0 = none. Equal on all ranks. On one node, a
  // combine whose x lies there moves no copy: each origin reads the rows of its tokens in place.
  int64_t num_combine_input_bytes = 0;
  // Shared-memory area for dispatch inputs (get_dispatch_input); 0 = none. Equal on all ranks. On one node, a
  // dispatch whose plain x lies there stages nothing but the routing: receivers read the rows in place.
  int64_t num_dispatch_input_bytes = 0;
  // Output memory the allocator faults in when the Buffer is created (Allocator::reserve), so that the first
  // dispatch and combine do not pay the kernel's first-touch page faults (zeroing, well under 1 GB/s on some
  // hosts). Size it like the outputs of one dispatch + combine: about num_tokens x num_topk x row bytes
  // (expert_major; num_tokens x ranks reached in rank_major) + num_tokens x hidden x elem. 0 = none. Local.
  // Once every rank has mapped the reserves, each rank also passes once over every reserve it may write
  // rows into (streaming stores; env EPCOMM_ARENA_SETTLE=0 skips it): on some virtual machines the first
  // pass of stores through a mapping of shared pages is 30-60x slower than the next. With low_latency_mode
  // the reserve is at least num_rdma_bytes (one node): the size hint of get_low_latency_rdma_size_hint holds
  // two calls' outputs, so the first low-latency call is as fast as the next.
  int64_t num_output_reserve_bytes = 0;
  // Address space of this rank's output arena: a shared-memory range, mapped by every peer on its node, that
  // the outputs are carved from (and handed to the allocator through Allocator::adopt), so that on one node
  // a dispatch sender writes each row once, straight into its place in the receiver's recv_x, with nothing
  // staged, and a combine of rows in the arena is read in place (across nodes, by the ranks of its node).
  // Pages exist only where outputs were written; freed outputs keep theirs for the next call (up to 4 GiB).
  // -1 = auto: env EPCOMM_OUTPUT_ARENA, else the host's physical memory; 0 = none (outputs come from the
  // allocator and dispatch copies every row through the segment). Output memory reserved with
  // num_output_reserve_bytes is then carved from the arena and mapped by the peers up front.
  int64_t num_output_arena_bytes = -1;
  // The contract a language front speaks ("ascend", "deepep"; empty for C++ callers): compared across
  // ranks at creation, so that ranks of different flavors fail there instead of in a call.
  std::string flavor;
};

namespace engine {
struct HandleData;  // the contents (internal: src/engine/handle_impl.h)
}

// What dispatch leaves for combine and cached re-dispatch. Immutable; tied to the Buffer that made it.
class Handle {
 public:
  using Impl = engine::HandleData;
  explicit Handle(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  ReceiveOrder receive_order() const;
  int64_t num_tokens() const;
  int num_topk() const;
  int num_experts() const;
  int64_t num_recv_rows() const;                            // N: exact rows (PAD included)
  int64_t num_rows() const;                                 // N, or num_worst_tokens when it was given
  std::vector<int64_t> num_recv_tokens_per_expert() const;  // aligned list
  std::vector<int64_t> num_recv_pairs_per_expert() const;   // cnt
  std::vector<int64_t> num_recv_rows_per_source() const;    // [R], PAD excluded
  // [R * R], row-major (source s, receiver d): the rows rank d received from rank s in this dispatch, PAD
  // excluded; equal on every rank (the receive plans every rank computes from the exchanged counts).
  std::vector<int64_t> num_rows_per_source_and_receiver() const;
  // [T * R] 0/1: whether own token t was sent to rank d (the layout's is_token_in_rank).
  std::vector<uint8_t> is_token_in_rank() const;
  // [num_rows] i32, -1 for PAD/tail rows (a low-latency handle: unspecified past each expert's pairs)
  Tensor recv_src_rank() const;
  Tensor recv_src_token() const;  // [num_rows] i32
  Tensor recv_src_slot() const;   // [num_rows] i32, all -1 in rank_major
  uint64_t dispatch_id() const;   // the group-wide sequence number of the dispatch that made it
  // Across nodes (a fresh normal-mode dispatch; empty otherwise), what the positional items that need other
  // ranks' routing are computed from (docs/python.md). Per received row, the ranks of this node its source
  // token goes to: bit j = the node's j-th rank (ascending), 0 for PAD and tail rows (empty with more than
  // 32 ranks per node).
  std::vector<uint32_t> recv_node_masks() const;
  // The entries of the dispatch windows that this rank's rail peer on `node` (the rank with its local index
  // there) sent to this node, in order, which this rank read as its proxy (none for this node): their token
  // indices, node masks as above (empty with more than 32 ranks per node) and, with top-k, K ids each
  // ([count * K]); `num_tokens` is that peer's T (this rank's for this node).
  struct RailEntries {
    int64_t num_tokens = 0;
    std::vector<int32_t> tokens, ids;
    std::vector<uint32_t> masks;
  };
  RailEntries rail_entries(int node) const;
  const Impl& impl() const { return *impl_; }

 private:
  std::shared_ptr<const Impl> impl_;
};

struct LayoutResult {
  Tensor num_tokens_per_rank;                      // [R] i32
  std::optional<Tensor> num_tokens_per_rdma_rank;  // [M] i32; none when M == 1
  Tensor num_tokens_per_expert;                    // [E] i32
  Tensor is_token_in_rank;                         // [T, R] bool
  EventOverlap event;
};

struct DispatchArgs {
  Payload x;
  std::shared_ptr<const Handle> handle;
  std::optional<Tensor> num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
      num_tokens_per_expert, topk_idx, topk_weights, dispatch_wait_recv_cost_stats;
  int64_t expert_alignment = 1, num_worst_tokens = 0;
  bool async_finish = false, allocate_on_comm_stream = false;
  std::optional<Config> config;
  std::optional<EventOverlap> previous_event;
  std::optional<QuantMode> quant_mode;
  std::optional<ReceiveOrder> receive_order;
};

struct DispatchResult {
  Payload recv_x;
  std::optional<Tensor> recv_topk_idx, recv_topk_weights;
  std::optional<std::vector<int64_t>> num_recv_tokens_per_expert_list;  // none for cached dispatch
  std::shared_ptr<const Handle> handle;                                 // none for cached dispatch
  EventOverlap event;
};

struct CombineArgs {
  Tensor x;
  std::shared_ptr<const Handle> handle;
  std::optional<Tensor> topk_weights;
  std::optional<Tensor> bias;   // [T, H'] in x's dtype
  std::optional<Tensor> bias2;  // second element of a bias tuple
  std::optional<Config> config;
  std::optional<EventOverlap> previous_event;
  bool async_finish = false, allocate_on_comm_stream = false;
  std::optional<Tensor> combine_send_cost_stats;
};

struct CombineResult {
  Tensor combined_x;
  std::optional<Tensor> combined_topk_weights;
  EventOverlap event;
};

class Buffer {
 public:
  // Collective over `group`.
  Buffer(std::shared_ptr<Group> group, const BufferOptions& options = {});
  ~Buffer();  // destroy() if not done yet; never throws
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  int rank() const;
  int num_ranks() const;
  int num_nodes() const;
  int node_of(int rank) const;
  ReceiveOrder receive_order() const;
  double timeout_s() const;
  int64_t num_nvl_bytes() const;

  // What this rank sent to other nodes since the Buffer was created (all zero on one node). Read it between
  // calls (after their events completed): the communication thread updates it.
  struct InternodeCounters {
    int64_t rows = 0;           // dispatch rows: one per (token, other node that needs it)
    int64_t row_bytes = 0;      // their payload bytes (data + scales)
    int64_t network_bytes = 0;  // everything handed to the network: rows, routing, headers, partials, signals
    int64_t network_writes = 0;
  };
  InternodeCounters internode_counters() const;
  // Raw network bandwidth (GB/s, 1e9 B/s) from this rank to its first rail peer: `bytes` put `iterations`
  // times into a registered buffer with the transport's one-sided put. Collective over the group; 0 on one
  // node. For the bench's ratio_to_link.
  double measure_link_gbps(int64_t bytes = 64 << 20, int iterations = 5);

  // Local: no communication.
  LayoutResult get_dispatch_layout(const Tensor& topk_idx, int num_experts,
                                   std::optional<EventOverlap> previous_event = std::nullopt,
                                   bool async_finish = false, bool allocate_on_comm_stream = false);
  DispatchResult dispatch(const DispatchArgs& args);
  CombineResult combine(const CombineArgs& args);
  // For callers that check arguments before they can build DispatchArgs / CombineArgs (a language binding):
  // makes the collective call `op` ("dispatch", "cached_dispatch" or "combine") fail on every rank instead of
  // leaving this rank one call behind. Takes the call's sequence number, publishes a failed header so that
  // the peers' same call raises Aborted quoting `message`, and throws Error(code, "<prefix><message>") here.
  // The Buffer stays usable; the next call pairs with the peers' next call.
  [[noreturn]] void fail_call(const std::string& op, ErrorCode code, const std::string& message);

  // Low-latency mode (docs/low-latency.md; BufferOptions::low_latency_mode = true), DeepEP's layout.
  // Collective, in call order with dispatch and combine (the two modes interleave freely on one Buffer).
  LowLatencyDispatchResult low_latency_dispatch(const LowLatencyDispatchArgs& args);
  LowLatencyCombineResult low_latency_combine(const LowLatencyCombineArgs& args);
  // A new [L, R * T_max, H] bf16 tensor in this rank's output arena (its peers read it in place): write the
  // expert outputs there and pass it as LowLatencyCombineArgs::x, and combine reads every row straight from
  // it with no copy. Local.
  Tensor low_latency_combine_buffer(const Handle& handle);
  // Rank masks (docs/low-latency.md, "Masks and shrink"), DeepEP's names. A masked rank is skipped by the
  // low-latency calls: nothing is sent to it or awaited from it, its experts' pairs are absent. update and
  // query are local (every rank sets the same mask); query returns [R] with 1 for masked ranks.
  void low_latency_update_mask_buffer(int rank, bool mask = false);
  std::vector<int32_t> low_latency_query_mask_buffer();
  // Collective among the unmasked ranks: clears the mask (every rank takes part in the next calls again).
  void low_latency_clean_mask_buffer();
  // Shrink (DeepEP's enable_shrink): a peer that misses the deadline of a
  // low-latency call is masked on every survivor instead of failing the call. Local; set it on every rank.
  void set_low_latency_shrink(bool enable);
  // DeepEP's clean_low_latency_buffer: validates its arguments; with shrink on it is collective (a peer
  // that misses it is masked), otherwise local.
  void clean_low_latency_buffer(int64_t num_max_dispatch_tokens_per_rank, int64_t hidden, int num_experts);
  // DeepEP's get_low_latency_rdma_size_hint: a num_rdma_bytes with which every low-latency call with these
  // parameters succeeds, on one node or across nodes (any node partition), in every format. InvalidUsage
  // for parameters no call could have (t_max, hidden, num_ranks < 1; num_experts not a multiple of ranks).
  static int64_t get_low_latency_rdma_size_hint(int64_t num_max_dispatch_tokens_per_rank, int64_t hidden,
                                                int num_ranks, int num_experts);
  // A [handle.num_rows, hidden] tensor of `dtype` (bf16, f16 or f32) at the start of this rank's shared
  // combine-input area (BufferOptions::num_combine_input_bytes; InvalidUsage when it is too small). Write the
  // expert outputs there and pass it (or its first rows' view) as CombineArgs::x: on one node combine then
  // copies nothing, each origin reads the rows of its tokens in place (docs/normal-mode.md). The memory
  // belongs to the Buffer: every call returns the same area, valid until destroy(); do not write it while a
  // combine that reads it is in flight. hidden = 0: the dispatched hidden size.
  Tensor get_combine_input(const Handle& handle, DType dtype = DType::bf16, int64_t hidden = 0);
  int64_t num_combine_input_bytes() const;
  // A [num_tokens, hidden] tensor of `dtype` (bf16, f16 or f32) at the start of this rank's shared
  // dispatch-input area (BufferOptions::num_dispatch_input_bytes; InvalidUsage when it is too small). Write
  // the tokens there (or have the layer before dispatch write its output there) and pass it, or a view of its
  // first rows, as DispatchArgs::x of a plain (unquantized) dispatch: on one node the sender then stages only
  // the routing and every receiver reads the rows it needs in place, so each received byte is copied once.
  // Same lifetime rules as get_combine_input: one area per Buffer, valid until destroy(); do not write it
  // while a dispatch that reads it is in flight.
  Tensor get_dispatch_input(int64_t num_tokens, int64_t hidden, DType dtype = DType::bf16);
  int64_t num_dispatch_input_bytes() const;
  // This rank's output arena (BufferOptions::num_output_arena_bytes): its address space in bytes, or 0 when
  // the Buffer has none (options, several nodes, or no address space for it); then dispatch stages rows.
  int64_t num_output_arena_bytes() const;

  // What this rank's calls copied and what its peers read in place, since the Buffer was created: shows
  // whether the shared input areas are in use. Read between calls (after their events completed).
  struct CopyCounters {
    int64_t dispatch_staged_tokens = 0;  // tokens whose payload this rank copied (or quantized) into staging
    int64_t dispatch_in_place_tokens = 0;  // tokens receivers read in place from its dispatch-input area
    int64_t dispatch_pushed_tokens = 0;    // tokens whose rows it wrote straight into receivers' recv_x
    int64_t combine_copied_rows = 0;       // rows it copied into other ranks' combine windows
    int64_t combine_in_place_rows = 0;     // rows other ranks read in place from its combine-input area
    // Own tokens it combined directly: every copy read straight from its holder's x (output arena or
    // combine-input area) at the rows a pushing dispatch wrote, with no windows (docs/normal-mode.md).
    int64_t combine_direct_tokens = 0;
    // Other ranks' tokens it reduced for them in direct combines, once done with its own: the last chunks
    // of a slower rank's tokens (results identical to the origin's own; EPCOMM_COMBINE_SHARING=0: none).
    int64_t combine_shared_tokens = 0;
  };
  CopyCounters copy_counters() const;

  // Local: waits for this rank's queued operations, releases the segment, invalidates handles.
  void destroy();
  EventOverlap capture() const { return EventOverlap(); }

  static int num_threads();  // class default for Config::num_threads (0 = automatic)
  static void set_num_threads(int n);
  static Config get_dispatch_config(int num_ranks);
  static Config get_combine_config(int num_ranks);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace epcomm
