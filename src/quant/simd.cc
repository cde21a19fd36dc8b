// quant/simd.cc — the AVX-512 and AVX2 instruction sets behind quant/simd_body.h's kernels, each compiled
// under its own target pragma, and the list of kernel sets this CPU runs.
#include "quant/simd.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define EPCOMM_QUANT_SIMD 1
#include <immintrin.h>
#endif

#include <type_traits>

#include "quant/kernels.h"

namespace epcomm::quant {

#if EPCOMM_QUANT_SIMD
namespace simd {

using kernels::E2m1;
using kernels::E4m3;
using kernels::E5m2;

// The constants of the integer encoders of epcomm/quant_element.h: a finite |v| (bits a) below kSubBelow
// takes the subnormal path, bits(|v| + magic) whose low bits are the code; else the code is a rounded to
// nearest even at bit kShift, rebiased: (a − kBias + kRound + lsb) >> kShift; a > kSatAbove saturates to
// kSatCode. The sign goes in above the kKeep bits.
template <class F>
struct EncodeConsts;
template <>
struct EncodeConsts<E4m3> {
  static constexpr uint32_t kBias = 0x3C000000u, kRound = 0x7FFFFu, kSubBelow = 0x3C800000u;
  static constexpr uint32_t kSatAbove = 0x43E80000u, kSatCode = 0x7Eu, kKeep = 0x7Fu;
  static constexpr int kShift = 20, kSignShift = 24;
  static float magic() { return 16384.0f; }  // ulp 2^-9
};
template <>
struct EncodeConsts<E5m2> {
  static constexpr uint32_t kBias = 0x38000000u, kRound = 0xFFFFFu, kSubBelow = 0x38800000u;
  static constexpr uint32_t kSatAbove = 0x476FFFFFu, kSatCode = 0x7Bu, kKeep = 0x7Fu;
  static constexpr int kShift = 21, kSignShift = 24;
  static float magic() { return 128.0f; }  // ulp 2^-16
};
template <>
struct EncodeConsts<E2m1> {
  static constexpr uint32_t kBias = 0x3F000000u, kRound = 0x1FFFFFu, kSubBelow = 0x3F800000u;
  static constexpr uint32_t kSatAbove = 0x40C00000u, kSatCode = 0x7u, kKeep = 0x7u;
  static constexpr int kShift = 22, kSignShift = 28;
  static float magic() { return 4194304.0f; }  // ulp 0.5
};

// GCC 12's AVX-512 headers trip -W(maybe-)uninitialized on their own undefined-vector helpers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

// Each instruction set provides, for W lanes of binary32: loads (bf16, f16, f32), integer and float lane
// operations, selects, and pack_unit, which narrows four vectors of codes (each lane < 256) to 4W bytes.
// A "unit" is 4W consecutive elements. widen_raw widens 2W bf16 by interleaving with zero words, which is
// one instruction per vector but leaves the lanes permuted within each 128-bit lane; pack_unit with
// kInterleaved undoes exactly that permutation (the saturating packs restore the in-lane order, a final
// cross-lane permute the rest).

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd")
struct Avx512 {
  using F = __m512;
  using I = __m512i;
  static constexpr int kW = 16;
  static F load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static F load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F load_bf16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // 2W bf16 elements raw, and widened into two vectors (interleaved order).
  static I load_raw(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static void widen_raw(I x, F* v) {
    v[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), x));
    v[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), x));
  }
  // max over 16-bit lanes of |x| bit patterns (sign cleared), as binary32 bits.
  static I abs16(I x) { return _mm512_and_si512(x, _mm512_set1_epi16(0x7FFF)); }
  static I max_u16(I a, I b) { return _mm512_max_epu16(a, b); }
  static uint32_t hmax16(I a) {
    __m256i m = _mm256_max_epu16(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
    __m128i h = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_minpos_epu16(_mm_xor_si128(h, _mm_set1_epi16(-1)));  // min of complements
    return (~static_cast<uint32_t>(_mm_cvtsi128_si32(h)) & 0xFFFFu) << 16;
  }
  static F setf(float f) { return _mm512_set1_ps(f); }
  static I set(uint32_t u) { return _mm512_set1_epi32(static_cast<int>(u)); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static I cvt_rne(F a) { return _mm512_cvtps_epi32(a); }  // the MXCSR rounding: to nearest even
  static F addf(F a, F b) { return _mm512_add_ps(a, b); }
  static I bits(F a) { return _mm512_castps_si512(a); }
  static F as_float(I a) { return _mm512_castsi512_ps(a); }
  static I band(I a, I b) { return _mm512_and_si512(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  template <int S>
  static I srl(I a) {
    return _mm512_srli_epi32(a, S);
  }
  static I max_u(I a, I b) { return _mm512_max_epu32(a, b); }
  static uint32_t hmax(I a) { return _mm512_reduce_max_epu32(a); }
  // (a + c + ((a >> S) & 1)) >> S: the round-to-nearest-even bit as a masked increment.
  template <int S>
  static I round_shift(I a, uint32_t c) {
    __m512i t = _mm512_add_epi32(a, set(c));
    t = _mm512_mask_add_epi32(t, _mm512_test_epi32_mask(a, set(1u << S)), t, set(1));
    return _mm512_srli_epi32(t, S);
  }
  // a < lim ? x : y and a > lim ? x : y, signed lanes.
  static I select_lt(I a, uint32_t lim, I x, I y) {
    return _mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(a, set(lim)), y, x);
  }
  static I select_gt(I a, uint32_t lim, I x, I y) {
    return _mm512_mask_blend_epi32(_mm512_cmpgt_epi32_mask(a, set(lim)), y, x);
  }
  // (x & keep) | (y & ~keep)
  static I bitselect(uint32_t keep, I x, I y) { return _mm512_ternarylogic_epi32(set(keep), x, y, 0xCA); }
  template <bool kInterleaved>
  static I pack_unit(const I* c) {
    __m512i p = _mm512_packus_epi16(_mm512_packus_epi32(c[0], c[1]), _mm512_packus_epi32(c[2], c[3]));
    if constexpr (kInterleaved)
      return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), p);
    else
      return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                      p);
  }
  static void store_bytes(uint8_t* p, I b) { _mm512_storeu_si512(p, b); }
  // Byte pairs (c0, c1), each < 16, to c0 | c1 << 4: 2W bytes.
  static void store_nibbles(uint8_t* p, I b) {
    __m512i t = _mm512_and_si512(_mm512_or_si512(b, _mm512_srli_epi16(b, 4)), _mm512_set1_epi16(0xFF));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi16_epi8(t));
  }
};
namespace avx512 {
using V = Avx512;
#include "quant/simd_body.h"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
struct Avx2 {
  using F = __m256;
  using I = __m256i;
  static constexpr int kW = 8;
  static F load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static F load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static F load_bf16(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static I load_raw(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void widen_raw(I x, F* v) {
    v[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
    v[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
  }
  static I abs16(I x) { return _mm256_and_si256(x, _mm256_set1_epi16(0x7FFF)); }
  static I max_u16(I a, I b) { return _mm256_max_epu16(a, b); }
  static uint32_t hmax16(I a) {
    __m128i h = _mm_max_epu16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    h = _mm_minpos_epu16(_mm_xor_si128(h, _mm_set1_epi16(-1)));
    return (~static_cast<uint32_t>(_mm_cvtsi128_si32(h)) & 0xFFFFu) << 16;
  }
  static F setf(float f) { return _mm256_set1_ps(f); }
  static I set(uint32_t u) { return _mm256_set1_epi32(static_cast<int>(u)); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static I cvt_rne(F a) { return _mm256_cvtps_epi32(a); }
  static F addf(F a, F b) { return _mm256_add_ps(a, b); }
  static I bits(F a) { return _mm256_castps_si256(a); }
  static F as_float(I a) { return _mm256_castsi256_ps(a); }
  static I band(I a, I b) { return _mm256_and_si256(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  template <int S>
  static I srl(I a) {
    return _mm256_srli_epi32(a, S);
  }
  static I max_u(I a, I b) { return _mm256_max_epu32(a, b); }
  template <int S>
  static I round_shift(I a, uint32_t c) {
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, S), set(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, set(c)), lsb), S);
  }
  static uint32_t hmax(I a) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
  }
  static I select_lt(I a, uint32_t lim, I x, I y) {
    return _mm256_blendv_epi8(y, x, _mm256_cmpgt_epi32(set(lim), a));
  }
  static I select_gt(I a, uint32_t lim, I x, I y) {
    return _mm256_blendv_epi8(y, x, _mm256_cmpgt_epi32(a, set(lim)));
  }
  static I bitselect(uint32_t keep, I x, I y) {
    const __m256i k = set(keep);
    return _mm256_or_si256(_mm256_and_si256(k, x), _mm256_andnot_si256(k, y));
  }
  template <bool kInterleaved>
  static I pack_unit(const I* c) {
    __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    if constexpr (kInterleaved)
      return _mm256_permute4x64_epi64(p, 0xD8);
    else
      return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  static void store_bytes(uint8_t* p, I b) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), b); }
  static void store_nibbles(uint8_t* p, I b) {
    __m256i t = _mm256_and_si256(_mm256_or_si256(b, _mm256_srli_epi16(b, 4)), _mm256_set1_epi16(0xFF));
    t = _mm256_permute4x64_epi64(_mm256_packus_epi16(t, t), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(t));
  }
};
namespace avx2 {
using V = Avx2;
#include "quant/simd_body.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC diagnostic pop

}  // namespace simd
#endif

std::vector<Fp8KernelSet> fp8_kernel_sets() {
  std::vector<Fp8KernelSet> k;
#if EPCOMM_QUANT_SIMD
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    k.push_back(simd::avx512::kSet);
  if (__builtin_cpu_supports("x86-64-v3")) k.push_back(simd::avx2::kSet);
#endif
  k.push_back(portable_fp8_kernels());
  return k;
}

}  // namespace epcomm::quant
