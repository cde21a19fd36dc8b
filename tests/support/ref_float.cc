// support/ref_float.cc — bit-level bf16/f16 <-> f32 conversions written from docs/quant.md.
#include "support/ref_float.h"

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace epcomm::testing {

uint32_t f32_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

float f32_from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

uint16_t f32_to_bf16(float value) {
  const uint32_t u = f32_bits(value);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN, sign dropped
  const uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

float bf16_to_f32(uint16_t bits) {
  return f32_from_bits(static_cast<uint32_t>(bits) << 16);
}

// Rounds `mantissa >> shift` to nearest, ties to even.
static uint32_t shift_right_rne(uint32_t mantissa, int shift) {
  const uint32_t kept = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (kept & 1u))) return kept + 1u;
  return kept;
}

uint16_t f32_to_f16(float value) {
  const uint32_t u = f32_bits(value);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int exponent = static_cast<int>((u >> 23) & 0xFFu);
  const uint32_t fraction = u & 0x7FFFFFu;
  if (exponent == 0xFF) return fraction != 0 ? 0x7E00 : static_cast<uint16_t>(sign | 0x7C00u);
  // f16 biased exponent of the value if it were normal in f16.
  const int e16 = exponent - 127 + 15;
  if (e16 >= 31) return static_cast<uint16_t>(sign | 0x7C00u);
  if (e16 >= 1) {
    // Normal: keep 10 fraction bits; a carry out of the fraction bumps the exponent (up to Inf), as it
    // should.
    const uint32_t magnitude = (static_cast<uint32_t>(e16) << 10) | (fraction >> 13);
    const uint32_t rest = fraction & 0x1FFFu;
    uint32_t rounded = magnitude;
    if (rest > 0x1000u || (rest == 0x1000u && (magnitude & 1u))) rounded += 1u;
    return static_cast<uint16_t>(sign | rounded);
  }
  // Subnormal f16 (units of 2^-24). f32 values below 2^-25 (this includes every f32 subnormal) round to zero.
  if (e16 < -10) return static_cast<uint16_t>(sign);
  const uint32_t significand = fraction | 0x800000u;  // exponent != 0 here
  // value = significand * 2^(exponent - 150) = q * 2^-24  =>  q = significand >> (14 - e16)
  const uint32_t q = shift_right_rne(significand, 14 - e16);  // q == 0x400 becomes the smallest normal
  return static_cast<uint16_t>(sign | q);
}

float f16_to_f32(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1Fu;
  const uint32_t fraction = bits & 0x3FFu;
  if (exponent == 0x1F) return f32_from_bits(sign | 0x7F800000u | (fraction << 13));
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(fraction), -24);  // exact
    return sign ? -magnitude : magnitude;
  }
  return f32_from_bits(sign | ((exponent - 15u + 127u) << 23) | (fraction << 13));
}

size_t elem_size(DType dtype) {
  switch (dtype) {
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::i8:
    case DType::u8:
    case DType::boolean:
    case DType::f8e4m3:
    case DType::f8e5m2:
    case DType::e8m0:
    case DType::f4x2:
      return 1;
  }
  throw std::invalid_argument("elem_size: unknown dtype");
}

void store_rounded(DType dtype, float value, uint8_t* out) {
  switch (dtype) {
    case DType::bf16: {
      const uint16_t h = f32_to_bf16(value);
      std::memcpy(out, &h, 2);
      return;
    }
    case DType::f16: {
      const uint16_t h = f32_to_f16(value);
      std::memcpy(out, &h, 2);
      return;
    }
    case DType::f32: {
      const uint32_t u = std::isnan(value) ? 0x7FC00000u : f32_bits(value);
      std::memcpy(out, &u, 4);
      return;
    }
    default:
      throw std::invalid_argument("store_rounded: dtype must be bf16, f16 or f32");
  }
}

float load_f32(DType dtype, const uint8_t* data, int64_t index) {
  switch (dtype) {
    case DType::bf16: {
      uint16_t h;
      std::memcpy(&h, data + index * 2, 2);
      return bf16_to_f32(h);
    }
    case DType::f16: {
      uint16_t h;
      std::memcpy(&h, data + index * 2, 2);
      return f16_to_f32(h);
    }
    case DType::f32: {
      float f;
      std::memcpy(&f, data + index * 4, 4);
      return f;
    }
    default:
      throw std::invalid_argument("load_f32: dtype must be bf16, f16 or f32");
  }
}

}  // namespace epcomm::testing
