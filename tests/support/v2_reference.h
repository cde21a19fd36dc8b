// support/v2_reference.h — seeded problems and a single-process reference of the operator family
// (docs/distribute-v2.md): every rank regenerates every rank's inputs and computes any rank's expected
// outputs with plain loops written from the spec, sharing no code with the engine or the transport (payload
// quantization calls the block quantizers, which have their own bit-exact tests).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "epcomm/tensor.h"

namespace epcomm::testing::v2 {

struct V2Spec {
  int W = 1;  // ep_world_size
  int T = 0;  // tp_world_size as passed: 0, 1 or 2 (the world has W·max(T,1) ranks)
  int E = 1;  // moe_expert_num
  int K = 1;
  int shared_num = 1;    // shared_expert_num as passed (1 with shared_ranks = 0 means none)
  int shared_ranks = 0;  // shared_expert_rank_num
  int64_t H = 8;
  DType dtype = DType::bf16;
  int64_t bs = 8;             // tokens per rank (global_bs = 0), or the largest Bs drawn (global_bs > 0)
  int64_t global_bs = 0;      // > 0: each rank draws Bs in [0, global_bs / W]
  int mask_dims = 0;          // 0 (no mask), 1 or 2
  double mask_prob = 0.7;     // probability that a token (1-D: prefix length drawn) / slot is active
  bool expert_scales = true;  // pass expert_scales to dispatch (combine always gets them)
  int quant_mode = 0;
  std::optional<DType> y_dtype;
  enum class Smooth { none, scalar, vector, table } smooth = Smooth::none;
  int token_nums_type = 1;
  enum class Routing { uniform, one_rank } routing = Routing::uniform;
  int skew_rank = 0;   // MoE rank index that gets every id with Routing::one_rank
  bool tagged = true;  // x rows carry (r, t) tags (mode 0 checks); else random finite values
  int zero_rows = 0;   // every zero_rows-th token is all zeros (quantizer degenerate case), 0 = none
  uint64_t seed = 1;

  int Tp() const { return T == 2 ? 2 : 1; }
  int world() const { return W * Tp(); }
  int S() const { return shared_ranks == 0 ? 0 : shared_num; }
  int R() const { return S() > 0 ? shared_ranks / S() : 1; }
  int L() const { return E / (W - shared_ranks); }
  int64_t max_bs() const { return global_bs > 0 ? global_bs / W : bs; }
  int64_t G() const { return global_bs > 0 ? global_bs : bs * W; }
  int64_t capacity(int p) const;  // A_p
  int local_experts(int p) const { return p < shared_ranks ? 1 : L(); }
};

struct V2Rank {
  int64_t bs = 0;
  std::vector<uint8_t> x;         // [bs*H] of spec.dtype
  std::vector<int32_t> ids;       // [bs*K]; inactive slots hold -1 or out-of-range junk (never read)
  std::vector<uint8_t> mask;      // [bs] (1-D) or [bs*K] (2-D); empty without a mask
  std::vector<float> weights;     // [bs*K] expert_scales, exact
  std::vector<uint8_t> shared_x;  // [bs*H] a shared_expert_x (only meaningful with shared_ranks = 0)
  std::vector<uint8_t> residual;  // [bs*H] residual_x of combine_add_rms_norm

  bool active_tok(int64_t t, int mask_dims, int K) const;
  bool active_slot(int64_t t, int k, int mask_dims, int K) const;
};

struct V2Problem {
  V2Spec spec;
  std::vector<V2Rank> ranks;   // world rank w = ep·Tp + tp
  std::vector<float> scales;   // smoothing: [1], [H] or [(S+E)·H]; empty for none
  std::vector<uint8_t> gamma;  // [H] of spec.dtype

  const V2Rank& at(int ep, int tp) const { return ranks[static_cast<size_t>(ep) * spec.Tp() + tp]; }
};

V2Problem make_v2_problem(const V2Spec& spec);

// Every output of dispatch_v2 on rank (ep, tp), full tensors with zero tails, plus bookkeeping.
struct V2DispatchRef {
  int64_t rows = 0;  // T·A
  int64_t n_own = 0, n_peer = 0;
  DType out_dtype = DType::bf16;
  size_t data_bytes = 0, scale_bytes = 0;         // per row
  std::vector<uint8_t> expand_x, dynamic_scales;  // dynamic_scales as raw bytes (f32 or e8m0)
  std::vector<int32_t> assist;
  std::vector<int64_t> expert_token_nums;
  std::vector<int32_t> ep_recv_counts, tp_recv_counts;
  std::vector<float> expand_scales;
  std::vector<int32_t> src_rank, src_token, src_slot;  // [n_own + n_peer]; for peer rows, the peer's triple
};
V2DispatchRef ref_dispatch_v2(const V2Problem& p, int ep, int tp);

// The fp32 accumulators of combine (docs/distribute-v2.md) on rank (ep, tp), before the final rounding:
// [bs*H], and the active-token flags. `outs[w]` are the expert outputs (the combine's expand_x) of world rank
// w, `refs[w]` its dispatch reference. shared_x: add spec's shared_x rows of this rank when true.
struct V2CombineAcc {
  std::vector<float> acc;
  std::vector<uint8_t> active;
};
V2CombineAcc ref_combine_acc(const V2Problem& p, const std::vector<V2DispatchRef>& refs,
                             const std::vector<std::vector<uint8_t>>& outs, int ep, int tp, int comm_quant,
                             bool shared_x);
// x of combine_v2: RNE_dt of the accumulator; zeros for inactive tokens.
std::vector<uint8_t> ref_round(const V2Problem& p, const V2CombineAcc& a);
// combine_add_rms_norm (docs/distribute-v2.md): y, rstd, x.
struct V2NormRef {
  std::vector<uint8_t> y, x;
  std::vector<float> rstd;
};
V2NormRef ref_add_rms_norm(const V2Problem& p, const V2CombineAcc& a, const std::vector<uint8_t>& residual,
                           float eps);

// calc_diff of docs/distribute-v2.md: 1 − 2Σa'b'/Σ(a'²+b'²), a' = a+1, b' = b+1, in fp64.
double calc_diff(const std::vector<double>& a, const std::vector<double>& b);

// The exact sum of two fp16 values rounded once to fp16 (reference of the TP reduce).
uint16_t ref_f16_exact_add(uint16_t a, uint16_t b);

}  // namespace epcomm::testing::v2
