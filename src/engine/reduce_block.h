// engine/reduce_block.h — the element formats of the reductions and their portable block loop, shared by
// the one-node reduction (kernels.cc) and the per-node f32 partials (partial_kernels.cc). IEEE f32
// element-wise, no FMA, fixed order: vector kernels reproduce these operations bit for bit.
#pragma once

#include <bit>
#include <cstdint>

#include "epcomm/quant_element.h"

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

}  // namespace epcomm::engine
