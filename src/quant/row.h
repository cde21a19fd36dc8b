// quant/row.h — the per-row quantization interface the communication engine uses for normal-mode quant_mode
// (docs/normal-mode.md): byte sizes, H checks, and quantize/dequantize of one row with the mode's algorithm.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epcomm/tensor.h"
#include "epcomm/types.h"

namespace epcomm::quant {

// Mode -> algorithm (docs/quant.md): int8 -> int8_per_token_a3; pertoken_fp8_e4m3 -> fp8_per_token (e4m3);
// pergroup_fp8_e4m3 -> fp8_per_group128 (e4m3, fp32 scales); mx_* -> MX with the FLOOR rule; bf16 -> a copy.
// All functions are pure and thread-safe; output buffers are caller-owned.

// Bytes of one quantized row's data and scales for `mode` and hidden size H (docs/normal-mode.md table);
// for QuantMode::bf16 data bytes are H*2 and scale bytes 0. They do not validate H (see check_hidden).
size_t row_data_bytes(QuantMode mode, int64_t H);
size_t row_scale_bytes(QuantMode mode, int64_t H);
// Throws epcomm::Error(InvalidUsage) naming `hidden` when H violates the mode's constraint (H >= 1 always,
// H % 32 == 0 for the MX modes).
void check_hidden(QuantMode mode, int64_t H);
// Quantizes one row of H elements of dtype `in` (bf16, f16 or f32) with the algorithm docs/normal-mode.md
// assigns to `mode`: row_data_bytes(mode, H) bytes go to data_out, row_scale_bytes(mode, H) to scales_out.
// Mode bf16 copies a bf16 row (another `in` throws). Throws Error(InvalidUsage) for a bad dtype or H.
void quantize_row(QuantMode mode, DType in, const void* x, int64_t H, void* data_out, void* scales_out);
// Dequantizes one row into fp32 (for combine-after-dequant tests and the demo). Never throws for a valid H.
void dequantize_row(QuantMode mode, const void* data, const void* scales, int64_t H, float* out);
// Output dtypes of recv_x data and scales for `mode` (e.g. {f8e4m3, f32}, {f4x2, e8m0}). Mode bf16 has
// data bf16 and no scales (scale_dtype returns u8, and row_scale_bytes is 0).
DType data_dtype(QuantMode mode);
DType scale_dtype(QuantMode mode);

}  // namespace epcomm::quant
