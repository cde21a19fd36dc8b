// quant/kernels.h — the templated loops behind block.h: one instantiation per (input dtype, smoothing,
// format, option), resolved once per call, so every per-element step inlines and auto-vectorizes.
#pragma once

#include <cstdint>
#include <cstring>

#include "common/target_clones.h"
#include "quant/block.h"
#include "quant/element.h"

// Only block.cc includes this header. Every loop body is straight-line: loads, binary32 multiplies/divides,
// integer bit manipulation and selects. amax is an integer max over |x| bit patterns, which is exact and
// NaN-safe (|NaN| bits exceed |Inf| bits), so a row is non-finite exactly when that max reaches 0x7F800000.
// Entry points in block.cc are compiled once per ISA (GCC target_clones on x86-64) and everything below is
// force-inlined into them, so each clone vectorizes for its own vector width. Results do not depend on it.
// (common/target_clones.h: nothing in ThreadSanitizer builds.)
#if !defined(__clang__) && !defined(EPCOMM_QUANT_NO_CLONES)
#define EPCOMM_QUANT_CLONES EPCOMM_TARGET_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
#else
#define EPCOMM_QUANT_CLONES
#endif
#if defined(__GNUC__)
#define EPCOMM_QUANT_LAMBDA_INLINE __attribute__((always_inline))
#else
#define EPCOMM_QUANT_LAMBDA_INLINE
#endif

namespace epcomm::quant::kernels {

inline constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
inline constexpr uint32_t kInfBits = 0x7F800000u;

// fp32(1/127) and fp32(1e-4) (quant.md §1), as bits so no compiler rounding is involved.
EPCOMM_QUANT_INLINE float k_inv127() {
  return f32_from_bits(0x3C010204u);
}
EPCOMM_QUANT_INLINE float k_eps_1e4() {
  return f32_from_bits(0x38D1B717u);
}

// ---- input rows: xf_i = fp32(x_i) ⊗ c_i ----

struct Bf16Src {
  const uint16_t* p;
  EPCOMM_QUANT_INLINE float operator[](int64_t i) const { return bf16_to_float(p[i]); }
};
struct F16Src {
  const uint16_t* p;
  EPCOMM_QUANT_INLINE float operator[](int64_t i) const { return fp16_to_float(p[i]); }
};
struct F32Src {
  const float* p;
  EPCOMM_QUANT_INLINE float operator[](int64_t i) const { return p[i]; }
};

struct NoSmooth {
  EPCOMM_QUANT_INLINE float operator()(float v, int64_t) const { return v; }
};
struct ScalarSmooth {
  float c;
  EPCOMM_QUANT_INLINE float operator()(float v, int64_t) const { return v * c; }
};
struct VectorSmooth {
  const float* c;
  EPCOMM_QUANT_INLINE float operator()(float v, int64_t i) const { return v * c[i]; }
};

template <class Src, class Sm>
struct Row {
  Src src;
  Sm sm;
  EPCOMM_QUANT_INLINE float operator()(int64_t i) const { return sm(src[i], i); }
};

// Calls f(row) with the Row type matching (in, smoothing). The caller has checked the arguments
// (check_row in block.cc): any dtype other than bf16 and f16 reads f32. (No lambdas here: a lambda of this
// header would be compiled for the baseline ISA and could not inline a vector kernel's f.)
template <class S, class Fn>
EPCOMM_QUANT_INLINE void visit_smoothing(S src, const Smoothing& c, Fn&& f) {
  if (c.kind() == Smoothing::Kind::vector)
    f(Row<S, VectorSmooth>{src, {c.vector_data()}});
  else if (c.kind() == Smoothing::Kind::scalar)
    f(Row<S, ScalarSmooth>{src, {c.scalar_value()}});
  else
    f(Row<S, NoSmooth>{src, {}});
}
template <class Fn>
EPCOMM_QUANT_INLINE void visit_row(DType in, const void* x, const Smoothing& c, Fn&& f) {
  if (in == DType::bf16)
    visit_smoothing(Bf16Src{static_cast<const uint16_t*>(x)}, c, f);
  else if (in == DType::f16)
    visit_smoothing(F16Src{static_cast<const uint16_t*>(x)}, c, f);
  else
    visit_smoothing(F32Src{static_cast<const float*>(x)}, c, f);
}

// Row r from element b on.
template <class R>
struct Shifted {
  R r;
  int64_t b;
  EPCOMM_QUANT_INLINE float operator()(int64_t i) const { return r(i + b); }
};

// max |xf_i| over [b, e) as binary32 bits (>= kInfBits: the range holds a NaN or ±Inf).
template <class R>
EPCOMM_QUANT_INLINE uint32_t amax_bits(R r, int64_t b, int64_t e) {
  uint32_t m = 0;
  for (int64_t i = b; i < e; ++i) {
    uint32_t a = f32_bits(r(i)) & kAbsMask;
    m = a > m ? a : m;
  }
  return m;
}

template <class T>
EPCOMM_QUANT_INLINE void fill(T* p, int64_t b, int64_t e, T v) {
  for (int64_t i = b; i < e; ++i) p[i] = v;
}

// ---- element formats as types, so the format is a template argument ----

struct E4m3 {
  static constexpr uint8_t kNan = 0x7F;
  static constexpr int kEmax = 8;
  EPCOMM_QUANT_INLINE static float max_value() { return 448.0f; }
  EPCOMM_QUANT_INLINE static float inv_max() { return f32_from_bits(0x3B124925u); }  // fp32(1/448)
  EPCOMM_QUANT_INLINE static uint8_t encode(float v) { return encode_e4m3(v, Saturation::sat); }
  EPCOMM_QUANT_INLINE static float decode(uint8_t c) { return decode_e4m3(c); }
};
struct E5m2 {
  static constexpr uint8_t kNan = 0x7E;
  static constexpr int kEmax = 15;
  EPCOMM_QUANT_INLINE static float max_value() { return 57344.0f; }
  EPCOMM_QUANT_INLINE static float inv_max() { return f32_from_bits(0x37924925u); }  // fp32(1/57344)
  EPCOMM_QUANT_INLINE static uint8_t encode(float v) { return encode_e5m2(v, Saturation::sat); }
  EPCOMM_QUANT_INLINE static float decode(uint8_t c) { return decode_e5m2(c); }
};
struct E2m1 {
  static constexpr uint8_t kNan = 0x0;
  static constexpr int kEmax = 2;
  EPCOMM_QUANT_INLINE static float max_value() { return 6.0f; }
  EPCOMM_QUANT_INLINE static float inv_max() { return f32_from_bits(0x3E2AAAABu); }  // fp32(1/6)
  EPCOMM_QUANT_INLINE static uint8_t encode(float v) { return encode_e2m1(v); }
  EPCOMM_QUANT_INLINE static float decode(uint8_t c) { return decode_e2m1(c); }
};

template <class Fn>
EPCOMM_QUANT_INLINE void visit_fp8(Fp8Format fmt, Fn&& f) {
  if (fmt == Fp8Format::e4m3)
    f(E4m3{});
  else
    f(E5m2{});
}

// ---- §3.2 ----

template <class R>
EPCOMM_QUANT_INLINE void int8_per_token_a3(R r, int64_t n, int8_t* q, float* scale) {
  uint32_t m = amax_bits(r, 0, n);
  if (m >= kInfBits) {
    fill<int8_t>(q, 0, n, 0);
    *scale = f32_from_bits(kF32Nan);
    return;
  }
  float s = 127.0f / f32_from_bits(m);
  if (m == 0 || f32_bits(s) == kInfBits) {
    fill<int8_t>(q, 0, n, 0);
    *scale = 0.0f;
    return;
  }
  for (int64_t i = 0; i < n; ++i) q[i] = int8_sat(r(i) * s, -127, 127);
  *scale = 1.0f / s;
}

template <class R>
EPCOMM_QUANT_INLINE void int8_per_token_950(R r, int64_t n, int8_t* q, float* scale) {
  uint32_t m = amax_bits(r, 0, n);
  if (m >= kInfBits) {
    fill<int8_t>(q, 0, n, 0);
    *scale = f32_from_bits(kF32Nan);
    return;
  }
  float sc = f32_from_bits(m) * k_inv127();
  if (sc == 0.0f) {
    fill<int8_t>(q, 0, n, 0);
    *scale = 0.0f;
    return;
  }
  for (int64_t i = 0; i < n; ++i) q[i] = int8_sat(r(i) / sc, -127, 127);
  *scale = sc;
}

// What one group (or a whole row) becomes once its amax is known: every code `fill`, or
// codes_i = encode(xf_i ⊗ mul). The vector kernels (quant/simd.cc) share these steps with the loops below.
struct GroupStep {
  bool fill;
  uint8_t code;  // the fill code
  float mul;
};
template <class R, class F>
EPCOMM_QUANT_INLINE void apply_step(R r, int64_t b, int64_t e, uint8_t* codes, GroupStep s) {
  if (s.fill)
    fill<uint8_t>(codes, b, e, s.code);
  else
    for (int64_t i = b; i < e; ++i) codes[i] = F::encode(r(i) * s.mul);
}

// fp8_per_token's arithmetic from amax bits m: d = M ∕ amax, *scale = 1 ∕ d.
template <class F>
EPCOMM_QUANT_INLINE GroupStep per_token_step(uint32_t m, float* scale) {
  if (m >= kInfBits) {
    *scale = f32_from_bits(kF32Nan);
    return {true, F::kNan, 0.0f};
  }
  float d = F::max_value() / f32_from_bits(m);
  if (m == 0 || f32_bits(d) == kInfBits) {
    *scale = 0.0f;
    return {true, 0, 0.0f};
  }
  *scale = 1.0f / d;
  return {false, 0, d};
}

// fp8_per_token on [b, e): also the per-group body of fp8_per_group128_a3.
template <class F, class R>
EPCOMM_QUANT_INLINE void fp8_per_token_range(R r, int64_t b, int64_t e, uint8_t* codes, float* scale) {
  apply_step<R, F>(r, b, e, codes, per_token_step<F>(amax_bits(r, b, e), scale));
}

template <class F, class R>
EPCOMM_QUANT_INLINE void fp8_per_group128_a3(R r, int64_t n, uint8_t* codes, float* scales) {
  for (int64_t b = 0, g = 0; b < n; b += 128, ++g)
    fp8_per_token_range<F>(r, b, b + 128 < n ? b + 128 : n, codes, scales + g);
}

// Stores group g's scale: one e8m0 byte, or one fp32 at any alignment (scales may sit inside packed records).
template <bool kUe8m0>
EPCOMM_QUANT_INLINE void store_scale(void* scales, int64_t g, float f32, uint8_t byte) {
  if constexpr (kUe8m0)
    static_cast<uint8_t*>(scales)[g] = byte;
  else
    std::memcpy(static_cast<uint8_t*>(scales) + 4 * g, &f32, sizeof f32);
}

// DeepEP per-group arithmetic from amax bits m (kPow2 = round_scale, kUe8m0 = one e8m0 byte per group);
// stores group g's scale.
template <class F, bool kPow2, bool kUe8m0>
EPCOMM_QUANT_INLINE GroupStep group128_step(uint32_t m, void* scales, int64_t g) {
  if (m >= kInfBits) {
    store_scale<kUe8m0>(scales, g, f32_from_bits(kF32Nan), 0xFF);
    return {true, F::kNan, 0.0f};
  }
  float amax = f32_from_bits(m);
  float a = amax < k_eps_1e4() ? k_eps_1e4() : amax;
  float scale_inv = a * F::inv_max();
  float d;
  int32_t k = 0;
  if constexpr (kPow2) {
    uint32_t t = f32_bits(scale_inv);
    k = static_cast<int32_t>(t >> 23) - 127 + ((t & 0x7FFFFFu) != 0);
    scale_inv = f32_from_bits(static_cast<uint32_t>(k + 127) << 23);
    d = f32_from_bits(static_cast<uint32_t>(127 - k) << 23);
  } else {
    d = F::max_value() / a;
  }
  store_scale<kUe8m0>(scales, g, scale_inv, static_cast<uint8_t>(k + 127));
  return {false, 0, d};
}

template <class F, bool kPow2, bool kUe8m0, class R>
EPCOMM_QUANT_INLINE void fp8_per_group128(R r, int64_t n, uint8_t* codes, void* scales) {
  for (int64_t b = 0, g = 0; b < n; b += 128, ++g) {
    int64_t e = b + 128 < n ? b + 128 : n;
    apply_step<R, F>(r, b, e, codes, group128_step<F, kPow2, kUe8m0>(amax_bits(r, b, e), scales, g));
  }
}

// ---- §3.3 MX ----

// The scale byte of one finite block from its amax bits (exponent field > 0).
template <class F, bool kRceil>
EPCOMM_QUANT_INLINE uint8_t mx_scale(uint32_t m) {
  if constexpr (kRceil) {
    return e8m0_ceil(f32_from_bits(m) * F::inv_max());
  } else {
    int32_t v = static_cast<int32_t>(m >> 23) - F::kEmax;
    return static_cast<uint8_t>(v < 0 ? 0 : v);
  }
}

// One MX block from its amax bits: NaN codes and scale 0xFF if non-finite, zero codes and scale 0x00 if the
// exponent field is 0, else codes_i = encode(x_i ⊗ 2^(127−s)).
template <class F, bool kRceil>
EPCOMM_QUANT_INLINE GroupStep mx_step(uint32_t m, uint8_t* scale) {
  if (m >= kInfBits) {
    *scale = 0xFF;
    return {true, F::kNan, 0.0f};
  }
  if ((m >> 23) == 0) {
    *scale = 0x00;
    return {true, 0, 0.0f};
  }
  *scale = mx_scale<F, kRceil>(m);
  return {false, 0, e8m0_reciprocal(*scale)};
}

template <class F, bool kRceil, class R>
EPCOMM_QUANT_INLINE uint8_t mx_block(R r, int64_t b, int64_t e, uint8_t* codes) {
  uint8_t s;
  apply_step<R, F>(r, b, e, codes, mx_step<F, kRceil>(amax_bits(r, b, e), &s));
  return s;
}

// Blocks of 32 are short, so eight of them (256 elements) are quantized together: widen, take eight maxima,
// spread each block's multiplier and code mask over the chunk, then one long encode loop. A non-finite block
// multiplies by NaN (which encodes to the NaN code), a block with exponent field 0 masks its codes to 0x00.
// `out` receives one code byte per element (e2m1 codes unpacked).
template <class F, bool kRceil, class R>
EPCOMM_QUANT_INLINE void mx_chunk(R r, int64_t c0, uint8_t* out, uint8_t* scales) {
  constexpr int64_t kBlocks = 8, kChunk = 32 * kBlocks;
  alignas(64) float v[kChunk], mul[kChunk];
  alignas(64) uint8_t keep[kChunk];
  uint32_t m[kBlocks];
  for (int64_t i = 0; i < kChunk; ++i) v[i] = r(c0 + i);
  for (int64_t b = 0; b < kBlocks; ++b) {
    uint32_t mm = 0;
    for (int64_t j = 0; j < 32; ++j) {
      uint32_t a = f32_bits(v[32 * b + j]) & kAbsMask;
      mm = a > mm ? a : mm;
    }
    m[b] = mm;
  }
  for (int64_t b = 0; b < kBlocks; ++b) {
    bool nonfinite = m[b] >= kInfBits, tiny = (m[b] >> 23) == 0;
    uint8_t s = nonfinite ? 0xFF : tiny ? 0x00 : mx_scale<F, kRceil>(m[b]);
    scales[b] = s;
    float mb = nonfinite ? f32_from_bits(kF32Nan) : e8m0_reciprocal(s);
    uint8_t kb = tiny ? 0x00 : 0xFF;
    for (int64_t j = 0; j < 32; ++j) mul[32 * b + j] = mb, keep[32 * b + j] = kb;
  }
  for (int64_t i = 0; i < kChunk; ++i) out[i] = F::encode(v[i] * mul[i]) & keep[i];
}

template <class F, bool kRceil, class R>
EPCOMM_QUANT_INLINE void mx_quantize(R r, int64_t n, uint8_t* codes, uint8_t* scales) {
  int64_t b = 0;
  for (; b + 256 <= n; b += 256) mx_chunk<F, kRceil>(r, b, codes + b, scales + b / 32);
  for (int64_t g = b / 32; b < n; b += 32, ++g)
    scales[g] = mx_block<F, kRceil>(r, b, b + 32 < n ? b + 32 : n, codes);
}

// e2m1: codes go through a buffer and are packed two per byte.
template <bool kRceil, class R>
EPCOMM_QUANT_INLINE void mxfp4_quantize(R r, int64_t n, uint8_t* packed, uint8_t* scales) {
  alignas(64) uint8_t tmp[256];
  int64_t b = 0;
  for (; b + 256 <= n; b += 256) {
    mx_chunk<E2m1, kRceil>(r, b, tmp, scales + b / 32);
    for (int64_t j = 0; j < 128; ++j) packed[b / 2 + j] = pack_f4x2(tmp[2 * j], tmp[2 * j + 1]);
  }
  for (int64_t g = b / 32; b < n; b += 32, ++g) {
    int64_t len = b + 32 < n ? 32 : n - b;
    // Shift the row so that mx_block writes tmp[0..len).
    scales[g] = mx_block<E2m1, kRceil>(Shifted<R>{r, b}, 0, len, tmp);
    for (int64_t j = 0; j < len / 2; ++j) packed[b / 2 + j] = pack_f4x2(tmp[2 * j], tmp[2 * j + 1]);
  }
}

// ---- §3.4 ----

template <class R>
EPCOMM_QUANT_INLINE void int8_static(R r, int64_t n, int8_t* q) {
  for (int64_t i = 0; i < n; ++i) q[i] = int8_sat(r(i), -128, 127);
}

template <class R>
EPCOMM_QUANT_INLINE void hif8_static(R r, int64_t n, uint8_t* codes) {
  for (int64_t i = 0; i < n; ++i) codes[i] = encode_hif8(r(i), Saturation::sat);
}

struct ToBf16 {
  static constexpr uint16_t kNan = kBf16Nan;
  EPCOMM_QUANT_INLINE static uint16_t round(float v) { return float_to_bf16(v); }
  EPCOMM_QUANT_INLINE static float widen(uint16_t h) { return bf16_to_float(h); }
};
struct ToF16 {
  static constexpr uint16_t kNan = kF16Nan;
  EPCOMM_QUANT_INLINE static uint16_t round(float v) { return float_to_fp16(v); }
  EPCOMM_QUANT_INLINE static float widen(uint16_t h) { return fp16_to_float(h); }
};

// One group of 8 (or the partial tail), straightforwardly.
template <class D, class R>
EPCOMM_QUANT_INLINE void int8_group8_combine_group(R r, int64_t b, int64_t e, int8_t* q, uint16_t* sigma) {
  uint32_t m = amax_bits(r, b, e);
  float s32 = f32_from_bits(m) * k_inv127();
  if (m >= kInfBits || f32_bits(s32) == 0) {
    fill<int8_t>(q, b, e, 0);
    *sigma = m >= kInfBits ? D::kNan : 0;
    return;
  }
  for (int64_t i = b; i < e; ++i) q[i] = int8_sat(r(i) / s32, -127, 127);
  *sigma = D::round(s32);
}

// Groups of 8 are too short to vectorize one at a time, so 8 groups (64 elements) go together: widen them,
// take 8 maxima, then divide every element by its group's s32 spread over a 64-float buffer. A zero or
// non-finite group divides by +Inf instead, which yields q = 0 for every element (int8_sat maps NaN to 0).
template <class D, class R>
EPCOMM_QUANT_INLINE void int8_group8_combine(R r, int64_t n, int8_t* q, uint16_t* sigma) {
  constexpr int64_t kChunk = 64, kGroups = kChunk / 8;
  int64_t c0 = 0;
  for (; c0 + kChunk <= n; c0 += kChunk) {
    alignas(64) float v[kChunk], div[kChunk];
    uint32_t m[kGroups];
    for (int64_t i = 0; i < kChunk; ++i) v[i] = r(c0 + i);
    for (int64_t g = 0; g < kGroups; ++g) {
      uint32_t mm = 0;
      for (int64_t j = 0; j < 8; ++j) {
        uint32_t a = f32_bits(v[8 * g + j]) & kAbsMask;
        mm = a > mm ? a : mm;
      }
      m[g] = mm;
    }
    for (int64_t g = 0; g < kGroups; ++g) {
      float s32 = f32_from_bits(m[g]) * k_inv127();
      uint32_t sb = f32_bits(s32);
      bool bad = m[g] >= kInfBits || sb == 0;
      uint16_t sg = static_cast<uint16_t>(quant_detail::pick(m[g] >= kInfBits, D::kNan, 0));
      sigma[c0 / 8 + g] = static_cast<uint16_t>(quant_detail::pick(bad, sg, D::round(s32)));
      float d = f32_from_bits(quant_detail::pick(bad, kInfBits, sb));
      for (int64_t j = 0; j < 8; ++j) div[8 * g + j] = d;
    }
    for (int64_t i = 0; i < kChunk; ++i) q[c0 + i] = int8_sat(v[i] / div[i], -127, 127);
  }
  for (int64_t b = c0; b < n; b += 8)
    int8_group8_combine_group<D>(r, b, b + 8 < n ? b + 8 : n, q, sigma + b / 8);
}

}  // namespace epcomm::quant::kernels
