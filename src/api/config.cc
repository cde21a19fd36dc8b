// api/config.cc — Config validation, size functions and size hints.
#include <algorithm>
#include <atomic>

#include "common/check.h"
#include "engine/internode.h"
#include "engine/protocol.h"
#include "epcomm/buffer.h"

namespace epcomm {

void Config::validate() const {
  EPCOMM_CHECK(num_threads >= 0, "config.num_threads: expected >= 0, got ", num_threads);
  auto chunk = [](const char* name, int v) {
    EPCOMM_CHECK(v >= 1, "config.", name, ": expected >= 1, got ", v);
  };
  chunk("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens);
  chunk("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens);
  chunk("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens);
  chunk("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens);
  EPCOMM_CHECK(num_max_nvl_chunked_send_tokens <= num_max_nvl_chunked_recv_tokens,
               "config.num_max_nvl_chunked_send_tokens: expected <= num_max_nvl_chunked_recv_tokens = ",
               num_max_nvl_chunked_recv_tokens, ", got ", num_max_nvl_chunked_send_tokens);
  EPCOMM_CHECK(num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens,
               "config.num_max_rdma_chunked_send_tokens: expected <= num_max_rdma_chunked_recv_tokens = ",
               num_max_rdma_chunked_recv_tokens, ", got ", num_max_rdma_chunked_send_tokens);
}

namespace {
// Per-token record sizes of the two protocols (dispatch: payload + ids + weights; combine: one copy per
// slot).
int64_t data_bytes_for(int64_t row_bytes, int num_topk, int num_ranks, int64_t tokens) {
  using namespace engine;
  size_t meta = std::max<size_t>(static_cast<size_t>(num_topk) * 8, static_cast<size_t>(num_ranks));
  size_t d = dispatch_min_data_bytes(row_bytes, meta);
  size_t per_token_d = d / 2;  // one staged token per half
  size_t c =
      combine_min_data_bytes(row_bytes, std::max(num_topk, num_ranks), static_cast<size_t>(num_topk) * 4);
  return static_cast<int64_t>(std::max(2 * per_token_d * tokens, c * tokens));
}
}  // namespace

int64_t min_nvl_bytes(int64_t row_bytes, int num_topk, int num_ranks, int /*ranks_per_node*/) {
  EPCOMM_CHECK(row_bytes >= 1 && num_topk >= 0 && num_ranks >= 1,
               "min_nvl_bytes: row_bytes >= 1, num_topk >= 0 and num_ranks >= 1 required, got ", row_bytes,
               ", ", num_topk, ", ", num_ranks);
  return static_cast<int64_t>(engine::control_bytes(num_ranks)) +
         data_bytes_for(row_bytes, num_topk, num_ranks, 1);
}

// Internode: every rank keeps one lane per node (engine/internode.h); a lane must hold the lane's control
// part and one token's dispatch entry (two halves) or combine window (copies, routing, f32 partial).
static int64_t rdma_bytes_for(int64_t row_bytes, int num_topk, int num_ranks, int ranks_per_node,
                              int64_t tokens) {
  using namespace engine;
  if (ranks_per_node <= 0 || ranks_per_node >= num_ranks) return 0;  // one node: no internode staging
  EPCOMM_CHECK(num_ranks % ranks_per_node == 0, "ranks_per_node = ", ranks_per_node,
               " must divide the number of ranks ", num_ranks);
  const int M = num_ranks / ranks_per_node;
  const size_t meta = align64(std::max<size_t>(static_cast<size_t>(num_topk) * 8, 1));
  const size_t row = align64(static_cast<size_t>(row_bytes));
  const size_t dispatch = 2 * (align64(8 + 4 * static_cast<size_t>(tokens)) + tokens * (meta + row));
  const int slots = std::max(num_topk, num_ranks);
  const size_t combine =
      static_cast<size_t>(tokens) * slots * (row + align64(4 * static_cast<size_t>(num_topk))) +
      align64(8 + tokens * (4 + 8 * static_cast<size_t>(num_topk) + num_ranks)) +
      tokens * align64(2 * static_cast<size_t>(row_bytes) + 4 * num_topk) + 3 * kAlign;
  const size_t lane =
      lane_overhead_bytes(ranks_per_node, num_ranks) + std::max<size_t>(std::max(dispatch, combine), 4096);
  return static_cast<int64_t>(M) * static_cast<int64_t>((lane + 4095) / 4096 * 4096);
}

int64_t min_rdma_bytes(int64_t row_bytes, int num_topk, int num_ranks, int ranks_per_node) {
  EPCOMM_CHECK(
      row_bytes >= 1 && num_topk >= 0 && num_ranks >= 1 && ranks_per_node >= 0,
      "min_rdma_bytes: row_bytes >= 1, num_topk >= 0, num_ranks >= 1 and ranks_per_node >= 0 required, got ",
      row_bytes, ", ", num_topk, ", ", num_ranks, ", ", ranks_per_node);
  return rdma_bytes_for(row_bytes, num_topk, num_ranks, ranks_per_node, 1);
}

int64_t Config::get_nvl_buffer_size_hint(int64_t hidden_bytes, int num_ranks, int /*ranks_per_node*/) const {
  validate();
  // A window of num_max_nvl_chunked_recv_tokens tokens for the largest record (K = 32).
  return static_cast<int64_t>(engine::control_bytes(num_ranks)) +
         data_bytes_for(hidden_bytes, 32, num_ranks, num_max_nvl_chunked_recv_tokens);
}

int64_t Config::get_rdma_buffer_size_hint(int64_t hidden_bytes, int num_ranks, int ranks_per_node) const {
  validate();
  return rdma_bytes_for(hidden_bytes, 32, num_ranks, ranks_per_node, num_max_rdma_chunked_recv_tokens);
}

}  // namespace epcomm
