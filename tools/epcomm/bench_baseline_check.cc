// tools/epcomm/bench_baseline_check.cc — the baseline's outputs against epcomm's (payload rows, ids, weight
// bits, the aligned list; combined rows and weights), through 64-bit digests of every row, naming the first
// row that differs.
#include <cstring>
#include <string>

#include "bench_baseline.h"

namespace epcomm::cli {

namespace {

// A 64-bit digest of `bytes` bytes (multiply-xorshift over 8-byte words, the tail zero-padded, the length
// folded in). Not cryptographic: it tells apart rows that differ by accident, which is all the check needs.
uint64_t digest(const void* p, size_t bytes) {
  const auto* b = static_cast<const unsigned char*>(p);
  uint64_t h = 0x243F6A8885A308D3ull ^ (bytes * 0x9E3779B97F4A7C15ull);
  auto mix = [&h](uint64_t w) {
    h = (h ^ w) * 0xFF51AFD7ED558CCDull;
    h ^= h >> 32;
  };
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, b + i, 8);
    mix(w);
  }
  if (i < bytes) {
    uint64_t w = 0;
    std::memcpy(&w, b + i, bytes - i);
    mix(w);
  }
  h ^= h >> 29;
  h *= 0xC4CEB9FE1A85EC53ull;
  return h ^ (h >> 32);
}

// One digest per row of `n` rows of `row_bytes` bytes.
std::vector<uint64_t> row_digests(const void* rows, int64_t n, size_t row_bytes) {
  std::vector<uint64_t> d(static_cast<size_t>(n > 0 ? n : 0));
  for (int64_t i = 0; i < n; ++i)
    d[static_cast<size_t>(i)] = digest(static_cast<const char*>(rows) + i * row_bytes, row_bytes);
  return d;
}

// The first row of `rows` (n rows of row_bytes) whose digest differs from `want`, or -1.
int64_t first_difference(const std::vector<uint64_t>& want, const void* rows, int64_t n, size_t row_bytes) {
  if (static_cast<int64_t>(want.size()) != n) return 0;
  for (int64_t i = 0; i < n; ++i)
    if (digest(static_cast<const char*>(rows) + i * row_bytes, row_bytes) != want[static_cast<size_t>(i)])
      return i;
  return -1;
}

}  // namespace

OutputDigests digest_outputs(const DispatchResult& d, const CombineResult& c, int64_t hidden, int topk) {
  OutputDigests o;
  o.rows = d.recv_x.data.size(0);
  o.row_bytes = d.recv_x.data.nbytes() / static_cast<size_t>(o.rows > 0 ? o.rows : 1);
  o.plain_rows =
      o.rows == 0 || o.row_bytes == static_cast<size_t>(hidden) * dtype_size(d.recv_x.data.dtype());
  o.recv_x = row_digests(d.recv_x.data.data(), o.rows, o.row_bytes);
  if (d.recv_topk_idx) o.recv_topk_idx = row_digests(d.recv_topk_idx->data(), o.rows, size_t{8} * topk);
  if (d.recv_topk_weights)
    o.recv_topk_weights = row_digests(d.recv_topk_weights->data(), o.rows, size_t{4} * topk);
  o.has_list = d.num_recv_tokens_per_expert_list.has_value();
  if (o.has_list) o.list = *d.num_recv_tokens_per_expert_list;
  o.tokens = c.combined_x.dim() > 0 ? c.combined_x.size(0) : 0;
  o.combined_row_bytes = c.combined_x.nbytes() / static_cast<size_t>(o.tokens > 0 ? o.tokens : 1);
  o.combined_x = row_digests(c.combined_x.data(), o.tokens, o.combined_row_bytes);
  o.has_combined_weights = c.combined_topk_weights.has_value();
  if (o.has_combined_weights)
    o.combined_topk_weights = row_digests(c.combined_topk_weights->data(), o.tokens, size_t{4} * topk);
  return o;
}

std::string compare_dispatch(const AlltoallvBaseline& b, const OutputDigests& e, int topk) {
  const int64_t n = e.rows;
  if (b.num_rows() != n)
    return "baseline received " + std::to_string(b.num_rows()) + " rows, epcomm " + std::to_string(n);
  if (!e.plain_rows)
    return "epcomm's rows are not plain rows of the dtype (a quantizing mode has no baseline)";
  if (int64_t i = first_difference(e.recv_x, b.recv_x(), n, e.row_bytes); i >= 0)
    return "recv_x row " + std::to_string(i) + " differs from epcomm's";
  if (static_cast<int64_t>(e.recv_topk_idx.size()) != n ||
      static_cast<int64_t>(e.recv_topk_weights.size()) != n)
    return "epcomm returned no recv_topk_idx / recv_topk_weights to compare";
  if (int64_t i = first_difference(e.recv_topk_idx, b.recv_topk_idx(), n, size_t{8} * topk); i >= 0)
    return "recv_topk_idx row " + std::to_string(i) + " differs from epcomm's";
  if (int64_t i = first_difference(e.recv_topk_weights, b.recv_topk_weights(), n, size_t{4} * topk); i >= 0)
    return "recv_topk_weights row " + std::to_string(i) + " differs from epcomm's";
  if (e.has_list && b.num_recv_tokens_per_expert_list() != e.list)
    return "num_recv_tokens_per_expert_list differs from epcomm's";
  return "";
}

std::string compare_combine(const AlltoallvBaseline& b, const OutputDigests& e, int topk) {
  if (int64_t i = first_difference(e.combined_x, b.combined_x(), e.tokens, e.combined_row_bytes); i >= 0)
    return "combined_x row " + std::to_string(i) + " differs from epcomm's";
  if (!e.has_combined_weights) return "epcomm returned no combined_topk_weights";
  if (int64_t i =
          first_difference(e.combined_topk_weights, b.combined_topk_weights(), e.tokens, size_t{4} * topk);
      i >= 0)
    return "combined_topk_weights row " + std::to_string(i) + " differs from epcomm's";
  return "";
}

}  // namespace epcomm::cli
