// tools/epcomm/demo_model.h — the inputs of `epcomm demo` (tokens and routing of any rank, from the seed) and
// its check: a single-process dense reference of the whole layer, compared element by element.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "moe_model.h"
#include "rank_tools.h"
#include "run_options.h"

namespace epcomm::cli {

struct DemoOptions {
  RunOptions run;
  int64_t intermediate = 256;
  ReceiveOrder order = ReceiveOrder::expert_major;
  MoeShape shape() const { return {run.hidden, intermediate, run.experts, run.topk}; }
};

// Rank s's tokens ([T, H] in the dtype) and their routing ([T, K] ids and weights).
struct RankInputs {
  std::vector<std::byte> x;
  std::vector<int64_t> topk_idx;
  std::vector<float> topk_weights;
};
RankInputs make_rank_inputs(const DemoOptions& o, const Router& router, int s);

struct CheckResult {
  int64_t elements = 0, failures = 0;
  double max_abs_err = 0, max_abs_ref = 0, worst_ratio = 0;  // worst_ratio: max of |err| / tolerance
  int64_t worst_token = -1, worst_col = -1;                  // token index over all ranks (s * T + t)
};

// Computes the dense reference of every token of every rank (through its top-k experts, weighted sum in
// fp32, rounded once to the dtype) and compares `combined` ([R * T, H] in the dtype, rank-major) with it
// within tolerance_formula(). With a quantizing mode the reference quantizes and dequantizes every token the
// same way first, so the check is one of communication. When `reference` is given it receives the rounded
// reference values ([R * T, H], exact in fp32).
CheckResult check_against_reference(const DemoOptions& o, const std::vector<std::byte>& combined,
                                    Progress& progress, std::vector<float>* reference = nullptr);

// Error statistics of one output against one reference, over every element.
struct ErrorStats {
  int64_t elements = 0;
  double max_abs_err = 0, max_abs_ref = 0;  // NaN errors count as Inf
  double sum_sq_err = 0, sum_sq_ref = 0;
  // Normwise: max |err| / max |ref|.
  double max_rel_err() const { return max_abs_ref > 0 ? max_abs_err / max_abs_ref : 0.0; }
  // sqrt(mean(err^2)), and that over sqrt(mean(ref^2)).
  double rms_err() const;
  double rel_rms_err() const;
};

// What a quantizing mode costs, every entry measured against the UNQUANTIZED dense reference (tokens
// dispatched as they are, in the dtype; fp32 weighted sum rounded once to the dtype):
//   plain      the layer run again without quantization (its error is rounding only);
//   quantized  the layer run with the mode (the output that was checked for PASS/FAIL);
//   reference  the quantization-aware dense reference (quantization alone, without communication).
struct QuantCost {
  ErrorStats plain, quantized, reference;
};
// `quantized` and `plain` are [R * T, H] in the dtype; `quant_reference` as returned by
// check_against_reference for the quantizing mode.
QuantCost quantization_cost(const DemoOptions& o, const std::vector<std::byte>& quantized,
                            const std::vector<std::byte>& plain, const std::vector<float>& quant_reference,
                            Progress& progress);

// The tolerance, as printed in the report.
std::string tolerance_formula(const DemoOptions& o);

}  // namespace epcomm::cli
