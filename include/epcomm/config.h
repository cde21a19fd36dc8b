// epcomm/config.h — per-call tuning knobs (threads, chunk sizes) of dispatch and combine.
// A plain value; validate() names the offending field. Results never depend on these values.
#pragma once

#include <cstdint>

namespace epcomm {

struct Config {
  int num_threads = 0;  // copy threads per rank per operation; 0 = hardware threads / local ranks (>= 1)
  int num_max_nvl_chunked_send_tokens = 32;
  int num_max_nvl_chunked_recv_tokens = 256;
  int num_max_rdma_chunked_send_tokens = 32;
  int num_max_rdma_chunked_recv_tokens = 256;

  // Throws epcomm::Error(InvalidUsage) naming the field: chunks >= 1, each send chunk <= its recv chunk,
  // num_threads >= 0.
  void validate() const;

  // DeepEP's size hints: a segment size at which no call with row_bytes <= hidden_bytes and num_topk <= 32
  // has to shrink its chunks below this config's. Always >= min_nvl_bytes(). rdma: 0 on one node.
  int64_t get_nvl_buffer_size_hint(int64_t hidden_bytes, int num_ranks, int ranks_per_node = 0) const;
  int64_t get_rdma_buffer_size_hint(int64_t hidden_bytes, int num_ranks, int ranks_per_node = 0) const;
};

// With a segment of at least this many bytes, every call whose record has `row_bytes` of payload and
// `num_topk` slots succeeds (it may move in rounds).
int64_t min_nvl_bytes(int64_t row_bytes, int num_topk, int num_ranks, int ranks_per_node = 0);
int64_t min_rdma_bytes(int64_t row_bytes, int num_topk, int num_ranks, int ranks_per_node = 0);

}  // namespace epcomm
