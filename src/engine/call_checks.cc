// engine/call_checks.cc — the header comparison of the normal-mode protocols and their cost statistics.
#include "engine/call_checks.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/check.h"
#include "engine/protocol.h"
#include "epcomm/types.h"

namespace epcomm::engine {

void add_cost_stats(const Tensor& stats, const std::vector<int64_t>& micros) {
  for (size_t r = 0; r < micros.size(); ++r) {
    int64_t us = std::max<int64_t>(micros[r], 0);
    if (stats.dtype() == DType::i64) {
      stats.data_as<int64_t>()[r] += us;
    } else {
      int64_t v = static_cast<int64_t>(stats.data_as<int32_t>()[r]) + us;
      stats.data_as<int32_t>()[r] = static_cast<int32_t>(std::min<int64_t>(v, INT32_MAX));
    }
  }
}

void check_headers_match(const OpContext& ctx) {
  const int R = ctx.size();
  auto differs = [&](auto get) {
    for (int r = 1; r < R; ++r)
      if (get(ctx.header(r)) != get(ctx.header(0))) return true;
    return false;
  };
  auto report = [&](const char* name, auto get) {
    if (!differs(get)) return;
    std::string per_rank;
    for (int r = 0; r < R; ++r) per_rank += detail::cat(r ? ", " : "", "rank ", r, " = ", get(ctx.header(r)));
    EPCOMM_THROW(InvalidUsage, ctx.prefix(), "mismatch: ranks disagree on ", name, ": ", per_rank);
  };
  auto order_name = [](const HeaderData* h) {
    return std::string(receive_order_name(static_cast<ReceiveOrder>(h->order)));
  };
  report("the operation",
         [](const HeaderData* h) { return std::string(op_kind_name(static_cast<OpKind>(h->op))); });
  report("receive_order", order_name);
  report("handle (dispatch id)", [](const HeaderData* h) { return h->handle_id; });
  report("num_experts", [](const HeaderData* h) { return h->num_experts; });
  report("num_topk", [](const HeaderData* h) { return h->num_topk; });
  report("hidden", [](const HeaderData* h) { return h->hidden; });
  report("quant_mode", [](const HeaderData* h) {
    return std::string(h->quant_mode < 0 ? "plain" : quant_mode_name(static_cast<QuantMode>(h->quant_mode)));
  });
  report("payload dtype",
         [](const HeaderData* h) { return std::string(dtype_name(static_cast<DType>(h->dtype))); });
  report("presence of topk_idx", [](const HeaderData* h) { return (h->flags & kHasTopk) != 0; });
  report("presence of weights", [](const HeaderData* h) { return (h->flags & kHasWeights) != 0; });
  report("expert_alignment", [](const HeaderData* h) { return h->expert_alignment; });
  report("num_max_dispatch_tokens_per_rank (low-latency mode)",
         [R](const HeaderData* h) { return h->expert_block_rows / R; });
  report("config.num_max_nvl_chunked_send_tokens", [](const HeaderData* h) { return h->chunks[0]; });
  report("config.num_max_nvl_chunked_recv_tokens", [](const HeaderData* h) { return h->chunks[1]; });
  report("config.num_max_rdma_chunked_send_tokens", [](const HeaderData* h) { return h->chunks[2]; });
  report("config.num_max_rdma_chunked_recv_tokens", [](const HeaderData* h) { return h->chunks[3]; });
}

}  // namespace epcomm::engine
