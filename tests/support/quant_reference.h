// support/quant_reference.h — an independent, slow and obviously-correct model of docs/quant.md for tests:
// formats decoded from their field formulas, encoders that search the code grid, block quantizers as written.
#pragma once

// Shares no code with src/quant or epcomm/quant_element.h. Values are exact doubles (every format here fits);
// rounding compares x with the exact midpoint of its two neighbours on the grid, then applies the tie rule
// and the docs/quant.md specials explicitly. Not for speed: each encode is a binary search.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace epcomm::testing::qref {

inline uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float ffrom(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

// ---- decoders (field formulas) ----

// Generic IEEE-style: `ebits` exponent bits, `mbits` fraction bits, bias, with or without Inf/NaN encodings.
inline double dec_ieee(uint32_t code, int ebits, int mbits, int bias) {
  uint32_t sign = (code >> (ebits + mbits)) & 1u;
  uint32_t e = (code >> mbits) & ((1u << ebits) - 1);
  uint32_t m = code & ((1u << mbits) - 1);
  double v = e == 0
                 ? std::ldexp(static_cast<double>(m), 1 - bias - mbits)
                 : std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -mbits), static_cast<int>(e) - bias);
  return sign ? -v : v;
}
inline double dec_bf16(uint16_t c) {
  if (((c >> 7) & 0xFF) == 0xFF) return (c & 0x7F) ? kNan : ((c & 0x8000) ? -kInf : kInf);
  return dec_ieee(c, 8, 7, 127);
}
inline double dec_fp16(uint16_t c) {
  if (((c >> 10) & 0x1F) == 0x1F) return (c & 0x3FF) ? kNan : ((c & 0x8000) ? -kInf : kInf);
  return dec_ieee(c, 5, 10, 15);
}
inline double dec_e4m3(uint8_t c) {
  if ((c & 0x7F) == 0x7F) return kNan;  // no Inf in E4M3
  return dec_ieee(c, 4, 3, 7);
}
inline double dec_e5m2(uint8_t c) {
  if (((c >> 2) & 0x1F) == 0x1F) return (c & 3) ? kNan : ((c & 0x80) ? -kInf : kInf);
  return dec_ieee(c, 5, 2, 15);
}
inline double dec_e2m1(uint8_t c) {
  return dec_ieee(c & 0xF, 2, 1, 1);
}
inline double dec_e8m0(uint8_t s) {
  return s == 0xFF ? kNan : std::ldexp(1.0, static_cast<int>(s) - 127);
}
// HiFloat8 from the prefix table of docs/quant.md.
inline double dec_hif8(uint8_t c) {
  if (c == 0x80) return kNan;
  if (c == 0x00) return 0.0;
  double sg = (c & 0x80) ? -1.0 : 1.0;
  unsigned b = c & 0x7F;
  if (b == 0x6F) return sg * kInf;
  int e, n;
  unsigned f;
  if ((b & 0x60) == 0x60) {
    e = 8 + static_cast<int>((b >> 1) & 7), n = 1, f = b & 1;
    if (b & 0x10) e = -e;
  } else if ((b & 0x60) == 0x40) {
    e = 4 + static_cast<int>((b >> 2) & 3), n = 2, f = b & 3;
    if (b & 0x10) e = -e;
  } else if ((b & 0x60) == 0x20) {
    e = 2 + static_cast<int>((b >> 3) & 1), n = 3, f = b & 7;
    if (b & 0x10) e = -e;
  } else if ((b & 0x70) == 0x10) {
    e = (b & 0x08) ? -1 : 1, n = 3, f = b & 7;
  } else if ((b & 0x78) == 0x08) {
    e = 0, n = 3, f = b & 7;
  } else {
    return sg * std::ldexp(1.0, static_cast<int>(b) - 23);
  }
  return sg * std::ldexp(1.0 + std::ldexp(static_cast<double>(f), -n), e);
}

// ---- grids and rounding ----

struct Grid {
  std::vector<double> value;  // ascending, non-negative, finite
  std::vector<uint32_t> code;
  bool has_over = false;  // the next point past the largest finite value (an Inf or NaN slot)
  double over = 0;
  uint32_t over_code = 0;
};

// Collects the non-negative finite codes in [0, ncodes) whose decode is a number, sorted by value.
template <class Dec>
Grid make_grid(uint32_t ncodes, Dec dec, bool has_over, double over, uint32_t over_code) {
  std::vector<std::pair<double, uint32_t>> pts;
  for (uint32_t c = 0; c < ncodes; ++c) {
    double v = dec(c);
    if (std::isfinite(v) && !std::signbit(v)) pts.push_back({v, c});
  }
  std::sort(pts.begin(), pts.end());
  Grid g;
  for (auto& [v, c] : pts) {
    if (!g.value.empty() && g.value.back() == v) continue;
    g.value.push_back(v);
    g.code.push_back(c);
  }
  g.has_over = has_over, g.over = over, g.over_code = over_code;
  return g;
}

// Nearest grid code to ax >= 0 (finite). Ties: away from zero, or to the even code (the grid's codes have
// their significand LSB in bit 0). Past the last point: the over point's code, or the last code (saturate).
inline uint32_t round_on_grid(const Grid& g, double ax, bool tie_away) {
  size_t n = g.value.size();
  if (g.has_over && ax >= g.over) return g.over_code;
  size_t i = static_cast<size_t>(std::upper_bound(g.value.begin(), g.value.end(), ax) - g.value.begin()) - 1;
  if (g.value[i] == ax) return g.code[i];
  double hi;
  uint32_t hic;
  if (i + 1 < n) {
    hi = g.value[i + 1], hic = g.code[i + 1];
  } else if (g.has_over) {
    hi = g.over, hic = g.over_code;
  } else {
    return g.code[i];
  }
  double mid = (g.value[i] + hi) / 2;  // exact: both have few significant bits
  if (ax < mid) return g.code[i];
  if (ax > mid) return hic;
  if (tie_away) return hic;
  return (g.code[i] & 1u) == 0 ? g.code[i] : hic;
}

inline const Grid& bf16_grid() {
  static const Grid g = make_grid(
      0x8000, [](uint32_t c) { return dec_bf16(static_cast<uint16_t>(c)); }, true, std::ldexp(1.0, 128),
      0x7F80);
  return g;
}
inline const Grid& fp16_grid() {
  static const Grid g = make_grid(
      0x8000, [](uint32_t c) { return dec_fp16(static_cast<uint16_t>(c)); }, true, 65536.0, 0x7C00);
  return g;
}
inline const Grid& e4m3_grid() {
  static const Grid g = make_grid(
      0x80, [](uint32_t c) { return dec_e4m3(static_cast<uint8_t>(c)); }, true, 480.0, 0x7F);
  return g;
}
inline const Grid& e5m2_grid() {
  static const Grid g = make_grid(
      0x80, [](uint32_t c) { return dec_e5m2(static_cast<uint8_t>(c)); }, true, 65536.0, 0x7C);
  return g;
}
inline const Grid& e2m1_grid() {
  static const Grid g = make_grid(
      0x8, [](uint32_t c) { return dec_e2m1(static_cast<uint8_t>(c)); }, false, 0, 0);
  return g;
}
inline const Grid& hif8_grid() {
  static const Grid g = make_grid(
      0x80, [](uint32_t c) { return dec_hif8(static_cast<uint8_t>(c)); }, true, 49152.0, 0x6F);
  return g;
}

// ---- encoders with the docs/quant.md specials ----

inline uint16_t enc_bf16(float x) {
  if (std::isnan(x)) return 0x7FC0;
  uint16_t s = std::signbit(x) ? 0x8000 : 0;
  if (std::isinf(x)) return s | 0x7F80;
  return static_cast<uint16_t>(s | round_on_grid(bf16_grid(), std::fabs(static_cast<double>(x)), false));
}
inline uint16_t enc_fp16(float x) {
  if (std::isnan(x)) return 0x7E00;
  uint16_t s = std::signbit(x) ? 0x8000 : 0;
  if (std::isinf(x)) return s | 0x7C00;
  return static_cast<uint16_t>(s | round_on_grid(fp16_grid(), std::fabs(static_cast<double>(x)), false));
}
inline uint8_t enc_e4m3(float x, bool sat) {
  if (std::isnan(x)) return 0x7F;
  uint8_t s = std::signbit(x) ? 0x80 : 0;
  if (std::isinf(x)) return s | (sat ? 0x7E : 0x7F);
  uint32_t c = round_on_grid(e4m3_grid(), std::fabs(static_cast<double>(x)), false);
  if (sat && c > 0x7E) c = 0x7E;
  return static_cast<uint8_t>(s | c);
}
inline uint8_t enc_e5m2(float x, bool sat) {
  if (std::isnan(x)) return 0x7E;
  uint8_t s = std::signbit(x) ? 0x80 : 0;
  if (std::isinf(x)) return s | (sat ? 0x7B : 0x7C);
  uint32_t c = round_on_grid(e5m2_grid(), std::fabs(static_cast<double>(x)), false);
  if (sat && c > 0x7B) c = 0x7B;
  return static_cast<uint8_t>(s | c);
}
inline uint8_t enc_e2m1(float x) {
  if (std::isnan(x)) return 0;
  uint8_t s = std::signbit(x) ? 0x8 : 0;
  if (std::isinf(x)) return s | 7;
  return static_cast<uint8_t>(s | round_on_grid(e2m1_grid(), std::fabs(static_cast<double>(x)), false));
}
inline uint8_t enc_hif8(float x, bool sat) {
  if (std::isnan(x)) return 0x80;
  uint8_t s = std::signbit(x) ? 0x80 : 0;
  if (std::isinf(x)) return s | (sat ? 0x6E : 0x6F);
  uint32_t c = round_on_grid(hif8_grid(), std::fabs(static_cast<double>(x)), true);
  if (c == 0) return 0;  // no −0
  if (sat && c == 0x6F) c = 0x6E;
  return static_cast<uint8_t>(s | c);
}
inline uint8_t e8m0_ceil(float t) {
  if (!std::isfinite(t)) return 0xFF;
  double a = std::fabs(static_cast<double>(t));
  for (int s = 0; s <= 254; ++s)
    if (std::ldexp(1.0, s - 127) >= a) return static_cast<uint8_t>(s);
  return 254;
}
// Nearest integer, ties to even, computed in double.
inline double rne_int(double v) {
  double fl = std::floor(v), frac = v - fl;
  if (frac < 0.5) return fl;
  if (frac > 0.5) return fl + 1;
  return std::fmod(fl, 2.0) == 0 ? fl : fl + 1;
}
inline int int8_sat(float v, int lo, int hi) {
  if (std::isnan(v)) return 0;
  double r = std::isinf(v) ? static_cast<double>(v) : rne_int(v);
  return static_cast<int>(std::min<double>(std::max<double>(r, lo), hi));
}

// ---- block quantizers of docs/quant.md, written as the spec states them, on xf (fp32 values after
// smoothing) ----

struct RefBlock {
  std::vector<uint8_t> codes;  // int8 codes as their bytes; f4x2 packed
  std::vector<float> scales;   // fp32 scales (per token or per group)
  std::vector<uint8_t> bytes;  // e8m0 scales
  std::vector<uint16_t> half;  // combine sigma (bf16/f16 bits)
};

inline bool all_finite(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}
inline float amax_of(const float* x, size_t n) {
  float m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

inline void int8_a3(const float* x, size_t n, uint8_t* q, float* scale) {
  if (!all_finite(x, n)) {
    std::fill(q, q + n, 0);
    *scale = ffrom(0x7FC00000u);
    return;
  }
  float amax = amax_of(x, n);
  float s = 127.0f / amax;
  if (amax == 0 || std::isinf(s)) {
    std::fill(q, q + n, 0);
    *scale = 0;
    return;
  }
  for (size_t i = 0; i < n; ++i) q[i] = static_cast<uint8_t>(int8_sat(x[i] * s, -127, 127));
  *scale = 1.0f / s;
}

inline void int8_950(const float* x, size_t n, uint8_t* q, float* scale) {
  if (!all_finite(x, n)) {
    std::fill(q, q + n, 0);
    *scale = ffrom(0x7FC00000u);
    return;
  }
  float sc = amax_of(x, n) * (1.0f / 127.0f);
  if (sc == 0) {
    std::fill(q, q + n, 0);
    *scale = 0;
    return;
  }
  for (size_t i = 0; i < n; ++i) q[i] = static_cast<uint8_t>(int8_sat(x[i] / sc, -127, 127));
  *scale = sc;
}

// M = 448 (e4m3) or 57344 (e5m2).
inline uint8_t enc_fp8(bool e4m3, float v) {
  return e4m3 ? enc_e4m3(v, true) : enc_e5m2(v, true);
}

inline void fp8_token(bool e4m3, const float* x, size_t n, uint8_t* c, float* scale) {
  if (!all_finite(x, n)) {
    std::fill(c, c + n, e4m3 ? 0x7F : 0x7E);
    *scale = ffrom(0x7FC00000u);
    return;
  }
  float amax = amax_of(x, n);
  float d = (e4m3 ? 448.0f : 57344.0f) / amax;
  if (amax == 0 || std::isinf(d)) {
    std::fill(c, c + n, 0);
    *scale = 0;
    return;
  }
  for (size_t i = 0; i < n; ++i) c[i] = enc_fp8(e4m3, x[i] * d);
  *scale = 1.0f / d;
}

inline RefBlock fp8_group_a3(bool e4m3, const std::vector<float>& x) {
  RefBlock r;
  r.codes.resize(x.size());
  for (size_t b = 0; b < x.size(); b += 128) {
    float s;
    fp8_token(e4m3, x.data() + b, std::min<size_t>(128, x.size() - b), r.codes.data() + b, &s);
    r.scales.push_back(s);
  }
  return r;
}

inline RefBlock fp8_group128(bool e4m3, const std::vector<float>& x, bool pow2, bool ue8m0) {
  RefBlock r;
  r.codes.resize(x.size());
  const float M = e4m3 ? 448.0f : 57344.0f;
  for (size_t b = 0; b < x.size(); b += 128) {
    size_t len = std::min<size_t>(128, x.size() - b);
    if (!all_finite(x.data() + b, len)) {
      std::fill(r.codes.begin() + b, r.codes.begin() + b + len, e4m3 ? 0x7F : 0x7E);
      r.scales.push_back(ffrom(0x7FC00000u));
      r.bytes.push_back(0xFF);
      continue;
    }
    float a = std::max(1e-4f, amax_of(x.data() + b, len));
    float scale_inv = a * (1.0f / M);
    float d = M / a;
    int k = 0;
    if (pow2) {
      // k = ceil(log2 t): t = f * 2^ex with f in [0.5, 1).
      int ex;
      double f = std::frexp(static_cast<double>(scale_inv), &ex);
      k = f == 0.5 ? ex - 1 : ex;
      scale_inv = std::ldexp(1.0f, k);
      d = std::ldexp(1.0f, -k);
    }
    for (size_t i = b; i < b + len; ++i) r.codes[i] = enc_fp8(e4m3, x[i] * d);
    r.scales.push_back(scale_inv);
    r.bytes.push_back(static_cast<uint8_t>(k + 127));
  }
  (void)ue8m0;
  return r;
}

// MX: elem 0 = e4m3, 1 = e5m2, 2 = e2m1.
inline RefBlock mx(int elem, bool rceil, const std::vector<float>& x) {
  const int emax = elem == 0 ? 8 : elem == 1 ? 15 : 2;
  const float M = elem == 0 ? 448.0f : elem == 1 ? 57344.0f : 6.0f;
  const uint8_t nan_code = elem == 0 ? 0x7F : elem == 1 ? 0x7E : 0x0;
  std::vector<uint8_t> codes(x.size());
  RefBlock r;
  for (size_t b = 0; b < x.size(); b += 32) {
    size_t len = std::min<size_t>(32, x.size() - b);
    if (!all_finite(x.data() + b, len)) {
      std::fill(codes.begin() + b, codes.begin() + b + len, nan_code);
      r.bytes.push_back(0xFF);
      continue;
    }
    float amax = amax_of(x.data() + b, len);
    int E = static_cast<int>(fbits(amax) >> 23);
    if (E == 0) {
      std::fill(codes.begin() + b, codes.begin() + b + len, 0);
      r.bytes.push_back(0);
      continue;
    }
    int s = rceil ? e8m0_ceil(amax * (1.0f / M)) : std::max(E - emax, 0);
    float mul = static_cast<float>(std::ldexp(1.0, 127 - s));
    for (size_t i = b; i < b + len; ++i) {
      float v = x[i] * mul;
      codes[i] = elem == 0 ? enc_e4m3(v, true) : elem == 1 ? enc_e5m2(v, true) : enc_e2m1(v);
    }
    r.bytes.push_back(static_cast<uint8_t>(s));
  }
  if (elem == 2) {
    for (size_t j = 0; j + 1 < codes.size(); j += 2)
      r.codes.push_back(static_cast<uint8_t>((codes[j] & 0xF) | (codes[j + 1] << 4)));
  } else {
    r.codes = codes;
  }
  return r;
}

// Combine int8 in groups of 8 (docs/distribute-v2.md + docs/quant.md); bf16 or fp16 sigma.
inline RefBlock group8_combine(bool bf16, const std::vector<float>& y) {
  RefBlock r;
  r.codes.resize(y.size());
  for (size_t b = 0; b < y.size(); b += 8) {
    size_t len = std::min<size_t>(8, y.size() - b);
    if (!all_finite(y.data() + b, len)) {
      std::fill(r.codes.begin() + b, r.codes.begin() + b + len, 0);
      r.half.push_back(bf16 ? 0x7FC0 : 0x7E00);
      continue;
    }
    float s32 = amax_of(y.data() + b, len) * (1.0f / 127.0f);
    if (s32 == 0) {
      std::fill(r.codes.begin() + b, r.codes.begin() + b + len, 0);
      r.half.push_back(0);
      continue;
    }
    for (size_t i = b; i < b + len; ++i) r.codes[i] = static_cast<uint8_t>(int8_sat(y[i] / s32, -127, 127));
    r.half.push_back(bf16 ? enc_bf16(s32) : enc_fp16(s32));
  }
  return r;
}

}  // namespace epcomm::testing::qref
