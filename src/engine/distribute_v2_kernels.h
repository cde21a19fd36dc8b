// engine/distribute_v2_kernels.h — the arithmetic of combine_v2 and combine_add_rms_norm
// (docs/distribute-v2.md): the fp32 accumulation in slot order, the single rounding, the fused
// residual add + RMSNorm and the TP-pair addition. Every operation is one IEEE binary32 step (no FMA), so
// results never depend on vector width.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epcomm/tensor.h"

namespace epcomm::engine::v2 {

// acc[h] = +0, then for each row j in order: acc ⊕= fp32(row_j[h]) ⊗ weights[j] when weighted[j], else
// acc ⊕= fp32(row_j[h]). Rows are `dt` (bf16 or fp16), `H` elements each.
void accumulate_rows(DType dt, const uint8_t* const* rows, const float* weights, const uint8_t* weighted,
                     int n, int64_t H, float* acc);
// The same sums rounded once into `out` (no fp32 row kept): out[h] = RNE_dt(acc[h]).
void accumulate_round_rows(DType dt, const uint8_t* const* rows, const float* weights,
                           const uint8_t* weighted, int n, int64_t H, uint8_t* out);
// docs/distribute-v2.md for one token: x = RNE_dt(acc ⊕ residual); rstd from the fp64-summed mean square; y
// with the intermediate rounding. `scratch` holds H floats.
void add_rms_norm_row(DType dt, const float* acc, const uint8_t* residual, const uint8_t* gamma, int64_t H,
                      float eps, uint8_t* x, uint8_t* y, float* rstd, float* scratch);
// The TP reduce of docs/distribute-v2.md: y = RNE_bf16(fp32(y) ⊕ fp32(p)) for bf16, RNE_fp16(exact y + p) for
// fp16.
void add_pair_row(DType dt, uint8_t* y, const uint8_t* p, int64_t H);
// The exact sum of two fp16 values (as double) rounded once to fp16 (bits).
uint16_t f16_round_exact_sum(uint16_t a, uint16_t b);

}  // namespace epcomm::engine::v2
