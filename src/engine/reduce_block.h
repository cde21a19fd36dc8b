// engine/reduce_block.h — the element formats of the reductions and their portable block loop, shared by
// the one-node reduction (kernels.cc) and the per-node f32 partials (partial_kernels.cc). IEEE f32
// element-wise, no FMA, fixed order: vector kernels reproduce these operations bit for bit.
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <utility>

#include "epcomm/quant_element.h"
#include "epcomm/tensor.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace epcomm::engine {

struct Bf16 {
  using T = uint16_t;
  static float load(T v) { return bf16_to_float(v); }
  static T store(float f) { return to_bf16_bits(f); }
};
struct F16 {
  using T = uint16_t;
  static float load(T v) { return fp16_to_float(v); }
  static T store(float f) { return to_fp16_bits(f); }
};
struct F32 {
  using T = float;
  static float load(T v) { return v; }
  static T store(float f) { return f != f ? std::bit_cast<float>(0x7FC00000u) : f; }  // canonical NaN
};

// p[0, m) = +0, then p = p + f32(w_j * x_j) (or p + x_j without weights) for each contribution j in order,
// over elements [c0, c0 + m) of the n rows.
template <typename Fmt>
[[gnu::always_inline]] inline void accumulate_block(const uint8_t* const* rows, const float* weights, int n,
                                                    int64_t c0, int64_t m, float* p) {
  using T = typename Fmt::T;
  for (int64_t i = 0; i < m; ++i) p[i] = 0.0f;
  for (int j = 0; j < n; ++j) {
    const T* x = reinterpret_cast<const T*>(rows[j]) + c0;
    if (weights) {
      const float w = weights[j];
      for (int64_t i = 0; i < m; ++i) {
        float c = w * Fmt::load(x[i]);
        p[i] = p[i] + c;
      }
    } else {
      for (int64_t i = 0; i < m; ++i) p[i] = p[i] + Fmt::load(x[i]);
    }
  }
}

// Rounds element c of an f32 sum into the output: acc = base (+ bias1[c]) (+ bias2[c]), one rounding.
template <typename Fmt>
[[gnu::always_inline]] inline void finish_element(float acc, int64_t c, const uint8_t* bias1,
                                                  const uint8_t* bias2, uint8_t* out) {
  using T = typename Fmt::T;
  if (bias1) acc = acc + Fmt::load(reinterpret_cast<const T*>(bias1)[c]);
  if (bias2) acc = acc + Fmt::load(reinterpret_cast<const T*>(bias2)[c]);
  reinterpret_cast<T*>(out)[c] = Fmt::store(acc);
}

// Rounds one block of fp32 sums (acc = +0 + p, then the biases) into the output.
template <typename Fmt>
[[gnu::always_inline]] inline void finish_block_t(const float* p, int64_t c0, int64_t m, const uint8_t* bias1,
                                                  const uint8_t* bias2, uint8_t* out) {
  using T = typename Fmt::T;
  T* o = reinterpret_cast<T*>(out) + c0;
  const T* b1 = bias1 ? reinterpret_cast<const T*>(bias1) + c0 : nullptr;
  const T* b2 = bias2 ? reinterpret_cast<const T*>(bias2) + c0 : nullptr;
  if (!b1) {
    for (int64_t i = 0; i < m; ++i) o[i] = Fmt::store(0.0f + p[i]);
    return;
  }
  for (int64_t i = 0; i < m; ++i) {
    float acc = 0.0f + p[i];
    acc = acc + Fmt::load(b1[i]);
    if (b2) acc = acc + Fmt::load(b2[i]);
    o[i] = Fmt::store(acc);
  }
}

#if defined(__x86_64__)
// AVX-512 building blocks of the vector reductions (kernels.cc, partial_kernels.cc); callers are compiled
// with the avx512f target and chosen at load time.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers, on their own helpers
// 16 elements of dtype `dt` (bf16, f16 or f32) widened exactly to f32.
[[gnu::target("avx512f"), gnu::always_inline]] inline __m512 load16_avx512(DType dt, const uint8_t* x) {
  if (dt == DType::f32) return _mm512_loadu_ps(x);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  if (dt == DType::bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);  // f16: exact widening
}

// Fmt::store of Bf16 on 16 lanes, after acc = +0 + p: round to nearest even, NaN -> 0x7FC0.
[[gnu::target("avx512f"), gnu::always_inline]] inline __m256i round_bf16_avx512(__m512 p) {
  const __m512i u = _mm512_castps_si512(_mm512_add_ps(_mm512_setzero_ps(), p));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// A token's copies counted at compile time where there are at most kUnrolledCopies (top-k <= 8 in
// expert_major, up to 8 ranks in rank_major: the common cases; the unrolled loop over them was 1.4-1.8x
// faster than the run-time one for two copies), a run-time count beyond. Kernel::fn<N> is a kernel for N
// copies (N = 0: any count) of function type Fn; the table holds N = 0..kUnrolledCopies, and
// copy_count_index(n) is the entry for n copies.
constexpr int kUnrolledCopies = 8;
template <typename Fn, typename Kernel, int... N>
constexpr std::array<Fn, sizeof...(N)> by_copy_count(std::integer_sequence<int, N...>) {
  return {Kernel::template fn<N>...};
}
template <typename Fn, typename Kernel>
constexpr std::array<Fn, kUnrolledCopies + 1> copy_count_table() {
  return by_copy_count<Fn, Kernel>(std::make_integer_sequence<int, kUnrolledCopies + 1>{});
}
inline int copy_count_index(int n) {
  return n <= kUnrolledCopies ? n : 0;
}

constexpr int64_t kSumBlock = 64;       // elements whose f32 sums one sum_block_avx512 keeps in registers
constexpr int64_t kSumPrefetch = 1024;  // bytes ahead on each contribution

// The f32 sums of elements [c0, c0 + 64) of n contributions of dtype DT, in four registers: a = +0, then
// a = a + f32(w_j * x_j) (a + x_j without weights) for j in order; the copies are read side by side and
// each is prefetched kSumPrefetch bytes ahead, so that a token's n streams overlap their misses.
// N > 0 fixes n = N at compile time: the loop over the copies is unrolled, which on the development VM
// made a two-copy token's reduction 1.4-1.8x faster than the run-time loop (docs/performance.md). N = 0
// reads n.
template <DType DT, int N = 0>
[[gnu::target("avx512f"), gnu::always_inline]] inline void sum_block_avx512(const uint8_t* const* rows,
                                                                            const float* weights, int n,
                                                                            int64_t c0, __m512& a0,
                                                                            __m512& a1, __m512& a2,
                                                                            __m512& a3) {
  constexpr size_t elem = DT == DType::f32 ? 4 : 2;
  a0 = _mm512_setzero_ps();
  a1 = a0;
  a2 = a0;
  a3 = a0;
#pragma GCC unroll 8
  for (int j = 0; j < (N > 0 ? N : n); ++j) {
    const uint8_t* x = rows[j] + c0 * elem;
    for (size_t l = 0; l < kSumBlock * elem; l += 64)
      _mm_prefetch(reinterpret_cast<const char*>(x + kSumPrefetch + l), _MM_HINT_T0);
    __m512 v0 = load16_avx512(DT, x), v1 = load16_avx512(DT, x + 16 * elem);
    __m512 v2 = load16_avx512(DT, x + 32 * elem), v3 = load16_avx512(DT, x + 48 * elem);
    if (weights) {
      const __m512 w = _mm512_set1_ps(weights[j]);
      v0 = _mm512_mul_ps(w, v0);
      v1 = _mm512_mul_ps(w, v1);
      v2 = _mm512_mul_ps(w, v2);
      v3 = _mm512_mul_ps(w, v3);
    }
    a0 = _mm512_add_ps(a0, v0);
    a1 = _mm512_add_ps(a1, v1);
    a2 = _mm512_add_ps(a2, v2);
    a3 = _mm512_add_ps(a3, v3);
  }
}

// Rounds the f32 sums of elements [c0, c0 + 64) (acc = +0 + a, then the biases) into `out`, as
// finish_block_t does: bf16 without biases in registers (with streaming stores when `stream`: `out` is
// 32-byte aligned and not read back soon), anything else through finish_block_t.
template <DType DT, typename Fmt>
[[gnu::target("avx512f"), gnu::always_inline]] inline void finish_block_avx512(
    __m512 a0, __m512 a1, __m512 a2, __m512 a3, int64_t c0, const uint8_t* bias1, const uint8_t* bias2,
    uint8_t* out, bool stream) {
  if (DT == DType::bf16 && !bias1) {  // bias2 needs bias1 (checked with the arguments)
    __m256i* o = reinterpret_cast<__m256i*>(out + c0 * 2);
    const __m256i r[4] = {round_bf16_avx512(a0), round_bf16_avx512(a1), round_bf16_avx512(a2),
                          round_bf16_avx512(a3)};
    for (int i = 0; i < 4; ++i) {
      if (stream)
        _mm256_stream_si256(o + i, r[i]);
      else
        _mm256_storeu_si256(o + i, r[i]);
    }
    return;
  }
  alignas(64) float p[kSumBlock];
  _mm512_store_ps(p, a0);
  _mm512_store_ps(p + 16, a1);
  _mm512_store_ps(p + 32, a2);
  _mm512_store_ps(p + 48, a3);
  finish_block_t<Fmt>(p, c0, kSumBlock, bias1, bias2, out);
}
#pragma GCC diagnostic pop
#endif

}  // namespace epcomm::engine
