// engine/call_checks.h — what the normal-mode protocols (dispatch, combine, low-latency) check and account
// per call beside moving data: the header comparison every rank runs, and the cost statistics.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/op_context.h"
#include "epcomm/tensor.h"

namespace epcomm::engine {

// The check every rank runs on all headers: parameters that must match (docs/normal-mode.md). Throws
// InvalidUsage "mismatch: ranks disagree on <name>: rank 0 = ..., rank 1 = ..." on every rank.
void check_headers_match(const OpContext& ctx);

// Adds elapsed microseconds into a cost-statistics tensor ([R] i64, or i32 saturating).
void add_cost_stats(const Tensor& stats, const std::vector<int64_t>& micros);

}  // namespace epcomm::engine
