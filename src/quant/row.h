// quant/row.h — row-level quantizers the engine calls (spec/quant.md, normal-mode.md §4.6).
// Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epcomm/tensor.h"
#include "epcomm/types.h"

namespace epcomm::quant {

size_t row_data_bytes(QuantMode mode, int64_t H);
size_t row_scale_bytes(QuantMode mode, int64_t H);
void check_hidden(QuantMode mode, int64_t H);
void quantize_row(QuantMode mode, DType in, const void* x, int64_t H, void* data_out, void* scales_out);
void dequantize_row(QuantMode mode, const void* data, const void* scales, int64_t H, float* out);
DType data_dtype(QuantMode mode);
DType scale_dtype(QuantMode mode);

}  // namespace epcomm::quant
