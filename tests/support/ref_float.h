// support/ref_float.h — the oracle's own scalar conversions: bf16/f16 <-> f32 (RNE, docs/quant.md), element
// sizes, and reading/writing one element of a bf16/f16/f32 row as f32. Shares no code with the library.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epcomm/tensor.h"

namespace epcomm::testing {

uint32_t f32_bits(float value);
float f32_from_bits(uint32_t bits);

// f32 -> bf16: add 0x7FFF + ((u >> 16) & 1) to the bits, keep the upper half; any NaN -> 0x7FC0.
uint16_t f32_to_bf16(float value);
float bf16_to_f32(uint16_t bits);

// f32 -> f16: IEEE binary16 round-to-nearest-even with gradual underflow; |x| >= 65520 -> Inf; NaN -> 0x7E00.
uint16_t f32_to_f16(float value);
float f16_to_f32(uint16_t bits);

// Bytes per element of `dtype` (f4x2 counts one byte per packed pair).
size_t elem_size(DType dtype);

// The single final rounding of combine (docs/normal-mode.md): f32 -> bf16/f16 as above; f32 output keeps the
// value but canonicalizes NaN to 0x7FC00000 (docs/quant.md: canonical NaNs are the only NaNs produced).
// Writes elem_size(dtype) bytes at `out`.
void store_rounded(DType dtype, float value, uint8_t* out);

// Reads element `index` of a bf16/f16/f32 buffer as f32 (exact).
float load_f32(DType dtype, const uint8_t* data, int64_t index);

}  // namespace epcomm::testing
