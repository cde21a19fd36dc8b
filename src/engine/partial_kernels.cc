// engine/partial_kernels.cc — the two halves of the hierarchical combine reduction (spec/normal-mode.md
// §5.1 across nodes): a node's f32 partial of its contributions, then the origin's sum of the partials in
// node order, the biases and the one rounding. Element-wise IEEE f32, no FMA, fixed order: the result does
// not depend on vector width.
#include <algorithm>
#include <bit>

#include "engine/kernels.h"
#include "epcomm/quant_element.h"

namespace epcomm::engine {
namespace {

constexpr int64_t kBlock = 256;

template <typename Load>
[[gnu::always_inline]] inline void partial_t(const uint8_t* const* rows, const float* weights, int n,
                                             int64_t hidden, float* out, Load load) {
  for (int64_t c0 = 0; c0 < hidden; c0 += kBlock) {
    const int64_t m = std::min(kBlock, hidden - c0);
    float* p = out + c0;
    for (int64_t i = 0; i < m; ++i) p[i] = 0.0f;
    for (int j = 0; j < n; ++j) {
      const uint8_t* x = rows[j];
      if (weights) {
        const float w = weights[j];
        for (int64_t i = 0; i < m; ++i) {
          float c = w * load(x, c0 + i);
          p[i] = p[i] + c;
        }
      } else {
        for (int64_t i = 0; i < m; ++i) p[i] = p[i] + load(x, c0 + i);
      }
    }
  }
}

float load_bf16(const uint8_t* x, int64_t i) {
  return bf16_to_float(reinterpret_cast<const uint16_t*>(x)[i]);
}
float load_f16(const uint8_t* x, int64_t i) {
  return fp16_to_float(reinterpret_cast<const uint16_t*>(x)[i]);
}
float load_f32(const uint8_t* x, int64_t i) {
  return reinterpret_cast<const float*>(x)[i];
}

}  // namespace

#if defined(__x86_64__)
[[gnu::target_clones("avx512f", "avx2", "default")]]
#endif
void reduce_partial(DType dt, const uint8_t* const* rows, const float* weights, int n, int64_t hidden,
                    float* out) {
  switch (dt) {
    case DType::bf16:
      return partial_t(rows, weights, n, hidden, out, load_bf16);
    case DType::f16:
      return partial_t(rows, weights, n, hidden, out, load_f16);
    default:
      return partial_t(rows, weights, n, hidden, out, load_f32);
  }
}

#if defined(__x86_64__)
[[gnu::target_clones("avx512f", "avx2", "default")]]
#endif
void finish_partials(DType dt, const float* const* parts, int n, int64_t hidden, const uint8_t* bias1,
                     const uint8_t* bias2, uint8_t* out) {
  for (int64_t i = 0; i < hidden; ++i) {
    float acc = 0.0f;
    for (int j = 0; j < n; ++j) acc = acc + parts[j][i];
    switch (dt) {
      case DType::bf16: {
        if (bias1) acc = acc + load_bf16(bias1, i);
        if (bias2) acc = acc + load_bf16(bias2, i);
        reinterpret_cast<uint16_t*>(out)[i] = to_bf16_bits(acc);
        break;
      }
      case DType::f16: {
        if (bias1) acc = acc + load_f16(bias1, i);
        if (bias2) acc = acc + load_f16(bias2, i);
        reinterpret_cast<uint16_t*>(out)[i] = to_fp16_bits(acc);
        break;
      }
      default: {
        if (bias1) acc = acc + load_f32(bias1, i);
        if (bias2) acc = acc + load_f32(bias2, i);
        reinterpret_cast<float*>(out)[i] = acc != acc ? std::bit_cast<float>(0x7FC00000u) : acc;
      }
    }
  }
}

}  // namespace epcomm::engine
