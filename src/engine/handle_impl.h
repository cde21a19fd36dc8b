// engine/handle_impl.h — the contents of a dispatch Handle: the routes of this rank's tokens and the
// placement of the rows it received, everything combine and cached re-dispatch need.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "epcomm/tensor.h"
#include "epcomm/types.h"

namespace epcomm::engine {

// The contents of a dispatch Handle (epcomm/buffer.h: Handle::Impl is this type).
struct HandleData {
  const void* buffer_key = nullptr;  // identity of the Buffer that made it
  std::weak_ptr<void> buffer_alive;  // expires when that Buffer is destroyed
  // Blocks until the fields above `recv_src_rank` are final (the dispatch's counts are exchanged); throws
  // when that dispatch failed. Set by the API; lets a caller use the handle of an asynchronous dispatch.
  std::function<void()> wait_shapes;
  uint64_t seq = 0;  // the dispatch's group-wide sequence number
  ReceiveOrder order = ReceiveOrder::expert_major;
  int num_ranks = 1, num_experts = 0, num_topk = 0, num_local = 0;
  int64_t num_tokens = 0, num_recv_rows = 0, num_rows = 0, expert_alignment = 1, num_worst_tokens = 0;
  int64_t expert_block_rows = 0;  // low-latency layout: rows per local expert block (0: normal mode)
  // Low-latency dispatch with rank masks: the real rank of each rank index of this handle (the dispatch ran
  // among these unmasked ranks only; its ranks and experts are numbered within them), and the number within
  // them of each real expert (-1: on a masked rank). Both empty: every rank, real numbers.
  std::vector<int32_t> live_ranks, expert_map;
  // Rows every rank of this host received together (pushed: against cache_resident_push_bytes).
  int64_t host_recv_rows = 0;
  int64_t hidden = 0;

  // Own tokens: normalized ids [T*K] (-1 = none), weights [T*K] (empty without top-k), destination ranks
  // [T*R] and tokens per destination rank [R].
  bool has_topk = false;
  std::vector<int32_t> topk_ids;
  std::vector<float> topk_weights;
  std::vector<uint8_t> in_rank;
  std::vector<int32_t> tokens_per_rank;

  // Received rows.
  std::vector<int64_t> list, cnt, rows_per_source;
  std::vector<int64_t>
      rows_matrix;  // [R * R]: rows receiver d got from source s at [s * R + d], PAD excluded
  Tensor recv_src_rank, recv_src_token, recv_src_slot;  // [num_rows] i32
  // Rows grouped by source rank (CSR), each group ordered by (source token, slot).
  std::vector<int64_t> source_offsets;  // [R + 1]
  std::vector<int32_t> source_rows;

  // Where our tokens' copies lie on their holders, when the dispatch pushed them (empty otherwise): the row
  // in holder rank_of(id)'s recv_x per top-k slot ([T*K], expert_major; -1 at slots without an expert) or in
  // rank d's recv_x per destination ([T*R], rank_major; -1 where not sent). A direct combine reads the
  // holders' x at these rows.
  std::vector<int32_t> send_rows;
  bool pushed = false;  // send_rows hold the placement (every rank pushed its rows in that dispatch)

  // Across nodes, a fresh normal-mode dispatch records what the positional items that need other ranks'
  // routing are computed from (docs/python.md; all empty otherwise):
  // - per received row, the ranks of this node its source token goes to: bit j = the node's j-th rank
  //   (ascending); 0 for PAD and tail rows; empty with more than 32 ranks per node.
  std::vector<uint32_t> recv_node_mask;
  // - [M], as proxy of the rail peer on node m (this node: empty): the entries of its dispatch windows this
  //   node needed, in order: token index, node mask as above (empty with more than 32 ranks per node) and,
  //   with top-k, its K ids; and that peer's number of tokens (this node: this rank's).
  std::vector<std::vector<int32_t>> rail_tokens, rail_ids;
  std::vector<std::vector<uint32_t>> rail_masks;
  std::vector<int64_t> rail_num_tokens;

  // The copies of own token t in canonical order (docs/normal-mode.md): f(slot, holder) per top-k slot k
  // with an expert, ascending (expert_major: slot k, holder the expert's rank), or per destination rank d,
  // ascending (rank_major: slot d, holder d). Slots index [T * slots] arrays such as send_rows.
  bool by_slot() const { return order == ReceiveOrder::expert_major && num_topk > 0; }
  int copy_slots() const { return by_slot() ? num_topk : num_ranks; }  // entries per token of send_rows
  template <typename F>
  void for_each_copy(int64_t t, F&& f) const {
    if (by_slot()) {
      for (int k = 0; k < num_topk; ++k)
        if (const int32_t id = topk_ids[t * num_topk + k]; id >= 0) f(k, id / num_local);
      return;
    }
    for (int d = 0; d < num_ranks; ++d)
      if (in_rank[t * num_ranks + d]) f(d, d);
  }
};

}  // namespace epcomm::engine
