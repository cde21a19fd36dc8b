// engine/kernels.cc — copy and reduction loops.
#include "engine/kernels.h"

#include <algorithm>
#include <bit>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "epcomm/quant_element.h"

namespace epcomm::engine {

namespace {

#if defined(__x86_64__)
// Streaming (non-temporal) copies: a dispatched row is not read again soon, so writing around the cache
// saves the read-for-ownership of every destination line. `dst` is 64-byte aligned; the tail uses memcpy.
// The trailing sfence orders the streaming stores before the signal that publishes them.
[[gnu::target("avx512f")]] void copy_stream_avx512(uint8_t* dst, const uint8_t* src, size_t bytes) {
  size_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    __m512i a = _mm512_loadu_si512(src + i), b = _mm512_loadu_si512(src + i + 64);
    __m512i c = _mm512_loadu_si512(src + i + 128), d = _mm512_loadu_si512(src + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 192), d);
  }
  for (; i + 64 <= bytes; i += 64)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
  _mm_sfence();
  if (i < bytes) std::memcpy(dst + i, src + i, bytes - i);
}

[[gnu::target("avx2")]] void copy_stream_avx2(uint8_t* dst, const uint8_t* src, size_t bytes) {
  size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  _mm_sfence();
  if (i < bytes) std::memcpy(dst + i, src + i, bytes - i);
}

using CopyFn = void (*)(uint8_t*, const uint8_t*, size_t);
CopyFn pick_stream_copy() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return copy_stream_avx512;
  if (__builtin_cpu_supports("avx2")) return copy_stream_avx2;
  return nullptr;
}
const CopyFn kStreamCopy = pick_stream_copy();
#endif

constexpr size_t kStreamMin = 2048;  // below this a row stays in cache: plain memcpy

}  // namespace

void copy_row(void* dst, const void* src, size_t bytes) {
#if defined(__x86_64__)
  if (kStreamCopy && bytes >= kStreamMin && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) {
    kStreamCopy(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), bytes);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

void gather_scales(uint8_t* dst, const uint8_t* base, int64_t t, int64_t st0, int64_t st1, int64_t cols,
                   size_t elem) {
  for (int64_t c = 0; c < cols; ++c) std::memcpy(dst + c * elem, base + (t * st0 + c * st1) * elem, elem);
}

namespace {

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
  static T store(float f) {
    return f != f ? std::bit_cast<float>(0x7FC00000u) : f;
  }  // canonical NaN (quant.md §1)
};

constexpr int64_t kBlock = 256;  // fp32 partial sums of one block stay in registers / L1

template <typename Fmt>
[[gnu::always_inline]] inline void reduce_token_t(const uint8_t* const* rows, const float* weights, int n,
                                                  int64_t hidden, const uint8_t* bias1, const uint8_t* bias2,
                                                  uint8_t* out) {
  using T = typename Fmt::T;
  T* o = reinterpret_cast<T*>(out);
  const T* b1 = reinterpret_cast<const T*>(bias1);
  const T* b2 = reinterpret_cast<const T*>(bias2);
  alignas(64) float p[kBlock];
  for (int64_t c0 = 0; c0 < hidden; c0 += kBlock) {
    const int64_t m = std::min(kBlock, hidden - c0);
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
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0.0f + p[i];
      if (b1) acc = acc + Fmt::load(b1[c0 + i]);
      if (b2) acc = acc + Fmt::load(b2[c0 + i]);
      o[c0 + i] = Fmt::store(acc);
    }
  }
}

}  // namespace

// One binary runs everywhere: the loop is compiled for AVX-512, AVX2 and baseline x86-64 and chosen at
// load time from the CPU's features. Results are identical (no FMA, same order of operations).
#if defined(__x86_64__)
[[gnu::target_clones("avx512f", "avx2", "default")]]
#endif
void reduce_token(DType dt, const uint8_t* const* rows, const float* weights, int n, int64_t hidden,
                  const uint8_t* bias1, const uint8_t* bias2, uint8_t* out) {
  switch (dt) {
    case DType::bf16:
      return reduce_token_t<Bf16>(rows, weights, n, hidden, bias1, bias2, out);
    case DType::f16:
      return reduce_token_t<F16>(rows, weights, n, hidden, bias1, bias2, out);
    default:
      return reduce_token_t<F32>(rows, weights, n, hidden, bias1, bias2, out);
  }
}

}  // namespace epcomm::engine
