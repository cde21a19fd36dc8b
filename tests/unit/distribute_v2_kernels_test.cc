// unit/distribute_v2_kernels_test.cc — the arithmetic of combine_v2 (docs/distribute-v2.md) against
// the test reference: the fp16 TP sum rounded once, the bf16 TP sum, accumulation order, RMSNorm.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "engine/distribute_v2_kernels.h"
#include "support/ref_float.h"
#include "support/rng.h"
#include "support/v2_reference.h"

namespace epcomm::engine::v2 {
namespace {

using testing::SplitMix64;

bool is_nan16(uint16_t v) {
  return (v & 0x7C00) == 0x7C00 && (v & 0x3FF);
}

TEST(DistributeV2Kernels, Fp16ExactSumMatchesReference) {
  // Random pairs over every exponent difference, including subnormals, ties and overflow.
  SplitMix64 g(42);
  for (int i = 0; i < 2000000; ++i) {
    const uint16_t a = static_cast<uint16_t>(g.next()), b = static_cast<uint16_t>(g.next());
    if (is_nan16(a) || is_nan16(b)) continue;
    const uint16_t got = f16_round_exact_sum(a, b), want = testing::v2::ref_f16_exact_add(a, b);
    ASSERT_EQ(got, want) << std::hex << "a=0x" << a << " b=0x" << b;
  }
}

TEST(DistributeV2Kernels, Fp16ExactSumIsSingleRounding) {
  // 2048 + (1 + 2^-10) = 2049.0009765625 -> the nearest fp16 is 2050 (ulp 2 at 2048).
  EXPECT_EQ(f16_round_exact_sum(0x6800, 0x3C01), 0x6801);
  // 65504 + 16 = 65520: the tie between 65504 and 2^16 rounds to +Inf.
  EXPECT_EQ(f16_round_exact_sum(0x7BFF, 0x4C00), 0x7C00);
  // (-0) + (-0) = -0; x + (-x) = +0.
  EXPECT_EQ(f16_round_exact_sum(0x8000, 0x8000), 0x8000);
  EXPECT_EQ(f16_round_exact_sum(0x3C00, 0xBC00), 0x0000);
  // A value that needs more than fp32's 24 bits: 2^15 + 2^-24 (subnormal) rounds to 2^15.
  EXPECT_EQ(f16_round_exact_sum(0x7800, 0x0001), 0x7800);
}

TEST(DistributeV2Kernels, AccumulateOrderAndWeights) {
  // acc = ((+0 ⊕ a·w0) ⊕ b·w1) ⊕ c (unweighted), each product rounded to fp32 first.
  const int64_t H = 300;
  SplitMix64 g(7);
  std::vector<uint16_t> r0(H), r1(H), r2(H);
  for (int64_t h = 0; h < H; ++h) {
    r0[h] = testing::f32_to_bf16(static_cast<float>(g.unit() * 8 - 4));
    r1[h] = testing::f32_to_bf16(static_cast<float>(g.unit() * 1e-3));
    r2[h] = testing::f32_to_bf16(static_cast<float>(g.unit() * 1e4));
  }
  const uint8_t* rows[3] = {reinterpret_cast<uint8_t*>(r0.data()), reinterpret_cast<uint8_t*>(r1.data()),
                            reinterpret_cast<uint8_t*>(r2.data())};
  const float w[3] = {0.3f, 0.7f, 1.0f};
  const uint8_t weighted[3] = {1, 1, 0};
  std::vector<float> acc(H);
  accumulate_rows(DType::bf16, rows, w, weighted, 3, H, acc.data());
  for (int64_t h = 0; h < H; ++h) {
    volatile float p0 = testing::bf16_to_f32(r0[h]) * w[0];
    volatile float p1 = testing::bf16_to_f32(r1[h]) * w[1];
    volatile float s = 0.0f + p0;
    s = s + p1;
    s = s + testing::bf16_to_f32(r2[h]);
    EXPECT_EQ(testing::f32_bits(acc[h]), testing::f32_bits(s)) << "h=" << h;
  }
}

TEST(DistributeV2Kernels, RmsNormOnZeroRowGivesRsqrtEps) {
  // acc + residual = 0 everywhere: x = 0, rstd = 1/sqrt(eps), y = 0.
  const int64_t H = 16;
  std::vector<float> acc(H, 0.0f), scratch(H);
  std::vector<uint16_t> res(H, 0), gamma(H, 0x3F80), x(H, 0xFFFF), y(H, 0xFFFF);
  float rstd = 0;
  add_rms_norm_row(DType::bf16, acc.data(), reinterpret_cast<uint8_t*>(res.data()),
                   reinterpret_cast<uint8_t*>(gamma.data()), H, 0.25f, reinterpret_cast<uint8_t*>(x.data()),
                   reinterpret_cast<uint8_t*>(y.data()), &rstd, scratch.data());
  EXPECT_EQ(rstd, 2.0f);
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_EQ(x[h], 0);
    EXPECT_EQ(y[h], 0);
  }
}

}  // namespace
}  // namespace epcomm::engine::v2
