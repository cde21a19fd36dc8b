// engine/distribute_v2_kernels.cc — combine_v2 arithmetic: slot-ordered fp32 accumulation, rounding, the
// residual add + RMSNorm of §7 and the TP-pair addition.
#include "engine/distribute_v2_kernels.h"

#include <cmath>

#include "common/target_clones.h"
#include "epcomm/quant_element.h"

namespace epcomm::engine::v2 {
namespace {

inline float load(DType dt, const uint16_t* p, int64_t h) {
  return dt == DType::bf16 ? bf16_to_float(p[h]) : fp16_to_float(p[h]);
}
inline uint16_t store(DType dt, float v) {
  return dt == DType::bf16 ? to_bf16_bits(v) : to_fp16_bits(v);
}

// One block of kBlock elements [h0, h0 + nb) of every row, summed in registers: the same binary32
// operations in the same row order as one pass per row over acc (so the same bits), without reading and
// writing acc once per row.
template <bool kBf16, int kBlock, typename Sink>
[[gnu::always_inline]] inline void accumulate_block(const uint8_t* const* rows, const float* weights,
                                                    const uint8_t* weighted, int n, int64_t h0, int64_t nb,
                                                    Sink&& sink) {
  float a[kBlock];
  for (int i = 0; i < kBlock; ++i) a[i] = 0.0f;
  for (int j = 0; j < n; ++j) {
    const uint16_t* r = reinterpret_cast<const uint16_t*>(rows[j]) + h0;
    const float w = weights[j];
    if (weighted[j])
      for (int i = 0; i < kBlock && i < nb; ++i)
        a[i] = a[i] + (kBf16 ? bf16_to_float(r[i]) : fp16_to_float(r[i])) * w;
    else
      for (int i = 0; i < kBlock && i < nb; ++i)
        a[i] = a[i] + (kBf16 ? bf16_to_float(r[i]) : fp16_to_float(r[i]));
  }
  for (int i = 0; i < kBlock && i < nb; ++i) sink(h0 + i, a[i]);
}

// Inlined into each clone of accumulate_rows, so that every ISA level gets its own vectorized loop. sink(h,
// sum) takes each element's sum once.
template <bool kBf16, typename Sink>
[[gnu::always_inline]] inline void accumulate_t(const uint8_t* const* rows, const float* weights,
                                                const uint8_t* weighted, int n, int64_t H, Sink&& sink) {
  constexpr int kBlock = 64;  // four 16-float vectors live across the rows
  int64_t h0 = 0;
  for (; h0 + kBlock <= H; h0 += kBlock)
    accumulate_block<kBf16, kBlock>(rows, weights, weighted, n, h0, kBlock, sink);
  if (h0 < H) accumulate_block<kBf16, kBlock>(rows, weights, weighted, n, h0, H - h0, sink);
}

}  // namespace

EPCOMM_TARGET_CLONES("avx512f", "avx2", "default")
void accumulate_rows(DType dt, const uint8_t* const* rows, const float* weights, const uint8_t* weighted,
                     int n, int64_t H, float* acc) {
  auto keep = [acc](int64_t h, float v) { acc[h] = v; };
  if (dt == DType::bf16)
    accumulate_t<true>(rows, weights, weighted, n, H, keep);
  else
    accumulate_t<false>(rows, weights, weighted, n, H, keep);
}

EPCOMM_TARGET_CLONES("avx512f", "avx2", "default")
void accumulate_round_rows(DType dt, const uint8_t* const* rows, const float* weights,
                           const uint8_t* weighted, int n, int64_t H, uint8_t* out) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
  if (dt == DType::bf16)
    accumulate_t<true>(rows, weights, weighted, n, H, [o](int64_t h, float v) { o[h] = to_bf16_bits(v); });
  else
    accumulate_t<false>(rows, weights, weighted, n, H, [o](int64_t h, float v) { o[h] = to_fp16_bits(v); });
}

void add_rms_norm_row(DType dt, const float* acc, const uint8_t* residual, const uint8_t* gamma, int64_t H,
                      float eps, uint8_t* x, uint8_t* y, float* rstd, float* xf) {
  const uint16_t* res = reinterpret_cast<const uint16_t*>(residual);
  const uint16_t* gam = reinterpret_cast<const uint16_t*>(gamma);
  uint16_t* xo = reinterpret_cast<uint16_t*>(x);
  uint16_t* yo = reinterpret_cast<uint16_t*>(y);
  const float inv_h = 1.0f / static_cast<float>(H);  // fp32(1/H): H is exact in binary32
  double sum = 0.0;
  for (int64_t h = 0; h < H; ++h) {
    xf[h] = acc[h] + load(dt, res, h);
    xo[h] = store(dt, xf[h]);
    const float sq = xf[h] * xf[h];
    const float p = sq * inv_h;
    sum += static_cast<double>(p);  // exact widening; fp64 adds in increasing h
  }
  const float ms = static_cast<float>(sum);
  const float denom = std::sqrt(ms + eps);  // correctly rounded binary32 sqrt
  const float r = 1.0f / denom;
  *rstd = r;
  for (int64_t h = 0; h < H; ++h) {
    const float n1 = xf[h] * r;
    const float n1r = dt == DType::bf16 ? bf16_to_float(to_bf16_bits(n1)) : fp16_to_float(to_fp16_bits(n1));
    const float g = load(dt, gam, h);
    yo[h] = store(dt, n1r * g);
  }
}

uint16_t f16_round_exact_sum(uint16_t a, uint16_t b) {
  const double s = static_cast<double>(fp16_to_float(a)) + static_cast<double>(fp16_to_float(b));  // exact
  if (std::isnan(s)) return 0x7E00;
  const double m = std::fabs(s);
  if (std::isinf(s) || m >= 65520.0) return s < 0 ? 0xFC00 : 0x7C00;
  // The fp16 ulp at |s|: 2^-24 below 2^-14 (subnormals), else 2^(e-10) for |s| in [2^e, 2^(e+1)).
  double ulp = std::ldexp(1.0, -24);
  if (m >= std::ldexp(1.0, -14)) {
    int e;
    std::frexp(m, &e);  // m = f·2^e, f in [0.5, 1)
    ulp = std::ldexp(1.0, e - 1 - 10);
  }
  if (m == 0.0) return std::signbit(s) ? 0x8000 : 0x0000;  // -0 only for (-0) + (-0)
  const double q = std::nearbyint(m / ulp);                // round half to even (the default rounding mode)
  const double r = q * ulp;  // exactly representable in fp16 (65536 is excluded above)
  const uint16_t bits = to_fp16_bits(static_cast<float>(r));
  return s < 0 ? static_cast<uint16_t>(bits | 0x8000) : bits;
}

void add_pair_row(DType dt, uint8_t* y, const uint8_t* p, int64_t H) {
  uint16_t* yo = reinterpret_cast<uint16_t*>(y);
  const uint16_t* pi = reinterpret_cast<const uint16_t*>(p);
  if (dt == DType::bf16) {
    for (int64_t h = 0; h < H; ++h) yo[h] = to_bf16_bits(bf16_to_float(yo[h]) + bf16_to_float(pi[h]));
  } else {
    for (int64_t h = 0; h < H; ++h) yo[h] = f16_round_exact_sum(yo[h], pi[h]);
  }
}

}  // namespace epcomm::engine::v2
