// engine/kernels.cc — copy and reduction loops.
#include "engine/kernels.h"

#include <algorithm>
#include <cstring>

#include "tensor/half.h"

namespace epcomm::engine {

void copy_row(void* dst, const void* src, size_t bytes) { std::memcpy(dst, src, bytes); }

void gather_scales(uint8_t* dst, const uint8_t* base, int64_t t, int64_t st0, int64_t st1, int64_t cols, size_t elem) {
  for (int64_t c = 0; c < cols; ++c) std::memcpy(dst + c * elem, base + (t * st0 + c * st1) * elem, elem);
}

namespace {

struct Bf16 {
  using T = uint16_t;
  static float load(T v) { return bf16_to_f32(v); }
  static T store(float f) { return f32_to_bf16(f); }
};
struct F16 {
  using T = uint16_t;
  static float load(T v) { return f16_to_f32(v); }
  static T store(float f) { return f32_to_f16(f); }
};
struct F32 {
  using T = float;
  static float load(T v) { return v; }
  static T store(float f) { return f != f ? bits_to_f32(0x7FC00000u) : f; }  // canonical NaN (quant.md §1)
};

constexpr int64_t kBlock = 256;  // fp32 partial sums of one block stay in registers / L1

template <typename Fmt>
[[gnu::always_inline]] inline void reduce_token_t(const uint8_t* const* rows, const float* weights, int n, int64_t hidden, const uint8_t* bias1,
                    const uint8_t* bias2, uint8_t* out) {
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
    case DType::bf16: return reduce_token_t<Bf16>(rows, weights, n, hidden, bias1, bias2, out);
    case DType::f16: return reduce_token_t<F16>(rows, weights, n, hidden, bias1, bias2, out);
    default: return reduce_token_t<F32>(rows, weights, n, hidden, bias1, bias2, out);
  }
}

}  // namespace epcomm::engine
