// multirank/cases_v2.cc — dispatch_v2 / combine_v2 / combine_add_rms_norm against the global reference:
// EP layouts, shared experts, masks, global_bs, TP pairs, quantization, caller buffers.
#include "multirank/v2_harness.h"
#include "support/check.h"

using namespace epcomm;
using namespace epcomm::testing;
using namespace epcomm::testing::v2;

namespace {

V2Spec base_spec(int W, uint64_t seed) {
  V2Spec s;
  s.W = W;
  s.seed = seed;
  s.shared_num = 1;  // torch_npu's default: means "none" without shared-expert ranks
  return s;
}

}  // namespace

MR_CASE("v2_ep_round_trip", {}) {
  // EP only (no TP, shared experts or quantization): tagged rows in (local expert, source, sender order),
  // counts of both types, identity experts and distinct outputs, windows that move in rounds.
  V2Groups g = make_v2_groups(ctx, 0, 256 << 10);
  const int W = ctx.size;
  uint64_t seed = 100;
  for (int L : {1, 3})
    for (int K : {1, 2, 8}) {
      const int E = L * W;
      if (K > E) continue;
      for (int64_t H : {int64_t{8}, int64_t{128}, int64_t{1000}}) {
        V2Spec s = base_spec(W, ++seed);
        s.E = E;
        s.K = K;
        s.H = H;
        s.bs = 1 + static_cast<int64_t>(seed % 23);
        s.dtype = seed % 2 ? DType::bf16 : DType::f16;
        s.token_nums_type = static_cast<int>(seed % 2);
        s.expert_scales = seed % 3 != 0;
        V2Run run;
        run.spec = s;
        run.experts = seed % 2 ? V2Run::Experts::identity : V2Run::Experts::distinct;
        run_v2(g, run);
      }
    }
}

MR_CASE("v2_ep_global_bs", {}) {
  // global_bs > 0: Bs varies per rank (0 included); capacities follow global_bs; tp_world_size 1.
  V2Groups g = make_v2_groups(ctx, 0, 1 << 20);
  const int W = ctx.size;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    V2Spec s = base_spec(W, 200 + seed);
    s.E = 2 * W;
    s.K = std::min(3, s.E);
    s.H = 64;
    s.global_bs = 16 * W;
    s.T = seed % 2 ? 1 : 0;
    s.routing = seed % 3 == 0 ? V2Spec::Routing::one_rank : V2Spec::Routing::uniform;
    s.skew_rank = static_cast<int>(seed % W);
    V2Run run;
    run.spec = s;
    run.experts = seed % 2 ? V2Run::Experts::identity : V2Run::Experts::distinct;
    run_v2(g, run);
  }
}

MR_CASE("v2_zero_tokens", {}) {
  // Bs = 0 on every rank: every call is still collective; outputs are zero-filled tensors of the exact
  // shapes.
  V2Groups g = make_v2_groups(ctx, 0);
  V2Spec s = base_spec(ctx.size, 300);
  s.E = ctx.size;
  s.K = 1;
  s.H = 16;
  s.bs = 0;
  V2Run run;
  run.spec = s;
  run.rms_norm = true;
  run_v2(g, run);
}

MR_CASE("v2_caller_buffers", {}) {
  // Caller *_out buffers (larger than needed) are written in their valid part only.
  V2Groups g = make_v2_groups(ctx, 0);
  V2Spec s = base_spec(ctx.size, 400);
  s.E = 2 * ctx.size;
  s.K = 2;
  s.H = 32;
  s.bs = 9;
  V2Run run;
  run.spec = s;
  run.caller_buffers = true;
  run_v2(g, run);
}
