// quant/block.cc — argument checks and the one switch per call that picks a kernel instantiation.
#include "quant/block.h"

#include <cstring>
#include <type_traits>

#include "common/check.h"
#include "quant/kernels.h"
#include "quant/simd.h"

namespace epcomm::quant {
namespace {

using namespace kernels;

// Throws for an input dtype or smoothing the quantizers do not take.
void check_row(DType in, const Smoothing& c) {
  EPCOMM_CHECK(in == DType::bf16 || in == DType::f16 || in == DType::f32,
               "x dtype: expected bf16, f16 or f32, got ", dtype_name(in));
  EPCOMM_CHECK(c.kind() != Smoothing::Kind::vector || c.vector_data() != nullptr,
               "smoothing: vector smoothing needs a non-null pointer");
}

// Calls f(row) with the Row type matching (in, smoothing), after checking them.
template <class F>
EPCOMM_QUANT_INLINE void with_row(DType in, const void* x, const Smoothing& c, F&& f) {
  check_row(in, c);
  visit_row(in, x, c, f);
}

void check_n(int64_t n) {
  EPCOMM_CHECK_GE(n, 0, "row length n must not be negative");
}

}  // namespace

EPCOMM_QUANT_CLONES void int8_per_token_950(DType in, const void* x, int64_t n, const Smoothing& c, int8_t* q,
                                            float* scale) {
  check_n(n);
  with_row(in, x, c, [&](auto r) EPCOMM_QUANT_LAMBDA_INLINE { kernels::int8_per_token_950(r, n, q, scale); });
}

namespace {

// ---- the portable fp8, MX and int8 loops (simd.h's "portable" set); the arguments are checked ----

EPCOMM_QUANT_CLONES void int8_per_token_portable(DType in, const void* x, int64_t n, const Smoothing& c,
                                                 int8_t* q, float* scale) {
  visit_row(in, x, c, [&](auto r) EPCOMM_QUANT_LAMBDA_INLINE { kernels::int8_per_token_a3(r, n, q, scale); });
}

EPCOMM_QUANT_CLONES void fp8_per_token_portable(Fp8Format fmt, DType in, const void* x, int64_t n,
                                                const Smoothing& c, uint8_t* codes, float* scale) {
  visit_fp8(fmt, [&](auto f) EPCOMM_QUANT_LAMBDA_INLINE {
    using F = decltype(f);
    visit_row(in, x, c, [&](auto r) EPCOMM_QUANT_LAMBDA_INLINE {
      kernels::fp8_per_token_range<F>(r, 0, n, codes, scale);
    });
  });
}

EPCOMM_QUANT_CLONES void fp8_per_group128_portable(Fp8Format fmt, DType in, const void* x, int64_t n,
                                                   const Smoothing& c, uint8_t* codes, void* scales,
                                                   Group128Options options) {
  visit_fp8(fmt, [&](auto f) EPCOMM_QUANT_LAMBDA_INLINE {
    using F = decltype(f);
    visit_row(in, x, c, [&](auto r) EPCOMM_QUANT_LAMBDA_INLINE {
      if (options.ue8m0)
        kernels::fp8_per_group128<F, true, true>(r, n, codes, scales);
      else if (options.pow2_scale)
        kernels::fp8_per_group128<F, true, false>(r, n, codes, scales);
      else
        kernels::fp8_per_group128<F, false, false>(r, n, codes, scales);
    });
  });
}

EPCOMM_QUANT_CLONES void fp8_per_group128_a3_portable(Fp8Format fmt, DType in, const void* x, int64_t n,
                                                      const Smoothing& c, uint8_t* codes, float* scales) {
  visit_fp8(fmt, [&](auto f) EPCOMM_QUANT_LAMBDA_INLINE {
    using F = decltype(f);
    visit_row(in, x, c, [&](auto r) EPCOMM_QUANT_LAMBDA_INLINE {
      kernels::fp8_per_group128_a3<F>(r, n, codes, scales);
    });
  });
}

EPCOMM_QUANT_CLONES void mx_quantize_portable(MxElem elem, ScaleRule rule, DType in, const void* x, int64_t n,
                                              uint8_t* codes, uint8_t* scales) {
  visit_row(in, x, Smoothing::none(), [&](auto r) EPCOMM_QUANT_LAMBDA_INLINE {
    bool rc = rule == ScaleRule::rceil;
    switch (elem) {
      case MxElem::e4m3:
        rc ? kernels::mx_quantize<E4m3, true>(r, n, codes, scales)
           : kernels::mx_quantize<E4m3, false>(r, n, codes, scales);
        return;
      case MxElem::e5m2:
        rc ? kernels::mx_quantize<E5m2, true>(r, n, codes, scales)
           : kernels::mx_quantize<E5m2, false>(r, n, codes, scales);
        return;
      case MxElem::e2m1:
        rc ? kernels::mxfp4_quantize<true>(r, n, codes, scales)
           : kernels::mxfp4_quantize<false>(r, n, codes, scales);
        return;
    }
  });
}

// The best set this CPU runs (simd.h), chosen once.
const Fp8KernelSet& best_fp8() {
  static const Fp8KernelSet k = fp8_kernel_sets().front();
  return k;
}

}  // namespace

Fp8KernelSet portable_fp8_kernels() {
  return {
      "portable",           fp8_per_group128_portable, fp8_per_token_portable, fp8_per_group128_a3_portable,
      mx_quantize_portable, int8_per_token_portable};
}

void int8_per_token_a3(DType in, const void* x, int64_t n, const Smoothing& c, int8_t* q, float* scale) {
  check_n(n);
  check_row(in, c);
  best_fp8().int8_per_token(in, x, n, c, q, scale);
}

void fp8_per_token(Fp8Format fmt, DType in, const void* x, int64_t n, const Smoothing& c, uint8_t* codes,
                   float* scale) {
  check_n(n);
  check_row(in, c);
  best_fp8().per_token(fmt, in, x, n, c, codes, scale);
}

void fp8_per_group128(Fp8Format fmt, DType in, const void* x, int64_t n, const Smoothing& c, uint8_t* codes,
                      void* scales, Group128Options options) {
  check_n(n);
  EPCOMM_CHECK(!options.ue8m0 || options.pow2_scale, "fp8_per_group128: ue8m0 requires pow2_scale");
  check_row(in, c);
  best_fp8().per_group128(fmt, in, x, n, c, codes, scales, options);
}

void fp8_per_group128_a3(Fp8Format fmt, DType in, const void* x, int64_t n, const Smoothing& c,
                         uint8_t* codes, float* scales) {
  check_n(n);
  check_row(in, c);
  best_fp8().per_group128_a3(fmt, in, x, n, c, codes, scales);
}

void mx_quantize(MxElem elem, ScaleRule rule, DType in, const void* x, int64_t n, uint8_t* codes,
                 uint8_t* scales) {
  check_n(n);
  check_row(in, Smoothing::none());
  if (elem == MxElem::e2m1)
    EPCOMM_CHECK(n % 2 == 0, "mxfp4_e2m1: the row length must be even to pack two codes per byte (n = ", n,
                 ")");
  best_fp8().mx(elem, rule, in, x, n, codes, scales);
}

EPCOMM_QUANT_CLONES void int8_static(DType in, const void* x, int64_t n, const Smoothing& c, int8_t* q) {
  check_n(n);
  with_row(in, x, c, [&](auto r) EPCOMM_QUANT_LAMBDA_INLINE { kernels::int8_static(r, n, q); });
}

EPCOMM_QUANT_CLONES void hif8_static(DType in, const void* x, int64_t n, const Smoothing& c, uint8_t* codes) {
  check_n(n);
  with_row(in, x, c, [&](auto r) EPCOMM_QUANT_LAMBDA_INLINE { kernels::hif8_static(r, n, codes); });
}

EPCOMM_QUANT_CLONES void int8_group8_combine(DType dt, const void* y, int64_t n, int8_t* q, uint16_t* sigma) {
  check_n(n);
  const auto* p = static_cast<const uint16_t*>(y);
  if (dt == DType::bf16)
    kernels::int8_group8_combine<ToBf16>(Row<Bf16Src, NoSmooth>{{p}, {}}, n, q, sigma);
  else if (dt == DType::f16)
    kernels::int8_group8_combine<ToF16>(Row<F16Src, NoSmooth>{{p}, {}}, n, q, sigma);
  else
    EPCOMM_THROW(InvalidUsage, "int8_group8_combine: y dtype must be bf16 or f16, got ", dtype_name(dt));
}

// ---- dequantization ----

EPCOMM_QUANT_CLONES void dequant_int8_per_token(const int8_t* q, float scale, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(q[i]) * scale;
}

EPCOMM_QUANT_CLONES void dequant_fp8_per_token(Fp8Format fmt, const uint8_t* codes, float scale, int64_t n,
                                               float* out) {
  visit_fp8(fmt, [&](auto f) EPCOMM_QUANT_LAMBDA_INLINE {
    using F = decltype(f);
    for (int64_t i = 0; i < n; ++i) out[i] = F::decode(codes[i]) * scale;
  });
}

EPCOMM_QUANT_CLONES void dequant_fp8_per_group128(Fp8Format fmt, const uint8_t* codes, const void* scales,
                                                  int64_t n, float* out, bool ue8m0) {
  visit_fp8(fmt, [&](auto f) EPCOMM_QUANT_LAMBDA_INLINE {
    using F = decltype(f);
    for (int64_t b = 0, g = 0; b < n; b += 128, ++g) {
      int64_t e = b + 128 < n ? b + 128 : n;
      float s;
      if (ue8m0)
        s = e8m0_decode(static_cast<const uint8_t*>(scales)[g]);
      else
        std::memcpy(&s, static_cast<const uint8_t*>(scales) + 4 * g, sizeof s);
      for (int64_t i = b; i < e; ++i) out[i] = F::decode(codes[i]) * s;
    }
  });
}

EPCOMM_QUANT_CLONES void dequant_mx(MxElem elem, const uint8_t* codes, const uint8_t* scales, int64_t n,
                                    float* out) {
  auto run = [&](auto f) EPCOMM_QUANT_LAMBDA_INLINE {
    using F = decltype(f);
    constexpr bool kFp4 = std::is_same_v<F, E2m1>;
    // Whole chunks of 8 blocks: spread the scales over a buffer so the loop is one long vectorizable pass.
    int64_t c0 = 0;
    for (; c0 + 256 <= n; c0 += 256) {
      alignas(64) float sx[256];
      for (int64_t b = 0; b < 8; ++b) {
        float s = e8m0_decode(scales[c0 / 32 + b]);
        for (int64_t j = 0; j < 32; ++j) sx[32 * b + j] = s;
      }
      if constexpr (kFp4) {
        for (int64_t j = 0; j < 128; ++j) {
          uint8_t byte = codes[c0 / 2 + j];
          out[c0 + 2 * j] = F::decode(f4x2_low(byte)) * sx[2 * j];
          out[c0 + 2 * j + 1] = F::decode(f4x2_high(byte)) * sx[2 * j + 1];
        }
      } else {
        for (int64_t i = 0; i < 256; ++i) out[c0 + i] = F::decode(codes[c0 + i]) * sx[i];
      }
    }
    for (int64_t i = c0; i < n; ++i) {
      float s = e8m0_decode(scales[i / 32]);
      uint8_t c = kFp4 ? ((i & 1) ? f4x2_high(codes[i / 2]) : f4x2_low(codes[i / 2])) : codes[i];
      out[i] = F::decode(c) * s;
    }
  };
  switch (elem) {
    case MxElem::e4m3:
      run(E4m3{});
      return;
    case MxElem::e5m2:
      run(E5m2{});
      return;
    case MxElem::e2m1:
      run(E2m1{});
      return;
  }
}

EPCOMM_QUANT_CLONES void int8_group8_combine_dequant(DType dt, const int8_t* q, const uint16_t* sigma,
                                                     int64_t n, uint16_t* out) {
  auto run = [&](auto d) EPCOMM_QUANT_LAMBDA_INLINE {
    using D = decltype(d);
    // sigma[i / 8] does not vectorize as such: spread 8 groups' scales over a 64-float buffer first.
    int64_t c0 = 0;
    for (; c0 + 64 <= n; c0 += 64) {
      alignas(64) float sx[64];
      for (int64_t g = 0; g < 8; ++g)
        for (int64_t j = 0; j < 8; ++j) sx[8 * g + j] = D::widen(sigma[c0 / 8 + g]);
      for (int64_t i = 0; i < 64; ++i) out[c0 + i] = D::round(static_cast<float>(q[c0 + i]) * sx[i]);
    }
    for (int64_t i = c0; i < n; ++i) out[i] = D::round(static_cast<float>(q[i]) * D::widen(sigma[i / 8]));
  };
  if (dt == DType::bf16)
    run(ToBf16{});
  else if (dt == DType::f16)
    run(ToF16{});
  else
    EPCOMM_THROW(InvalidUsage, "int8_group8_combine_dequant: dtype must be bf16 or f16, got ",
                 dtype_name(dt));
}

}  // namespace epcomm::quant
