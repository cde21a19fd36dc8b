// quant/element.h — the element conversions of docs/quant.md under epcomm::quant, for the engine and kernels.
// The inline definitions live in the public epcomm/quant_element.h; this header only re-exports them.
#pragma once

#include "epcomm/quant_element.h"

namespace epcomm::quant {

using epcomm::bf16_to_float;
using epcomm::decode_e2m1;
using epcomm::decode_e4m3;
using epcomm::decode_e5m2;
using epcomm::decode_hif8;
using epcomm::e8m0_ceil;
using epcomm::e8m0_decode;
using epcomm::e8m0_reciprocal;
using epcomm::encode_e2m1;
using epcomm::encode_e4m3;
using epcomm::encode_e5m2;
using epcomm::encode_hif8;
using epcomm::f4x2_high;
using epcomm::f4x2_low;
using epcomm::float_to_bf16;
using epcomm::float_to_fp16;
using epcomm::fp16_to_float;
using epcomm::int8_sat;
using epcomm::pack_f4x2;
using epcomm::Saturation;
using epcomm::to_bf16_bits;
using epcomm::to_fp16_bits;

inline uint32_t f32_bits(float f) {
  return quant_detail::bits(f);
}
inline float f32_from_bits(uint32_t u) {
  return quant_detail::from_bits(u);
}

// Canonical NaNs (docs/quant.md).
inline constexpr uint32_t kF32Nan = 0x7FC00000u;
inline constexpr uint16_t kBf16Nan = 0x7FC0u;
inline constexpr uint16_t kF16Nan = 0x7E00u;

}  // namespace epcomm::quant
