// routing/layout.h — get_dispatch_layout's counts (docs/normal-mode.md) and the per-call receive plan.
// Pure functions of top-k ids and counts: no I/O, exhaustively unit-tested.
#pragma once

#include <cstdint>
#include <vector>

#include "epcomm/types.h"

namespace epcomm::routing {

// Expert ownership: experts map to ranks in contiguous blocks of L = E / R.
struct ExpertMap {
  int num_experts = 0, num_ranks = 1, num_local = 0;
  // 32-bit division (expert ids are below kMaxExperts): a 64-bit one cost several times more. Per-slot loops
  // of dispatch ask hosts() instead.
  int rank_of(int64_t e) const { return static_cast<int32_t>(e) / num_local; }
  // Whether rank d hosts expert e (e >= 0 or -1 for "no expert"): a range check, no division.
  bool hosts(int d, int64_t e) const {
    return static_cast<uint64_t>(e - static_cast<int64_t>(d) * num_local) < static_cast<uint64_t>(num_local);
  }
};

struct Layout {
  std::vector<int32_t> num_tokens_per_rank;    // [R]
  std::vector<int32_t> num_tokens_per_node;    // [M]
  std::vector<int32_t> num_tokens_per_expert;  // [E]
  std::vector<uint8_t> is_token_in_rank;       // [T, R]
};

// `ids` are normalized top-k ids ([T*K], -1 for "no expert", all < E). node_of_rank has R entries, values <
// M.
Layout compute_layout(const int32_t* ids, int64_t num_tokens, int num_topk, const ExpertMap& map,
                      const std::vector<int>& node_of_rank, int num_nodes);

// Normalizes user ids of dtype i64 or i32 into `out` (negative -> -1); throws InvalidUsage
// "topk_idx[t, k] = v is out of range [0, E)" for the first offending id in row-major order.
void normalize_topk_ids(const void* ids, bool is_i64, int64_t num_tokens, int num_topk, int num_experts,
                        int32_t* out);

// What receiving rank d gets, computed from every source's published counts.
struct ReceivePlan {
  ReceiveOrder order = ReceiveOrder::expert_major;
  int64_t num_recv_rows = 0;             // N (PAD rows included in expert_major)
  std::vector<int64_t> cnt, list;        // [L] pairs per local expert, aligned list
  std::vector<int64_t> rows_per_source;  // [R] PAD excluded
  // expert_major: first row of (source s, local expert j) at [s * L + j]; PAD rows of j at
  // [pad_begin[j], block_end[j]). rank_major: first row of source s at [s].
  std::vector<int64_t> start;
  std::vector<int64_t> pad_begin, block_end;  // [L], expert_major only
};

// pairs_per_expert[s] = source s's num_tokens_per_expert ([E]); tokens_per_rank[s] its num_tokens_per_rank
// ([R]). rank_major without top-k: pairs_per_expert carry the caller-supplied num_tokens_per_expert (list
// only). block_rows > 0 (expert_major, low-latency mode): block j is rows [j * block_rows, (j + 1) *
// block_rows), its pairs first, the rest its PAD range; N = L * block_rows. The caller checks that every
// cnt[j] fits.
// Fills `p` (its vectors keep their capacity: a caller planning every receiver reuses one plan).
void plan_receive(ReceivePlan& p, int d, ReceiveOrder order, const ExpertMap& map, int64_t expert_alignment,
                  const std::vector<const int32_t*>& pairs_per_expert,
                  const std::vector<const int32_t*>& tokens_per_rank, int64_t block_rows = 0);
inline ReceivePlan plan_receive(int d, ReceiveOrder order, const ExpertMap& map, int64_t expert_alignment,
                                const std::vector<const int32_t*>& pairs_per_expert,
                                const std::vector<const int32_t*>& tokens_per_rank, int64_t block_rows = 0) {
  ReceivePlan p;
  plan_receive(p, d, order, map, expert_alignment, pairs_per_expert, tokens_per_rank, block_rows);
  return p;
}

// n rounded up to a multiple of a (> 0). a = 1 (no alignment, the common case) skips the 64-bit division,
// which costs ~40 cycles per call: a plan calls this once per local expert and receiver.
inline int64_t align_up(int64_t n, int64_t a) {
  return a == 1 ? n : (n + a - 1) / a * a;
}

}  // namespace epcomm::routing
