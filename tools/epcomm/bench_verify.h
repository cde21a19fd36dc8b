// tools/epcomm/bench_verify.h — the inputs of `epcomm bench` (tokens and uniform random routing of any rank,
// from the seed) and the once-per-run check of one dispatch and one combine against a plain local model.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epcomm/buffer.h"
#include "run_options.h"

namespace epcomm::cli {

// Token t of rank s goes to K distinct experts drawn uniformly; weights uniform in [0.05, 1).
void bench_route(const RunOptions& o, int s, int64_t t, int64_t* ids, float* weights);

// Rank s's routing: [T, K] ids and weights.
struct Routing {
  std::vector<int64_t> ids;
  std::vector<float> weights;
};
Routing bench_routing(const RunOptions& o, int s);

// Checks a dispatch on rank r against docs/normal-mode.md computed from the seed: row count and
// list, each row's source (handle) and payload bytes (bitwise; the quantized bytes for quantizing modes),
// recv_topk_idx and recv_topk_weights. Returns "" when it matches, else what differs first.
std::string verify_dispatch(const RunOptions& o, ReceiveOrder order, int r, const DispatchResult& d);

// Checks a combine on rank r whose input was the dispatched rows fed back (as the dtype): expert_major
// gives round(sum_k w_k x), rank_major round(n_ranks x), within 2u|expected| (u: the dtype's unit
// roundoff); combined_topk_weights equal the original weights bitwise. Returns "" or what differs first.
std::string verify_combine(const RunOptions& o, ReceiveOrder order, int r, const std::vector<std::byte>& x,
                           const Routing& routing, const CombineResult& c);

}  // namespace epcomm::cli
