// tensor/half.h — scalar bf16/fp16 <-> fp32 conversions (round to nearest even, canonical NaNs as in
// spec/quant.md §2.1), inline so that copy and reduction loops vectorize around them.
#pragma once

#include <cstdint>
#include <cstring>

namespace epcomm {

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_f32(uint16_t h) { return bits_to_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN: canonical, sign dropped
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return bits_to_f32(sign | 0x7F800000u | (man << 13));
  if (exp != 0) return bits_to_f32(sign | ((exp + 112) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24, exact in fp32
  float v = static_cast<float>(man) * bits_to_f32(0x33800000u);
  return sign ? -v : v;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_to_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7E00;                      // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 rounds to Inf
  if (a >= 0x38800000u) {                                 // normal fp16 range
    uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
  }
  if (a < 0x33000000u) return sign;  // below half the smallest subnormal: ±0 (2^-25 exactly ties to 0)
  // subnormal: value = m * 2^-24 with m rounded to nearest even
  uint32_t e = a >> 23;
  uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t shift = 126 - e;  // m * 2^(e-150) / 2^-24 = m >> (126 - e)
  uint32_t q = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

}  // namespace epcomm
