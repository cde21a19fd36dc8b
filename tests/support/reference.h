// support/reference.h — the independent oracle for normal-mode layout, dispatch, cached dispatch and combine
// (docs/normal-mode.md–docs/normal-mode.md), written as plain loops that follow the spec pseudo-code. Shares
// no code with the library: only epcomm::DType / epcomm::ReceiveOrder are borrowed. Needs no communication:
// every rank can evaluate every other rank's expected outputs from the Problem. Errors in the arguments throw
// std::invalid_argument.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "epcomm/tensor.h"
#include "epcomm/types.h"
#include "support/problem.h"

namespace epcomm::testing {

// ---------------------------------------------------------------------------------------------------------
// Node partition (docs/normal-mode.md): ranks_per_node P > 0 → node(r) = r / P, M = R / P (R % P == 0
// required); P = 0 → one node (M = 1), as on a single host.
// ---------------------------------------------------------------------------------------------------------

int ref_num_nodes(int num_ranks, int ranks_per_node);
int ref_node_of(int rank, int ranks_per_node);

// ---------------------------------------------------------------------------------------------------------
// docs/normal-mode.md get_dispatch_layout
// ---------------------------------------------------------------------------------------------------------

struct RefLayout {
  std::vector<int32_t> num_tokens_per_rank;       // [R]
  std::vector<int32_t> num_tokens_per_rdma_rank;  // [M]; EMPTY when M == 1 (the API returns None)
  std::vector<int32_t> num_tokens_per_expert;     // [E]
  std::vector<uint8_t> is_token_in_rank;          // [T*R], 0/1
};

// Layout of rank `rank`'s topk_idx. An id >= E throws std::invalid_argument with the spec's message
// "topk_idx[t, k] = v is out of range [0, E)" for the first offending (t, k) in row-major order.
RefLayout ref_layout(const Problem& problem, int rank, int ranks_per_node = 0);
// Same, from raw ids: topk_idx [T*K].
RefLayout ref_layout_of(const std::vector<int64_t>& topk_idx, int64_t num_tokens, int num_topk, int num_ranks,
                        int num_experts, int ranks_per_node = 0);

// ---------------------------------------------------------------------------------------------------------
// docs/normal-mode.md dispatch, as seen by receiving rank d
// ---------------------------------------------------------------------------------------------------------

struct RefDispatch {
  // num_worst_tokens > 0 and N > num_worst_tokens: the dispatch must raise InvalidUsage on EVERY rank
  // (docs/normal-mode.md). Then only num_recv_rows, cnt, list and rows_per_source are filled.
  bool overflow = false;
  int64_t num_worst_tokens = 0;          // as passed
  int64_t num_recv_rows = 0;             // N (PAD rows included)
  int64_t num_rows = 0;                  // num_worst_tokens if > 0, else N
  std::vector<uint8_t> recv_x;           // [num_rows * row_bytes]; PAD and tail rows zero
  std::vector<int64_t> recv_topk_idx;    // [num_rows * K], local ids; EMPTY when the problem has no top-k
  std::vector<float> recv_topk_weights;  // [num_rows * K]; EMPTY when the problem has no top-k
  std::vector<int64_t> list;             // [L] aligned counts = handle.num_recv_tokens_per_expert
  std::vector<int64_t> cnt;              // [L] = handle.num_recv_pairs_per_expert
  std::vector<int64_t> rows_per_source;  // [R], PAD excluded = handle.num_recv_rows_per_source
  std::vector<int32_t> src_rank, src_token, src_slot;  // [num_rows]; -1 for PAD/tail; slot -1 in rank_major

  // What dispatch itself returns as num_recv_tokens_per_expert_list: `list`, or empty with num_worst_tokens.
  std::vector<int64_t> result_list() const { return num_worst_tokens > 0 ? std::vector<int64_t>{} : list; }
};

// Fresh dispatch received by rank d. Payload bytes of x are copied verbatim (plain mode).
RefDispatch ref_dispatch(const Problem& problem, int d, ReceiveOrder order, int64_t expert_alignment = 1,
                         int64_t num_worst_tokens = 0);

// The same without payload: recv_x, recv_topk_idx and recv_topk_weights stay empty (cheap for large H;
// enough for counts, lists and the handle's source arrays).
RefDispatch ref_dispatch_placement(const Problem& problem, int d, ReceiveOrder order,
                                   int64_t expert_alignment = 1, int64_t num_worst_tokens = 0);

// docs/normal-mode.md: places per-rank rows (new_x[s] = [T_s * row_bytes] bytes, any format: a new x,
// quantized data, or a per-row scale block) at the rows of `placement`: row i gets new_x[src_rank[i]] row
// src_token[i]; PAD and tail rows are zero. Throws if `placement.overflow`.
std::vector<uint8_t> ref_place_rows(const Problem& problem, const RefDispatch& placement,
                                    const std::vector<std::vector<uint8_t>>& new_x, size_t row_bytes);

// Cached re-dispatch of new_x along the routing of ref_dispatch(problem, d, order, alignment, worst).
std::vector<uint8_t> ref_cached_dispatch(const Problem& problem, int d, ReceiveOrder order,
                                         int64_t expert_alignment, int64_t num_worst_tokens,
                                         const std::vector<std::vector<uint8_t>>& new_x, size_t row_bytes);

// Expert outputs in the row order of `dispatch` (make_expert_output over its source arrays; PAD/tail NaN).
std::vector<uint8_t> make_expert_output(uint64_t seed, const RefDispatch& dispatch, DType dtype,
                                        int64_t hidden);

// ---------------------------------------------------------------------------------------------------------
// docs/normal-mode.md combine, as seen by origin rank r
// ---------------------------------------------------------------------------------------------------------

struct RefCombine {
  std::vector<uint8_t> combined_x;           // [T_r * hidden2] in dtype
  std::vector<float> combined_topk_weights;  // [T_r * K] when has_weights, else empty
  bool has_weights = false;  // expert_major: always; rank_major: iff recv_weights_per_rank was given
};

// Arguments:
//   order, expert_alignment   those of the dispatch whose handle combine uses (they fix the row indices).
//   num_worst_tokens          row-count check of expert_outputs: > 0 → every expert_outputs[d] has exactly
//                             that many rows; 0 → exactly N_d rows; < 0 → at least N_d rows (use when the
//                             ranks passed different num_worst_tokens).
//   dtype, hidden2            combine's x dtype (bf16/f16/f32) and H'.
//   expert_outputs[d]         rank d's combine x, [rows_d * hidden2] in dtype. PAD/tail rows are never read.
//   explicit_topk_weights     expert_major only: combine's topk_weights on the origin rank, [T_r * K] f32;
//                             nullptr → the dispatch-time weights of the problem.
//   recv_weights_per_rank     rank_major only: g[d] = combine's topk_weights on rank d, [rows_d * K] f32
//                             (at least N_d rows); nullptr → combined_topk_weights is None.
//   biases                    0, 1 (tensor) or 2 (tuple) pointers to [T_r * hidden2] in dtype.
//   ranks_per_node            node partition of the Buffer (docs/normal-mode.md); 0 = one node.
// Arithmetic (docs/normal-mode.md): element-wise IEEE f32, RNE, no FMA; acc = +0; per node (ascending) p = +0
// plus the node's contributions in canonical order; acc += p; then bias; then one rounding to dtype.
RefCombine ref_combine(const Problem& problem, int r, ReceiveOrder order, int64_t expert_alignment,
                       int64_t num_worst_tokens, DType dtype, int64_t hidden2,
                       const std::vector<std::vector<uint8_t>>& expert_outputs,
                       const std::vector<float>* explicit_topk_weights,
                       const std::vector<std::vector<float>>* recv_weights_per_rank,
                       const std::vector<const std::vector<uint8_t>*>& biases, int ranks_per_node = 0);

}  // namespace epcomm::testing
