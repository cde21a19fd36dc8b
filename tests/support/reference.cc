// support/reference.cc — the oracle: docs/normal-mode.md–docs/normal-mode.md as plain loops, in the spec's
// own order. Each function first builds the spec's list of rows, then derives every output from that list.
#include "support/reference.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "support/ref_float.h"

namespace epcomm::testing {

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("reference: " + message);
}

int64_t align_up(int64_t n, int64_t a) {
  return (n + a - 1) / a * a;
}

// One received row: source (s, t, k); PAD and tail rows are (-1, -1, -1); rank_major rows have k = -1.
struct Row {
  int32_t s, t, k;
};
constexpr Row kPad{-1, -1, -1};

size_t idx(int64_t i) {
  return static_cast<size_t>(i);
}

// V_s[t,k]: the id if >= 0, else -1 (any negative id means "no expert").
int64_t V(const RankInputs& in, int num_topk, int64_t t, int k) {
  const int64_t v = in.topk_idx[idx(t * num_topk + k)];
  return v >= 0 ? v : -1;
}

void check_ids(const std::vector<int64_t>& topk_idx, int64_t num_tokens, int num_topk, int num_experts) {
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int k = 0; k < num_topk; ++k) {
      const int64_t v = topk_idx[idx(t * num_topk + k)];
      if (v >= num_experts)
        throw std::invalid_argument("topk_idx[" + std::to_string(t) + ", " + std::to_string(k) +
                                    "] = " + std::to_string(v) + " is out of range [0, " +
                                    std::to_string(num_experts) + ")");
    }
}

void check_partition(int num_ranks, int ranks_per_node) {
  require(ranks_per_node >= 0, "ranks_per_node must be >= 0");
  require(ranks_per_node == 0 || num_ranks % ranks_per_node == 0, "num_ranks % ranks_per_node != 0");
}

bool is_float_dtype(DType dtype) {
  return dtype == DType::bf16 || dtype == DType::f16 || dtype == DType::f32;
}

// The rows rank d receives (docs/normal-mode.md), before the worst-case tail, plus cnt and list.
struct RowPlan {
  std::vector<Row> rows;
  std::vector<int64_t> cnt, list;
};

RowPlan plan_expert_major(const Problem& problem, int d, int64_t expert_alignment) {
  const int R = problem.spec.num_ranks, K = problem.spec.num_topk, L = problem.num_local_experts();
  RowPlan plan;
  plan.cnt.assign(idx(L), 0);
  plan.list.assign(idx(L), 0);
  for (int j = 0; j < L; ++j) {
    const int64_t expert = int64_t{d} * L + j;
    int64_t appended = 0;
    for (int s = 0; s < R; ++s) {
      const RankInputs& in = problem.ranks[idx(s)];
      for (int64_t t = 0; t < in.num_tokens; ++t)
        for (int k = 0; k < K; ++k)
          if (V(in, K, t, k) == expert) {
            plan.rows.push_back(Row{s, static_cast<int32_t>(t), k});
            ++appended;
          }
    }
    plan.cnt[idx(j)] = appended;
    plan.list[idx(j)] = align_up(appended, expert_alignment);
    for (int64_t p = appended; p < plan.list[idx(j)]; ++p) plan.rows.push_back(kPad);  // block j+1 aligned
  }
  return plan;
}

RowPlan plan_rank_major(const Problem& problem, int d, int64_t expert_alignment) {
  const int R = problem.spec.num_ranks, K = problem.spec.num_topk, L = problem.num_local_experts();
  const bool topk = problem.spec.topk;
  // Without top-k the destinations and counts are what the caller passes: is_token_in_rank and
  // num_tokens_per_expert as docs/normal-mode.md derives them.
  std::vector<RefLayout> layouts;
  if (!topk)
    for (int s = 0; s < R; ++s) layouts.push_back(ref_layout(problem, s));
  RowPlan plan;
  for (int s = 0; s < R; ++s) {
    const RankInputs& in = problem.ranks[idx(s)];
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      bool in_d = false;
      if (topk) {
        for (int k = 0; k < K; ++k) {
          const int64_t v = V(in, K, t, k);
          if (v >= 0 && v / L == d) in_d = true;
        }
      } else {
        in_d = layouts[idx(s)].is_token_in_rank[idx(t * R + d)] != 0;
      }
      if (in_d) plan.rows.push_back(Row{s, static_cast<int32_t>(t), -1});
    }
  }
  plan.cnt.assign(idx(L), 0);
  plan.list.assign(idx(L), 0);
  for (int j = 0; j < L; ++j) {
    const int64_t expert = int64_t{d} * L + j;
    int64_t count = 0;
    for (int s = 0; s < R; ++s) {
      const RankInputs& in = problem.ranks[idx(s)];
      if (topk) {
        for (int64_t t = 0; t < in.num_tokens; ++t)
          for (int k = 0; k < K; ++k) count += V(in, K, t, k) == expert;
      } else {
        count += layouts[idx(s)].num_tokens_per_expert[idx(expert)];
      }
    }
    plan.cnt[idx(j)] = count;
    plan.list[idx(j)] = align_up(count, expert_alignment);  // the list only; no PAD rows
  }
  return plan;
}

// docs/normal-mode.md: acc = +0; for each node ascending, p = +0 plus that node's contributions in canonical
// order; acc += p. `node_of_contribution[i]` / `value[i]` list the contributions in canonical order.
float reduce_canonical(const std::vector<int>& node_of_contribution, const std::vector<float>& value,
                       int num_nodes) {
  float acc = +0.0f;
  for (int n = 0; n < num_nodes; ++n) {
    float p = +0.0f;
    for (size_t i = 0; i < value.size(); ++i)
      if (node_of_contribution[i] == n) p = p + value[i];
    acc = acc + p;
  }
  return acc;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------
// Node partition
// ---------------------------------------------------------------------------------------------------------

int ref_num_nodes(int num_ranks, int ranks_per_node) {
  check_partition(num_ranks, ranks_per_node);
  return ranks_per_node > 0 ? num_ranks / ranks_per_node : 1;
}

int ref_node_of(int rank, int ranks_per_node) {
  return ranks_per_node > 0 ? rank / ranks_per_node : 0;
}

// ---------------------------------------------------------------------------------------------------------
// docs/normal-mode.md layout
// ---------------------------------------------------------------------------------------------------------

RefLayout ref_layout_of(const std::vector<int64_t>& topk_idx, int64_t num_tokens, int num_topk, int num_ranks,
                        int num_experts, int ranks_per_node) {
  require(num_ranks >= 1 && num_topk >= 1 && num_tokens >= 0, "bad shape");
  require(num_experts >= 1 && num_experts % num_ranks == 0, "num_experts % num_ranks != 0");
  require(topk_idx.size() == idx(num_tokens * num_topk), "topk_idx must have T*K entries");
  const int R = num_ranks, K = num_topk, E = num_experts, L = E / R;
  const int M = ref_num_nodes(R, ranks_per_node);
  check_ids(topk_idx, num_tokens, K, E);
  auto v_of = [&](int64_t t, int k) {
    const int64_t v = topk_idx[idx(t * K + k)];
    return v >= 0 ? v : int64_t{-1};
  };

  RefLayout layout;
  layout.is_token_in_rank.assign(idx(num_tokens * R), 0);
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int d = 0; d < R; ++d)
      for (int k = 0; k < K; ++k)
        if (v_of(t, k) >= 0 && v_of(t, k) / L == d) layout.is_token_in_rank[idx(t * R + d)] = 1;

  layout.num_tokens_per_rank.assign(idx(R), 0);
  for (int d = 0; d < R; ++d)
    for (int64_t t = 0; t < num_tokens; ++t)
      layout.num_tokens_per_rank[idx(d)] += layout.is_token_in_rank[idx(t * R + d)];

  if (M > 1) {
    layout.num_tokens_per_rdma_rank.assign(idx(M), 0);
    for (int n = 0; n < M; ++n)
      for (int64_t t = 0; t < num_tokens; ++t) {
        bool to_node = false;
        for (int k = 0; k < K; ++k)
          if (v_of(t, k) >= 0 && ref_node_of(static_cast<int>(v_of(t, k) / L), ranks_per_node) == n)
            to_node = true;
        layout.num_tokens_per_rdma_rank[idx(n)] += to_node;
      }
  }

  layout.num_tokens_per_expert.assign(idx(E), 0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int k = 0; k < K; ++k) layout.num_tokens_per_expert[idx(e)] += v_of(t, k) == e;
  return layout;
}

RefLayout ref_layout(const Problem& problem, int rank, int ranks_per_node) {
  validate_problem(problem);
  require(rank >= 0 && rank < problem.spec.num_ranks, "rank out of range");
  const RankInputs& in = problem.ranks[idx(rank)];
  return ref_layout_of(in.topk_idx, in.num_tokens, problem.spec.num_topk, problem.spec.num_ranks,
                       problem.spec.num_experts, ranks_per_node);
}

// ---------------------------------------------------------------------------------------------------------
// docs/normal-mode.md dispatch
// ---------------------------------------------------------------------------------------------------------

namespace {

// Both public entry points: with_payload = false leaves recv_x, recv_topk_idx and recv_topk_weights empty.
RefDispatch build_dispatch(const Problem& problem, int d, ReceiveOrder order, int64_t expert_alignment,
                           int64_t num_worst_tokens, bool with_payload) {
  validate_problem(problem);
  const int R = problem.spec.num_ranks, K = problem.spec.num_topk, L = problem.num_local_experts();
  require(d >= 0 && d < R, "receiving rank out of range");
  require(expert_alignment >= 1, "expert_alignment must be >= 1");
  require(num_worst_tokens >= 0, "num_worst_tokens must be >= 0");
  require(order == ReceiveOrder::rank_major || problem.spec.topk, "expert_major requires top-k");
  for (int s = 0; s < R; ++s) {
    const RankInputs& in = problem.ranks[idx(s)];
    try {
      check_ids(in.topk_idx, in.num_tokens, K, problem.spec.num_experts);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("rank " + std::to_string(s) + ": " + e.what());
    }
  }

  RowPlan plan = order == ReceiveOrder::expert_major ? plan_expert_major(problem, d, expert_alignment)
                                                     : plan_rank_major(problem, d, expert_alignment);
  RefDispatch out;
  out.num_worst_tokens = num_worst_tokens;
  out.num_recv_rows = static_cast<int64_t>(plan.rows.size());
  out.cnt = plan.cnt;
  out.list = plan.list;
  out.rows_per_source.assign(idx(R), 0);
  for (const Row& row : plan.rows)
    if (row.s >= 0) out.rows_per_source[idx(row.s)] += 1;

  // docs/normal-mode.md: overflow on any receiving rank makes every rank raise; no rows are produced.
  if (num_worst_tokens > 0 && out.num_recv_rows > num_worst_tokens) {
    out.overflow = true;
    return out;
  }
  std::vector<Row> rows = plan.rows;
  if (num_worst_tokens > 0) rows.resize(idx(num_worst_tokens), kPad);
  out.num_rows = static_cast<int64_t>(rows.size());

  const size_t row_bytes = problem.row_bytes();
  out.src_rank.assign(idx(out.num_rows), -1);
  out.src_token.assign(idx(out.num_rows), -1);
  out.src_slot.assign(idx(out.num_rows), -1);
  for (int64_t i = 0; i < out.num_rows; ++i) {
    out.src_rank[idx(i)] = rows[idx(i)].s;  // PAD / tail: (-1, -1, -1)
    out.src_token[idx(i)] = rows[idx(i)].t;
    out.src_slot[idx(i)] = rows[idx(i)].k;
  }
  if (!with_payload) return out;
  out.recv_x.assign(idx(out.num_rows) * row_bytes, 0);
  const bool topk = problem.spec.topk;
  if (topk) {
    out.recv_topk_idx.assign(idx(out.num_rows * K), -1);
    out.recv_topk_weights.assign(idx(out.num_rows * K), +0.0f);
  }
  for (int64_t i = 0; i < out.num_rows; ++i) {
    const Row row = rows[idx(i)];
    if (row.s < 0) continue;  // PAD / tail: zero payload, ids -1, weights +0, source -1
    const RankInputs& in = problem.ranks[idx(row.s)];
    std::memcpy(out.recv_x.data() + idx(i) * row_bytes, in.x.data() + idx(row.t) * row_bytes, row_bytes);
    if (!topk) continue;
    for (int kk = 0; kk < K; ++kk) {
      const int64_t v = V(in, K, row.t, kk);
      int64_t local = -1;
      if (order == ReceiveOrder::expert_major) {
        if (kk == row.k) local = v - int64_t{d} * L;
      } else {
        if (v >= 0 && v / L == d) local = v - int64_t{d} * L;
      }
      out.recv_topk_idx[idx(i * K + kk)] = local;
      if (local >= 0) out.recv_topk_weights[idx(i * K + kk)] = in.topk_weights[idx(row.t * K + kk)];
    }
  }
  return out;
}

}  // namespace

RefDispatch ref_dispatch(const Problem& problem, int d, ReceiveOrder order, int64_t expert_alignment,
                         int64_t num_worst_tokens) {
  return build_dispatch(problem, d, order, expert_alignment, num_worst_tokens, true);
}

RefDispatch ref_dispatch_placement(const Problem& problem, int d, ReceiveOrder order,
                                   int64_t expert_alignment, int64_t num_worst_tokens) {
  return build_dispatch(problem, d, order, expert_alignment, num_worst_tokens, false);
}

std::vector<uint8_t> ref_place_rows(const Problem& problem, const RefDispatch& placement,
                                    const std::vector<std::vector<uint8_t>>& new_x, size_t row_bytes) {
  require(!placement.overflow, "placement of an overflowing worst-case dispatch");
  require(new_x.size() == problem.ranks.size(), "new_x must have one entry per rank");
  for (size_t s = 0; s < new_x.size(); ++s)
    require(new_x[s].size() == idx(problem.ranks[s].num_tokens) * row_bytes,
            "new_x[" + std::to_string(s) + "] must have T_s * row_bytes bytes");
  std::vector<uint8_t> out(idx(placement.num_rows) * row_bytes, 0);
  for (int64_t i = 0; i < placement.num_rows; ++i) {
    const int32_t s = placement.src_rank[idx(i)];
    if (s < 0) continue;
    std::memcpy(out.data() + idx(i) * row_bytes,
                new_x[idx(s)].data() + idx(placement.src_token[idx(i)]) * row_bytes, row_bytes);
  }
  return out;
}

std::vector<uint8_t> ref_cached_dispatch(const Problem& problem, int d, ReceiveOrder order,
                                         int64_t expert_alignment, int64_t num_worst_tokens,
                                         const std::vector<std::vector<uint8_t>>& new_x, size_t row_bytes) {
  const RefDispatch placement = ref_dispatch_placement(problem, d, order, expert_alignment, num_worst_tokens);
  return ref_place_rows(problem, placement, new_x, row_bytes);
}

std::vector<uint8_t> make_expert_output(uint64_t seed, const RefDispatch& dispatch, DType dtype,
                                        int64_t hidden) {
  return make_expert_output(seed, dispatch.src_rank, dispatch.src_token, dispatch.src_slot, dtype, hidden);
}

// ---------------------------------------------------------------------------------------------------------
// docs/normal-mode.md combine
// ---------------------------------------------------------------------------------------------------------

RefCombine ref_combine(const Problem& problem, int r, ReceiveOrder order, int64_t expert_alignment,
                       int64_t num_worst_tokens, DType dtype, int64_t hidden2,
                       const std::vector<std::vector<uint8_t>>& expert_outputs,
                       const std::vector<float>* explicit_topk_weights,
                       const std::vector<std::vector<float>>* recv_weights_per_rank,
                       const std::vector<const std::vector<uint8_t>*>& biases, int ranks_per_node) {
  validate_problem(problem);
  const int R = problem.spec.num_ranks, K = problem.spec.num_topk, L = problem.num_local_experts();
  const int M = ref_num_nodes(R, ranks_per_node);
  require(r >= 0 && r < R, "origin rank out of range");
  require(is_float_dtype(dtype), "combine dtype must be bf16, f16 or f32");
  require(hidden2 >= 1, "hidden2 must be >= 1");
  require(biases.size() <= 2, "bias is none, a tensor or a 2-tuple");
  const RankInputs& origin = problem.ranks[idx(r)];
  const int64_t T = origin.num_tokens;
  const size_t elem = elem_size(dtype);
  const size_t row_bytes2 = idx(hidden2) * elem;
  for (const std::vector<uint8_t>* bias : biases)
    require(bias != nullptr && bias->size() == idx(T) * row_bytes2, "bias must have T_r * hidden2 elements");

  // Where each rank d holds the rows of r's tokens: the original dispatch placement, inverted.
  //   expert_major: row_of[d][t*K + k] = row_d(t, k);  rank_major: row_of[d][t] = row_d(t);  -1 = none.
  std::vector<RefDispatch> placement;
  std::vector<std::vector<int64_t>> row_of(idx(R));
  for (int d = 0; d < R; ++d) {
    placement.push_back(ref_dispatch_placement(problem, d, order, expert_alignment, 0));
    const RefDispatch& at = placement.back();
    const bool expert_major = order == ReceiveOrder::expert_major;
    row_of[idx(d)].assign(idx(expert_major ? T * K : T), -1);
    for (int64_t i = 0; i < at.num_recv_rows; ++i) {
      if (at.src_rank[idx(i)] != r) continue;
      const int64_t key =
          expert_major ? int64_t{at.src_token[idx(i)]} * K + at.src_slot[idx(i)] : at.src_token[idx(i)];
      require(row_of[idx(d)][idx(key)] == -1, "internal: a pair or token placed twice on one rank");
      row_of[idx(d)][idx(key)] = i;
    }
  }
  require(expert_outputs.size() == idx(R), "expert_outputs must have one entry per rank");
  for (int d = 0; d < R; ++d) {
    const size_t bytes = expert_outputs[idx(d)].size();
    const int64_t n = placement[idx(d)].num_recv_rows;
    const std::string where = "expert_outputs[" + std::to_string(d) + "]: ";
    require(bytes % row_bytes2 == 0, where + "not a whole number of rows");
    const int64_t rows = static_cast<int64_t>(bytes / row_bytes2);
    if (num_worst_tokens > 0) require(rows == num_worst_tokens, where + "expected num_worst_tokens rows");
    if (num_worst_tokens == 0) require(rows == n, where + "expected N_d rows");
    require(rows >= n, where + "fewer than N_d rows");
  }

  RefCombine out;
  out.combined_x.assign(idx(T) * row_bytes2, 0);
  // One contribution: its node and where its f32 factor and row live.
  struct Contribution {
    int node;
    float weight;  // expert_major: w_used; rank_major: unused
    const uint8_t* row;
  };

  if (order == ReceiveOrder::expert_major) {
    require(problem.spec.topk, "expert_major requires top-k");
    require(recv_weights_per_rank == nullptr, "receiving-side weights are a rank_major argument");
    if (explicit_topk_weights != nullptr)
      require(explicit_topk_weights->size() == idx(T * K), "explicit topk_weights must have T_r*K entries");
    // docs/normal-mode.md w_used, returned as combined_topk_weights.
    std::vector<float> w_used(idx(T * K), +0.0f);
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < K; ++k)
        if (V(origin, K, t, k) >= 0)
          w_used[idx(t * K + k)] = explicit_topk_weights != nullptr ? (*explicit_topk_weights)[idx(t * K + k)]
                                                                    : origin.topk_weights[idx(t * K + k)];
    for (int64_t t = 0; t < T; ++t) {
      std::vector<Contribution> contributions;
      for (int k = 0; k < K; ++k) {  // canonical position = k
        const int64_t v = V(origin, K, t, k);
        if (v < 0) continue;
        const int d = static_cast<int>(v / L);
        const int64_t row_index = row_of[idx(d)][idx(t * K + k)];  // row_d(t, k): pair (r, t, k) on d
        require(row_index >= 0, "internal: pair not found on its rank");
        contributions.push_back(Contribution{ref_node_of(d, ranks_per_node), w_used[idx(t * K + k)],
                                             expert_outputs[idx(d)].data() + idx(row_index) * row_bytes2});
      }
      for (int64_t h = 0; h < hidden2; ++h) {
        std::vector<int> nodes;
        std::vector<float> values;
        for (const Contribution& c : contributions) {
          nodes.push_back(c.node);
          values.push_back(c.weight * load_f32(dtype, c.row, h));  // one f32 product, RNE
        }
        float acc = reduce_canonical(nodes, values, M);
        if (biases.size() == 1) acc = acc + load_f32(dtype, biases[0]->data() + idx(t) * row_bytes2, h);
        if (biases.size() == 2) {
          acc = acc + load_f32(dtype, biases[0]->data() + idx(t) * row_bytes2, h);
          acc = acc + load_f32(dtype, biases[1]->data() + idx(t) * row_bytes2, h);
        }
        store_rounded(dtype, acc, out.combined_x.data() + idx(t) * row_bytes2 + idx(h) * elem);
      }
    }
    out.combined_topk_weights = w_used;
    out.has_weights = true;
    return out;
  }

  // docs/normal-mode.md rank_major: unweighted sum over the copies, canonical position = d.
  require(explicit_topk_weights == nullptr, "origin-side topk_weights are an expert_major argument");
  if (recv_weights_per_rank != nullptr) {
    require(recv_weights_per_rank->size() == idx(R), "recv_weights_per_rank must have one entry per rank");
    for (int d = 0; d < R; ++d)
      require((*recv_weights_per_rank)[idx(d)].size() >= idx(placement[idx(d)].num_recv_rows * K),
              "recv_weights_per_rank[" + std::to_string(d) + "] must have at least N_d*K entries");
  }
  out.has_weights = recv_weights_per_rank != nullptr;
  if (out.has_weights) out.combined_topk_weights.assign(idx(T * K), +0.0f);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> nodes;
    std::vector<int64_t> row_on;  // [contribution] -> row index on its rank
    std::vector<int> rank_of;
    for (int d = 0; d < R; ++d) {  // canonical position = d
      const int64_t i = row_of[idx(d)][idx(t)];
      if (i < 0) continue;  // not in_d(t)
      nodes.push_back(ref_node_of(d, ranks_per_node));
      row_on.push_back(i);
      rank_of.push_back(d);
    }
    for (int64_t h = 0; h < hidden2; ++h) {
      std::vector<float> values;
      for (size_t c = 0; c < nodes.size(); ++c)
        values.push_back(
            load_f32(dtype, expert_outputs[idx(rank_of[c])].data() + idx(row_on[c]) * row_bytes2, h));
      float acc = reduce_canonical(nodes, values, M);
      if (biases.size() == 1) acc = acc + load_f32(dtype, biases[0]->data() + idx(t) * row_bytes2, h);
      if (biases.size() == 2) {
        acc = acc + load_f32(dtype, biases[0]->data() + idx(t) * row_bytes2, h);
        acc = acc + load_f32(dtype, biases[1]->data() + idx(t) * row_bytes2, h);
      }
      store_rounded(dtype, acc, out.combined_x.data() + idx(t) * row_bytes2 + idx(h) * elem);
    }
    if (!out.has_weights) continue;
    for (int k = 0; k < K; ++k) {
      std::vector<float> values;
      for (size_t c = 0; c < nodes.size(); ++c)
        values.push_back((*recv_weights_per_rank)[idx(rank_of[c])][idx(row_on[c] * K + k)]);
      out.combined_topk_weights[idx(t * K + k)] = reduce_canonical(nodes, values, M);  // no bias, no rounding
    }
  }
  return out;
}

}  // namespace epcomm::testing
