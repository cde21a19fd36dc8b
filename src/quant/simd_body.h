// quant/simd_body.h — the vector quantizer kernels, written once over an instruction set V (simd.cc includes
// this file once per set, inside that set's target pragma and namespace; no include guard on purpose).
//
// Same arithmetic as kernels.h, lane by lane: amax is the integer max of |x| bit patterns, the group's
// multiplier comes from the shared scalar step (per_token_step, group128_step, mx_step), and each code is
// encode(xf ⊗ mul) computed with the integer recipe of epcomm/quant_element.h. Partial groups at the end of
// a row go through the scalar loops. encode() is only used on finite products (non-finite groups are
// filled by the step); kSat = false further assumes |v| < the format's saturation threshold, which holds
// for the fp8 per-token and per-group arithmetic (|xf| <= amax, so |xf ⊗ mul| <= M (1 + 2^-23)^2).

using namespace kernels;
using F = V::F;
using I = V::I;
constexpr int kW = V::kW, kUnit = 4 * kW;

// The lambdas handed to visit_row and visit_fp8 are called, not force-inlined: those helpers are compiled
// for the baseline ISA and cannot inline code of this one.

// encode_e4m3 / encode_e5m2 / encode_e2m1 of quant_element.h on W lanes (finite v).
template <class Fmt, bool kSat>
EPCOMM_QUANT_INLINE I encode(F v) {
  using C = EncodeConsts<Fmt>;
  I u = V::bits(v);
  I a = V::band(u, V::set(0x7FFFFFFFu));
  I normal = V::template round_shift<C::kShift>(a, C::kRound - C::kBias);
  // The adder rounds to the subnormal step; the code is in the low bits of the sum (the magic's are 0).
  I sub = V::bits(V::addf(V::as_float(a), V::setf(C::magic())));
  I r = V::select_lt(a, C::kSubBelow, sub, normal);
  if constexpr (kSat) r = V::select_gt(a, C::kSatAbove, V::set(C::kSatCode), r);
  return V::bitselect(C::kKeep, r, V::srl<C::kSignShift>(u));
}

// The row's elements unit by unit: bf16 without per-element smoothing in interleaved lane order. Plain bf16
// (kRaw) also offers the raw words, whose amax needs half the instructions.
template <class R>
struct Loader {
  static constexpr bool kInterleaved =
      std::is_same_v<decltype(R::src), Bf16Src> && !std::is_same_v<decltype(R::sm), VectorSmooth>;
  static constexpr bool kRaw =
      std::is_same_v<decltype(R::src), Bf16Src> && std::is_same_v<decltype(R::sm), NoSmooth>;
  R r;
  EPCOMM_QUANT_INLINE F load(int64_t i) const {
    if constexpr (std::is_same_v<decltype(R::src), Bf16Src>)
      return V::load_bf16(r.src.p + i);
    else if constexpr (std::is_same_v<decltype(R::src), F16Src>)
      return V::load_f16(r.src.p + i);
    else
      return V::load_f32(r.src.p + i);
  }
  EPCOMM_QUANT_INLINE void unit(int64_t i, F* v) const {
    if constexpr (kInterleaved) {
      V::widen_raw(V::load_raw(r.src.p + i), v);
      V::widen_raw(V::load_raw(r.src.p + i + 2 * kW), v + 2);
    } else
      for (int k = 0; k < 4; ++k) v[k] = load(i + k * kW);
    if constexpr (std::is_same_v<decltype(R::sm), ScalarSmooth>) {
      F c = V::setf(r.sm.c);
      for (int k = 0; k < 4; ++k) v[k] = V::mul(v[k], c);
    } else if constexpr (std::is_same_v<decltype(R::sm), VectorSmooth>) {
      for (int k = 0; k < 4; ++k) v[k] = V::mul(v[k], V::load_f32(r.sm.c + i + k * kW));
    }
  }
};

EPCOMM_QUANT_INLINE I abs_max(const F* v, int n) {
  const I mask = V::set(0x7FFFFFFFu);
  I m = V::band(V::bits(v[0]), mask);
  for (int k = 1; k < n; ++k) m = V::max_u(m, V::band(V::bits(v[k]), mask));
  return m;
}

// Codes of one group of vectors from its step.
template <class Fmt, bool kSat>
EPCOMM_QUANT_INLINE void step_codes(const F* v, int n, GroupStep s, I* c) {
  if (s.fill) {
    for (int k = 0; k < n; ++k) c[k] = V::set(s.code);
    return;
  }
  F mul = V::setf(s.mul);
  for (int k = 0; k < n; ++k) c[k] = encode<Fmt, kSat>(V::mul(v[k], mul));
}

// Whole spans of max(G, unit) elements: per group of G the amax, step(g, amax bits) and the codes. Returns
// the number of elements done (a multiple of G); the caller finishes the row with the scalar loops.
// kPacked: e2m1 codes, two per byte.
template <class Fmt, int G, bool kSat, bool kPacked, class R, class Step>
EPCOMM_QUANT_INLINE int64_t grouped(R r, int64_t n, uint8_t* out, Step step) {
  constexpr int kSpan = G > kUnit ? G : kUnit, kUnits = kSpan / kUnit, kPerGroup = G / kW;
  const Loader<R> ld{r};
  int64_t b = 0;
  for (; b + kSpan <= n; b += kSpan) {
    F v[kSpan / kW];
    I c[kSpan / kW];
    uint32_t m[kSpan / G];
    if constexpr (Loader<R>::kRaw) {  // each group's amax over its raw words, then the widening
      constexpr int kRawPerGroup = kPerGroup / 2;
      I raw[kSpan / kW / 2];
      for (int k = 0; k < kSpan / kW / 2; ++k) raw[k] = V::load_raw(r.src.p + b + 2 * kW * k);
      for (int g = 0; g < kSpan / G; ++g) {
        I mg = V::abs16(raw[g * kRawPerGroup]);
        for (int k = 1; k < kRawPerGroup; ++k) mg = V::max_u16(mg, V::abs16(raw[g * kRawPerGroup + k]));
        m[g] = V::hmax16(mg);
      }
      for (int k = 0; k < kSpan / kW / 2; ++k) V::widen_raw(raw[k], v + 2 * k);
    } else {
      for (int u = 0; u < kUnits; ++u) ld.unit(b + u * kUnit, v + 4 * u);
      for (int g = 0; g < kSpan / G; ++g) m[g] = V::hmax(abs_max(v + g * kPerGroup, kPerGroup));
    }
    for (int g = 0; g < kSpan / G; ++g)
      step_codes<Fmt, kSat>(v + g * kPerGroup, kPerGroup, step(b / G + g, m[g]), c + g * kPerGroup);
    for (int u = 0; u < kUnits; ++u) {
      I bytes = V::template pack_unit<Loader<R>::kInterleaved>(c + 4 * u);
      if constexpr (kPacked)
        V::store_nibbles(out + (b + u * kUnit) / 2, bytes);
      else
        V::store_bytes(out + b + u * kUnit, bytes);
    }
  }
  return b;
}

// The groups of [b, n) one by one with the scalar loops.
template <class Fmt, int G, class R, class Step>
EPCOMM_QUANT_INLINE void scalar_groups(R r, int64_t b, int64_t n, uint8_t* codes, Step step) {
  for (; b < n; b += G) {
    int64_t e = b + G < n ? b + G : n;
    apply_step<R, Fmt>(r, b, e, codes, step(b / G, amax_bits(r, b, e)));
  }
}

template <class Fmt, int G, bool kSat, class R, class Step>
EPCOMM_QUANT_INLINE void groups(R r, int64_t n, uint8_t* codes, Step step) {
  scalar_groups<Fmt, G>(r, grouped<Fmt, G, kSat, false>(r, n, codes, step), n, codes, step);
}

template <class Fmt, bool kPow2, bool kUe8m0, class R>
EPCOMM_QUANT_INLINE void per_group128_t(R r, int64_t n, uint8_t* codes, void* scales) {
  groups<Fmt, 128, false>(r, n, codes, [scales](int64_t g, uint32_t m) EPCOMM_QUANT_LAMBDA_INLINE {
    return group128_step<Fmt, kPow2, kUe8m0>(m, scales, g);
  });
}

void per_group128(Fp8Format fmt, DType in, const void* x, int64_t n, const Smoothing& c, uint8_t* codes,
                  void* scales, Group128Options options) {
  visit_fp8(fmt, [&](auto f) {
    using Fmt = decltype(f);
    visit_row(in, x, c, [&](auto r) {
      if (options.ue8m0)
        per_group128_t<Fmt, true, true>(r, n, codes, scales);
      else if (options.pow2_scale)
        per_group128_t<Fmt, true, false>(r, n, codes, scales);
      else
        per_group128_t<Fmt, false, false>(r, n, codes, scales);
    });
  });
}

void per_group128_a3(Fp8Format fmt, DType in, const void* x, int64_t n, const Smoothing& c, uint8_t* codes,
                     float* scales) {
  visit_fp8(fmt, [&](auto f) {
    using Fmt = decltype(f);
    visit_row(in, x, c, [&](auto r) {
      groups<Fmt, 128, false>(r, n, codes, [scales](int64_t g, uint32_t m) EPCOMM_QUANT_LAMBDA_INLINE {
        return per_token_step<Fmt>(m, scales + g);
      });
    });
  });
}

// One amax over the row, then one encode pass.
template <class Fmt, class R>
EPCOMM_QUANT_INLINE void per_token_t(R r, int64_t n, uint8_t* codes, float* scale) {
  const Loader<R> ld{r};
  const int64_t whole = n / kUnit * kUnit;
  I mv = V::set(0);
  for (int64_t b = 0; b < whole; b += kUnit) {
    F v[4];
    ld.unit(b, v);
    mv = V::max_u(mv, abs_max(v, 4));
  }
  uint32_t m = V::hmax(mv), t = amax_bits(r, whole, n);
  GroupStep s = per_token_step<Fmt>(m > t ? m : t, scale);
  for (int64_t b = 0; b < whole; b += kUnit) {
    F v[4];
    I c[4];
    ld.unit(b, v);
    step_codes<Fmt, false>(v, 4, s, c);
    V::store_bytes(codes + b, V::template pack_unit<Loader<R>::kInterleaved>(c));
  }
  apply_step<R, Fmt>(r, whole, n, codes, s);
}

void per_token(Fp8Format fmt, DType in, const void* x, int64_t n, const Smoothing& c, uint8_t* codes,
               float* scale) {
  visit_fp8(fmt, [&](auto f) {
    using Fmt = decltype(f);
    visit_row(in, x, c, [&](auto r) { per_token_t<Fmt>(r, n, codes, scale); });
  });
}

// int8_per_token_a3 of kernels.h: one amax over the row (over the raw words for plain bf16), then
// q = RNE(xf ⊗ s), s = 127 / amax. |xf| <= amax keeps every product within 127 (1 + 2^-23)^2, which rounds
// to at most 127: int8_sat's clamp never acts, so the conversion alone gives its codes.
template <class R>
EPCOMM_QUANT_INLINE void int8_token_t(R r, int64_t n, int8_t* q, float* scale) {
  const Loader<R> ld{r};
  const int64_t whole = n / kUnit * kUnit;
  uint32_t m = 0;
  if constexpr (Loader<R>::kRaw) {
    I mv = V::set(0);
    for (int64_t b = 0; b < whole; b += 2 * kW) mv = V::max_u16(mv, V::abs16(V::load_raw(r.src.p + b)));
    m = V::hmax16(mv);
  } else {
    I mv = V::set(0);
    for (int64_t b = 0; b < whole; b += kUnit) {
      F v[4];
      ld.unit(b, v);
      mv = V::max_u(mv, abs_max(v, 4));
    }
    m = V::hmax(mv);
  }
  const uint32_t t = amax_bits(r, whole, n);
  m = m > t ? m : t;
  const float s = 127.0f / f32_from_bits(m);
  if (m >= kInfBits || m == 0 || f32_bits(s) == kInfBits) return kernels::int8_per_token_a3(r, n, q, scale);
  const F sv = V::setf(s);
  const I low = V::set(0xFFu);
  for (int64_t b = 0; b < whole; b += kUnit) {
    F v[4];
    I c[4];
    ld.unit(b, v);
    for (int k = 0; k < 4; ++k) c[k] = V::band(V::cvt_rne(V::mul(v[k], sv)), low);
    V::store_bytes(reinterpret_cast<uint8_t*>(q) + b, V::template pack_unit<Loader<R>::kInterleaved>(c));
  }
  for (int64_t i = whole; i < n; ++i) q[i] = int8_sat(r(i) * s, -127, 127);
  *scale = 1.0f / s;
}

void int8_per_token(DType in, const void* x, int64_t n, const Smoothing& c, int8_t* q, float* scale) {
  visit_row(in, x, c, [&](auto r) { int8_token_t(r, n, q, scale); });
}

template <class Fmt, bool kRceil, class R>
EPCOMM_QUANT_INLINE void mx_t(R r, int64_t n, uint8_t* codes, uint8_t* scales) {
  auto step = [scales](int64_t g, uint32_t m)
                  EPCOMM_QUANT_LAMBDA_INLINE { return mx_step<Fmt, kRceil>(m, scales + g); };
  if constexpr (std::is_same_v<Fmt, E2m1>) {
    int64_t b = grouped<Fmt, 32, true, true>(r, n, codes, step);
    mxfp4_quantize<kRceil>(Shifted<R>{r, b}, n - b, codes + b / 2, scales + b / 32);
  } else {
    scalar_groups<Fmt, 32>(r, grouped<Fmt, 32, true, false>(r, n, codes, step), n, codes, step);
  }
}

void mx(MxElem elem, ScaleRule rule, DType in, const void* x, int64_t n, uint8_t* codes, uint8_t* scales) {
  visit_row(in, x, Smoothing::none(), [&](auto r) {
    bool rc = rule == ScaleRule::rceil;
    switch (elem) {
      case MxElem::e4m3:
        return rc ? mx_t<E4m3, true>(r, n, codes, scales) : mx_t<E4m3, false>(r, n, codes, scales);
      case MxElem::e5m2:
        return rc ? mx_t<E5m2, true>(r, n, codes, scales) : mx_t<E5m2, false>(r, n, codes, scales);
      case MxElem::e2m1:
        return rc ? mx_t<E2m1, true>(r, n, codes, scales) : mx_t<E2m1, false>(r, n, codes, scales);
    }
  });
}

constexpr Fp8KernelSet kSet{
    V::kW == 16 ? "avx512" : "avx2", per_group128, per_token, per_group128_a3, mx, int8_per_token};
