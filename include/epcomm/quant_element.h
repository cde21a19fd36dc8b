// epcomm/quant_element.h — scalar number-format conversions of docs/quant.md (bf16, fp16, fp8, fp4, e8m0,
// HiFloat8, int8), header-only and branch-light so that loops calling them auto-vectorize. Bit-exact per
// spec.
#pragma once

#include <array>
#include <bit>
#include <cstdint>

// Forces inlining into vectorized loops (including loops compiled for a wider ISA than the caller's default).
#if defined(__GNUC__)
#define EPCOMM_QUANT_INLINE inline __attribute__((always_inline))
#else
#define EPCOMM_QUANT_INLINE inline
#endif

// Every function here is pure, thread-safe and never throws. Codes are raw bit patterns (uint8_t/uint16_t);
// "decode" widens a code to its exact binary32 value. Results are specified bit for bit by docs/quant.md,
// need IEEE binary32 arithmetic in round-to-nearest-even with subnormals honoured (no FTZ/DAZ), and hold for
// any compiler that does not contract or reassociate floating-point operations.
namespace epcomm {

// Overflow policy of the fp8 and HiFloat8 encoders (docs/quant.md). `sat` maps finite overflow and ±Inf
// to ±max finite; `nosat` gives the format's Inf (e5m2, hif8) or NaN code (e4m3). Block quantizers use `sat`;
// for HiFloat8 `nosat` is the format's default mode.
enum class Saturation { sat, nosat };

namespace quant_detail {

EPCOMM_QUANT_INLINE uint32_t bits(float f) {
  return std::bit_cast<uint32_t>(f);
}
EPCOMM_QUANT_INLINE float from_bits(uint32_t u) {
  return std::bit_cast<float>(u);
}
// c ? a : b through a mask. Written as arithmetic so that GCC keeps loops branch-free even when an operand
// comes from a floating-point operation it must not speculate under -ftrapping-math (the default).
EPCOMM_QUANT_INLINE uint32_t pick(bool c, uint32_t a, uint32_t b) {
  uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}

// NaN codes of the 8-bit formats decode to the canonical 0x7FC00000.
constexpr uint32_t kCanonicalNan = 0x7FC00000u;

// Builds the bits of sign * m * 2^e exactly for a small integer significand, using only
// integer operations (constexpr-friendly). `m` may be 0.
constexpr uint32_t exact_bits(bool negative, uint32_t m, int e) {
  uint32_t sign = negative ? 0x80000000u : 0u;
  if (m == 0) return sign;
  int top = 31 - std::countl_zero(m);  // m = 1.xxx * 2^top
  int exp = e + top;                   // value = 1.xxx * 2^exp (all table values are binary32 normals)
  uint32_t frac = (m << (23 - top)) & 0x7FFFFFu;
  return sign | (static_cast<uint32_t>(exp + 127) << 23) | frac;
}

constexpr std::array<uint32_t, 256> make_e4m3_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t c = 0; c < 256; ++c) {
    uint32_t e = (c >> 3) & 15, m = c & 7;
    bool neg = (c & 0x80) != 0;
    if (e == 15 && m == 7)
      t[c] = kCanonicalNan;
    else if (e == 0)
      t[c] = exact_bits(neg, m, -9);
    else
      t[c] = exact_bits(neg, 8 | m, static_cast<int>(e) - 7 - 3);
  }
  return t;
}

constexpr std::array<uint32_t, 256> make_e5m2_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t c = 0; c < 256; ++c) {
    uint32_t e = (c >> 2) & 31, m = c & 3;
    bool neg = (c & 0x80) != 0;
    if (e == 31)
      t[c] = m == 0 ? ((neg ? 0x80000000u : 0u) | 0x7F800000u) : kCanonicalNan;
    else if (e == 0)
      t[c] = exact_bits(neg, m, -16);
    else
      t[c] = exact_bits(neg, 4 | m, static_cast<int>(e) - 15 - 2);
  }
  return t;
}

// HiFloat8 (docs/quant.md): sign bit 7, then a prefix selecting the exponent width.
constexpr std::array<uint32_t, 256> make_hif8_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t c = 0; c < 256; ++c) {
    bool neg = (c & 0x80) != 0;
    uint32_t b = c & 0x7F;
    int e = 0, n = 0;
    uint32_t f = 0;
    if (c == 0x00 || c == 0x80) {
      t[c] = c == 0 ? 0u : kCanonicalNan;
      continue;
    }
    if (b == 0x6F) {
      t[c] = (neg ? 0x80000000u : 0u) | 0x7F800000u;
      continue;
    }
    if ((b >> 5) == 3) {  // 11 σ aaa f
      int mag = 8 + static_cast<int>((b >> 1) & 7);
      e = (b & 0x10) ? -mag : mag, n = 1, f = b & 1;
    } else if ((b >> 5) == 2) {  // 10 σ aa ff
      int mag = 4 + static_cast<int>((b >> 2) & 3);
      e = (b & 0x10) ? -mag : mag, n = 2, f = b & 3;
    } else if ((b >> 5) == 1) {  // 01 σ a fff
      int mag = 2 + static_cast<int>((b >> 3) & 1);
      e = (b & 0x10) ? -mag : mag, n = 3, f = b & 7;
    } else if ((b >> 4) == 1) {  // 001 σ fff
      e = (b & 0x08) ? -1 : 1, n = 3, f = b & 7;
    } else if ((b >> 3) == 1) {  // 0001 fff
      e = 0, n = 3, f = b & 7;
    } else {  // 0000 kkk: 2^(k-23)
      t[c] = exact_bits(neg, 1, static_cast<int>(b) - 23);
      continue;
    }
    t[c] = exact_bits(neg, (1u << n) | f, e - n);
  }
  return t;
}

inline constexpr std::array<uint32_t, 256> kE4m3Bits = make_e4m3_table();
inline constexpr std::array<uint32_t, 256> kE5m2Bits = make_e5m2_table();
inline constexpr std::array<uint32_t, 256> kHif8Bits = make_hif8_table();
inline constexpr std::array<float, 16> kE2m1Values = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

}  // namespace quant_detail

// ---- bf16 (docs/quant.md) ----

// fp32 -> bf16 bits, round to nearest even; overflow gives ±Inf, subnormals are rounded; NaN gives 0x7FC0.
EPCOMM_QUANT_INLINE uint16_t to_bf16_bits(float f) {
  uint32_t u = quant_detail::bits(f);
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
}
EPCOMM_QUANT_INLINE uint16_t float_to_bf16(float f) {
  return to_bf16_bits(f);
}
// Exact widening bf16 -> fp32 (NaN payloads are kept).
EPCOMM_QUANT_INLINE float bf16_to_float(uint16_t b) {
  return quant_detail::from_bits(static_cast<uint32_t>(b) << 16);
}

// ---- fp16 (docs/quant.md) ----

// fp32 -> IEEE binary16 bits, RNE with gradual underflow; |x| >= 65520 and ±Inf give ±Inf; NaN gives 0x7E00.
EPCOMM_QUANT_INLINE uint16_t to_fp16_bits(float f) {
  using quant_detail::pick;
  uint32_t u = quant_detail::bits(f);
  uint32_t a = u & 0x7FFFFFFFu;
  uint32_t sign = (u >> 16) & 0x8000u;
  // Normal range: rebias the exponent (127 -> 15) and round away 13 significand bits; a carry may reach Inf.
  uint32_t normal = (a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  // Below 2^-14: the binary32 adder rounds |x| to a multiple of 2^-24 exactly (0.5 has ulp 2^-24).
  uint32_t sub = quant_detail::bits(quant_detail::from_bits(a) + 0.5f) - 0x3F000000u;
  uint32_t r = pick(a < 0x38800000u, sub, normal);
  r = pick(a >= 0x477FF000u, 0x7C00u, r);
  r |= sign;
  return static_cast<uint16_t>(pick(a > 0x7F800000u, 0x7E00u, r));
}
EPCOMM_QUANT_INLINE uint16_t float_to_fp16(float f) {
  return to_fp16_bits(f);
}
// Exact widening binary16 -> fp32 (Inf kept; NaN payloads are kept, as hardware conversions do).
EPCOMM_QUANT_INLINE float fp16_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t m = static_cast<uint32_t>(h & 0x7FFFu) << 13;
  // Scaling by 2^112 rebiases normals and normalizes subnormals exactly.
  uint32_t finite = quant_detail::bits(quant_detail::from_bits(m) * 0x1p112f);
  uint32_t r = quant_detail::pick((h & 0x7C00u) == 0x7C00u, m | 0x7F800000u, finite);
  return quant_detail::from_bits(r | sign);
}

// ---- fp8 e4m3 / e5m2 (docs/quant.md) ----

// fp32 -> e4m3 code, RNE with gradual underflow. sat: |x| > 464 and ±Inf give ±448 (0x7E/0xFE);
// nosat: they give sign|0x7F. NaN gives 0x7F.
EPCOMM_QUANT_INLINE uint8_t encode_e4m3(float f, Saturation s = Saturation::sat) {
  uint32_t u = quant_detail::bits(f);
  uint32_t a = u & 0x7FFFFFFFu;
  uint32_t normal = (a - 0x3C000000u + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
  // Below 2^-6: 16384 has ulp 2^-9, the subnormal step, so the adder performs the RNE.
  uint32_t sub = quant_detail::bits(quant_detail::from_bits(a) + 16384.0f) - 0x46800000u;
  uint32_t r = quant_detail::pick(a < 0x3C800000u, sub, normal);
  r = quant_detail::pick(a > 0x43E80000u, s == Saturation::sat ? 0x7Eu : 0x7Fu, r);
  r |= (u >> 24) & 0x80u;
  return static_cast<uint8_t>(quant_detail::pick(a > 0x7F800000u, 0x7Fu, r));
}
// e4m3 code -> exact fp32; 0x7F/0xFF give 0x7FC00000.
EPCOMM_QUANT_INLINE float decode_e4m3(uint8_t c) {
  return quant_detail::from_bits(quant_detail::kE4m3Bits[c]);
}

// fp32 -> e5m2 code, RNE with gradual underflow. sat: |x| >= 61440 and ±Inf give ±57344 (0x7B/0xFB);
// nosat: they give sign|0x7C (Inf). NaN gives 0x7E.
EPCOMM_QUANT_INLINE uint8_t encode_e5m2(float f, Saturation s = Saturation::sat) {
  uint32_t u = quant_detail::bits(f);
  uint32_t a = u & 0x7FFFFFFFu;
  uint32_t normal = (a - 0x38000000u + 0xFFFFFu + ((a >> 21) & 1u)) >> 21;
  // Below 2^-14: 128 has ulp 2^-16, the subnormal step.
  uint32_t sub = quant_detail::bits(quant_detail::from_bits(a) + 128.0f) - 0x43000000u;
  uint32_t r = quant_detail::pick(a < 0x38800000u, sub, normal);
  r = quant_detail::pick(a >= 0x47700000u, s == Saturation::sat ? 0x7Bu : 0x7Cu, r);
  r |= (u >> 24) & 0x80u;
  return static_cast<uint8_t>(quant_detail::pick(a > 0x7F800000u, 0x7Eu, r));
}
// e5m2 code -> exact fp32 (±Inf kept); NaN codes give 0x7FC00000.
EPCOMM_QUANT_INLINE float decode_e5m2(uint8_t c) {
  return quant_detail::from_bits(quant_detail::kE5m2Bits[c]);
}

// ---- fp4 e2m1 and f4x2 packing (docs/quant.md) ----

// fp32 -> e2m1 code (low 4 bits), RNE on the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6, saturating at 6 (Inf too);
// the sign is kept (−0 gives 0x8); NaN gives 0x0.
EPCOMM_QUANT_INLINE uint8_t encode_e2m1(float f) {
  uint32_t u = quant_detail::bits(f);
  uint32_t a = u & 0x7FFFFFFFu;
  // Each threshold crossed adds one code; strict/non-strict comparisons encode the ties-to-even rule.
  uint32_t c = (a > 0x3E800000u) + (a >= 0x3F400000u) + (a > 0x3FA00000u) + (a >= 0x3FE00000u) +
               (a > 0x40200000u) + (a >= 0x40600000u) + (a > 0x40A00000u);
  c |= (u >> 28) & 0x8u;
  return static_cast<uint8_t>(a > 0x7F800000u ? 0u : c);
}
// e2m1 code (low 4 bits used) -> exact fp32.
EPCOMM_QUANT_INLINE float decode_e2m1(uint8_t c) {
  return quant_detail::kE2m1Values[c & 0xFu];
}
// Packs two e2m1 codes: element 2j in bits 3..0, element 2j+1 in bits 7..4 (PyTorch float4_e2m1fn_x2).
EPCOMM_QUANT_INLINE uint8_t pack_f4x2(uint8_t even, uint8_t odd) {
  return static_cast<uint8_t>((even & 0xFu) | (odd << 4));
}
EPCOMM_QUANT_INLINE uint8_t f4x2_low(uint8_t byte) {
  return byte & 0xFu;
}
EPCOMM_QUANT_INLINE uint8_t f4x2_high(uint8_t byte) {
  return byte >> 4;
}

// ---- e8m0 scale byte (docs/quant.md) ----

// 2^(s-127) exactly: s = 0 gives 2^-127 (0x00400000); 0xFF gives NaN (0x7FC00000).
EPCOMM_QUANT_INLINE float e8m0_decode(uint8_t s) {
  uint32_t r = s == 0 ? 0x00400000u : static_cast<uint32_t>(s) << 23;
  return quant_detail::from_bits(s == 0xFF ? quant_detail::kCanonicalNan : r);
}
// 2^(127-s) exactly: s = 254 gives 2^-127; 0xFF gives NaN.
EPCOMM_QUANT_INLINE float e8m0_reciprocal(uint8_t s) {
  uint32_t r = s == 254 ? 0x00400000u : static_cast<uint32_t>(254 - s) << 23;
  return quant_detail::from_bits(s == 0xFF ? quant_detail::kCanonicalNan : r);
}
// The smallest 2^(s-127) >= |t| (the RCEIL rule), capped at 254; NaN and ±Inf give 0xFF.
EPCOMM_QUANT_INLINE uint8_t e8m0_ceil(float t) {
  uint32_t a = quant_detail::bits(t) & 0x7FFFFFFFu;
  uint32_t e = a >> 23, m = a & 0x7FFFFFu;
  uint32_t r = e == 0 ? static_cast<uint32_t>(m > 0x400000u) : e + (m != 0);
  r = r > 254u ? 254u : r;
  return static_cast<uint8_t>(e == 255 ? 0xFFu : r);
}

// ---- HiFloat8 (docs/quant.md) ----

// fp32 -> hif8 code, rounding half away from zero. NaN gives 0x80; |x| < 2^-23 gives 0x00 (no −0);
// |x| >= 40960 and ±Inf give ±Inf (0x6F/0xEF), or ±32768 (0x6E/0xEE) with Saturation::sat.
EPCOMM_QUANT_INLINE uint8_t encode_hif8(float f, Saturation s = Saturation::nosat) {
  using quant_detail::pick;
  uint32_t u = quant_detail::bits(f);
  uint32_t a = u & 0x7FFFFFFFu;
  // Fraction bits n kept at this exponent: 3 for |e| <= 3, 2 for 4..7, 1 for 8..15, 0 for e <= -16. As masks
  // on the binary32 significand: `half` is half a step; adding it and truncating rounds half away from zero,
  // and a carry bumps the exponent (leaving a zero fraction). Constants instead of shifts by n keep SSE2
  // happy.
  uint32_t ea = a >> 23;  // biased exponent
  uint32_t half =
      pick(ea <= 111u, 1u << 22,
           pick(ea <= 119u || ea >= 135u, 1u << 21, pick(ea <= 123u || ea >= 131u, 1u << 20, 1u << 19)));
  uint32_t r = (a + half) & ~(2 * half - 1);
  int32_t e2 = static_cast<int32_t>(r >> 23) - 127;
  uint32_t neg = static_cast<uint32_t>(e2 < 0);
  uint32_t ae2 = static_cast<uint32_t>(e2 < 0 ? -e2 : e2);
  uint32_t f1 = (r >> 22) & 1u, f2 = (r >> 21) & 3u, f3 = (r >> 20) & 7u;  // zero after a carry
  uint32_t code = pick(ae2 == 1u, 0x10u | (neg << 3) | f3, 0x08u | f3);
  code = pick(ae2 >= 2u, 0x20u | (neg << 4) | ((ae2 - 2) << 3) | f3, code);
  code = pick(ae2 >= 4u, 0x40u | (neg << 4) | ((ae2 - 4) << 2) | f2, code);
  code = pick(ae2 >= 8u, 0x60u | (neg << 4) | ((ae2 - 8) << 1) | f1, code);
  code = pick(e2 <= -16, static_cast<uint32_t>(e2 + 23), code);  // denormals 2^(k-23)
  code = pick(a < 0x34800000u, 1u, code);                        // 2^-23 <= |x| < 2^-22 (rule 3)
  code = pick(a >= 0x47200000u, s == Saturation::sat ? 0x6Eu : 0x6Fu, code);
  code |= (u >> 24) & 0x80u;
  code = pick(a < 0x34000000u, 0u, code);  // below 2^-23, ±0 and fp32 subnormals: unsigned zero
  return static_cast<uint8_t>(pick(a > 0x7F800000u, 0x80u, code));
}
// hif8 code -> exact fp32: 0x6F/0xEF give ±Inf, 0x80 gives 0x7FC00000.
EPCOMM_QUANT_INLINE float decode_hif8(uint8_t c) {
  return quant_detail::from_bits(quant_detail::kHif8Bits[c]);
}

// ---- int8 (docs/quant.md) ----

// clamp(RNE_int(v), lo, hi) with NaN -> 0, for integer bounds -128 <= lo <= 0 <= hi <= 127.
EPCOMM_QUANT_INLINE int8_t int8_sat(float v, int32_t lo, int32_t hi) {
  using quant_detail::pick;
  uint32_t u = quant_detail::bits(v);
  uint32_t a = u & 0x7FFFFFFFu;
  // Clamp on the bit patterns (monotone in |v|): no floating-point compare, so no branch. Clamping before
  // rounding gives the same result because the bounds are integers.
  uint32_t lo_bits = quant_detail::bits(static_cast<float>(lo));
  uint32_t hi_bits = quant_detail::bits(static_cast<float>(hi));
  uint32_t bound = (u >> 31) ? lo_bits : hi_bits;
  uint32_t c = pick(a > (bound & 0x7FFFFFFFu), bound, u);
  c = pick(a > 0x7F800000u, 0u, c);
  // 1.5 * 2^23 has ulp 1: the adder rounds c to an integer (ties to even) held in the low significand bits.
  int32_t q = static_cast<int32_t>(quant_detail::bits(quant_detail::from_bits(c) + 12582912.0f)) - 0x4B400000;
  return static_cast<int8_t>(q);
}

}  // namespace epcomm
