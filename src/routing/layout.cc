// routing/layout.cc — layout counts, id normalization and receive plans.
#include "routing/layout.h"

#include "common/check.h"

namespace epcomm::routing {

Layout compute_layout(const int32_t* ids, int64_t num_tokens, int num_topk, const ExpertMap& map,
                      const std::vector<int>& node_of_rank, int num_nodes) {
  const int R = map.num_ranks;
  Layout out;
  out.num_tokens_per_rank.assign(R, 0);
  out.num_tokens_per_node.assign(num_nodes, 0);
  out.num_tokens_per_expert.assign(map.num_experts, 0);
  out.is_token_in_rank.assign(static_cast<size_t>(num_tokens) * R, 0);
  std::vector<uint8_t> node_hit(num_nodes);
  for (int64_t t = 0; t < num_tokens; ++t) {
    uint8_t* in_rank = &out.is_token_in_rank[static_cast<size_t>(t) * R];
    std::fill(node_hit.begin(), node_hit.end(), 0);
    for (int k = 0; k < num_topk; ++k) {
      int32_t e = ids[t * num_topk + k];
      if (e < 0) continue;
      ++out.num_tokens_per_expert[e];
      int r = map.rank_of(e);
      in_rank[r] = 1;
      node_hit[node_of_rank[r]] = 1;
    }
    for (int r = 0; r < R; ++r) out.num_tokens_per_rank[r] += in_rank[r];
    for (int n = 0; n < num_nodes; ++n) out.num_tokens_per_node[n] += node_hit[n];
  }
  return out;
}

void normalize_topk_ids(const void* ids, bool is_i64, int64_t num_tokens, int num_topk, int num_experts,
                        int32_t* out) {
  const int64_t n = num_tokens * num_topk;
  for (int64_t i = 0; i < n; ++i) {
    int64_t v = is_i64 ? static_cast<const int64_t*>(ids)[i] : static_cast<const int32_t*>(ids)[i];
    if (v >= num_experts)
      EPCOMM_THROW(InvalidUsage, "argument: topk_idx[", i / num_topk, ", ", i % num_topk, "] = ", v,
                   " is out of range [0, ", num_experts, ")");
    out[i] = v < 0 ? -1 : static_cast<int32_t>(v);
  }
}

void plan_receive(ReceivePlan& p, int d, ReceiveOrder order, const ExpertMap& map, int64_t expert_alignment,
                  const std::vector<const int32_t*>& pairs_per_expert,
                  const std::vector<const int32_t*>& tokens_per_rank, int64_t block_rows) {
  const int R = map.num_ranks, L = map.num_local;
  p.order = order;
  p.rows_per_source.assign(R, 0);
  int64_t* per_source = p.rows_per_source.data();
  if (order == ReceiveOrder::expert_major) {
    // Loops over experts with sources outside, each vectorizable: a receiver's plan is made on every rank
    // for every receiver per call, and a loop over (expert, source) with the running row carried through
    // both cost ~0.7 us at 256 local experts.
    p.cnt.assign(L, 0);
    p.list.resize(L);
    p.start.resize(static_cast<size_t>(R) * L);
    p.pad_begin.resize(L);
    p.block_end.resize(L);
    int64_t *cnt = p.cnt.data(), *list = p.list.data(), *begin = p.pad_begin.data(),
            *end = p.block_end.data();
    for (int s = 0; s < R; ++s) {  // start: offsets within each expert's rows, for now
      const int32_t* c = pairs_per_expert[s] + static_cast<ptrdiff_t>(d) * L;
      int64_t* st = p.start.data() + static_cast<size_t>(s) * L;
      int64_t sum = 0;
      for (int j = 0; j < L; ++j) {
        st[j] = cnt[j];
        cnt[j] += c[j];
        sum += c[j];
      }
      per_source[s] = sum;
    }
    int64_t row = 0;  // begin[j]: the expert's first row, for now
    for (int j = 0; j < L; ++j) {
      list[j] = align_up(cnt[j], expert_alignment);
      begin[j] = block_rows > 0 ? j * block_rows : row;
      row = begin[j] + (block_rows > 0 ? block_rows : list[j]);
      end[j] = row;
    }
    for (int s = 0; s < R; ++s) {
      int64_t* st = p.start.data() + static_cast<size_t>(s) * L;
      for (int j = 0; j < L; ++j) st[j] += begin[j];
    }
    for (int j = 0; j < L; ++j) begin[j] += cnt[j];  // now the PAD rows' first
    p.num_recv_rows = row;
    return;
  }
  p.pad_begin.clear();
  p.block_end.clear();
  p.cnt.assign(L, 0);
  for (int s = 0; s < R; ++s)
    for (int j = 0; j < L; ++j) p.cnt[j] += pairs_per_expert[s][d * L + j];
  p.list.resize(L);
  for (int j = 0; j < L; ++j) p.list[j] = align_up(p.cnt[j], expert_alignment);
  p.start.resize(R);
  int64_t row = 0;
  for (int s = 0; s < R; ++s) {
    p.start[s] = row;
    per_source[s] = tokens_per_rank[s][d];
    row += tokens_per_rank[s][d];
  }
  p.num_recv_rows = row;
}

}  // namespace epcomm::routing
