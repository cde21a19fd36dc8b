// tools/epcomm/bench_baseline.h — the MPI baseline of `epcomm bench --bootstrap mpi`: the same dispatch and
// combine as users write them without epcomm (pack rows per destination, MPI_Alltoallv, unpack; the reverse
// exchange and the same fp32 reduction). No <mpi.h> here; builds without MPI link a stub (have_mpi() false).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "epcomm/bootstrap.h"
#include "epcomm/buffer.h"
#include "epcomm/types.h"

namespace epcomm::cli {

// Whether this build of the tool links MPI (epcomm_mpi): --bootstrap mpi and the baseline need it.
bool have_mpi();

// A Bootstrap over MPI_COMM_WORLD (calls MPI_Init when needed). Throws UsageError in a build without MPI.
std::unique_ptr<Bootstrap> make_world_bootstrap(std::chrono::milliseconds timeout);

// The shape of one baseline run on one rank; x, ids and weights are the rank's own inputs ([T, H] rows of
// `dtype`, [T, K] i64, [T, K] f32), which must stay valid while the baseline lives.
struct BaselineInputs {
  int rank = 0, ranks = 1;
  int64_t tokens = 0, hidden = 0;
  int topk = 1, experts = 1;
  DType dtype = DType::bf16;
  ReceiveOrder order = ReceiveOrder::expert_major;
  int64_t expert_alignment = 1;
  const std::byte* x = nullptr;
  const int64_t* ids = nullptr;
  const float* weights = nullptr;
  std::vector<int>
      node_of_rank;  // empty: one node; else the node partition, for the docs/normal-mode.md reduction order
};

// Dispatch and combine over MPI_COMM_WORLD with MPI_Alltoallv, producing epcomm's outputs bit for bit:
// recv_x, recv_topk_idx and recv_topk_weights in the receive order of docs/normal-mode.md (PAD rows
// included) or docs/normal-mode.md, the aligned per-expert list, and combine's docs/normal-mode.md canonical
// fp32 reduction. Both calls are collective over MPI_COMM_WORLD; not thread-safe. Buffers are allocated on
// the first call and reused, as a user's loop would.
class AlltoallvBaseline {
 public:
  explicit AlltoallvBaseline(const BaselineInputs& in);
  ~AlltoallvBaseline();
  AlltoallvBaseline(const AlltoallvBaseline&) = delete;
  AlltoallvBaseline& operator=(const AlltoallvBaseline&) = delete;

  // Count exchange (MPI_Alltoall), pack rows and their top-k metadata per destination, MPI_Alltoallv of the
  // rows, the ids and the weights, unpack into the receive order.
  void dispatch();
  // The same dispatch again on the plan of the last dispatch() (what a user's cached re-dispatch does: the
  // routing has not changed): pack, MPI_Alltoallv and unpack of the rows only, no count exchange, the ids
  // and weights left from dispatch(). Requires a dispatch() before.
  void dispatch_cached();
  // The reverse: pack this rank's received rows of `expert_out` ([rows, H], the dispatch's order; PAD rows
  // are not read) per source rank, MPI_Alltoallv back, reduce at the origin. rank_major also sends
  // back `recv_weights` ([rows, K] f32) and sums them into combined_topk_weights, as epcomm does.
  void combine(const std::byte* expert_out, const float* recv_weights);

  // Dispatch outputs (valid after dispatch()).
  int64_t num_rows() const;
  const std::byte* recv_x() const;
  const int64_t* recv_topk_idx() const;
  const float* recv_topk_weights() const;
  const std::vector<int64_t>& num_recv_tokens_per_expert_list() const;
  // Combine outputs (valid after combine()): [T, H] of the dtype and [T, K] f32.
  const std::byte* combined_x() const;
  const float* combined_topk_weights() const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

// What the baseline is checked against: 64-bit digests of every row of epcomm's first-iteration outputs
// (bench_baseline_check.cc), so that those outputs need not stay alive while the bench runs epcomm's other
// lines; the baseline runs after all of them. Two rows that differ agree in their digests with a chance of
// about 2^-64.
struct OutputDigests {
  int64_t rows = 0;        // dispatch rows (PAD rows included)
  size_t row_bytes = 0;    // bytes per recv_x row
  bool plain_rows = true;  // rows of H elements of the dtype (false: quantized rows, no baseline)
  std::vector<uint64_t> recv_x, recv_topk_idx, recv_topk_weights;  // per row
  bool has_list = false;
  std::vector<int64_t> list;  // num_recv_tokens_per_expert_list, as it is
  int64_t tokens = 0;         // combine rows
  size_t combined_row_bytes = 0;
  std::vector<uint64_t> combined_x, combined_topk_weights;  // per token
  bool has_combined_weights = false;
};
OutputDigests digest_outputs(const DispatchResult& d, const CombineResult& c, int64_t hidden, int topk);

// "" when the baseline's dispatch outputs equal epcomm's (rows, ids, weights, list), else the first row
// that differs.
std::string compare_dispatch(const AlltoallvBaseline& b, const OutputDigests& epcomm, int topk);
// "" when the baseline's combine outputs equal epcomm's, else the first row that differs.
std::string compare_combine(const AlltoallvBaseline& b, const OutputDigests& epcomm, int topk);

}  // namespace epcomm::cli
