// api/distribute_v2_args.h — argument checks of the operator family (docs/distribute-v2.md) and the
// engine inputs they produce. Messages name the parameter, the expected and the actual value; the caller
// adds the "epcomm[ep r] <op>#<seq>: " prefix.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "engine/distribute_v2.h"
#include "epcomm/moe/distribute_v2.h"

namespace epcomm::moe::detail {

// The layout parameters the three operators share.
struct LayoutArgs {
  int64_t W, ep_rank, E, tp_world_size, tp_rank, shard, shared_expert_num, Sr, global_bs;
};

// Checked routing of one rank: ids with -1 at inactive slots, and active tokens (docs/distribute-v2.md).
struct Routing {
  int64_t bs = 0;
  int K = 0;
  std::vector<int32_t> ids;
  std::vector<uint8_t> active;
  int mask_dims = 0;  // 0 (none), 1 or 2
};

struct DispatchPlan {
  engine::v2::DispatchV2Input in;
  int tp_world_size = 0, tp_rank = 0;
  int64_t A = 0;                   // capacity of this rank
  std::vector<float> scales_copy;  // smoothing values when `scales` was not contiguous
  std::vector<uint8_t> x_copy;     // x when its rows were not contiguous
  DispatchV2Result result;         // outputs, allocated (zeroed) or the caller's
  // expand_x / dynamic_scales were allocated without zeroing: their rows past the written ones are zeroed
  // after the call.
  bool zero_tail_x = false, zero_tail_scales = false;
};

struct CombinePlan {
  engine::v2::CombineV2Input in;
  int tp_world_size = 0, tp_rank = 0;
  int64_t n_send = 0;                 // rows returned to the TP peer
  const uint8_t* expand_x = nullptr;  // contiguous rows
  std::vector<uint8_t> expand_x_copy, shared_copy, residual_copy, gamma_copy;
  std::vector<int32_t> assist_copy;
  Tensor x, y, rstd;  // outputs
};

void prepare_dispatch(Group& ep, Group* tp, const DispatchV2Args& a, const OpOptions& o, DispatchPlan& p);
// `norm` is null for combine_v2.
void prepare_combine(Group& ep, Group* tp, const CombineV2Args& a, const CombineAddRmsNormArgs* norm,
                     const OpOptions& o, CombinePlan& p);

// docs/distribute-v2.md, only when options name a product. Throws InvalidUsage("exceeds <product> limit:
// <rule>").
void check_strict_dispatch(const OpOptions& o, const DispatchV2Args& a, const engine::v2::Layout& lay,
                           const Routing& routing, int64_t H);
void check_strict_combine(const OpOptions& o, const CombineV2Args& a, const engine::v2::Layout& lay,
                          const Routing& routing, int64_t H, DType dt, bool add_rms_norm);
void check_options(const OpOptions& o);

}  // namespace epcomm::moe::detail
