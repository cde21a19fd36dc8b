// support/problem.h — seeded multi-rank test problems: every rank calls make_problem with the same spec and
// gets every rank's inputs (T_s, topk_idx, topk_weights, x), bit for bit, with no communication.
// Payloads are TAGGED (row x_s[t] encodes (s, t), so order bugs show) or random bit patterns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "epcomm/tensor.h"

namespace epcomm::testing {

// ---------------------------------------------------------------------------------------------------------
// Problem description and generation
// ---------------------------------------------------------------------------------------------------------

struct ProblemSpec {
  int num_ranks = 1;          // R
  int num_experts = 1;        // E, a multiple of R
  int num_topk = 1;           // K >= 1
  int64_t hidden = 1;         // H >= 1
  DType dtype = DType::bf16;  // payload dtype: bf16, f16 or f32
  uint64_t seed = 0;
  int64_t min_tokens = 0, max_tokens = 64;  // per-rank T_s drawn uniformly in [min_tokens, max_tokens]
  double neg_prob = 0.1;                    // probability that a slot is -1
  double dup_prob = 0.05;                   // probability that a slot repeats an expert already in its row
  enum class Routing {
    uniform,          // experts drawn from [0, E), avoiding repeats unless dup_prob fires
    skewed_one_rank,  // every valid slot names an expert of rank skew_rank
    all_empty,        // every slot is -1
  } routing = Routing::uniform;
  int skew_rank = 0;
  bool random_bits = false;              // x holds random bit patterns, with NaN/-0/subnormal/Inf injected
  std::vector<int64_t> tokens_override;  // non-empty: exactly T_s for every rank s (size R)
  bool topk = true;  // false: dispatched without top-k (rank_major only); destinations are then the
                     // is_token_in_rank and counts the num_tokens_per_expert that ref_layout derives
};

struct RankInputs {
  int64_t num_tokens = 0;           // T_s
  std::vector<int64_t> topk_idx;    // [T*K], -1 = no expert
  std::vector<float> topk_weights;  // [T*K] in (0, 1), also at -1 slots (never read there)
  std::vector<uint8_t> x;           // [T*H] elements of spec.dtype, row-major
};

struct Problem {
  ProblemSpec spec;
  std::vector<RankInputs> ranks;  // [R]

  int num_local_experts() const { return spec.num_experts / spec.num_ranks; }  // L
  size_t row_bytes() const;                                                    // H * elem_size(dtype)
};

// Deterministic: a pure function of `spec`. Throws std::invalid_argument on an inconsistent spec.
Problem make_problem(const ProblemSpec& spec);

// Checks the shapes of a (possibly hand-built) problem; throws std::invalid_argument naming the field.
// Ids >= E are allowed here (ref_layout reports them as the spec requires).
void validate_problem(const Problem& problem);

// ---------------------------------------------------------------------------------------------------------
// Payloads
// ---------------------------------------------------------------------------------------------------------

// Tagged element h of row (s, t): an integer in [-128, 128], exact in bf16, f16 and f32.
//   h = 0: s + 1;  h = 1, 2, 3: 7-bit digits of t (low first) + 1;
//   h >= 4: ((131 s + 29 t + 7 h) mod 255) - 127, so a column shift is visible too.
// Requires 0 <= s < 128 and 0 <= t < 2^21. Never all-zero, so a zero (PAD) row never decodes.
float tag_value(int s, int64_t t, int64_t h);
void write_tagged_row(int s, int64_t t, int64_t hidden, DType dtype, uint8_t* out);

struct RowTag {
  int rank;
  int64_t token;
};
// Decodes the (s, t) a tagged row carries, or nullopt if the row is not exactly a tagged row. (s, t) is
// fully recoverable when hidden >= 4 (digits beyond the row width are taken as 0).
std::optional<RowTag> decode_row_tag(const uint8_t* row, int64_t hidden, DType dtype);
std::string describe_row_tag(const uint8_t* row, int64_t hidden, DType dtype);  // "(s=1, t=7)" or "untagged"

// A rank's x: [num_tokens * hidden] elements of dtype (bf16/f16/f32): tagged, or (random_bits) random bit
// patterns seeded by (seed, s) with about 1/8 of the elements NaN (several payloads/signs), +-0, +-Inf or
// subnormal. make_problem uses it with spec.seed; cached-dispatch tests use it for a new x.
std::vector<uint8_t> make_payload(int s, int64_t num_tokens, int64_t hidden, DType dtype, bool random_bits,
                                  uint64_t seed);

// Distinct expert output element for dispatch row (s, t, k) (k = -1 in rank_major): a finite value with
// 1/8 <= |v| <= 8 and random low bits, a pure function of (seed, s, t, k, h, dtype), exact in `dtype`.
float expert_output_value(uint64_t seed, int s, int64_t t, int k, int64_t h, DType dtype);

// Rows of expert outputs in the order of a dispatch's rows, given its source arrays ([rows] each, -1 for
// PAD/tail). PAD and tail rows are filled with 0xFF bytes (NaN in bf16/f16/f32): combine must never read
// them.
std::vector<uint8_t> make_expert_output(uint64_t seed, const std::vector<int32_t>& src_rank,
                                        const std::vector<int32_t>& src_token,
                                        const std::vector<int32_t>& src_slot, DType dtype, int64_t hidden);

// [num_rows * hidden] random finite values, 1/8 <= |v| <= 8, in dtype (biases, explicit weights' companions,
// ...).
std::vector<uint8_t> make_random_rows(int64_t num_rows, int64_t hidden, DType dtype, uint64_t seed);

// [count] f32 weights in (0, 1): odd multiples of 2^-25, exact.
std::vector<float> make_random_weights(int64_t count, uint64_t seed);

}  // namespace epcomm::testing
