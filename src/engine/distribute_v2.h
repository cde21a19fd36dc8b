// engine/distribute_v2.h — the protocols of the operator family (docs/distribute-v2.md) on the engine's
// segments: dispatch_v2 (staged pull, rows in (local expert, source, sender order)), its TP all-gather, and
// combine_v2 (TP reduce, then origin windows with one fixed slot per (token, slot) and a canonical
// reduction).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/op_context.h"
#include "engine/workers.h"
#include "epcomm/tensor.h"

namespace epcomm::engine::v2 {

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Rank layout and capacity of docs/distribute-v2.md (expert_shard_type 0). Pure values, equal on every rank
// of a call.
struct Layout {
  int W = 1;                  // ep_world_size
  int E = 1;                  // MoE experts
  int K = 1;                  // top-k
  int S = 0;                  // effective shared experts (0 when Sr = 0)
  int Sr = 0;                 // shared-expert ranks
  int R = 1;                  // replicas per shared expert (Sr / S)
  int L = 1;                  // experts per MoE rank
  int T = 1;                  // max(tp_world_size, 1)
  int64_t max_bs = 0, G = 0;  // maxBs and G of docs/distribute-v2.md

  bool is_shared(int p) const { return p < Sr; }
  int rank_of(int e) const { return Sr + e / L; }
  int local_experts(int p) const { return is_shared(p) ? 1 : L; }  // L_p
  int shared_expert_of(int p) const { return p / R; }
  int64_t capacity(int p) const {  // A_p
    return is_shared(p) ? max_bs * ceil_div(W, R) : G * std::min(L, K);
  }
  // True when source `src` sends its tokens to shared rank p (the replica of expert p / R it uses).
  bool shared_serves(int p, int src) const { return src % R == p % R; }
};

// Parameters every rank must agree on (docs/distribute-v2.md). They travel at the start of the header's
// counts area.
enum Param : int {
  kParamW,
  kParamE,
  kParamT,
  kParamShard,
  kParamS,
  kParamSr,
  kParamGlobalBs,
  kParamH,
  kParamK,
  kParamDtype,
  kParamQuantMode,
  kParamOutDtype,
  kParamCommQuant,
  kParamBs,
  kParamEpRank,
  kNumParams
};
struct Params {
  int32_t v[kNumParams] = {};
};
const char* param_name(int p);

// Writes `params` into this rank's header (counts area) and returns where the op's own counts start.
int32_t* put_params(OpContext& ctx, const Params& params, int num_counts);
// After exchange_headers: every peer must be in the same operation and agree on `fields` (and on Bs when
// global_bs is 0 and `bs_matters`). Throws InvalidUsage listing every disagreeing peer, field, its value and
// ours. The same check runs on every rank, so every rank raises in the same call.
void check_params(const OpContext& ctx, OpKind op, const std::vector<int>& fields, bool bs_matters);
const int32_t* peer_counts(const OpContext& ctx, int r);  // the op's counts of rank r (after the params)

// The row format of dispatch rows.
struct RowFormat {
  int quant_mode = 0;
  DType x_dtype = DType::bf16, out_dtype = DType::bf16;
  int64_t H = 0;
  size_t data_bytes = 0;   // bytes of one expand_x row
  size_t scale_bytes = 0;  // bytes of one dynamic_scales row (0 in modes 0 and 1)
};

// Quantization smoothing of docs/distribute-v2.md: none, one scalar, one (H,) vector, or a (S+E, H) table
// indexed by row.
struct SmoothingSource {
  enum class Kind { none, scalar, vector, table } kind = Kind::none;
  const float* data = nullptr;
};

struct DispatchV2Input {
  Layout lay;
  int me = 0;  // ep rank
  int64_t bs = 0;
  RowFormat fmt;
  const uint8_t* x = nullptr;  // [bs, H] rows of x_dtype at `x_row_bytes` stride
  size_t x_row_bytes = 0;
  std::vector<int32_t> ids;          // [bs*K]: the expert of each active slot, -1 for an inactive slot
  std::vector<uint8_t> active;       // [bs]: active_tok
  std::vector<float> expert_scales;  // [bs*K], empty when not given
  SmoothingSource smooth;
  int expert_token_nums_type = 1;
  Params params;
  std::string label, tp_label;       // message prefixes of the EP and TP stages
  WorkerPool* workers = nullptr;     // the group's copy threads (null: this thread only)
  int threads = 1;                   // copy threads this call may use (engine/workers.h)
  CopyCounters* counters = nullptr;  // the group's (staged and pushed tokens), or null
  // Where a pushing sender quantizes its tokens while the headers travel (the group's: its pages stay
  // between calls), or null.
  std::vector<uint8_t>* payload_scratch = nullptr;
};

// Output pointers (caller- or API-allocated, valid for rows [0, T·A)) and what the call learnt.
struct DispatchV2Output {
  uint8_t* expand_x = nullptr;
  uint8_t* dynamic_scales = nullptr;  // null when scale_bytes is 0
  int32_t* assist = nullptr;
  int64_t* expert_token_nums = nullptr;
  int32_t* ep_recv_counts = nullptr;
  int32_t* tp_recv_counts = nullptr;  // null when tp_world_size is 0
  float* expand_scales = nullptr;     // null without expert_scales
  // Where expand_x and dynamic_scales start in this rank's output arena, or -1 when they do not lie in it.
  // When every rank's do (one node), senders write the rows straight into them (docs/distribute-v2.md).
  int64_t expand_x_offset = -1, scales_offset = -1;
  int64_t n_own = 0, n_peer = 0;
  std::vector<int32_t> cnt, peer_cnt;  // inclusive prefix over the W·L_p blocks
};

// The EP stage (docs/distribute-v2.md): header exchange, then every rank pulls its rows from the senders'
// staged windows. `on_moving` is called once data starts to move (errors after it fail the group).
void run_dispatch_v2(OpContext& ctx, const DispatchV2Input& in, DispatchV2Output& out,
                     const std::function<void()>& on_moving);
// The TP stage (docs/distribute-v2.md) on the pair's context: own rows first, then the peer's. Needs
// run_dispatch_v2 first.
void run_dispatch_v2_tp(OpContext& tctx, const DispatchV2Input& in, DispatchV2Output& out,
                        const std::function<void()>& on_moving);
// Fills expert_token_nums, ep_recv_counts and tp_recv_counts from cnt (and peer_cnt with T = 2).
void write_dispatch_counts(const DispatchV2Input& in, DispatchV2Output& out, int tp_world_size, int tp_rank);

struct CombineV2Input {
  Layout lay;
  int me = 0;
  int64_t bs = 0, H = 0;
  DType dt = DType::bf16;  // expand_x dtype
  int comm_quant = 0;      // 0 or 2
  int64_t n_own = 0;
  const uint8_t* rows = nullptr;  // [n_own, H] contiguous dt: the rows to return (after the TP reduce)
  // Where `rows` start in this rank's output arena, or -1. When every rank's do (one node, comm_quant_mode
  // 0), the origins read the rows in place (docs/distribute-v2.md, "Output arena").
  int64_t rows_offset = -1;
  CopyCounters* counters = nullptr;   // the group's (rows copied into windows, rows read in place), or null
  const int32_t* assist = nullptr;    // 3·n_own
  std::vector<int32_t> ids;           // [bs*K], -1 for an inactive slot
  std::vector<uint8_t> active;        // [bs]
  std::vector<float> expert_scales;   // [bs*K]
  const uint8_t* shared_x = nullptr;  // [bs, H] dt contiguous, or null
  // combine_add_rms_norm (docs/distribute-v2.md) when residual is set.
  const uint8_t* residual = nullptr;  // [bs, H] dt
  const uint8_t* gamma = nullptr;     // [H] dt
  float norm_eps = 0;
  Params params;
  std::string label, tp_label;
  WorkerPool* workers = nullptr;  // the group's copy threads (null: this thread only)
  int threads = 1;                // copy threads this call may use (engine/workers.h)
  // Rows of each origin sorted by (token, slot): rows_of[origin_offsets[o] .. origin_offsets[o+1]).
  std::vector<int64_t> origin_offsets;
  std::vector<int32_t> origin_rows;
};

struct CombineV2Output {
  uint8_t* x = nullptr;   // [bs, H] dt
  uint8_t* y = nullptr;   // [bs, H] dt (rms norm only)
  float* rstd = nullptr;  // [bs] (rms norm only)
};

// Groups this rank's rows by origin and checks them (docs/distribute-v2.md: triples in range, no duplicate
// (r, t, slot)). Throws InvalidUsage naming the row; runs before any header is published.
void prepare_combine_v2(CombineV2Input& in);
// The TP reduce of docs/distribute-v2.md on the pair's context: sends rows [n_own, n_own + n_send) of
// `expand_x`, receives the peer's n_own rows and adds them into `y` ([n_own, H], a copy of the first n_own
// rows).
void run_combine_v2_tp(OpContext& tctx, const CombineV2Input& in, const uint8_t* expand_x, int64_t n_send,
                       uint8_t* y, const std::function<void()>& on_moving);
// The EP stage of docs/distribute-v2.md.
void run_combine_v2(OpContext& ctx, const CombineV2Input& in, const CombineV2Output& out,
                    const std::function<void()>& on_moving);

}  // namespace epcomm::engine::v2
