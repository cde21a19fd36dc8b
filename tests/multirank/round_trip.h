// multirank/round_trip.h — the shared check of dispatch + combine against the reference model.
#pragma once

#include <optional>

#include "epcomm/buffer.h"
#include "multirank/driver.h"
#include "support/problem.h"
#include "support/reference.h"

namespace epcomm::testing {

struct RoundTrip {
  ProblemSpec spec;
  ReceiveOrder order = ReceiveOrder::expert_major;
  int64_t expert_alignment = 1;
  int64_t num_worst_tokens = 0;  // < 0: use max over receivers of N plus -value
  bool async = false;            // async_finish with previous_event chains
  bool pass_layout = true;       // pass num_tokens_per_rank / is_token_in_rank too
  bool cached = true;            // also run a cached re-dispatch with a new x (other H and dtype)
  bool idx32 = false;            // pass topk_idx as i32 (recv_topk_idx comes back as i32)
  DType combine_dtype = DType::bf16;
  int64_t combine_hidden = 0;  // 0: same as spec.hidden
  bool shared_input = false;   // combines read x from Buffer::get_combine_input (the Buffer must have one)
  bool shared_dispatch_input = false;  // dispatches read x from Buffer::get_dispatch_input (same)
};

BufferOptions test_options(int64_t nvl_bytes = 8 << 20, double timeout_s = 60);

// Runs layout, dispatch, two combines (fed-back rows; distinct outputs with explicit weights and a bias
// tuple) and optionally a cached dispatch on `buf`, checking every output against the reference.
void run_round_trip(RankCtx& ctx, Buffer& buf, const RoundTrip& rt);

// Tensor views of a problem's inputs on rank r.
Tensor x_of(const Problem& p, int r);
Tensor topk_idx_of(const Problem& p, int r);
Tensor topk_weights_of(const Problem& p, int r);

// Fresh-dispatch arguments for rank r of `p`: x, top-k ids and weights, and the per-expert counts from
// buf.get_dispatch_layout (the other fields at their defaults).
DispatchArgs dispatch_args_of(const Problem& p, int r, Buffer& buf);

// Expects `fn` to throw epcomm::Error with `code` and every keyword in its message.
void expect_error(const std::function<void()>& fn, ErrorCode code,
                  std::initializer_list<const char*> keywords);

// A timeout for a missing peer: the message (Timeout, or an Aborted quoting a peer's Timeout) names
// `word` ("rank", "ep rank") `missing` with the last call seen from it (#`seen`); a rank's own Timeout for a
// peer on another node (EPCOMM_RANKS_PER_NODE) also names that node and the rank of ours that relays it.
void check_names_missing(const Error& e, const RankCtx& ctx, const char* word, int missing, int seen);

}  // namespace epcomm::testing
