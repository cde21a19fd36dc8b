// engine/dispatch.h — the dispatch protocol (fresh and cached) over a Transport: header and count
// exchange, then rounds of staged windows that every receiver pulls straight into its outputs.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "engine/call_checks.h"
#include "engine/handle_impl.h"
#include "engine/op_context.h"
#include "engine/workers.h"
#include "epcomm/tensor.h"

namespace epcomm::engine {

// How one row travels: `data_row_bytes` of data, then `scale_row_bytes` of scales.
struct RowFormat {
  DType data_dtype = DType::bf16;
  int64_t data_cols = 0;  // elements of data_dtype per row
  size_t data_row_bytes = 0;
  DType scale_dtype = DType::f32;
  size_t scale_row_bytes = 0;  // 0: no scales
  enum class ScaleShape { none, vec, mat, flat } scale_shape = ScaleShape::none;
  int64_t scale_cols = 0;             // elements per row
  std::optional<QuantMode> quantize;  // quantize x (of x_dtype) on the sender into this format
  QuantMode mode = QuantMode::bf16;   // for the header
  bool plain = true;
};

struct DispatchInput {
  bool cached = false;
  ReceiveOrder order = ReceiveOrder::expert_major;
  int num_experts = 0, num_topk = 0;  // num_topk 0: no top-k (rank_major with is_token_in_rank)
  int64_t num_tokens = 0, hidden = 0, expert_alignment = 1, num_worst_tokens = 0;
  // Low-latency layout (expert_major, docs/low-latency.md): every local expert owns a block of this many
  // rows (R * T_max), its pairs first; the rest of the block (payload and source entries) is left unwritten,
  // and no recv_topk_idx / recv_topk_weights are produced. 0: the normal-mode layout.
  int64_t expert_block_rows = 0;
  RowFormat format;
  DType x_dtype = DType::bf16;
  const uint8_t* x = nullptr;  // [T, row] contiguous (x_dtype, or data_dtype for pre-quantized input)
  size_t x_row_bytes = 0;
  // >= 0 when x (plain, no scales) lies in this rank's shared dispatch-input area
  // (Buffer::get_dispatch_input): its offset from the start of this rank's segment. On one node receivers
  // then read the rows in place and the sender stages only the routing.
  int64_t shared_offset = -1;
  CopyCounters* counters = nullptr;  // optional
  const uint8_t* scales = nullptr;   // pre-quantized scales: element (t, c) at scales + (t*st0 + c*st1)*size
  int64_t scale_stride0 = 0, scale_stride1 = 0;
  DType idx_dtype = DType::i64;
  std::vector<int32_t> ids;                  // [T*K] normalized
  std::vector<float> weights;                // [T*K]
  std::vector<uint8_t> in_rank;              // [T*R]
  std::vector<int32_t> pairs_per_expert;     // [E]
  std::vector<int32_t> tokens_per_rank;      // [R]
  std::shared_ptr<const HandleData> handle;  // cached dispatch
  int32_t chunks[4] = {0, 0, 0, 0};
  Allocator* allocator = nullptr;
  bool poison = false;
  WorkerPool* workers = nullptr;     // the rank's copy threads (null: this thread only)
  int threads = 1;                   // copy threads this call may use (engine/workers.h)
  std::optional<Tensor> cost_stats;  // [R] i64 or i32, accumulated
  std::vector<Tensor> keep;          // user tensors held until the call completes
  // Called once, on the thread that runs the call, when every row of this rank has been sent: written into
  // the receivers' outputs (pushed) or staged and published to them (and across nodes handed to the
  // network). Optional; low-latency return_recv_hook returns to its caller then.
  std::function<void()> on_sent;
};

// Outputs left undefined are allocated by run_dispatch; the caller pre-allocates those whose shapes it knows
// (cached and worst-case dispatch) so that an asynchronous call can return before the count exchange.
// `handle` is created by the caller for a fresh dispatch and filled here.
struct DispatchOutput {
  Payload recv_x;
  std::optional<Tensor> recv_topk_idx, recv_topk_weights;
  std::vector<int64_t> list;
  std::shared_ptr<HandleData> handle;
};

// Runs one dispatch. `on_shapes` is called once the outputs exist (before any payload moves). A fresh
// dispatch moves the routing of `in` (ids, weights, in_rank) into the handle: they are not copied.
void run_dispatch(OpContext& ctx, DispatchInput& in, DispatchOutput& out,
                  const std::function<void()>& on_shapes);

}  // namespace epcomm::engine
