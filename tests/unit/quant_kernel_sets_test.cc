// unit/quant_kernel_sets_test.cc — every fp8/MX/int8 kernel set this CPU runs (quant/simd.h: AVX-512, AVX2,
// portable) against the portable loops, bit for bit, on adversarial rows: every input dtype and smoothing,
// lengths with partial groups and vector tails, groups that are NaN, ±Inf, zero, fp32-subnormal, below the
// 1e-4 floor, whose small elements land on fp8 subnormals, and random bit patterns (ties included).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "quant/block.h"
#include "quant/element.h"
#include "quant/simd.h"
#include "support/rng.h"

namespace {

namespace q = epcomm::quant;
using epcomm::DType;
using q::Fp8Format;
using q::Fp8KernelSet;
using q::MxElem;
using q::ScaleRule;
using q::Smoothing;

using Rng = epcomm::testing::SplitMix64;

float f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One element of a 32-element stretch of kind `kind` around binary exponent e (biased).
uint32_t element(Rng& rng, int kind, int e) {
  const uint32_t sign = static_cast<uint32_t>(rng.next() & 1) << 31;
  const uint32_t frac = static_cast<uint32_t>(rng.next()) & 0x7FFFFFu;
  switch (kind) {
    case 0:  // random bits: NaN, Inf, subnormal and everything else
      return static_cast<uint32_t>(rng.next());
    case 1:  // around 2^(e-127), mantissas with few bits set (exact ties after power-of-two scaling)
      return sign | (static_cast<uint32_t>(e - static_cast<int>(rng.below(4))) << 23) | (frac & 0x7F0000u);
    case 2:  // one large element, the rest 2^-10..2^-30 of it: fp8 subnormals and underflow
      return rng.below(32) == 0
                 ? sign | (static_cast<uint32_t>(e) << 23) | frac
                 : sign | (static_cast<uint32_t>(e - 10 - static_cast<int>(rng.below(20))) << 23) |
                       (frac & 0x7F8000u);
    case 3:  // ±0 and fp32 subnormals
      return rng.below(2) ? sign : sign | (frac >> rng.below(23));
    case 4:  // tiny normals: amax below the 1e-4 floor
      return sign | (static_cast<uint32_t>(100 + rng.below(20)) << 23) | frac;
    case 5: {  // one special value among normals
      const uint32_t specials[] = {0x7F800000u, 0xFF800000u, 0x7FC00000u,
                                   0x7F800001u, 0xFFC00001u, 0x7F7FFFFFu};
      return rng.below(32) == 0 ? specials[rng.below(6)] : sign | (static_cast<uint32_t>(e) << 23) | frac;
    }
    default:  // wide: each element at its own scale
      return sign | (static_cast<uint32_t>(1 + rng.below(253)) << 23) | frac;
  }
}

// A row of n values as fp32 bit patterns, kind chosen per 32 elements.
std::vector<uint32_t> adversarial_row(Rng& rng, int64_t n) {
  std::vector<uint32_t> v(static_cast<size_t>(n));
  for (int64_t b = 0; b < n; b += 32) {
    const int kind = static_cast<int>(rng.below(7));
    const int e = 20 + static_cast<int>(rng.below(210));
    for (int64_t i = b; i < n && i < b + 32; ++i) v[static_cast<size_t>(i)] = element(rng, kind, e);
  }
  return v;
}

// The row in dtype `dt` (bf16 and f16 by truncation / conversion of the bits; NaN payloads survive).
std::vector<uint8_t> as_dtype(const std::vector<uint32_t>& v, DType dt) {
  const size_t es = dt == DType::f32 ? 4 : 2;
  std::vector<uint8_t> out(v.size() * es + 64);
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t h = 0;
    if (dt == DType::f32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
      continue;
    }
    if (dt == DType::bf16)
      h = static_cast<uint16_t>(v[i] >> 16);
    else  // f16: a value from the bits' top half scaled into range, or the bits themselves (NaN/Inf, sNaN)
      h = static_cast<uint16_t>((v[i] & 0x7C000000u) == 0x7C000000u ? v[i] >> 16
                                                                    : q::to_fp16_bits(f32(v[i]) * 0x1p-100f));
    std::memcpy(out.data() + 2 * i, &h, 2);
  }
  return out;
}

const int64_t kLengths[] = {0,  1,   15,  16,  17,  31,  32,  33,   63,  64,
                            96, 127, 128, 129, 200, 256, 384, 1000, 7168};
const DType kDtypes[] = {DType::bf16, DType::f16, DType::f32};

// Runs `call(set, dtype, row, n, smoothing, out)` for every set and compares its output (codes then scales,
// 2n + 64 bytes) with the portable set's.
template <class Call>
void compare_sets(const std::string& what, uint64_t seed, bool smoothing, Call call) {
  const std::vector<Fp8KernelSet> sets = q::fp8_kernel_sets();
  const Fp8KernelSet portable = q::portable_fp8_kernels();
  Rng rng(seed);
  for (int rep = 0; rep < 6; ++rep)
    for (int64_t n : kLengths) {
      const std::vector<uint32_t> bits = adversarial_row(rng, n);
      std::vector<float> cvec(static_cast<size_t>(n) + 16);
      for (float& c : cvec)
        c = f32((static_cast<uint32_t>(110 + rng.below(34)) << 23) | (rng.next() & 0x7FFFFFu));
      const Smoothing all[] = {Smoothing::none(), Smoothing::scalar(cvec[0]), Smoothing::vector(cvec.data())};
      for (DType dt : kDtypes)
        for (int k = 0; k < (smoothing ? 3 : 1); ++k) {
          const std::vector<uint8_t> x = as_dtype(bits, dt);
          const size_t bytes = 2 * static_cast<size_t>(n) + 64;
          std::vector<uint8_t> want(bytes, 0xA5);
          call(portable, dt, x.data(), n, all[k], want.data());
          for (const Fp8KernelSet& s : sets) {
            std::vector<uint8_t> got(bytes, 0xA5);
            call(s, dt, x.data(), n, all[k], got.data());
            ASSERT_EQ(0, std::memcmp(got.data(), want.data(), bytes))
                << what << ": set " << s.name << ", dtype " << epcomm::dtype_name(dt) << ", n " << n
                << ", smoothing " << k << ", rep " << rep;
          }
        }
    }
}

TEST(QuantKernelSets, ListedBestFirstWithPortableLast) {
  std::vector<std::string> names;
  for (const Fp8KernelSet& s : q::fp8_kernel_sets()) names.push_back(s.name);
  std::vector<std::string> want;
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    want.push_back("avx512");
  if (__builtin_cpu_supports("x86-64-v3")) want.push_back("avx2");
#endif
  want.push_back("portable");
  EXPECT_EQ(want, names);
}

const char* fmt_name(Fp8Format f) {
  return f == Fp8Format::e4m3 ? "e4m3" : "e5m2";
}

TEST(QuantKernelSets, Fp8PerGroup128EveryVariant) {
  const q::Group128Options variants[] = {{false, false}, {true, false}, {true, true}};
  for (Fp8Format fmt : {Fp8Format::e4m3, Fp8Format::e5m2})
    for (const q::Group128Options& o : variants)
      // The scales at an odd offset after the codes (fp32 scales may sit unaligned in packed records).
      compare_sets(std::string("fp8_per_group128 ") + fmt_name(fmt) +
                       (o.ue8m0        ? " ue8m0"
                        : o.pow2_scale ? " pow2"
                                       : ""),
                   1 + o.pow2_scale + 2 * o.ue8m0, true,
                   [&](const Fp8KernelSet& s, DType dt, const void* x, int64_t n, const Smoothing& c,
                       uint8_t* out) { s.per_group128(fmt, dt, x, n, c, out, out + n + 1, o); });
}

TEST(QuantKernelSets, Fp8PerTokenAndPerGroup128A3) {
  for (Fp8Format fmt : {Fp8Format::e4m3, Fp8Format::e5m2}) {
    compare_sets(
        std::string("fp8_per_token ") + fmt_name(fmt), 10, true,
        [&](const Fp8KernelSet& s, DType dt, const void* x, int64_t n, const Smoothing& c, uint8_t* out) {
          float scale;
          s.per_token(fmt, dt, x, n, c, out, &scale);
          std::memcpy(out + n, &scale, 4);
        });
    compare_sets(
        std::string("fp8_per_group128_a3 ") + fmt_name(fmt), 11, true,
        [&](const Fp8KernelSet& s, DType dt, const void* x, int64_t n, const Smoothing& c, uint8_t* out) {
          std::vector<float> scales(static_cast<size_t>((n + 127) / 128));
          s.per_group128_a3(fmt, dt, x, n, c, out, scales.data());
          if (!scales.empty()) std::memcpy(out + n, scales.data(), 4 * scales.size());  // n = 0: none
        });
  }
}

TEST(QuantKernelSets, Int8PerTokenA3) {
  auto call = [](const Fp8KernelSet& s, DType dt, const void* x, int64_t n, const Smoothing& c,
                 uint8_t* out) {
    float scale;
    s.int8_per_token(dt, x, n, c, reinterpret_cast<int8_t*>(out), &scale);
    std::memcpy(out + n, &scale, 4);
  };
  compare_sets("int8_per_token_a3", 12, true, call);
  // Finite rows too (most long adversarial rows hold a NaN or an Inf, which the scalar loop handles): the
  // vector conversion on every length and dtype, ties to even included.
  const Fp8KernelSet portable = q::portable_fp8_kernels();
  Rng rng(13);
  for (int64_t n : kLengths)
    for (DType dt : kDtypes) {
      std::vector<uint32_t> bits = adversarial_row(rng, n);
      for (uint32_t& b : bits)
        if (((b >> 23) & 0xFF) == 0xFF) b &= ~(1u << 23);  // NaN / Inf -> a large finite value
      const std::vector<uint8_t> x = as_dtype(bits, dt);
      std::vector<uint8_t> want(static_cast<size_t>(n) + 4), got = want;
      call(portable, dt, x.data(), n, Smoothing::none(), want.data());
      for (const Fp8KernelSet& s : q::fp8_kernel_sets()) {
        call(s, dt, x.data(), n, Smoothing::none(), got.data());
        ASSERT_EQ(want, got) << "finite row: set " << s.name << ", dtype " << epcomm::dtype_name(dt) << ", n "
                             << n;
      }
    }
}

TEST(QuantKernelSets, MxEveryElementAndRule) {
  for (MxElem e : {MxElem::e4m3, MxElem::e5m2, MxElem::e2m1})
    for (ScaleRule rule : {ScaleRule::floor, ScaleRule::rceil})
      compare_sets(
          "mx " + std::to_string(static_cast<int>(e)) + (rule == ScaleRule::rceil ? " rceil" : " floor"),
          20 + static_cast<int>(e), false,
          [&](const Fp8KernelSet& s, DType dt, const void* x, int64_t n, const Smoothing&, uint8_t* out) {
            if (e == MxElem::e2m1 && n % 2) return;  // packed codes need an even length
            s.mx(e, rule, dt, x, n, out, out + n);
          });
}

}  // namespace
