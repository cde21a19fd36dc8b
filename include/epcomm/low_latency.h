// epcomm/low_latency.h — arguments and results of the Buffer's low-latency calls (docs/low-latency.md): the
// decode path, NVIDIA DeepEP's layout. One row per (token, top-k slot) pair; every local expert owns a block
// of R * T_max rows of a [L, R * T_max, H] output, its valid rows first, in (source rank, token) order.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "epcomm/event.h"
#include "epcomm/tensor.h"

namespace epcomm {

class Handle;

struct LowLatencyDispatchArgs {
  Tensor x;         // [T, H] bf16, T <= num_max_dispatch_tokens_per_rank
  Tensor topk_idx;  // [T, K] i64 or i32; negative = no expert; the experts of one token are distinct
  int64_t num_max_dispatch_tokens_per_rank = 0;  // T_max, equal on every rank
  int num_experts = 0;                           // E, a multiple of the number of ranks
  // use_fp8: e4m3 codes per 128 channels (docs/quant.md fp8_per_group128); round_scale: power-of-two scales;
  // use_ue8m0 (requires round_scale): one ue8m0 byte per group, packed four per i32.
  bool use_fp8 = true, round_scale = false, use_ue8m0 = false;
  bool async_finish = false;  // returns once the call is queued; see event
  // Returns once this rank's rows are sent (written into the receivers' outputs, or across nodes handed to
  // the network); event.wait() (the hook) waits for the rows of every source. Not with async_finish.
  bool return_recv_hook = false;
  std::optional<Tensor> cumulative_local_expert_recv_stats;  // [L] i32, += recv_count
  std::optional<Tensor> dispatch_wait_recv_cost_stats;       // [R] i64, += microseconds waited per source
};

struct LowLatencyDispatchResult {
  Tensor recv_x;                      // [L, R * T_max, H]: bf16, or f8e4m3 codes with use_fp8
  std::optional<Tensor> recv_scales;  // use_fp8: [L, H/128, R * T_max] f32, or [L, H/512, R * T_max] i32
                                      // of packed ue8m0 bytes (DeepEP's column-major scales, transposed)
  Tensor recv_count;                  // [L] i32: valid rows per local expert
  Tensor src_info;                    // [L, R * T_max] i32: source token of each valid row
  Tensor layout_range;                // [L, R] i64: (begin << 32) | count of the rows from each source rank
  std::shared_ptr<const Handle> handle;
  EventOverlap event;  // async_finish: the outputs above are defined once it completes
};

struct LowLatencyCombineArgs {
  Tensor x;                              // [L, R * T_max, H] bf16 (rows past recv_count never read)
  std::shared_ptr<const Handle> handle;  // of a low-latency dispatch of this Buffer
  Tensor topk_idx;                       // [T, K]: the dispatch's (checked)
  Tensor topk_weights;                   // [T, K] f32
  std::optional<Tensor> out;             // [T, H] bf16: written in place and returned
  bool async_finish = false;
  std::optional<Tensor> combine_wait_recv_cost_stats;  // [R] i64
};

struct LowLatencyCombineResult {
  Tensor combined_x;  // [T, H] bf16: sum over k of topk_weights[t, k] * expert output (f32, one rounding)
  EventOverlap event;
};

}  // namespace epcomm
