// api/warm_up.cc — the round trips a Buffer makes once, collectively, at the end of its creation, so that
// its first call runs like the next (docs/design.md, "Warm-up"). Without them a first call pays for the code
// pages it runs (page faults, about 12 µs each on the development VM), the heap its bookkeeping grows into
// and the transport's first hand-offs: at one token per rank the first calls took 5-150x their median.
#include <algorithm>
#include <cstring>
#include <vector>

#include "api/buffer_impl.h"
#include "api/moe_context.h"
#include "common/env.h"
#include "common/log.h"

namespace epcomm::detail {
namespace {

// One token per rank in the decode shape's proportions: a bf16 row of kHidden, top-8 (at most 8 ranks'
// worth) of 8 experts per rank, every expert on a different rank where there are enough ranks, so that
// every path a call takes between ranks runs (own rows, rows pushed to peers, combine windows).
struct WarmUpInputs {
  static constexpr int64_t kHidden = 7168;
  static constexpr int kLocalExperts = 8;
  int rank = 0, R = 1, E = kLocalExperts, K = 1;
  std::vector<uint16_t> x;
  std::vector<int64_t> ids;
  std::vector<int32_t> ids32;  // the operators' expert_ids
  std::vector<float> weights;
  std::vector<uint16_t> expert_out;  // the private expert outputs of a combine (rows of zeros)

  WarmUpInputs(int r, int ranks) : rank(r), R(ranks), E(ranks * kLocalExperts), K(std::min(8, E)) {
    x.assign(kHidden, 0);
    // Slot k goes to rank (rank + k) % R, local expert k / R there: distinct experts.
    for (int k = 0; k < K; ++k) ids.push_back(((rank + k) % R) * kLocalExperts + (k / R) % kLocalExperts);
    ids32.assign(ids.begin(), ids.end());
    weights.assign(K, 1.0f / static_cast<float>(K));
  }
  Tensor token() { return Tensor::wrap(x.data(), DType::bf16, {1, kHidden}); }
  Tensor topk_idx() { return Tensor::wrap(ids.data(), DType::i64, {1, K}); }
  Tensor expert_ids() { return Tensor::wrap(ids32.data(), DType::i32, {1, K}); }
  Tensor topk_weights() { return Tensor::wrap(weights.data(), DType::f32, {1, K}); }
  // [shape..., kHidden] bf16 zeros (`shape` multiplies to the rows).
  Tensor private_rows(Shape shape) {
    int64_t rows = 1;
    for (int64_t n : shape) rows *= n;
    expert_out.assign(static_cast<size_t>(rows * kHidden), 0);
    shape.push_back(kHidden);
    return Tensor::wrap(expert_out.data(), DType::bf16, std::move(shape));
  }
};

// Normal mode in one receive order: dispatch, then combine of private expert outputs (windows), then
// combine of the dispatched rows themselves (read in place where they lie in the output arena).
void normal_round_trip(Buffer& buf, WarmUpInputs& in, ReceiveOrder order) {
  const LayoutResult layout = buf.get_dispatch_layout(in.topk_idx(), in.E);
  DispatchArgs d;
  d.x.data = in.token();
  d.topk_idx = in.topk_idx();
  d.topk_weights = in.topk_weights();
  d.num_tokens_per_rank = layout.num_tokens_per_rank;
  d.is_token_in_rank = layout.is_token_in_rank;
  d.num_tokens_per_expert = layout.num_tokens_per_expert;
  d.receive_order = order;
  const DispatchResult r = buf.dispatch(d);
  CombineArgs c;
  c.handle = r.handle;
  // expert_major weighs on the origin (its own weights), rank_major sums the received ones.
  c.topk_weights =
      order == ReceiveOrder::expert_major ? std::optional<Tensor>(in.topk_weights()) : r.recv_topk_weights;
  c.x = in.private_rows({r.recv_x.data.size(0)});
  buf.combine(c);
  if (r.recv_x.data.dtype() != DType::bf16) return;  // quantized rows (EPCOMM_NORMAL_INT8): no in-place run
  c.x = r.recv_x.data;
  buf.combine(c);
}

// Low-latency mode (DeepEP's layout): dispatch, combine of private expert outputs, zero-copy combine.
void low_latency_round_trip(Buffer& buf, WarmUpInputs& in) {
  LowLatencyDispatchArgs d;
  d.x = in.token();
  d.topk_idx = in.topk_idx();
  d.num_max_dispatch_tokens_per_rank = 1;
  d.num_experts = in.E;
  d.use_fp8 = false;
  const LowLatencyDispatchResult r = buf.low_latency_dispatch(d);
  LowLatencyCombineArgs c;
  c.handle = r.handle;
  c.topk_idx = in.topk_idx();
  c.topk_weights = in.topk_weights();
  c.x = in.private_rows({r.recv_x.size(0), r.recv_x.size(1)});
  buf.low_latency_combine(c);
  c.x = buf.low_latency_combine_buffer(*r.handle);
  std::memset(c.x.data(), 0, c.x.nbytes());
  buf.low_latency_combine(c);
}

// The operator family: dispatch_v2 of one bf16 token (its rows pushed into the receivers' output arenas),
// combine_v2 of the dispatched rows (read in place there), then of private expert outputs (copied).
void operators_round_trip(Group& group, WarmUpInputs& in) {
  moe::DispatchV2Args a;
  a.x = in.token();
  a.expert_ids = in.expert_ids();
  a.ep_world_size = in.R;
  a.ep_rank_id = in.rank;
  a.moe_expert_num = in.E;
  a.shared_expert_num = 0;
  const moe::DispatchV2Result d = moe::dispatch_v2(group, nullptr, a);
  moe::CombineV2Args c;
  c.expand_x = d.expand_x;
  c.expert_ids = a.expert_ids;
  c.assist_info_for_combine = d.assist_info_for_combine;
  c.ep_send_counts = d.ep_recv_counts;
  c.expert_scales = in.topk_weights();
  c.ep_world_size = in.R;
  c.ep_rank_id = in.rank;
  c.moe_expert_num = in.E;
  c.shared_expert_num = 0;
  moe::combine_v2(group, nullptr, c);
  c.expand_x = in.private_rows({d.expand_x.size(0)});
  moe::combine_v2(group, nullptr, c);
}

// Runs `round_trips`; a context too small for the warm-up's token skips them (every rank raises the same
// InvalidUsage before data moves, and the context stays usable): its first calls warm up instead.
template <typename F>
void warm_up_unless_too_small(int rank, const char* what, F&& round_trips) {
  try {
    round_trips();
  } catch (const Error& e) {
    if (e.code() != ErrorCode::InvalidUsage) throw;
    EPCOMM_LOG(info, rank, what, ": no warm-up: ", e.what());
  }
}

}  // namespace

void warm_up_group(Group& group) {
  if (!env::warm_up()) return;
  WarmUpInputs in(group.rank(), group.size());
  warm_up_unless_too_small(group.rank(), "moe group context", [&] { operators_round_trip(group, in); });
}

void warm_up(Buffer& buf, const BufferOptions& options) {
  if (!env::warm_up()) return;
  WarmUpInputs in(buf.rank(), buf.num_ranks());
  warm_up_unless_too_small(buf.rank(), "Buffer", [&] {
    normal_round_trip(buf, in, ReceiveOrder::expert_major);
    normal_round_trip(buf, in, ReceiveOrder::rank_major);
    if (options.low_latency_mode && options.flavor != "ascend") low_latency_round_trip(buf, in);
  });
}

}  // namespace epcomm::detail
