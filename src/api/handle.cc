// api/handle.cc — Handle accessors.
#include <algorithm>

#include "common/check.h"
#include "engine/handle_impl.h"
#include "epcomm/buffer.h"

namespace epcomm {

ReceiveOrder Handle::receive_order() const {
  return impl_->order;
}
int64_t Handle::num_tokens() const {
  return impl_->num_tokens;
}
int Handle::num_topk() const {
  return impl_->num_topk;
}
int Handle::num_experts() const {
  return impl_->num_experts;
}
int64_t Handle::num_recv_rows() const {
  return impl_->num_recv_rows;
}
int64_t Handle::num_rows() const {
  return impl_->num_rows;
}
std::vector<int64_t> Handle::num_recv_tokens_per_expert() const {
  return impl_->list;
}
std::vector<int64_t> Handle::num_recv_pairs_per_expert() const {
  return impl_->cnt;
}
std::vector<int64_t> Handle::num_recv_rows_per_source() const {
  return impl_->rows_per_source;
}
std::vector<int64_t> Handle::num_rows_per_source_and_receiver() const {
  return impl_->rows_matrix;
}
std::vector<uint8_t> Handle::is_token_in_rank() const {
  return impl_->in_rank;
}
Tensor Handle::recv_src_rank() const {
  return impl_->recv_src_rank;
}
Tensor Handle::recv_src_token() const {
  return impl_->recv_src_token;
}
Tensor Handle::recv_src_slot() const {
  return impl_->recv_src_slot;
}
uint64_t Handle::dispatch_id() const {
  return impl_->seq;
}
std::vector<uint32_t> Handle::recv_node_masks() const {
  return impl_->recv_node_mask;
}
Handle::RailEntries Handle::rail_entries(int node) const {
  const auto n = static_cast<size_t>(node);
  EPCOMM_CHECK(node >= 0 && n < std::max<size_t>(impl_->rail_num_tokens.size(), 1),
               "Handle::rail_entries: argument: node = ", node, ", expected 0 <= node < ",
               std::max<size_t>(impl_->rail_num_tokens.size(), 1));
  if (n >= impl_->rail_num_tokens.size()) return {};
  return {impl_->rail_num_tokens[n], impl_->rail_tokens[n], impl_->rail_ids[n], impl_->rail_masks[n]};
}

}  // namespace epcomm
