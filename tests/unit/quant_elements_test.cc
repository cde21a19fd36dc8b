// unit/quant_elements_test.cc — every element conversion of docs/quant.md against the independent reference
// of support/quant_reference.h: exhaustive bf16-derived inputs (docs/quant.md), all codes decoded
// (docs/quant.md), monotonicity (docs/quant.md).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "quant/element.h"
#include "support/quant_reference.h"

namespace {

namespace q = epcomm::quant;
namespace ref = epcomm::testing::qref;
using epcomm::Saturation;

// docs/quant.md: all 65,536 bf16 patterns widened, plus every high half with twelve fixed low halves (ties,
// near-ties, double-rounding traps) and two random ones.
const std::vector<uint32_t>& exhaustive_inputs() {
  static const std::vector<uint32_t> inputs = [] {
    std::vector<uint32_t> v;
    const uint32_t lows[] = {0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x2FFF,
                             0x3000, 0x7FFF, 0x8000, 0x8001, 0xF000, 0xFFFF};
    std::mt19937 rng(20240917);
    v.reserve(65536 * 14);
    for (uint32_t hi = 0; hi < 65536; ++hi) {
      for (uint32_t lo : lows) v.push_back(hi << 16 | lo);
      v.push_back(hi << 16 | (rng() & 0xFFFF));
      v.push_back(hi << 16 | (rng() & 0xFFFF));
    }
    return v;
  }();
  return inputs;
}

std::string hex(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "%08x", v);
  return b;
}

// Compares lib(x) with want(x) for every exhaustive input; reports the first mismatches.
void check_all(const char* name, const std::function<uint32_t(float)>& lib,
               const std::function<uint32_t(float)>& want) {
  int bad = 0;
  for (uint32_t u : exhaustive_inputs()) {
    float x = ref::ffrom(u);
    uint32_t got = lib(x), exp = want(x);
    if (got != exp && ++bad <= 10)
      ADD_FAILURE() << name << "(0x" << hex(u) << "): got 0x" << hex(got) << ", want 0x" << hex(exp);
  }
  EXPECT_EQ(bad, 0) << name << ": mismatches";
}

TEST(quant_elements, ExhaustiveBf16) {
  check_all(
      "to_bf16", [](float x) { return q::to_bf16_bits(x); }, [](float x) { return ref::enc_bf16(x); });
}
TEST(quant_elements, ExhaustiveFp16) {
  check_all(
      "to_fp16", [](float x) { return q::to_fp16_bits(x); }, [](float x) { return ref::enc_fp16(x); });
}
TEST(quant_elements, ExhaustiveE4m3Sat) {
  check_all(
      "e4m3 sat", [](float x) { return q::encode_e4m3(x, Saturation::sat); },
      [](float x) { return ref::enc_e4m3(x, true); });
}
TEST(quant_elements, ExhaustiveE4m3Nosat) {
  check_all(
      "e4m3 nosat", [](float x) { return q::encode_e4m3(x, Saturation::nosat); },
      [](float x) { return ref::enc_e4m3(x, false); });
}
TEST(quant_elements, ExhaustiveE5m2Sat) {
  check_all(
      "e5m2 sat", [](float x) { return q::encode_e5m2(x, Saturation::sat); },
      [](float x) { return ref::enc_e5m2(x, true); });
}
TEST(quant_elements, ExhaustiveE5m2Nosat) {
  check_all(
      "e5m2 nosat", [](float x) { return q::encode_e5m2(x, Saturation::nosat); },
      [](float x) { return ref::enc_e5m2(x, false); });
}
TEST(quant_elements, ExhaustiveE2m1) {
  check_all(
      "e2m1", [](float x) { return q::encode_e2m1(x); }, [](float x) { return ref::enc_e2m1(x); });
}
TEST(quant_elements, ExhaustiveHif8Default) {
  check_all(
      "hif8", [](float x) { return q::encode_hif8(x); }, [](float x) { return ref::enc_hif8(x, false); });
}
TEST(quant_elements, ExhaustiveHif8Sat) {
  check_all(
      "hif8 sat", [](float x) { return q::encode_hif8(x, Saturation::sat); },
      [](float x) { return ref::enc_hif8(x, true); });
}
TEST(quant_elements, ExhaustiveE8m0Ceil) {
  // Defined for t >= 0; the library reads |t|.
  check_all(
      "e8m0_ceil", [](float x) { return q::e8m0_ceil(x); }, [](float x) { return ref::e8m0_ceil(x); });
}
TEST(quant_elements, ExhaustiveInt8Sat) {
  for (auto [lo, hi] : {std::pair{-127, 127}, std::pair{-128, 127}}) {
    check_all(
        "int8_sat",
        [lo, hi](float x) { return static_cast<uint32_t>(static_cast<uint8_t>(q::int8_sat(x, lo, hi))); },
        [lo, hi](float x) { return static_cast<uint32_t>(static_cast<uint8_t>(ref::int8_sat(x, lo, hi))); });
  }
  // Unclamped range with fractional parts: every multiple of 1/8 in [-130, 130].
  for (int k = -1040; k <= 1040; ++k) {
    float v = static_cast<float>(k) / 8;
    ASSERT_EQ(q::int8_sat(v, -128, 127), ref::int8_sat(v, -128, 127)) << v;
  }
}

// ---- docs/quant.md decoding ----

// Library decode vs the field formulas; NaN codes must give exactly the canonical 0x7FC00000.
void check_decode(const char* name, int ncodes, const std::function<float(uint32_t)>& lib,
                  const std::function<double(uint32_t)>& want) {
  for (int c = 0; c < ncodes; ++c) {
    float got = lib(static_cast<uint32_t>(c));
    double w = want(static_cast<uint32_t>(c));
    if (std::isnan(w)) {
      EXPECT_EQ(ref::fbits(got), 0x7FC00000u) << name << " code 0x" << hex(static_cast<uint32_t>(c));
    } else {
      EXPECT_EQ(ref::fbits(got), ref::fbits(static_cast<float>(w))) << name << " code 0x" << hex(c);
      EXPECT_EQ(static_cast<double>(got), w) << name << " code 0x" << hex(c) << " is not exact";
    }
  }
}

TEST(quant_elements, DecodeAllCodes) {
  check_decode(
      "e4m3", 256, [](uint32_t c) { return q::decode_e4m3(static_cast<uint8_t>(c)); },
      [](uint32_t c) { return ref::dec_e4m3(static_cast<uint8_t>(c)); });
  check_decode(
      "e5m2", 256, [](uint32_t c) { return q::decode_e5m2(static_cast<uint8_t>(c)); },
      [](uint32_t c) { return ref::dec_e5m2(static_cast<uint8_t>(c)); });
  check_decode(
      "hif8", 256, [](uint32_t c) { return q::decode_hif8(static_cast<uint8_t>(c)); },
      [](uint32_t c) { return ref::dec_hif8(static_cast<uint8_t>(c)); });
  check_decode(
      "e8m0", 256, [](uint32_t c) { return q::e8m0_decode(static_cast<uint8_t>(c)); },
      [](uint32_t c) { return ref::dec_e8m0(static_cast<uint8_t>(c)); });
  check_decode(
      "e2m1", 16, [](uint32_t c) { return q::decode_e2m1(static_cast<uint8_t>(c)); },
      [](uint32_t c) { return ref::dec_e2m1(static_cast<uint8_t>(c)); });
}

TEST(quant_elements, WidenAllBf16AndFp16) {
  for (uint32_t c = 0; c < 65536; ++c) {
    double wb = ref::dec_bf16(static_cast<uint16_t>(c)), wh = ref::dec_fp16(static_cast<uint16_t>(c));
    float gb = q::bf16_to_float(static_cast<uint16_t>(c)), gh = q::fp16_to_float(static_cast<uint16_t>(c));
    if (std::isnan(wb)) {
      EXPECT_TRUE(std::isnan(gb)) << hex(c);
    } else {
      ASSERT_EQ(static_cast<double>(gb), wb) << hex(c);
      EXPECT_EQ(std::signbit(gb), std::signbit(wb)) << hex(c);
      EXPECT_EQ(q::to_bf16_bits(gb), c);  // widening then narrowing is the identity
    }
    if (std::isnan(wh)) {
      EXPECT_TRUE(std::isnan(gh)) << hex(c);
    } else {
      ASSERT_EQ(static_cast<double>(gh), wh) << hex(c);
      EXPECT_EQ(std::signbit(gh), std::signbit(wh)) << hex(c);
      EXPECT_EQ(q::to_fp16_bits(gh), c);
    }
  }
}

TEST(quant_elements, EveryCodeReencodesToItself) {
  for (int c = 0; c < 256; ++c) {
    auto b = static_cast<uint8_t>(c);
    uint8_t e4 = q::encode_e4m3(q::decode_e4m3(b), Saturation::nosat);
    EXPECT_EQ(e4, (c & 0x7F) == 0x7F ? 0x7F : c) << "e4m3 " << hex(c);
    if ((c & 0x7F) != 0x7F) {
      EXPECT_EQ(q::encode_e4m3(q::decode_e4m3(b), Saturation::sat), c);
    }
    bool e5nan = (c & 0x7C) == 0x7C && (c & 3) != 0;
    EXPECT_EQ(q::encode_e5m2(q::decode_e5m2(b), Saturation::nosat), e5nan ? 0x7E : c) << "e5m2 " << hex(c);
    EXPECT_EQ(q::encode_hif8(q::decode_hif8(b)), c) << "hif8 " << hex(c);
  }
  for (int c = 0; c < 16; ++c) EXPECT_EQ(q::encode_e2m1(q::decode_e2m1(static_cast<uint8_t>(c))), c);
  for (int s = 0; s <= 254; ++s) EXPECT_EQ(q::e8m0_ceil(q::e8m0_decode(static_cast<uint8_t>(s))), s);
  EXPECT_EQ(q::e8m0_ceil(q::e8m0_decode(0xFF)), 0xFF);
}

TEST(quant_elements, E8m0Reciprocal) {
  for (int s = 0; s < 255; ++s) {
    auto b = static_cast<uint8_t>(s);
    EXPECT_EQ(static_cast<double>(q::e8m0_reciprocal(b)), std::ldexp(1.0, 127 - s)) << s;
    if (s >= 1 && s <= 253) {
      EXPECT_EQ(q::e8m0_decode(b) * q::e8m0_reciprocal(b), 1.0f) << s;
    }
  }
  EXPECT_EQ(ref::fbits(q::e8m0_reciprocal(0xFF)), 0x7FC00000u);
}

TEST(quant_elements, F4x2Packing) {
  for (int lo = 0; lo < 16; ++lo)
    for (int hi = 0; hi < 16; ++hi) {
      uint8_t b = q::pack_f4x2(static_cast<uint8_t>(lo), static_cast<uint8_t>(hi));
      EXPECT_EQ(b, lo | hi << 4);  // element 2j in bits 3..0 (not the PTX order)
      EXPECT_EQ(q::f4x2_low(b), lo);
      EXPECT_EQ(q::f4x2_high(b), hi);
    }
}

// ---- docs/quant.md monotonicity ----

TEST(quant_elements, Monotone) {
  std::vector<float> xs;
  for (uint32_t u : exhaustive_inputs()) {
    float x = ref::ffrom(u);
    if (!std::isnan(x)) xs.push_back(x);
  }
  std::sort(xs.begin(), xs.end());
  // NaN results (e4m3 nosat overflow) stand for ±Inf by the input's sign.
  auto ord = [](double d, float x) { return std::isnan(d) ? (x < 0 ? -ref::kInf : ref::kInf) : d; };
  const std::vector<std::pair<const char*, std::function<double(float)>>> casts = {
      {"bf16", [](float x) { return ref::dec_bf16(q::to_bf16_bits(x)); }},
      {"fp16", [](float x) { return ref::dec_fp16(q::to_fp16_bits(x)); }},
      {"e4m3 sat", [](float x) { return ref::dec_e4m3(q::encode_e4m3(x, Saturation::sat)); }},
      {"e4m3 nosat", [](float x) { return ref::dec_e4m3(q::encode_e4m3(x, Saturation::nosat)); }},
      {"e5m2 sat", [](float x) { return ref::dec_e5m2(q::encode_e5m2(x, Saturation::sat)); }},
      {"e5m2 nosat", [](float x) { return ref::dec_e5m2(q::encode_e5m2(x, Saturation::nosat)); }},
      {"e2m1", [](float x) { return ref::dec_e2m1(q::encode_e2m1(x)); }},
      {"hif8", [](float x) { return ref::dec_hif8(q::encode_hif8(x)); }},
      {"hif8 sat", [](float x) { return ref::dec_hif8(q::encode_hif8(x, Saturation::sat)); }},
      {"int8", [](float x) { return static_cast<double>(q::int8_sat(x, -128, 127)); }},
  };
  for (auto& [name, f] : casts) {
    double prev = -ref::kInf;
    for (float x : xs) {
      double d = ord(f(x), x);
      ASSERT_GE(d, prev) << name << " not monotone at 0x" << hex(ref::fbits(x));
      prev = d;
    }
  }
}

// ---- opt-in: the full 2^32 sweep of to_bf16 / to_fp16 (EPCOMM_QUANT_LONG_TESTS=1) ----

TEST(quant_elements, FullSweepBf16Fp16Long) {
  const char* env = std::getenv("EPCOMM_QUANT_LONG_TESTS");
  if (!env || std::string(env) != "1") GTEST_SKIP() << "set EPCOMM_QUANT_LONG_TESTS=1 to run the 2^32 sweep";
  uint64_t bad = 0;
  for (uint64_t i = 0; i <= 0xFFFFFFFFull; ++i) {
    uint32_t u = static_cast<uint32_t>(i);
    float x = ref::ffrom(u);
    // fp16: the compiler's own conversion (GCC soft-float / F16C), canonical NaN aside.
    _Float16 h = static_cast<_Float16>(x);
    uint16_t hb;
    std::memcpy(&hb, &h, 2);
    uint16_t want_h = std::isnan(x) ? 0x7E00 : hb;
    // bf16: scale to an integer grid and round with nearbyint (the default RNE mode), in double.
    uint16_t want_b;
    if (std::isnan(x)) {
      want_b = 0x7FC0;
    } else if (std::isinf(x)) {
      want_b = static_cast<uint16_t>(u >> 16);
    } else {
      int ex;
      std::frexp(static_cast<double>(x), &ex);
      int step = std::max(ex - 8, -133);  // bf16 has 8 significant bits; subnormal step 2^-133
      double r = std::ldexp(std::nearbyint(std::ldexp(static_cast<double>(x), -step)), step);
      float rf = std::fabs(r) >= std::ldexp(1.0, 128) ? std::copysign(INFINITY, static_cast<float>(r))
                                                      : static_cast<float>(r);
      if (r == 0) rf = std::copysign(0.0f, x);
      want_b = static_cast<uint16_t>(ref::fbits(rf) >> 16);
    }
    if (q::to_fp16_bits(x) != want_h && ++bad < 10) {
      ADD_FAILURE() << "to_fp16 " << hex(u);
    }
    if (q::to_bf16_bits(x) != want_b && ++bad < 10) {
      ADD_FAILURE() << "to_bf16 " << hex(u);
    }
  }
  EXPECT_EQ(bad, 0u);
}

}  // namespace
