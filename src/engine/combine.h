// engine/combine.h — the combine protocol: each origin opens a window over its own tokens; every rank that
// holds copies of those tokens writes them into the window's fixed slots; the origin reduces them in
// canonical order (docs/normal-mode.md) straight into combined_x.
#pragma once

#include <cstring>
#include <functional>
#include <memory>
#include <optional>

#include "engine/handle_impl.h"
#include "engine/op_context.h"
#include "engine/workers.h"

namespace epcomm::engine {

// The row a combine window slot stands for: the copy written into it or, when its holder's expert outputs
// lie in shared memory (`shared_x`, as mapped here; null otherwise), that holder's row at the index the slot
// holds (holders then write 8-byte row indices instead of rows).
inline const uint8_t* slot_row(const uint8_t* slot, const uint8_t* shared_x, size_t row_bytes) {
  if (!shared_x) return slot;
  int64_t row;
  std::memcpy(&row, slot, sizeof(row));
  return shared_x + row * static_cast<int64_t>(row_bytes);
}

struct CombineInput {
  const HandleData* handle = nullptr;
  std::shared_ptr<const void> keep_handle;  // keeps `handle` (its Handle) alive until the call completes
  DType dtype = DType::bf16;
  int64_t hidden = 0;          // H'
  const uint8_t* x = nullptr;  // [num_rows, H'] contiguous
  // >= 0 when x lies in this rank's shared combine-input area (Buffer::get_combine_input): its offset from
  // the start of this rank's segment. On one node, holders then pass row indices instead of copying rows, and
  // each origin reads the rows of its tokens straight from the holders' areas (one read per copy).
  int64_t shared_offset = -1;
  bool shared_in_arena = false;  // shared_offset counts from the start of this rank's output arena instead
  CopyCounters* counters = nullptr;  // optional
  // expert_major: weights used per own (t, k) ([T*K], already masked to +0 at -1 slots).
  std::vector<float> weights_used;
  // rank_major: receiving-side weights g ([num_rows, K] f32 contiguous) or null.
  // Presence is a flag, not the pointer: a tensor with no rows may have no storage (null data).
  const float* recv_weights = nullptr;
  bool has_recv_weights = false;
  int64_t recv_weights_offset = -1;  // >= 0: recv_weights lies in this rank's output arena, at this offset
  const uint8_t* bias1 = nullptr;    // [T, H'] or null
  const uint8_t* bias2 = nullptr;
  int32_t chunks[4] = {0, 0, 0, 0};
  bool poison = false;
  WorkerPool* workers = nullptr;  // the rank's copy threads (null: this thread only)
  int threads = 1;                // copy threads this call may use (engine/workers.h)
  std::optional<Tensor> cost_stats;
  std::vector<Tensor> keep;  // user tensors held until the call completes
};

// Allocated by the caller: combined_x [T, H'] and, when returned, combined_topk_weights [T, K].
struct CombineOutput {
  Tensor combined_x;
  std::optional<Tensor> combined_topk_weights;
};

void run_combine(OpContext& ctx, const CombineInput& in, CombineOutput& out,
                 const std::function<void()>& on_shapes);

}  // namespace epcomm::engine
