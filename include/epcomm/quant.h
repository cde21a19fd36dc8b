// epcomm/quant.h — quantize and dequantize your own tensors in the formats epcomm sends (docs/quant.md), and
// the scalar element conversions (epcomm/quant_element.h). Bit-exact with what dispatch puts on the wire.
#pragma once

#include <utility>

#include "epcomm/quant_element.h"
#include "epcomm/tensor.h"
#include "epcomm/types.h"

namespace epcomm {

struct QuantOptions {
  // Rows are split over this many threads (>= 1). The results never depend on it.
  int num_threads = 1;
  // Allocates the returned tensors; null means default_allocator().
  Allocator* allocator = nullptr;
};

// Quantizes every row of `x` with the algorithm normal mode assigns to `mode` (docs/quant.md):
//   int8                -> (i8 [T,H],      f32 [T])                 int8_per_token_a3
//   pertoken_fp8_e4m3   -> (f8e4m3 [T,H],  f32 [T])                 fp8_per_token (e4m3)
//   pergroup_fp8_e4m3   -> (f8e4m3 [T,H],  f32 [T, ceil(H/128)])    fp8_per_group128 (e4m3)
//   mx_fp8_e4m3/_e5m2   -> (f8e4m3/f8e5m2 [T,H], e8m0 [T, H/32])   mxfp8_*, FLOOR scale
//   mx_fp4_e2m1         -> (f4x2 [T,H/2],  e8m0 [T, H/32])          mxfp4_e2m1, FLOOR scale
//   bf16                -> (a bf16 copy of x, an undefined Tensor)   x must already be bf16
// `x` is [T,H] (or [H], treated as one row) of bf16, f16 or f32 whose last dimension is contiguous; it is
// only read. The returned tensors are new, contiguous and owned by the caller (they come from
// options.allocator). Throws Error(InvalidUsage) naming the argument for a wrong rank, dtype, stride, or an H
// the mode forbids (MX modes need H % 32 == 0).
std::pair<Tensor, Tensor> quantize(const Tensor& x, QuantMode mode, const QuantOptions& options = {});

// Inverse of quantize (docs/quant.md): returns a new contiguous [T,H] tensor of dtype `out` (f32, bf16 or
// f16; bf16/f16 are the RNE roundings of the fp32 dequantized value). `data` must be contiguous with the
// dtype and shape quantize returns for `mode`; `scales` may have any strides, and MX scales may also be flat
// [T * H/32]. For mode bf16 `scales` is ignored. Throws Error(InvalidUsage) listing the expected and received
// dtypes/shapes when they do not match `mode`, or for an unsupported `out`.
Tensor dequantize(const Tensor& data, const Tensor& scales, QuantMode mode, DType out = DType::f32,
                  const QuantOptions& options = {});

}  // namespace epcomm
