// engine/kernels.cc — copy and reduction loops.
#include "engine/kernels.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <utility>

#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common/target_clones.h"
#include "engine/reduce_block.h"
#include "epcomm/quant_element.h"

namespace epcomm::engine {

namespace {

#if defined(__x86_64__)
// Streaming (non-temporal) copies of one row to n destinations: a dispatched row is not read again soon, so
// writing around the cache saves the read-for-ownership of every destination line. Each block of the
// source is loaded once and stored to every destination: for a token written to two ranks that was 17-27%
// faster than one copy per destination on the development VM (docs/performance.md). Every destination is
// 64-byte aligned; the tail uses memcpy. The trailing sfence orders the streaming stores before the signal
// that publishes them.
[[gnu::target("avx512f")]] void copy_stream_avx512(uint8_t* const* dsts, int n, const uint8_t* src,
                                                   size_t bytes, bool fence) {
  size_t i = 0;
  for (; i + 256 <= bytes; i += 256) {
    __m512i a = _mm512_loadu_si512(src + i), b = _mm512_loadu_si512(src + i + 64);
    __m512i c = _mm512_loadu_si512(src + i + 128), d = _mm512_loadu_si512(src + i + 192);
    for (int j = 0; j < n; ++j) {
      uint8_t* dst = dsts[j];
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), a);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 64), b);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 128), c);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 192), d);
    }
  }
  for (; i + 64 <= bytes; i += 64) {
    const __m512i a = _mm512_loadu_si512(src + i);
    for (int j = 0; j < n; ++j) _mm512_stream_si512(reinterpret_cast<__m512i*>(dsts[j] + i), a);
  }
  if (fence) _mm_sfence();
  if (i < bytes)
    for (int j = 0; j < n; ++j) std::memcpy(dsts[j] + i, src + i, bytes - i);
}

[[gnu::target("avx2")]] void copy_stream_avx2(uint8_t* const* dsts, int n, const uint8_t* src, size_t bytes,
                                              bool fence) {
  size_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    for (int j = 0; j < n; ++j) {
      uint8_t* dst = dsts[j];
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
    }
  }
  if (fence) _mm_sfence();
  if (i < bytes)
    for (int j = 0; j < n; ++j) std::memcpy(dsts[j] + i, src + i, bytes - i);
}

using CopyFn = void (*)(uint8_t* const*, int, const uint8_t*, size_t, bool);
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

void copy_row_to(uint8_t* const* dsts, int n, const void* src, size_t bytes, bool fence,
                 bool cache_resident) {
  if (n == 0) return;  // (a token none of whose rows go to the receivers served now is not read)
#if defined(__x86_64__)
  bool aligned = !cache_resident;
  for (int j = 0; j < n; ++j) aligned = aligned && (reinterpret_cast<uintptr_t>(dsts[j]) & 63) == 0;
  if (kStreamCopy && bytes >= kStreamMin && aligned) {
    kStreamCopy(dsts, n, static_cast<const uint8_t*>(src), bytes, fence);
    return;
  }
#endif
  for (int j = 0; j < n; ++j) std::memcpy(dsts[j], src, bytes);
}

void copy_row(void* dst, const void* src, size_t bytes, bool fence, bool cache_resident) {
  uint8_t* d = static_cast<uint8_t*>(dst);
  copy_row_to(&d, 1, src, bytes, fence, cache_resident);
}

void write_token_rows(uint8_t* const* dsts, uint8_t* const* scale_dsts, int n, const void* src, size_t bytes,
                      const void* scales, size_t scale_bytes, bool cache_resident) {
  copy_row_to(dsts, n, src, bytes, false, cache_resident);
  if (scale_bytes)  // after the data (dispatch_v2 at the decode shape: 466 us against 473 the other way round)
    for (int j = 0; j < n; ++j) std::memcpy(scale_dsts[j], scales, scale_bytes);
}

size_t cache_resident_push_bytes() {
  static const size_t limit = [] {
    constexpr size_t kMax = size_t{16} << 20;
    long llc = -1;
#if defined(_SC_LEVEL3_CACHE_SIZE)
    llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (llc <= 0) llc = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return llc > 0 ? std::min(kMax, static_cast<size_t>(llc) / 2) : kMax;
  }();
  return limit;
}

void store_fence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

void gather_scales(uint8_t* dst, const uint8_t* base, int64_t t, int64_t st0, int64_t st1, int64_t cols,
                   size_t elem) {
  for (int64_t c = 0; c < cols; ++c) std::memcpy(dst + c * elem, base + (t * st0 + c * st1) * elem, elem);
}

namespace {

constexpr int64_t kBlock = 256;  // fp32 partial sums of one block stay in L1

// Portable loop, also the tail (fewer than kVecBlock elements) of the vector kernels below.
template <typename Fmt>
[[gnu::always_inline]] inline void reduce_block_t(const uint8_t* const* rows, const float* weights, int n,
                                                  int64_t c0, int64_t c1, const uint8_t* bias1,
                                                  const uint8_t* bias2, uint8_t* out) {
  alignas(64) float p[kBlock];
  for (; c0 < c1; c0 += kBlock) {
    const int64_t m = std::min(kBlock, c1 - c0);
    accumulate_block<Fmt>(rows, weights, n, c0, m, p);
    for (int64_t i = 0; i < m; ++i) finish_element<Fmt>(0.0f + p[i], c0 + i, bias1, bias2, out);
  }
}

#if defined(__x86_64__)
// Vector kernels: a block of kVecBlock elements keeps its fp32 sums in registers while every copy of the
// token is read (the copies are read side by side, block by block), and prefetches each copy kSumPrefetch
// bytes ahead so that a token's K streams overlap their misses. Same operations in the same order as
// reduce_block_t: p = +0; p = p + f32(w * x) per copy; no FMA (mul and add are separate instructions).
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own undefined-vector helpers.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
constexpr int64_t kVecBlock = kSumBlock;
using ReduceNFn = void (*)(const uint8_t* const*, const float*, int, int64_t, const uint8_t*, const uint8_t*,
                           uint8_t*);

template <DType DT, typename Fmt, int N>
[[gnu::target("avx512f")]] void reduce_avx512_n(const uint8_t* const* rows, const float* weights, int n,
                                                int64_t hidden, const uint8_t* bias1, const uint8_t* bias2,
                                                uint8_t* out) {
  constexpr size_t elem = DT == DType::f32 ? 4 : 2;
  // Without biases a bf16 row is rounded in registers and written around the cache: combined_x is
  // written once and not read back by the reduction, so its lines need no read-for-ownership.
  const bool stream = DT == DType::bf16 && !bias1 && (reinterpret_cast<uintptr_t>(out) & 31) == 0 &&
                      hidden * static_cast<int64_t>(elem) >= static_cast<int64_t>(kStreamMin);
  int64_t c0 = 0;
  for (; c0 + kVecBlock <= hidden; c0 += kVecBlock) {
    __m512 a0, a1, a2, a3;
    sum_block_avx512<DT, N>(rows, weights, n, c0, a0, a1, a2, a3);
    finish_block_avx512<DT, Fmt>(a0, a1, a2, a3, c0, bias1, bias2, out, stream);
  }
  if (stream) _mm_sfence();  // order the streaming stores before the tail and whatever publishes the row
  if (c0 < hidden) reduce_block_t<Fmt>(rows, weights, n, c0, hidden, bias1, bias2, out);
}

template <DType DT, typename Fmt>
struct Avx512ByCount {
  template <int N>
  static constexpr ReduceNFn fn = reduce_avx512_n<DT, Fmt, N>;
};

[[gnu::target("avx2"), gnu::always_inline]] inline __m256 load8_avx2(DType dt, const uint8_t* x) {
  if (dt == DType::f32) return _mm256_loadu_ps(reinterpret_cast<const float*>(x));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16
}

template <DType DT, typename Fmt, int N>
[[gnu::target("avx2")]] void reduce_avx2_n(const uint8_t* const* rows, const float* weights, int n,
                                           int64_t hidden, const uint8_t* bias1, const uint8_t* bias2,
                                           uint8_t* out) {
  constexpr size_t elem = DT == DType::f32 ? 4 : 2;
  alignas(64) float p[kVecBlock];
  int64_t c0 = 0;
  for (; c0 + kVecBlock <= hidden; c0 += kVecBlock) {
    __m256 a[8];
    for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < (N > 0 ? N : n); ++j) {
      const uint8_t* x = rows[j] + c0 * elem;
      for (size_t l = 0; l < kVecBlock * elem; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(x + kSumPrefetch + l), _MM_HINT_T0);
      const __m256 w = _mm256_set1_ps(weights ? weights[j] : 1.0f);
      for (int i = 0; i < 8; ++i) {
        __m256 v = load8_avx2(DT, x + 8 * i * elem);
        if (weights) v = _mm256_mul_ps(w, v);
        a[i] = _mm256_add_ps(a[i], v);
      }
    }
    for (int i = 0; i < 8; ++i) _mm256_store_ps(p + 8 * i, a[i]);
    finish_block_t<Fmt>(p, c0, kVecBlock, bias1, bias2, out);
  }
  if (c0 < hidden) reduce_block_t<Fmt>(rows, weights, n, c0, hidden, bias1, bias2, out);
}

template <DType DT, typename Fmt>
struct Avx2ByCount {
  template <int N>
  static constexpr ReduceNFn fn = reduce_avx2_n<DT, Fmt, N>;
};
#pragma GCC diagnostic pop

// The kernel for a token's copy count (reduce_block.h, copy_count_table).
template <typename Kernel>
void reduce_by_count(const uint8_t* const* rows, const float* weights, int n, int64_t hidden,
                     const uint8_t* bias1, const uint8_t* bias2, uint8_t* out) {
  static constexpr auto kByCount = copy_count_table<ReduceNFn, Kernel>();
  kByCount[copy_count_index(n)](rows, weights, n, hidden, bias1, bias2, out);
}
#endif

// The portable loop, compiled for AVX-512, AVX2 and baseline x86-64 (chosen at load time); used where no
// hand-written kernel fits (f16 without AVX-512, non-x86).
EPCOMM_TARGET_CLONES("avx512f", "avx2", "default")
void reduce_token_portable(DType dt, const uint8_t* const* rows, const float* weights, int n, int64_t hidden,
                           const uint8_t* bias1, const uint8_t* bias2, uint8_t* out) {
  switch (dt) {
    case DType::bf16:
      return reduce_block_t<Bf16>(rows, weights, n, 0, hidden, bias1, bias2, out);
    case DType::f16:
      return reduce_block_t<F16>(rows, weights, n, 0, hidden, bias1, bias2, out);
    default:
      return reduce_block_t<F32>(rows, weights, n, 0, hidden, bias1, bias2, out);
  }
}

struct ReduceKernels {
  ReduceNFn bf16 = nullptr, f16 = nullptr, f32 = nullptr;  // null: the portable loop
};
#if defined(__x86_64__)
constexpr ReduceKernels kAvx512Kernels{reduce_by_count<Avx512ByCount<DType::bf16, Bf16>>,
                                       reduce_by_count<Avx512ByCount<DType::f16, F16>>,
                                       reduce_by_count<Avx512ByCount<DType::f32, F32>>};
constexpr ReduceKernels kAvx2Kernels{reduce_by_count<Avx2ByCount<DType::bf16, Bf16>>, nullptr,
                                     reduce_by_count<Avx2ByCount<DType::f32, F32>>};
#endif
constexpr ReduceKernels kPortableKernels{};

template <const ReduceKernels& Set>
void reduce_with(DType dt, const uint8_t* const* rows, const float* weights, int n, int64_t hidden,
                 const uint8_t* bias1, const uint8_t* bias2, uint8_t* out) {
  ReduceNFn f = dt == DType::bf16 ? Set.bf16 : dt == DType::f16 ? Set.f16 : Set.f32;
  if (f) return f(rows, weights, n, hidden, bias1, bias2, out);
  reduce_token_portable(dt, rows, weights, n, hidden, bias1, bias2, out);
}

// One binary runs everywhere: reduce_token uses the first kernel set this CPU runs, chosen once.
const ReduceKernel kReduce = reduce_kernels().front();

}  // namespace

void prefetch_row_starts(const uint8_t* const* rows, int n, size_t row_bytes, const uint8_t* const* prev,
                         int prev_n) {
  const size_t bytes = std::min<size_t>(row_bytes, 1024);  // the kernels' prefetch distance
  for (int j = 0; j < n; ++j) {
    if (j < prev_n && rows[j] == prev[j] + row_bytes) continue;  // a stream the hardware already follows
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(rows[j] + off, 0, 3);
  }
}

std::vector<ReduceKernel> reduce_kernels() {
  std::vector<ReduceKernel> k;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) k.push_back({"avx512", reduce_with<kAvx512Kernels>});
  if (__builtin_cpu_supports("avx2")) k.push_back({"avx2", reduce_with<kAvx2Kernels>});
#endif
  k.push_back({"portable", reduce_with<kPortableKernels>});
  return k;
}

void reduce_token(DType dt, const uint8_t* const* rows, const float* weights, int n, int64_t hidden,
                  const uint8_t* bias1, const uint8_t* bias2, uint8_t* out) {
  kReduce.run(dt, rows, weights, n, hidden, bias1, bias2, out);
}

}  // namespace epcomm::engine
