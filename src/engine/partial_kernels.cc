// engine/partial_kernels.cc — the two halves of the hierarchical combine reduction (spec/normal-mode.md
// §5.1 across nodes): a node's f32 partial of its contributions, then the origin's sum of the partials in
// node order, the biases and the one rounding. Element-wise IEEE f32, no FMA, fixed order: the result does
// not depend on vector width.
#include <algorithm>

#include "engine/kernels.h"
#include "engine/reduce_block.h"

namespace epcomm::engine {
namespace {

constexpr int64_t kBlock = 256;

template <typename Fmt>
[[gnu::always_inline]] inline void partial_t(const uint8_t* const* rows, const float* weights, int n,
                                             int64_t hidden, float* out) {
  for (int64_t c0 = 0; c0 < hidden; c0 += kBlock)
    accumulate_block<Fmt>(rows, weights, n, c0, std::min(kBlock, hidden - c0), out + c0);
}

template <typename Fmt>
[[gnu::always_inline]] inline void finish_t(const float* const* parts, int n, int64_t hidden,
                                            const uint8_t* bias1, const uint8_t* bias2, uint8_t* out) {
  for (int64_t i = 0; i < hidden; ++i) {
    float acc = 0.0f;
    for (int j = 0; j < n; ++j) acc = acc + parts[j][i];
    finish_element<Fmt>(acc, i, bias1, bias2, out);
  }
}

}  // namespace

#if defined(__x86_64__)
[[gnu::target_clones("avx512f", "avx2", "default")]]
#endif
void reduce_partial(DType dt, const uint8_t* const* rows, const float* weights, int n, int64_t hidden,
                    float* out) {
  switch (dt) {
    case DType::bf16:
      return partial_t<Bf16>(rows, weights, n, hidden, out);
    case DType::f16:
      return partial_t<F16>(rows, weights, n, hidden, out);
    default:
      return partial_t<F32>(rows, weights, n, hidden, out);
  }
}

#if defined(__x86_64__)
[[gnu::target_clones("avx512f", "avx2", "default")]]
#endif
void finish_partials(DType dt, const float* const* parts, int n, int64_t hidden, const uint8_t* bias1,
                     const uint8_t* bias2, uint8_t* out) {
  switch (dt) {
    case DType::bf16:
      return finish_t<Bf16>(parts, n, hidden, bias1, bias2, out);
    case DType::f16:
      return finish_t<F16>(parts, n, hidden, bias1, bias2, out);
    default:
      return finish_t<F32>(parts, n, hidden, bias1, bias2, out);
  }
}

}  // namespace epcomm::engine
