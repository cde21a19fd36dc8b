// unit/quant_blocks_test.cc — property tests of every block quantizer (docs/quant.md): 10^4 random and
// adversarial rows each, the docs/quant.md round-trip bounds, the docs/quant.md structure and special cases,
// and bit equality with the scalar reference of support/quant_reference.h (which also makes it a
// vectorized-vs-scalar check).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "quant/block.h"
#include "quant/element.h"
#include "support/quant_reference.h"

namespace {

namespace q = epcomm::quant;
namespace ref = epcomm::testing::qref;
using epcomm::DType;
using q::Fp8Format;
using q::MxElem;
using q::ScaleRule;
using q::Smoothing;

constexpr int kRows = 10000;
const int64_t kHs[] = {32, 128, 136, 1000, 4096, 7168};

// ---- row generation ----

struct Rng {
  uint64_t s;
  uint64_t next() {  // splitmix64
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1p-53; }
  int range(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1)); }
  // Approximately standard normal (Irwin-Hall of 4 uniforms): cheap, bell-shaped, unbounded enough.
  double normal() { return (uniform() + uniform() + uniform() + uniform() - 2.0) * 1.7320508; }
};

enum Kind {
  kNormal,     // scaled normals, amax in [2^-60, 2^60]
  kOutlier,    // normals plus one value 2^6..2^12 times larger
  kTies,       // half-integers on a power-of-two grid with amax = 127 * 2^k: exact int8 ties
  kSparse,     // normals with about half the elements ±0
  kWide,       // every element at its own random scale 2^-60..2^60
  kZeros,      // all ±0
  kSubnormal,  // fp32-subnormal bf16 values only (degenerate for the per-token family)
  kNan,        // kNormal with one NaN
  kInf,        // kNormal with one +Inf or −Inf
  kHuge,       // kNormal at scale 2^60..2^126 (only the MX bounds apply)
  kNumKinds
};

struct TestRow {
  int64_t H;
  Kind kind;
  std::vector<uint16_t> x;  // bf16 bits
};

// Test data only needs bf16 values, not a particular rounding: truncate (exact for the values that matter).
uint16_t bf(double v) {
  return static_cast<uint16_t>(ref::fbits(static_cast<float>(v)) >> 16);
}

TestRow make_row(int i, Rng& rng) {
  TestRow r;
  r.H = kHs[i % 6];
  r.kind = static_cast<Kind>((i / 6) % kNumKinds);
  r.x.resize(static_cast<size_t>(r.H));
  const size_t n = r.x.size();
  double scale = std::ldexp(1.0, rng.range(-60, 52));
  switch (r.kind) {
    case kTies: {
      int k = rng.range(-40, 40);
      for (auto& v : r.x) v = bf(std::ldexp((rng.range(-254, 254)) / 2.0, k));
      r.x[rng.next() % n] = bf(std::ldexp(rng.range(0, 1) ? 127.0 : -127.0, k));
      break;
    }
    case kZeros:
      for (auto& v : r.x) v = rng.range(0, 1) ? 0x8000 : 0x0000;
      break;
    case kSubnormal:
      for (auto& v : r.x) v = static_cast<uint16_t>(rng.range(0, 0x7F) | (rng.range(0, 1) << 15));
      break;
    case kWide:
      for (auto& v : r.x) v = bf(rng.normal() * std::ldexp(1.0, rng.range(-60, 60)));
      break;
    case kHuge:
      scale = std::ldexp(1.0, rng.range(60, 124));
      for (auto& v : r.x) v = bf(rng.normal() * scale);
      break;
    default:
      for (auto& v : r.x) v = bf(rng.normal() * scale);
      break;
  }
  if (r.kind == kOutlier) r.x[rng.next() % n] = bf(scale * std::ldexp(rng.normal() + 3, rng.range(6, 12)));
  if (r.kind == kSparse)
    for (auto& v : r.x)
      if (rng.range(0, 1)) v = rng.range(0, 1) ? 0x8000 : 0x0000;
  if (r.kind == kNan) r.x[static_cast<size_t>(i * 7) % n] = rng.range(0, 1) ? 0x7FC0 : 0xFFC1;
  if (r.kind == kInf) r.x[static_cast<size_t>(i * 13) % n] = rng.range(0, 1) ? 0x7F80 : 0xFF80;
  return r;
}

const std::vector<TestRow>& rows() {
  static const std::vector<TestRow> all = [] {
    std::vector<TestRow> v;
    Rng rng{0xC0FFEE};
    for (int i = 0; i < kRows; ++i) v.push_back(make_row(i, rng));
    return v;
  }();
  return all;
}

// The reference is slow: compare every short row and one in eight of the long ones.
bool check_ref(size_t i, const TestRow& r) {
  return r.H <= 136 || i % 8 == 0;
}

// bf16 -> fp32 is exact: the bf16 bits are the upper half of the fp32 bits.
std::vector<float> widen(const std::vector<uint16_t>& x) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = ref::ffrom(static_cast<uint32_t>(x[i]) << 16);
  return f;
}

bool finite_all(const float* x, size_t n) {
  return ref::all_finite(x, n);
}
double amax_d(const float* x, size_t n) {
  return ref::amax_of(x, n);
}
bool in_domain(double amax) {
  return amax >= std::ldexp(1.0, -60) && amax <= std::ldexp(1.0, 60);
}
uint32_t B(float f) {
  return ref::fbits(f);
}

// Collects failures without flooding the log.
struct Failures {
  std::string algo;
  int count = 0;
  template <class... A>
  void add(size_t row, int64_t H, A&&... what) {
    if (++count <= 8) {
      std::ostringstream os;
      (os << ... << what);
      ADD_FAILURE() << algo << " row " << row << " (H=" << H << "): " << os.str();
    }
  }
  ~Failures() { EXPECT_EQ(count, 0) << algo << ": failures"; }
};

// ---- int8 per token ----

void int8_per_token_test(bool a3) {
  Failures f{a3 ? "int8_per_token_a3" : "int8_per_token_950"};
  auto lib = a3 ? q::int8_per_token_a3 : q::int8_per_token_950;
  auto refq = a3 ? ref::int8_a3 : ref::int8_950;
  const auto& all = rows();
  for (size_t ri = 0; ri < all.size(); ++ri) {
    const TestRow& r = all[ri];
    const size_t n = r.x.size();
    std::vector<int8_t> qv(n);
    float scale;
    lib(DType::bf16, r.x.data(), r.H, Smoothing::none(), qv.data(), &scale);
    std::vector<float> xf = widen(r.x);
    if (!finite_all(xf.data(), n)) {
      if (B(scale) != 0x7FC00000u) f.add(ri, r.H, "non-finite row: scale ", B(scale));
      for (size_t i = 0; i < n; ++i)
        if (qv[i] != 0) f.add(ri, r.H, "non-finite row: q[", i, "] = ", int(qv[i]));
      continue;
    }
    double amax = amax_d(xf.data(), n);
    if (amax == 0 && B(scale) != 0) f.add(ri, r.H, "zero row: scale ", scale);
    if (in_domain(amax)) {
      for (size_t i = 0; i < n; ++i) {
        double x = xf[i], xh = static_cast<double>(static_cast<float>(qv[i]) * scale);
        if (std::fabs(x - xh) > (0.5 + std::ldexp(1.0, -12)) * scale)
          f.add(ri, r.H, "bound at ", i, ": x=", x, " q=", int(qv[i]));
        if (std::fabs(x) == amax && std::abs(qv[i]) != 127) f.add(ri, r.H, "|q| != 127 at amax, element ", i);
      }
      if (!a3 && B(scale) != B(static_cast<float>(amax) * (1.0f / 127.0f))) f.add(ri, r.H, "950 scale");
    }
    if (check_ref(ri, r)) {
      std::vector<uint8_t> rq(n);
      float rs;
      refq(xf.data(), n, rq.data(), &rs);
      if (B(rs) != B(scale)) f.add(ri, r.H, "scale ", B(scale), " != reference ", B(rs));
      if (std::memcmp(rq.data(), qv.data(), n) != 0) f.add(ri, r.H, "codes differ from the reference");
    }
  }
}

TEST(quant_blocks, Int8PerTokenA3) {
  int8_per_token_test(true);
}
TEST(quant_blocks, Int8PerToken950) {
  int8_per_token_test(false);
}

// ---- fp8 bound helpers ----

struct Fmt {
  int m, emin, emax;
  double M;
};
Fmt fmt_of(MxElem e) {
  switch (e) {
    case MxElem::e4m3:
      return {3, -6, 8, 448};
    case MxElem::e5m2:
      return {2, -14, 15, 57344};
    case MxElem::e2m1:
      return {1, 0, 2, 6};
  }
  return {};
}
Fmt fmt_of(Fp8Format f) {
  return fmt_of(f == Fp8Format::e4m3 ? MxElem::e4m3 : MxElem::e5m2);
}
float decode(MxElem e, uint8_t c) {
  return static_cast<float>(e == MxElem::e4m3   ? ref::dec_e4m3(c)
                            : e == MxElem::e5m2 ? ref::dec_e5m2(c)
                                                : ref::dec_e2m1(c));
}
double fp_bound(const Fmt& ft, double x, double S) {
  return std::ldexp(std::fabs(x), -(ft.m + 1)) * (1 + std::ldexp(1.0, -20)) +
         std::ldexp(S, ft.emin - ft.m - 1);
}

// ---- fp8 per token ----

void fp8_per_token_test(Fp8Format fmt) {
  const bool e4 = fmt == Fp8Format::e4m3;
  Failures f{e4 ? "fp8_per_token e4m3" : "fp8_per_token e5m2"};
  const Fmt ft = fmt_of(fmt);
  const MxElem el = e4 ? MxElem::e4m3 : MxElem::e5m2;
  const auto& all = rows();
  for (size_t ri = 0; ri < all.size(); ++ri) {
    const TestRow& r = all[ri];
    const size_t n = r.x.size();
    std::vector<uint8_t> c(n);
    float scale;
    q::fp8_per_token(fmt, DType::bf16, r.x.data(), r.H, Smoothing::none(), c.data(), &scale);
    std::vector<float> xf = widen(r.x);
    if (!finite_all(xf.data(), n)) {
      if (B(scale) != 0x7FC00000u) f.add(ri, r.H, "non-finite row: scale");
      for (size_t i = 0; i < n; ++i)
        if (c[i] != (e4 ? 0x7F : 0x7E)) f.add(ri, r.H, "non-finite row: code ", i);
      continue;
    }
    double amax = amax_d(xf.data(), n);
    if (in_domain(amax)) {
      for (size_t i = 0; i < n; ++i) {
        double x = xf[i], xh = static_cast<double>(decode(el, c[i]) * scale);
        if (std::fabs(x - xh) > fp_bound(ft, x, scale)) f.add(ri, r.H, "bound at ", i, ": x=", x, " x^=", xh);
      }
    }
    if (check_ref(ri, r)) {
      std::vector<uint8_t> rc(n);
      float rs;
      ref::fp8_token(e4, xf.data(), n, rc.data(), &rs);
      if (B(rs) != B(scale)) f.add(ri, r.H, "scale differs from the reference");
      if (rc != c) f.add(ri, r.H, "codes differ from the reference");
    }
  }
}

TEST(quant_blocks, Fp8PerTokenE4m3) {
  fp8_per_token_test(Fp8Format::e4m3);
}
TEST(quant_blocks, Fp8PerTokenE5m2) {
  fp8_per_token_test(Fp8Format::e5m2);
}

// ---- fp8 per group (DeepEP and _a3) ----

void fp8_group_test(Fp8Format fmt, int variant) {  // 0 plain, 1 pow2, 2 pow2 + ue8m0, 3 _a3
  const bool e4 = fmt == Fp8Format::e4m3;
  const char* names[] = {"", " pow2", " ue8m0", " _a3"};
  Failures f{std::string("fp8_per_group128") + (e4 ? " e4m3" : " e5m2") + names[variant]};
  const Fmt ft = fmt_of(fmt);
  const MxElem el = e4 ? MxElem::e4m3 : MxElem::e5m2;
  const auto& all = rows();
  for (size_t ri = 0; ri < all.size(); ++ri) {
    const TestRow& r = all[ri];
    const size_t n = r.x.size(), G = (n + 127) / 128;
    std::vector<uint8_t> c(n), bytes(G);
    std::vector<float> s(G);
    if (variant == 3)
      q::fp8_per_group128_a3(fmt, DType::bf16, r.x.data(), r.H, Smoothing::none(), c.data(), s.data());
    else if (variant == 2)
      q::fp8_per_group128(fmt, DType::bf16, r.x.data(), r.H, Smoothing::none(), c.data(), bytes.data(),
                          {true, true});
    else
      q::fp8_per_group128(fmt, DType::bf16, r.x.data(), r.H, Smoothing::none(), c.data(), s.data(),
                          {variant == 1, false});
    if (variant == 2)
      for (size_t g = 0; g < G; ++g) s[g] = static_cast<float>(ref::dec_e8m0(bytes[g]));
    std::vector<float> xf = widen(r.x);
    for (size_t g = 0; g < G; ++g) {
      size_t b = g * 128, e = std::min(n, b + 128);
      if (!finite_all(xf.data() + b, e - b)) {
        if (!std::isnan(s[g])) f.add(ri, r.H, "non-finite group ", g, ": scale not NaN");
        for (size_t i = b; i < e; ++i)
          if (c[i] != (e4 ? 0x7F : 0x7E)) f.add(ri, r.H, "non-finite group: code ", i);
        continue;
      }
      double amax = amax_d(xf.data() + b, e - b);
      if (variant == 3 && amax == 0 && B(s[g]) != 0) f.add(ri, r.H, "zero group ", g, ": scale not +0");
      if (variant != 3 && amax == 0)
        for (size_t i = b; i < e; ++i)
          if (c[i] != (std::signbit(xf[i]) ? 0x80 : 0x00))
            f.add(ri, r.H, "zero group: code not a signed zero");
      if (variant == 1 || variant == 2) {
        int ex;
        if (std::frexp(static_cast<double>(s[g]), &ex) != 0.5)
          f.add(ri, r.H, "pow2 scale ", s[g], " not a power of 2");
      }
      if (!in_domain(amax) && !(variant != 3 && amax < 1e-4)) continue;
      for (size_t i = b; i < e; ++i) {
        double x = xf[i], xh = static_cast<double>(decode(el, c[i]) * s[g]);
        if (std::fabs(x - xh) > fp_bound(ft, x, s[g])) f.add(ri, r.H, "bound at ", i, ": x=", x, " x^=", xh);
      }
    }
    if (check_ref(ri, r)) {
      ref::RefBlock rb =
          variant == 3 ? ref::fp8_group_a3(e4, xf) : ref::fp8_group128(e4, xf, variant >= 1, variant == 2);
      if (rb.codes != c) f.add(ri, r.H, "codes differ from the reference");
      for (size_t g = 0; g < G; ++g) {
        bool same = variant == 2 ? rb.bytes[g] == bytes[g] : B(rb.scales[g]) == B(s[g]);
        if (!same) f.add(ri, r.H, "scale ", g, " differs from the reference");
      }
    }
  }
}

TEST(quant_blocks, Fp8PerGroup128E4m3) {
  fp8_group_test(Fp8Format::e4m3, 0);
}
TEST(quant_blocks, Fp8PerGroup128E4m3Pow2) {
  fp8_group_test(Fp8Format::e4m3, 1);
}
TEST(quant_blocks, Fp8PerGroup128E4m3Ue8m0) {
  fp8_group_test(Fp8Format::e4m3, 2);
}
TEST(quant_blocks, Fp8PerGroup128E5m2) {
  fp8_group_test(Fp8Format::e5m2, 0);
}
TEST(quant_blocks, Fp8PerGroup128E5m2Pow2) {
  fp8_group_test(Fp8Format::e5m2, 1);
}
TEST(quant_blocks, Fp8PerGroup128A3E4m3) {
  fp8_group_test(Fp8Format::e4m3, 3);
}
TEST(quant_blocks, Fp8PerGroup128A3E5m2) {
  fp8_group_test(Fp8Format::e5m2, 3);
}

// ---- MX ----

void mx_test(MxElem el, ScaleRule rule) {
  const bool fp4 = el == MxElem::e2m1, rceil = rule == ScaleRule::rceil;
  const char* en[] = {"mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1"};
  Failures f{std::string(en[static_cast<int>(el)]) + (rceil ? " RCEIL" : " FLOOR")};
  const Fmt ft = fmt_of(el);
  const auto& all = rows();
  for (size_t ri = 0; ri < all.size(); ++ri) {
    const TestRow& r = all[ri];
    const size_t n = r.x.size(), nb = (n + 31) / 32;
    std::vector<uint8_t> c(fp4 ? n / 2 : n), s(nb);
    q::mx_quantize(el, rule, DType::bf16, r.x.data(), r.H, c.data(), s.data());
    std::vector<uint8_t> codes(n);
    for (size_t i = 0; i < n; ++i) codes[i] = fp4 ? ((c[i / 2] >> (i % 2 ? 4 : 0)) & 0xF) : c[i];
    std::vector<float> xf = widen(r.x);
    for (size_t b = 0; b < nb; ++b) {
      size_t lo = b * 32, hi = std::min(n, lo + 32);
      if (!finite_all(xf.data() + lo, hi - lo)) {
        if (s[b] != 0xFF) f.add(ri, r.H, "non-finite block ", b, ": scale ", int(s[b]));
        for (size_t i = lo; i < hi; ++i)
          if (codes[i] != (el == MxElem::e4m3 ? 0x7F : el == MxElem::e5m2 ? 0x7E : 0x0))
            f.add(ri, r.H, "NaN code");
        continue;
      }
      float amax = ref::amax_of(xf.data() + lo, hi - lo);
      int E = static_cast<int>(B(amax) >> 23);
      if (E == 0) {
        if (s[b] != 0) f.add(ri, r.H, "subnormal block ", b, ": scale ", int(s[b]));
        for (size_t i = lo; i < hi; ++i)
          if (codes[i] != 0) f.add(ri, r.H, "subnormal block: code ", i, " = ", int(codes[i]));
        continue;
      }
      if (!rceil && s[b] != std::max(E - ft.emax, 0)) f.add(ri, r.H, "FLOOR byte ", int(s[b]), " E ", E);
      double S = std::ldexp(1.0, s[b] - 127);
      if (rceil && !(S >= static_cast<double>(amax) / ft.M)) f.add(ri, r.H, "RCEIL scale below amax/M");
      if (rceil && s[b] > 0 && !(S / 2 < static_cast<double>(amax) / ft.M))
        f.add(ri, r.H, "RCEIL scale not minimal");
      if (std::fabs(amax) > std::ldexp(1.0, 126)) continue;
      for (size_t i = lo; i < hi; ++i) {
        double x = xf[i], xh = static_cast<double>(decode(el, codes[i])) * S;
        if (static_cast<double>(decode(el, codes[i]) * static_cast<float>(ref::dec_e8m0(s[b]))) != xh)
          f.add(ri, r.H, "dequantization not exact");
        if (!rceil && std::fabs(x) > ft.M * S) {
          if (std::fabs(xh) != ft.M * S || std::signbit(xh) != std::signbit(x))
            f.add(ri, r.H, "saturation value");
          if (!(std::fabs(x - xh) < (std::ldexp(1.0, ft.emax + 1) - ft.M) * S))
            f.add(ri, r.H, "saturated bound");
        } else if (std::fabs(x - xh) > fp_bound(ft, x, S)) {
          f.add(ri, r.H, "bound at ", i, ": x=", x, " x^=", xh);
        }
      }
    }
    if (check_ref(ri, r)) {
      ref::RefBlock rb = ref::mx(static_cast<int>(el), rceil, xf);
      if (rb.codes != c) f.add(ri, r.H, "codes differ from the reference");
      if (rb.bytes != s) f.add(ri, r.H, "scales differ from the reference");
    }
  }
}

TEST(quant_blocks, MxFp8E4m3Floor) {
  mx_test(MxElem::e4m3, ScaleRule::floor);
}
TEST(quant_blocks, MxFp8E4m3Rceil) {
  mx_test(MxElem::e4m3, ScaleRule::rceil);
}
TEST(quant_blocks, MxFp8E5m2Floor) {
  mx_test(MxElem::e5m2, ScaleRule::floor);
}
TEST(quant_blocks, MxFp8E5m2Rceil) {
  mx_test(MxElem::e5m2, ScaleRule::rceil);
}
TEST(quant_blocks, MxFp4E2m1Floor) {
  mx_test(MxElem::e2m1, ScaleRule::floor);
}
TEST(quant_blocks, MxFp4E2m1Rceil) {
  mx_test(MxElem::e2m1, ScaleRule::rceil);
}

// ---- static ----

// A power-of-two factor that maps the row's amax to about 2^target (exact, so xf = x * c).
float pow2_toward(const std::vector<float>& xf, int target) {
  double amax = 0;
  for (float v : xf)
    if (std::isfinite(v)) amax = std::max(amax, std::fabs(static_cast<double>(v)));
  if (amax == 0) return 1.0f;
  int ex;
  std::frexp(amax, &ex);
  return std::ldexp(1.0f, std::clamp(target - ex, -126, 127));
}

TEST(quant_blocks, Int8Static) {
  Failures f{"int8_static"};
  const auto& all = rows();
  for (size_t ri = 0; ri < all.size(); ++ri) {
    const TestRow& r = all[ri];
    const size_t n = r.x.size();
    std::vector<float> x = widen(r.x);
    float c = pow2_toward(x, static_cast<int>(ri % 10));  // amax up to 2^10: exercises saturation
    std::vector<int8_t> qv(n);
    q::int8_static(DType::bf16, r.x.data(), r.H, Smoothing::scalar(c), qv.data());
    for (size_t i = 0; i < n; ++i) {
      float xf = x[i] * c;
      int want = ref::int8_sat(xf, -128, 127);
      if (qv[i] != want) f.add(ri, r.H, "element ", i, ": ", int(qv[i]), " != ", want);
      if (std::isfinite(xf) && xf >= -128.5f && xf <= 127.5f &&
          std::fabs(static_cast<double>(xf) - qv[i]) > 0.5)
        f.add(ri, r.H, "bound at ", i);
    }
  }
}

TEST(quant_blocks, Hif8Static) {
  Failures f{"hif8_static"};
  const auto& all = rows();
  for (size_t ri = 0; ri < all.size(); ++ri) {
    const TestRow& r = all[ri];
    const size_t n = r.x.size();
    std::vector<float> x = widen(r.x);
    float c = pow2_toward(x, static_cast<int>(ri % 40) - 22);  // amax 2^-22 .. 2^17
    std::vector<uint8_t> codes(n);
    q::hif8_static(DType::bf16, r.x.data(), r.H, Smoothing::scalar(c), codes.data());
    for (size_t i = 0; i < n; ++i) {
      float xf = x[i] * c;
      uint8_t want = ref::enc_hif8(xf, true);
      if (codes[i] != want) f.add(ri, r.H, "element ", i, ": ", int(codes[i]), " != ", int(want));
      double ax = std::fabs(static_cast<double>(xf)), xh = ref::dec_hif8(codes[i]);
      if (!std::isfinite(xf) || ax >= 40960) continue;
      double err = std::fabs(static_cast<double>(xf) - xh);
      if (ax < std::ldexp(1.0, -22)) {
        if (err > std::ldexp(1.0, -23)) f.add(ri, r.H, "tiny bound at ", i);
        continue;
      }
      int e = static_cast<int>(B(xf) >> 23 & 0xFF) - 127, ae = std::abs(e);
      int nb = e <= -16 ? 0 : ae >= 8 ? 1 : ae >= 4 ? 2 : 3;
      if (err > std::ldexp(1.0, e - nb - 1)) f.add(ri, r.H, "bound at ", i, ": x=", xf, " x^=", xh);
    }
  }
}

// ---- smoothing and input dtypes ----

// Every per-token/per-group algorithm with vector and scalar smoothing and with f32/f16 input, against the
// reference on the short rows.
TEST(quant_blocks, SmoothingAndInputDtypes) {
  Failures f{"smoothing/dtypes"};
  const auto& all = rows();
  Rng rng{77};
  for (size_t ri = 0; ri < all.size(); ri += 3) {
    const TestRow& r = all[ri];
    if (r.H > 1000) continue;
    const size_t n = r.x.size();
    std::vector<float> cvec(n);
    for (auto& v : cvec) v = static_cast<float>(0.5 + 1.5 * rng.uniform());
    const float cs = 0.75f;
    // Inputs: bf16, its exact f32 widening, and its fp16 rounding.
    std::vector<float> x32 = widen(r.x);
    std::vector<uint16_t> x16(n);
    for (size_t i = 0; i < n; ++i) x16[i] = ref::enc_fp16(x32[i]);
    struct In {
      DType dt;
      const void* p;
      std::vector<float> xf;
    };
    std::vector<float> x16f(n);
    for (size_t i = 0; i < n; ++i) x16f[i] = static_cast<float>(ref::dec_fp16(x16[i]));
    const In ins[] = {
        {DType::bf16, r.x.data(), x32}, {DType::f32, x32.data(), x32}, {DType::f16, x16.data(), x16f}};
    for (const In& in : ins) {
      for (int sk = 0; sk < 3; ++sk) {
        Smoothing sm = sk == 0   ? Smoothing::none()
                       : sk == 1 ? Smoothing::scalar(cs)
                                 : Smoothing::vector(cvec.data());
        std::vector<float> xf(n);
        for (size_t i = 0; i < n; ++i) xf[i] = sk == 0 ? in.xf[i] : in.xf[i] * (sk == 1 ? cs : cvec[i]);
        std::vector<uint8_t> c(n), rc(n);
        float s, rs;
        q::int8_per_token_a3(in.dt, in.p, r.H, sm, reinterpret_cast<int8_t*>(c.data()), &s);
        ref::int8_a3(xf.data(), n, rc.data(), &rs);
        if (c != rc || B(s) != B(rs))
          f.add(ri, r.H, "int8_per_token_a3 dtype ", int(in.dt), " smoothing ", sk);
        q::int8_per_token_950(in.dt, in.p, r.H, sm, reinterpret_cast<int8_t*>(c.data()), &s);
        ref::int8_950(xf.data(), n, rc.data(), &rs);
        if (c != rc || B(s) != B(rs))
          f.add(ri, r.H, "int8_per_token_950 dtype ", int(in.dt), " smoothing ", sk);
        q::fp8_per_token(Fp8Format::e4m3, in.dt, in.p, r.H, sm, c.data(), &s);
        ref::fp8_token(true, xf.data(), n, rc.data(), &rs);
        if (c != rc || B(s) != B(rs)) f.add(ri, r.H, "fp8_per_token dtype ", int(in.dt), " smoothing ", sk);
        std::vector<float> gs((n + 127) / 128);
        q::fp8_per_group128(Fp8Format::e4m3, in.dt, in.p, r.H, sm, c.data(), gs.data());
        ref::RefBlock rb = ref::fp8_group128(true, xf, false, false);
        if (c != rb.codes || std::memcmp(gs.data(), rb.scales.data(), gs.size() * 4) != 0)
          f.add(ri, r.H, "fp8_per_group128 dtype ", int(in.dt), " smoothing ", sk);
        q::fp8_per_group128_a3(Fp8Format::e5m2, in.dt, in.p, r.H, sm, c.data(), gs.data());
        rb = ref::fp8_group_a3(false, xf);
        if (c != rb.codes || std::memcmp(gs.data(), rb.scales.data(), gs.size() * 4) != 0)
          f.add(ri, r.H, "fp8_per_group128_a3 dtype ", int(in.dt), " smoothing ", sk);
        q::int8_static(in.dt, in.p, r.H, sm, reinterpret_cast<int8_t*>(c.data()));
        for (size_t i = 0; i < n; ++i)
          if (static_cast<int8_t>(c[i]) != ref::int8_sat(xf[i], -128, 127)) f.add(ri, r.H, "int8_static ", i);
        if (sk == 0) {  // MX takes no smoothing
          std::vector<uint8_t> ms((n + 31) / 32);
          q::mx_quantize(MxElem::e4m3, ScaleRule::floor, in.dt, in.p, r.H, c.data(), ms.data());
          rb = ref::mx(0, false, xf);
          if (c != rb.codes || ms != rb.bytes) f.add(ri, r.H, "mxfp8_e4m3 dtype ", int(in.dt));
        }
      }
    }
  }
}

// ---- combine int8 groups of 8 ----

void group8_test(bool bf16) {
  Failures f{bf16 ? "int8_group8_combine bf16" : "int8_group8_combine f16"};
  const auto& all = rows();
  for (size_t ri = 0; ri < all.size(); ++ri) {
    const TestRow& r = all[ri];
    const size_t n = r.x.size(), G = (n + 7) / 8;
    std::vector<uint16_t> y(n);
    std::vector<float> yf(n), x = widen(r.x);
    // fp16 rows are moved into fp16's range first (amax about 2^-10 .. 2^15), then rounded to fp16.
    float c = bf16 ? 1.0f : pow2_toward(x, static_cast<int>(ri % 26) - 10);
    for (size_t i = 0; i < n; ++i) {
      y[i] = bf16 ? r.x[i] : q::to_fp16_bits(x[i] * c);  // data generation only
      yf[i] = static_cast<float>(bf16 ? ref::dec_bf16(y[i]) : ref::dec_fp16(y[i]));
    }
    std::vector<int8_t> qv(n);
    std::vector<uint16_t> sigma(G), dec(n);
    q::int8_group8_combine(bf16 ? DType::bf16 : DType::f16, y.data(), r.H, qv.data(), sigma.data());
    q::int8_group8_combine_dequant(bf16 ? DType::bf16 : DType::f16, qv.data(), sigma.data(), r.H, dec.data());
    if (check_ref(ri, r)) {
      ref::RefBlock rb = ref::group8_combine(bf16, yf);
      if (rb.half != sigma) f.add(ri, r.H, "sigma differs from the reference");
      if (std::memcmp(rb.codes.data(), qv.data(), n) != 0) f.add(ri, r.H, "codes differ from the reference");
    }
    auto widen_dt = [bf16](uint16_t h) { return bf16 ? ref::dec_bf16(h) : ref::dec_fp16(h); };
    for (size_t g = 0; g < G; ++g) {
      size_t b = g * 8, e = std::min(n, b + 8);
      if (!finite_all(yf.data() + b, e - b)) continue;
      float amax = ref::amax_of(yf.data() + b, e - b);
      double s32 = static_cast<double>(amax * (1.0f / 127.0f)), sg = widen_dt(sigma[g]);
      for (size_t i = b; i < e; ++i) {
        // The receiver's decode, recomputed: RNE_dt(fp32(q) * fp32(sigma)).
        if (check_ref(ri, r)) {
          float prod = static_cast<float>(qv[i]) * static_cast<float>(sg);
          uint16_t want = bf16 ? ref::enc_bf16(prod) : ref::enc_fp16(prod);
          if (dec[i] != want) f.add(ri, r.H, "dequant element ", i);
        }
        if (std::abs(qv[i]) > 127) f.add(ri, r.H, "|q| > 127");
        if (yf[i] == amax || yf[i] == -amax)
          if (s32 != 0 && std::abs(qv[i]) != 127) f.add(ri, r.H, "|q| != 127 at the group amax");
        if (s32 == 0 || !std::isfinite(widen_dt(dec[i]))) continue;
        double d = widen_dt(dec[i]);
        double ulp = std::ldexp(std::fabs(d) + 1e-300, bf16 ? -8 : -11);  // half an ulp of dt, generously
        double bound = 0.5 * s32 + 127 * std::fabs(sg - s32) + ulp + (bf16 ? 0 : std::ldexp(1.0, -25));
        if (std::fabs(static_cast<double>(yf[i]) - d) > bound) f.add(ri, r.H, "bound at ", i);
      }
    }
  }
}

TEST(quant_blocks, Int8Group8CombineBf16) {
  group8_test(true);
}
TEST(quant_blocks, Int8Group8CombineF16) {
  group8_test(false);
}

// ---- non-finite and degenerate units at every position (H = 136: two groups, five blocks, partial tails)
// ----

TEST(quant_blocks, SpecialValuesAtEveryPosition) {
  const int64_t H = 136;
  Rng rng{5};
  std::vector<float> base(H);
  for (auto& v : base) v = static_cast<float>(rng.normal());
  const float specials[] = {std::nanf(""), INFINITY, -INFINITY};
  for (int64_t p = 0; p < H; ++p) {
    for (float sp : specials) {
      std::vector<float> x = base;
      x[p] = sp;
      std::vector<uint8_t> c(H);
      float s1, s2[2];
      q::int8_per_token_a3(DType::f32, x.data(), H, Smoothing::none(), reinterpret_cast<int8_t*>(c.data()),
                           &s1);
      EXPECT_TRUE(std::isnan(s1));
      EXPECT_EQ(std::count(c.begin(), c.end(), 0), H);
      q::fp8_per_group128_a3(Fp8Format::e4m3, DType::f32, x.data(), H, Smoothing::none(), c.data(), s2);
      EXPECT_EQ(std::isnan(s2[0]), p < 128) << p;
      EXPECT_EQ(std::isnan(s2[1]), p >= 128) << p;
      q::fp8_per_group128(Fp8Format::e4m3, DType::f32, x.data(), H, Smoothing::none(), c.data(), s2);
      EXPECT_EQ(std::isnan(s2[0]), p < 128) << p;
      EXPECT_EQ(std::isnan(s2[1]), p >= 128) << p;
      uint8_t ms[5];
      q::mx_quantize(MxElem::e2m1, ScaleRule::floor, DType::f32, x.data(), H, c.data(), ms);
      for (int b = 0; b < 5; ++b) EXPECT_EQ(ms[b] == 0xFF, b == p / 32) << p;
      std::vector<uint16_t> y(H), sg(17);
      for (int64_t i = 0; i < H; ++i) y[i] = ref::enc_bf16(x[i]);
      q::int8_group8_combine(DType::bf16, y.data(), H, reinterpret_cast<int8_t*>(c.data()), sg.data());
      for (int g = 0; g < 17; ++g) EXPECT_EQ(sg[g] == 0x7FC0, g == p / 8) << p;
    }
    // A zero unit at p's group/block: the others keep their scales.
    std::vector<float> x = base;
    for (int64_t i = p / 8 * 8; i < p / 8 * 8 + 8; ++i) x[i] = 0;
    std::vector<uint16_t> y(H), sg(17);
    std::vector<int8_t> qv(H);
    for (int64_t i = 0; i < H; ++i) y[i] = ref::enc_bf16(x[i]);
    q::int8_group8_combine(DType::bf16, y.data(), H, qv.data(), sg.data());
    for (int g = 0; g < 17; ++g) EXPECT_EQ(sg[g] == 0, g == p / 8) << p;
  }
}

}  // namespace
