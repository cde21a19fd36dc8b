// engine/partial_kernels.cc — the two halves of the hierarchical combine reduction (docs/normal-mode.md,
// combine across nodes, and docs/internode.md): a node's f32 partial of its contributions, then the origin's
// sum of the partials in node order, the biases and the one rounding. Element-wise IEEE f32, no FMA, fixed
// order: the result does not depend on vector width.
#include <algorithm>

#include "common/target_clones.h"
#include "engine/kernels.h"
#include "engine/reduce_block.h"

namespace epcomm::engine {
namespace {

constexpr int64_t kBlock = 256;

// Elements [c0, hidden) of a node's partial, and of the origin's finished row.
template <typename Fmt>
[[gnu::always_inline]] inline void partial_t(const uint8_t* const* rows, const float* weights, int n,
                                             int64_t c0, int64_t hidden, float* out) {
  for (; c0 < hidden; c0 += kBlock)
    accumulate_block<Fmt>(rows, weights, n, c0, std::min(kBlock, hidden - c0), out + c0);
}

template <typename Fmt>
[[gnu::always_inline]] inline void finish_t(const float* const* parts, int n, int64_t c0, int64_t hidden,
                                            const uint8_t* bias1, const uint8_t* bias2, uint8_t* out) {
  for (int64_t i = c0; i < hidden; ++i) {
    float acc = 0.0f;
    for (int j = 0; j < n; ++j) acc = acc + parts[j][i];
    finish_element<Fmt>(acc, i, bias1, bias2, out);
  }
}

#if defined(__x86_64__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 headers
constexpr int64_t kVec = kSumBlock;

// partial_t on 64-element blocks whose sums stay in registers while every contribution is read; the same
// operations in the same order (p = +0, then p = p + f32(w * x) per contribution, no FMA). N > 0: exactly
// N contributions, the loop over them unrolled (reduce_block.h, copy_count_table).
template <DType DT, typename Fmt, int N>
[[gnu::target("avx512f")]] void partial_avx512(const uint8_t* const* rows, const float* weights, int n,
                                               int64_t hidden, float* out) {
  int64_t c0 = 0;
  for (; c0 + kVec <= hidden; c0 += kVec) {
    __m512 a0, a1, a2, a3;
    sum_block_avx512<DT, N>(rows, weights, n, c0, a0, a1, a2, a3);
    _mm512_storeu_ps(out + c0, a0);
    _mm512_storeu_ps(out + c0 + 16, a1);
    _mm512_storeu_ps(out + c0 + 32, a2);
    _mm512_storeu_ps(out + c0 + 48, a3);
  }
  partial_t<Fmt>(rows, weights, n, c0, hidden, out);
}

using PartialNFn = void (*)(const uint8_t* const*, const float*, int, int64_t, float*);
template <DType DT, typename Fmt>
struct PartialByCount {
  template <int N>
  static constexpr PartialNFn fn = partial_avx512<DT, Fmt, N>;
};
template <DType DT, typename Fmt>
void partial_by_count(const uint8_t* const* rows, const float* weights, int n, int64_t hidden, float* out) {
  static constexpr auto kByCount = copy_count_table<PartialNFn, PartialByCount<DT, Fmt>>();
  kByCount[copy_count_index(n)](rows, weights, n, hidden, out);
}

// finish_t on 64-element blocks: acc = +0 + p_1 + ... + p_n in registers, then the biases and the rounding
// (acc is never -0, so finish_block_avx512's extra +0 changes nothing).
template <DType DT, typename Fmt>
[[gnu::target("avx512f")]] void finish_avx512(const float* const* parts, int n, int64_t hidden,
                                              const uint8_t* bias1, const uint8_t* bias2, uint8_t* out) {
  int64_t c0 = 0;
  for (; c0 + kVec <= hidden; c0 += kVec) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int j = 0; j < n; ++j) {
      const float* p = parts[j] + c0;
      a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p));
      a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + 16));
      a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + 32));
      a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + 48));
    }
    finish_block_avx512<DT, Fmt>(a0, a1, a2, a3, c0, bias1, bias2, out, false);
  }
  finish_t<Fmt>(parts, n, c0, hidden, bias1, bias2, out);
}
#pragma GCC diagnostic pop

const bool kHaveAvx512 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") != 0;
}();
#endif

}  // namespace

// The portable loops, compiled for AVX-512, AVX2 and baseline x86-64 (chosen at load time); the AVX-512
// kernels above replace them where the CPU has AVX-512. Every choice gives the same bits.
EPCOMM_TARGET_CLONES("avx512f", "avx2", "default")
static void reduce_partial_portable(DType dt, const uint8_t* const* rows, const float* weights, int n,
                                    int64_t hidden, float* out) {
  switch (dt) {
    case DType::bf16:
      return partial_t<Bf16>(rows, weights, n, 0, hidden, out);
    case DType::f16:
      return partial_t<F16>(rows, weights, n, 0, hidden, out);
    default:
      return partial_t<F32>(rows, weights, n, 0, hidden, out);
  }
}

EPCOMM_TARGET_CLONES("avx512f", "avx2", "default")
static void finish_partials_portable(DType dt, const float* const* parts, int n, int64_t hidden,
                                     const uint8_t* bias1, const uint8_t* bias2, uint8_t* out) {
  switch (dt) {
    case DType::bf16:
      return finish_t<Bf16>(parts, n, 0, hidden, bias1, bias2, out);
    case DType::f16:
      return finish_t<F16>(parts, n, 0, hidden, bias1, bias2, out);
    default:
      return finish_t<F32>(parts, n, 0, hidden, bias1, bias2, out);
  }
}

void reduce_partial(DType dt, const uint8_t* const* rows, const float* weights, int n, int64_t hidden,
                    float* out) {
#if defined(__x86_64__)
  if (kHaveAvx512) {
    switch (dt) {
      case DType::bf16:
        return partial_by_count<DType::bf16, Bf16>(rows, weights, n, hidden, out);
      case DType::f16:
        return partial_by_count<DType::f16, F16>(rows, weights, n, hidden, out);
      default:
        return partial_by_count<DType::f32, F32>(rows, weights, n, hidden, out);
    }
  }
#endif
  reduce_partial_portable(dt, rows, weights, n, hidden, out);
}

void finish_partials(DType dt, const float* const* parts, int n, int64_t hidden, const uint8_t* bias1,
                     const uint8_t* bias2, uint8_t* out) {
#if defined(__x86_64__)
  if (kHaveAvx512) {
    switch (dt) {
      case DType::bf16:
        return finish_avx512<DType::bf16, Bf16>(parts, n, hidden, bias1, bias2, out);
      case DType::f16:
        return finish_avx512<DType::f16, F16>(parts, n, hidden, bias1, bias2, out);
      default:
        return finish_avx512<DType::f32, F32>(parts, n, hidden, bias1, bias2, out);
    }
  }
#endif
  finish_partials_portable(dt, parts, n, hidden, bias1, bias2, out);
}

}  // namespace epcomm::engine
