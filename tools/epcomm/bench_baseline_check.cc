// tools/epcomm/bench_baseline_check.cc — the baseline's outputs against epcomm's, bitwise (payload bytes,
// ids, weight bits, the aligned list; combined rows and weights), naming the first difference.
#include <cstring>
#include <string>

#include "bench_baseline.h"

namespace epcomm::cli {

namespace {

// The first index where two arrays of `n` elements of `size` bytes differ, or -1.
int64_t first_difference(const void* a, const void* b, int64_t n, size_t size) {
  if (n == 0 || std::memcmp(a, b, static_cast<size_t>(n) * size) == 0) return -1;
  for (int64_t i = 0; i < n; ++i)
    if (std::memcmp(static_cast<const char*>(a) + i * size, static_cast<const char*>(b) + i * size, size) !=
        0)
      return i;
  return -1;
}

}  // namespace

std::string compare_dispatch(const AlltoallvBaseline& b, const DispatchResult& d, int64_t hidden, int topk) {
  const int64_t n = d.recv_x.data.size(0);
  if (b.num_rows() != n)
    return "baseline received " + std::to_string(b.num_rows()) + " rows, epcomm " + std::to_string(n);
  const size_t row = d.recv_x.data.nbytes() / static_cast<size_t>(n > 0 ? n : 1);
  if (n > 0 && row != static_cast<size_t>(hidden) * dtype_size(d.recv_x.data.dtype()))
    return "epcomm's rows are not plain rows of the dtype (a quantizing mode has no baseline)";
  if (int64_t i = first_difference(b.recv_x(), d.recv_x.data.data(), n, row); i >= 0)
    return "recv_x row " + std::to_string(i) + " differs from epcomm's";
  if (int64_t i = first_difference(b.recv_topk_idx(), d.recv_topk_idx->data(), n, 8 * topk); i >= 0)
    return "recv_topk_idx row " + std::to_string(i) + " differs from epcomm's";
  if (int64_t i = first_difference(b.recv_topk_weights(), d.recv_topk_weights->data(), n, 4 * topk); i >= 0)
    return "recv_topk_weights row " + std::to_string(i) + " differs from epcomm's";
  if (d.num_recv_tokens_per_expert_list &&
      b.num_recv_tokens_per_expert_list() != *d.num_recv_tokens_per_expert_list)
    return "num_recv_tokens_per_expert_list differs from epcomm's";
  return "";
}

std::string compare_combine(const AlltoallvBaseline& b, const CombineResult& c, int64_t tokens, int topk) {
  const size_t row = c.combined_x.nbytes() / static_cast<size_t>(tokens > 0 ? tokens : 1);
  if (int64_t i = first_difference(b.combined_x(), c.combined_x.data(), tokens, row); i >= 0)
    return "combined_x row " + std::to_string(i) + " differs from epcomm's";
  if (!c.combined_topk_weights) return "epcomm returned no combined_topk_weights";
  if (int64_t i =
          first_difference(b.combined_topk_weights(), c.combined_topk_weights->data(), tokens, 4 * topk);
      i >= 0)
    return "combined_topk_weights row " + std::to_string(i) + " differs from epcomm's";
  return "";
}

}  // namespace epcomm::cli
