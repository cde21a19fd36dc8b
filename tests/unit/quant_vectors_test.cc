// unit/quant_vectors_test.cc — every test vector of docs/quant.md, bit for bit, table-driven. Test names
// carry the vector's evidence tag: I (independent implementation), G (upstream golden), F (spec formulas).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant/block.h"
#include "quant/element.h"

namespace {

namespace q = epcomm::quant;
using epcomm::DType;
using epcomm::Saturation;
using q::Fp8Format;
using q::MxElem;
using q::ScaleRule;
using q::Smoothing;

float F(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t B(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// ---- docs/quant.md constants ----

TEST(quant_vectors, F_Constants) {
  EXPECT_EQ(B(1.0f / 127.0f), 0x3C010204u);
  EXPECT_EQ(B(1.0f / 448.0f), 0x3B124925u);
  EXPECT_EQ(B(1.0f / 57344.0f), 0x37924925u);
  EXPECT_EQ(B(1.0f / 6.0f), 0x3E2AAAABu);
  EXPECT_EQ(B(1e-4f), 0x38D1B717u);
}

// ---- docs/quant.md ----

struct Pair {
  uint32_t in, out;
};

TEST(quant_vectors, I_Bf16) {
  const Pair v[] = {{0x3f808000, 0x3f80}, {0x3f818000, 0x3f82}, {0x3f808001, 0x3f81}, {0x43eff333, 0x43f0},
                    {0x7f7fffff, 0x7f80}, {0x007fffff, 0x0080}, {0x00000001, 0x0000}};
  for (auto [in, out] : v) EXPECT_EQ(q::to_bf16_bits(F(in)), out) << std::hex << in;
}
TEST(quant_vectors, F_Bf16Nan) {
  EXPECT_EQ(q::to_bf16_bits(F(0xffc00001)), 0x7fc0);
}

TEST(quant_vectors, I_Fp16) {
  const Pair v[] = {{0x3f800000, 0x3c00}, {0x3f801000, 0x3c00}, {0x3f803000, 0x3c02}, {0x3f801001, 0x3c01},
                    {0x3dcccccd, 0x2e66}, {0x477fe000, 0x7bff}, {0x477fefff, 0x7bff}, {0x477ff000, 0x7c00},
                    {0x7f7fffff, 0x7c00}, {0xff800000, 0xfc00}, {0x80000000, 0x8000}, {0x33800000, 0x0001},
                    {0x33000000, 0x0000}, {0x33400000, 0x0001}, {0x387fc000, 0x03ff}};
  for (auto [in, out] : v) EXPECT_EQ(q::to_fp16_bits(F(in)), out) << std::hex << in;
}
TEST(quant_vectors, F_Fp16Nan) {
  EXPECT_EQ(q::to_fp16_bits(F(0x7fc00000)), 0x7e00);
  EXPECT_EQ(q::to_fp16_bits(F(0xffc00001)), 0x7e00);
}

// ---- docs/quant.md element table: e4m3, e4m3 nosat, e5m2, e5m2 nosat, e2m1, hif8 ----

struct ElemRow {
  uint32_t in;
  uint8_t e4, e4n, e5, e5n, e2, h8;
};
const ElemRow kElemRows[] = {
    {0x00000000, 0x00, 0x00, 0x00, 0x00, 0x0, 0x00},
    {0x80000000, 0x80, 0x80, 0x80, 0x80, 0x8, 0x00},
    {0x3f800000, 0x38, 0x38, 0x3c, 0x3c, 0x2, 0x08},
    {0xbf800000, 0xb8, 0xb8, 0xbc, 0xbc, 0xa, 0x88},
    {0x3e99999a, 0x2a, 0x2a, 0x35, 0x35, 0x1, 0x32},
    {0x3fa00000, 0x3a, 0x3a, 0x3d, 0x3d, 0x2, 0x0a},
    {0x3fc00000, 0x3c, 0x3c, 0x3e, 0x3e, 0x3, 0x0c},
    {0x40200000, 0x42, 0x42, 0x41, 0x41, 0x4, 0x12},
    {0x40600000, 0x46, 0x46, 0x43, 0x43, 0x6, 0x16},
    {0x40a00000, 0x4a, 0x4a, 0x45, 0x45, 0x6, 0x22},
    {0x40c00000, 0x4c, 0x4c, 0x46, 0x46, 0x7, 0x24},
    {0x40e00000, 0x4e, 0x4e, 0x47, 0x47, 0x7, 0x26},
    {0x3e800000, 0x28, 0x28, 0x34, 0x34, 0x0, 0x30},
    {0x3f400000, 0x34, 0x34, 0x3a, 0x3a, 0x2, 0x1c},
    {0x3c800000, 0x08, 0x08, 0x24, 0x24, 0x0, 0x58},
    {0x3b000000, 0x01, 0x01, 0x18, 0x18, 0x0, 0x72},
    {0x3a800000, 0x00, 0x00, 0x14, 0x14, 0x0, 0x74},
    {0x3ac00000, 0x01, 0x01, 0x16, 0x16, 0x0, 0x75},
    {0x43e00000, 0x7e, 0x7e, 0x5f, 0x5f, 0x7, 0x62},
    {0x43e80000, 0x7e, 0x7e, 0x5f, 0x5f, 0x7, 0x62},
    {0x43e88000, 0x7e, 0x7f, 0x5f, 0x5f, 0x7, 0x62},
    {0x43f00000, 0x7e, 0x7f, 0x60, 0x60, 0x7, 0x62},
    {0x447a0000, 0x7e, 0x7f, 0x64, 0x64, 0x7, 0x64},
    {0xc47a0000, 0xfe, 0xff, 0xe4, 0xe4, 0xf, 0xe4},
    {0x47600000, 0x7e, 0x7f, 0x7b, 0x7b, 0x7, 0x6f},
    {0x476fff00, 0x7e, 0x7f, 0x7b, 0x7b, 0x7, 0x6f},
    {0x47700000, 0x7e, 0x7f, 0x7b, 0x7c, 0x7, 0x6f},
    // NaN and ±Inf: their I cells (nosat, e2m1 Inf, hif8); the F cells are checked below.
    {0x7fc00000, 0x7f, 0x7f, 0x7e, 0x7e, 0xFF, 0x80},
    {0x7f800000, 0xFF, 0x7f, 0xFF, 0x7c, 0x7, 0x6f},
    {0xff800000, 0xFF, 0xff, 0xFF, 0xfc, 0xf, 0xef},
};

TEST(quant_vectors, I_ElementTable) {
  for (const auto& r : kElemRows) {
    float x = F(r.in);
    SCOPED_TRACE(testing::Message() << std::hex << "input 0x" << r.in);
    if (r.e4 != 0xFF) {
      EXPECT_EQ(q::encode_e4m3(x, Saturation::sat), r.e4);
    }
    EXPECT_EQ(q::encode_e4m3(x, Saturation::nosat), r.e4n);
    if (r.e5 != 0xFF) {
      EXPECT_EQ(q::encode_e5m2(x, Saturation::sat), r.e5);
    }
    EXPECT_EQ(q::encode_e5m2(x, Saturation::nosat), r.e5n);
    if (r.e2 != 0xFF) {
      EXPECT_EQ(q::encode_e2m1(x), r.e2);
    }
    EXPECT_EQ(q::encode_hif8(x), r.h8);
  }
}

// Cells marked * (OFP8/NVIDIA satfinite) and the fp4 NaN policy.
TEST(quant_vectors, F_ElementTableSatInfAndFp4Nan) {
  EXPECT_EQ(q::encode_e4m3(F(0x7f800000), Saturation::sat), 0x7e);
  EXPECT_EQ(q::encode_e4m3(F(0xff800000), Saturation::sat), 0xfe);
  EXPECT_EQ(q::encode_e5m2(F(0x7f800000), Saturation::sat), 0x7b);
  EXPECT_EQ(q::encode_e5m2(F(0xff800000), Saturation::sat), 0xfb);
  EXPECT_EQ(q::encode_e2m1(F(0x7fc00000)), 0x0);
  EXPECT_EQ(q::encode_e2m1(F(0xffc00000)), 0x0);
}

// ---- docs/quant.md e8m0 ----

TEST(quant_vectors, F_E8m0) {
  const Pair dec[] = {
      {0x00, 0x00400000}, {0x01, 0x00800000}, {0x7F, 0x3F800000}, {0xFE, 0x7F000000}, {0xFF, 0x7FC00000}};
  for (auto [s, bits] : dec) EXPECT_EQ(B(q::e8m0_decode(static_cast<uint8_t>(s))), bits) << s;
  const Pair rec[] = {
      {0x00, 0x7F000000}, {0x7F, 0x3F800000}, {0xFD, 0x00800000}, {0xFE, 0x00400000}, {0xFF, 0x7FC00000}};
  for (auto [s, bits] : rec) EXPECT_EQ(B(q::e8m0_reciprocal(static_cast<uint8_t>(s))), bits) << s;
  const Pair ceil[] = {{0x00000000, 0x00}, {0x00400000, 0x00}, {0x00400001, 0x01}, {0x00800000, 0x01},
                       {0x3f800000, 0x7F}, {0x3fc00000, 0x80}, {0x40400000, 0x81}, {0x40a00000, 0x82},
                       {0x7F7FFFFF, 0xFE}, {0x7f800000, 0xFF}, {0x7fc00000, 0xFF}};
  for (auto [t, s] : ceil) EXPECT_EQ(q::e8m0_ceil(F(t)), s) << std::hex << t;
}

// ---- docs/quant.md HiFloat8 ----

TEST(quant_vectors, G_Hif8) {
  const Pair v[] = {{0x3638c290, 0x04}, {0x358b4f67, 0x03}, {0x3f48849e, 0x1d}, {0x3cfdc7cd, 0x54},
                    {0x3e2040ed, 0x3a}, {0x43411383, 0x4e}, {0x438e0e21, 0x60}, {0x42356389, 0x46},
                    {0x43b308db, 0x61}, {0x4686c7e7, 0x6c}, {0x46e1ca4a, 0x6e}, {0x453d6d1b, 0x67},
                    {0x4743505e, 0x6f}};
  for (auto [in, out] : v) EXPECT_EQ(q::encode_hif8(F(in)), out) << std::hex << in;
  const Pair h[] = {{0x0005, 0x01}, {0x289b, 0x55}, {0x79ea, 0x6f}};  // fp16 inputs
  for (auto [in, out] : h) EXPECT_EQ(q::encode_hif8(q::fp16_to_float(static_cast<uint16_t>(in))), out) << in;
}

TEST(quant_vectors, I_Hif8) {
  const Pair v[] = {{0x3f800000, 0x08}, {0x3f880000, 0x09}, {0x3fe00000, 0x0e}, {0x3f000000, 0x18},
                    {0x40000000, 0x10}, {0x40800000, 0x20}, {0x41700000, 0x2f}, {0x41800000, 0x40},
                    {0x41880000, 0x40}, {0x42c80000, 0x4a}, {0x437f0000, 0x60}, {0x447a0000, 0x64},
                    {0x471fff00, 0x6e}, {0x47200000, 0x6f}, {0x38000000, 0x7e}, {0x37800000, 0x07},
                    {0x37c00000, 0x7e}, {0x34000000, 0x01}, {0x33fd70a4, 0x00}, {0xbf800000, 0x88},
                    {0x80000000, 0x00}};
  for (auto [in, out] : v) EXPECT_EQ(q::encode_hif8(F(in)), out) << std::hex << in;
}

TEST(quant_vectors, F_Hif8) {
  EXPECT_EQ(q::encode_hif8(F(0x00000001)), 0x00);
  EXPECT_EQ(q::encode_hif8(F(0x807fffff)), 0x00);
  EXPECT_EQ(q::encode_hif8(F(0x47200000), Saturation::sat), 0x6e);
  EXPECT_EQ(q::encode_hif8(F(0x7f800000), Saturation::sat), 0x6e);
  EXPECT_EQ(q::encode_hif8(F(0xff800000), Saturation::sat), 0xee);
  EXPECT_EQ(q::decode_hif8(0x1d), 0.8125f);
  EXPECT_EQ(q::decode_hif8(0x4e), 192.0f);
  EXPECT_EQ(q::decode_hif8(0x6e), 32768.0f);
  EXPECT_EQ(q::decode_hif8(0x7e), std::ldexp(1.0f, -15));
  EXPECT_EQ(q::decode_hif8(0x07), std::ldexp(1.0f, -16));
  EXPECT_EQ(q::decode_hif8(0x01), std::ldexp(1.0f, -22));
}

// ---- docs/quant.md int8 per token ----

struct Int8Row {
  std::vector<float> x;
  uint32_t a3_scale;
  std::vector<int> a3_q;
  uint32_t s950_scale;
  std::vector<int> q950;
};

std::vector<Int8Row> int8_rows() {
  const float nan = F(0x7fc00000);
  return {
      {{127, 2.5, 3.5, -2.5, 0.5, -0.5, 1.5, 126.5},
       0x3f800000,
       {127, 2, 4, -2, 0, 0, 2, 126},
       0x3f800000,
       {127, 2, 4, -2, 0, 0, 2, 126}},
      {{0.10009765625f, -3.296875f, 2.703125f, 0.00099945068359375f},
       0x3cd4a952,
       {4, -127, 104, 0},
       0x3cd4a953,
       {4, -127, 104, 0}},
      {{0.76953125f, -2.671875f, -0.1943359375f, -2.15625f, 3.34375f, -3.625f, -1.8125f, -1.9609375f},
       0x3ce9d3a8,
       {27, -94, -7, -76, 117, -127, -63, -69},
       0x3ce9d3a7,
       {27, -94, -7, -76, 117, -127, -64, -69}},
      {{0.6328125f, -0.53515625f, -2.328125f, -0.44140625f, 1.7421875f, 2.5f, 3.484375f, -0.55078125f},
       0x3ce0c184,
       {23, -20, -85, -16, 63, 91, 127, -20},
       0x3ce0c183,
       {23, -20, -85, -16, 64, 91, 127, -20}},
      {{2.046875f, -2.25f, -0.341796875f, 0.14453125f, -4.34375f, -0.59375f, -2.171875f, -3.421875f},
       0x3d0c1831,
       {60, -66, -10, 4, -127, -17, -64, -100},
       0x3d0c1830,
       {60, -66, -10, 4, -127, -17, -64, -100}},
      {{F(0x00800000), F(0x80400000), F(0x00000001)}, 0x00000000, {0, 0, 0}, 0x00010204, {127, -64, 0}},
      {{0.0f, -0.0f}, 0x00000000, {0, 0}, 0x00000000, {0, 0}},
      {{1.0f, nan}, 0x7fc00000, {0, 0}, 0x7fc00000, {0, 0}},
  };
}

TEST(quant_vectors, F_Int8PerToken) {
  for (const auto& r : int8_rows()) {
    const int64_t n = static_cast<int64_t>(r.x.size());
    std::vector<int8_t> qa(r.x.size()), qb(r.x.size());
    float sa = -1, sb = -1;
    q::int8_per_token_a3(DType::f32, r.x.data(), n, Smoothing::none(), qa.data(), &sa);
    q::int8_per_token_950(DType::f32, r.x.data(), n, Smoothing::none(), qb.data(), &sb);
    SCOPED_TRACE(testing::Message() << "row starting " << r.x[0]);
    EXPECT_EQ(B(sa), r.a3_scale);
    EXPECT_EQ(B(sb), r.s950_scale);
    for (size_t i = 0; i < r.x.size(); ++i) {
      EXPECT_EQ(qa[i], r.a3_q[i]) << "a3 element " << i;
      EXPECT_EQ(qb[i], r.q950[i]) << "950 element " << i;
    }
  }
}

// Row T: element 7 is an exact tie whose error is 0.500004 * scale (why the docs/quant.md bound is not
// scale/2).
TEST(quant_vectors, F_Int8RowTBound) {
  auto r = int8_rows()[4];
  std::vector<int8_t> qv(8);
  float s;
  q::int8_per_token_a3(DType::f32, r.x.data(), 8, Smoothing::none(), qv.data(), &s);
  double err = std::fabs(static_cast<double>(r.x[6]) - static_cast<double>(qv[6] * s));
  EXPECT_GT(err, 0.5 * s);
  EXPECT_LE(err, (0.5 + std::ldexp(1.0, -12)) * s);
}

// ---- docs/quant.md fp8 per token and per group ----

std::vector<float> r1() {
  return {3.0f, -1.5f, F(0x3c23d70a), F(0x4039999a)};
}
std::vector<float> r2() {
  return int8_rows()[2].x;
}

void expect_codes(const std::vector<uint8_t>& got, size_t off, const std::vector<uint8_t>& want) {
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[off + i], want[i]) << "code " << off + i;
}

TEST(quant_vectors, F_Fp8PerToken) {
  struct Case {
    Fp8Format f;
    std::vector<float> x;
    uint32_t scale;
    std::vector<uint8_t> codes;
  };
  const Case cases[] = {
      {Fp8Format::e4m3, r1(), 0x3bdb6db7, {0x7e, 0xf6, 0x3c, 0x7e}},
      {Fp8Format::e4m3, r2(), 0x3c049249, {0x6c, 0xfa, 0xdc, 0xf8, 0x7d, 0xfe, 0xf6, 0xf7}},
      {Fp8Format::e5m2, r1(), 0x385b6db7, {0x7b, 0xf7, 0x5a, 0x7b}},
      {Fp8Format::e5m2, r2(), 0x38849249, {0x72, 0xf9, 0xea, 0xf8, 0x7a, 0xfb, 0xf7, 0xf8}},
      {Fp8Format::e4m3, {0.0f, 0.0f}, 0x00000000, {0x00, 0x00}},
      {Fp8Format::e4m3, {1.0f, F(0x7f800000)}, 0x7fc00000, {0x7f, 0x7f}},
  };
  for (const auto& c : cases) {
    std::vector<uint8_t> codes(c.x.size());
    float s;
    q::fp8_per_token(c.f, DType::f32, c.x.data(), static_cast<int64_t>(c.x.size()), Smoothing::none(),
                     codes.data(), &s);
    EXPECT_EQ(B(s), c.scale);
    expect_codes(codes, 0, c.codes);
  }
}

TEST(quant_vectors, F_Fp8PerGroup128A3) {
  std::vector<float> x = r1();
  x.resize(128, 0.0f);
  for (float v : r2()) x.push_back(v);
  ASSERT_EQ(x.size(), 136u);
  std::vector<uint8_t> codes(136, 0xAA);
  float scales[2];
  q::fp8_per_group128_a3(Fp8Format::e4m3, DType::f32, x.data(), 136, Smoothing::none(), codes.data(), scales);
  EXPECT_EQ(B(scales[0]), 0x3bdb6db7u);
  EXPECT_EQ(B(scales[1]), 0x3c049249u);
  expect_codes(codes, 0, {0x7e, 0xf6, 0x3c, 0x7e});
  for (size_t i = 4; i < 128; ++i) EXPECT_EQ(codes[i], 0) << i;
  expect_codes(codes, 128, {0x6c, 0xfa, 0xdc, 0xf8, 0x7d, 0xfe, 0xf6, 0xf7});
}

TEST(quant_vectors, F_Fp8PerGroup128) {
  std::vector<float> x = r1();
  x.resize(128, 0.0f);
  // A second, all-zero group with signed zeros: its codes are the signed zeros.
  for (int i = 0; i < 128; ++i) x.push_back(i % 2 ? -0.0f : 0.0f);
  struct Case {
    Fp8Format f;
    bool pow2;
    uint32_t scale0, scale1;
    std::vector<uint8_t> codes;
  };
  const Case cases[] = {
      {Fp8Format::e4m3, false, 0x3bdb6db8, 0x346facad, {0x7e, 0xf6, 0x3c, 0x7e}},
      {Fp8Format::e4m3, true, 0x3c000000, 0x34800000, {0x7c, 0xf4, 0x3a, 0x7c}},
      {Fp8Format::e5m2, false, 0x385b6db8, 0x30efacad, {0x7b, 0xf7, 0x5a, 0x7b}},
      {Fp8Format::e5m2, true, 0x38800000, 0, {0x7a, 0xf6, 0x59, 0x7a}},
  };
  for (const auto& c : cases) {
    std::vector<uint8_t> codes(256, 0xAA);
    float s[2];
    q::fp8_per_group128(c.f, DType::f32, x.data(), 256, Smoothing::none(), codes.data(), s, {c.pow2, false});
    SCOPED_TRACE(testing::Message() << "e4m3=" << (c.f == Fp8Format::e4m3) << " pow2=" << c.pow2);
    EXPECT_EQ(B(s[0]), c.scale0);
    if (c.scale1) {
      EXPECT_EQ(B(s[1]), c.scale1);
    }
    expect_codes(codes, 0, c.codes);
    for (size_t i = 4; i < 128; ++i) EXPECT_EQ(codes[i], 0) << i;
    for (size_t i = 128; i < 256; ++i) EXPECT_EQ(codes[i], i % 2 ? 0x80 : 0x00) << i;
  }
  // ue8m0 bytes: 78 for r1, 69 for the zero group (e4m3).
  std::vector<uint8_t> codes(256);
  uint8_t bytes[2];
  q::fp8_per_group128(Fp8Format::e4m3, DType::f32, x.data(), 256, Smoothing::none(), codes.data(), bytes,
                      {true, true});
  EXPECT_EQ(bytes[0], 0x78);
  EXPECT_EQ(bytes[1], 0x69);
  expect_codes(codes, 0, {0x7c, 0xf4, 0x3a, 0x7c});
  // [NaN, 1]: NaN scale, NaN codes.
  const float bad[2] = {F(0x7fc00000), 1.0f};
  float s;
  q::fp8_per_group128(Fp8Format::e4m3, DType::f32, bad, 2, Smoothing::none(), codes.data(), &s);
  EXPECT_EQ(B(s), 0x7fc00000u);
  expect_codes(codes, 0, {0x7f, 0x7f});
  q::fp8_per_group128(Fp8Format::e4m3, DType::f32, bad, 2, Smoothing::none(), codes.data(), bytes,
                      {true, true});
  EXPECT_EQ(bytes[0], 0xff);
  expect_codes(codes, 0, {0x7f, 0x7f});
}

// ---- docs/quant.md MX ----

struct MxCase {
  const char* tag;
  std::vector<float> x;  // zero-padded to 32
  MxElem elem;
  int rules;  // 1 = FLOOR, 2 = RCEIL, 3 = both
  uint8_t scale;
  std::vector<uint8_t> codes;  // leading codes (bytes for e2m1); the rest must be zero unless `fill`
  int fill = -1;               // expected value of every code byte when >= 0
};

void run_mx(const MxCase& c) {
  std::vector<float> x = c.x;
  x.resize(32, 0.0f);
  for (int rule = 1; rule <= 2; ++rule) {
    if (!(c.rules & rule)) continue;
    SCOPED_TRACE(testing::Message() << c.tag << (rule == 1 ? " FLOOR" : " RCEIL"));
    std::vector<uint8_t> codes(32, 0xAA);
    uint8_t scale = 0xAA;
    q::mx_quantize(c.elem, rule == 1 ? ScaleRule::floor : ScaleRule::rceil, DType::f32, x.data(), 32,
                   codes.data(), &scale);
    EXPECT_EQ(scale, c.scale);
    size_t nbytes = c.elem == MxElem::e2m1 ? 16 : 32;
    for (size_t i = 0; i < nbytes; ++i) {
      int want = c.fill >= 0 ? c.fill : (i < c.codes.size() ? c.codes[i] : 0);
      EXPECT_EQ(codes[i], want) << "byte " << i;
    }
  }
}

TEST(quant_vectors, G_MxAscendDocExample) {
  run_mx({"[0,8,64,512]", {0, 8, 64, 512}, MxElem::e4m3, 3, 0x80, {0x00, 0x48, 0x60, 0x78}});
}

TEST(quant_vectors, I_MxBlocks) {
  const MxCase cases[] = {
      {"448..", {448, -1, 0.5, 3.1415926f}, MxElem::e4m3, 3, 0x7f, {0x7e, 0xb8, 0x30, 0x45}},
      {"500 e4m3", {500, -250, 1, -0.001f}, MxElem::e4m3, 1, 0x7f, {0x7e, 0xf8, 0x38, 0x81}},
      {"500 e4m3", {500, -250, 1, -0.001f}, MxElem::e4m3, 2, 0x80, {0x78, 0xf0, 0x30, 0x80}},
      {"500 e5m2", {500, -250, 1, -0.001f}, MxElem::e5m2, 1, 0x78, {0x7b, 0xf8, 0x58, 0xb0}},
      {"500 e5m2", {500, -250, 1, -0.001f}, MxElem::e5m2, 2, 0x79, {0x78, 0xf4, 0x54, 0xac}},
      {"fp4", {0.1f, -0.25f, 1, 2.9f, 5.5f, 6, -7.5f, 12}, MxElem::e2m1, 3, 0x80, {0x80, 0x31, 0x55, 0x7e}},
      {"fp4 ties",
       {1, 1.25f, 1.75f, 2.5f, 3.5f, 5, -0.25f, -0.75f},
       MxElem::e2m1,
       1,
       0x7f,
       {0x22, 0x44, 0x66, 0xa8}},
      {"3e38", {3.0e38f, -1}, MxElem::e4m3, 1, 0xf6, {0x7e, 0x80}},
      {"3e38", {3.0e38f, -1}, MxElem::e4m3, 2, 0xf7, {0x76, 0x80}},
  };
  for (const auto& c : cases) run_mx(c);
}

TEST(quant_vectors, F_MxSpecialBlocks) {
  const float nan = F(0x7fc00000), inf = F(0x7f800000);
  const MxCase cases[] = {
      {"zeros", {0.0f, -0.0f}, MxElem::e4m3, 3, 0x00, {0x00, 0x00}},
      {"exponent field 0", {F(0x00100000), F(0x00000001)}, MxElem::e4m3, 1, 0x00, {0x00, 0x00}},
      {"inf", {inf, 1}, MxElem::e4m3, 3, 0xff, {}, 0x7f},
      {"nan", {nan, 1}, MxElem::e4m3, 3, 0xff, {}, 0x7f},
      {"nan fp4", {nan, 1}, MxElem::e2m1, 3, 0xff, {}, 0x00},
  };
  for (const auto& c : cases) run_mx(c);
}

TEST(quant_vectors, I_MxRowC) {
  const uint32_t bits[32] = {
      0xc0da3d71, 0xc0cc28f6, 0xc0be147b, 0xc0b00000, 0xc0a1eb85, 0xc093d70a, 0xc085c28f, 0xc06f5c29,
      0xc0533333, 0xc0370a3d, 0xc01ae148, 0xbffd70a4, 0xbfc51eb8, 0xbf8ccccd, 0xbf28f5c3, 0xbe6147ae,
      0x3e6147ae, 0x3f28f5c3, 0x3f8ccccd, 0x3fc51eb8, 0x3ffd70a4, 0x401ae148, 0x40370a3d, 0x40533333,
      0x406f5c29, 0x4085c28f, 0x4093d70a, 0x40a1eb85, 0x40b00000, 0x40be147b, 0x40cc28f6, 0x40da3d71};
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) {
    x[i] = F(bits[i]);
    EXPECT_EQ(x[i], static_cast<float>((i - 15.5) * 0.44)) << i;  // the row's definition
  }
  run_mx({"C",
          x,
          MxElem::e2m1,
          1,
          0x7f,
          {0xff, 0xff, 0xef, 0xee, 0xdd, 0xcc, 0xab, 0x89, 0x10, 0x32, 0x44, 0x55, 0x66, 0x76, 0x77, 0x77}});
  run_mx({"C",
          x,
          MxElem::e2m1,
          2,
          0x80,
          {0xdd, 0xdd, 0xcd, 0xcc, 0xbb, 0xaa, 0x9a, 0x89, 0x10, 0x21, 0x22, 0x33, 0x44, 0x54, 0x55, 0x55}});
}

TEST(quant_vectors, I_MxRowD) {
  const uint32_t bits[16] = {0xc3f10000, 0xc3d2e000, 0xc3710000, 0x42710000, 0x43f10000, 0x00000000,
                             0xc3b4c000, 0x43d2e000, 0x4396a000, 0x4396a000, 0x43d2e000, 0xc3b4c000,
                             0x00000000, 0x43f10000, 0x42710000, 0xc3710000};
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) {
    x[i] = F(bits[i % 16]);
    EXPECT_EQ(x[i], static_cast<float>(((i % 16) * (i % 16) % 17 - 8) * 60.25)) << i;
  }
  const std::vector<uint8_t> fl = {0xfe, 0xfd, 0xf7, 0x67, 0x7e, 0x00, 0xfb, 0x7d,
                                   0x79, 0x79, 0x7d, 0xfb, 0x00, 0x7e, 0x67, 0xf7};
  const std::vector<uint8_t> rc = {0xf7, 0xf5, 0xef, 0x5f, 0x77, 0x00, 0xf3, 0x75,
                                   0x71, 0x71, 0x75, 0xf3, 0x00, 0x77, 0x5f, 0xef};
  std::vector<uint8_t> fl2 = fl, rc2 = rc;
  fl2.insert(fl2.end(), fl.begin(), fl.end());
  rc2.insert(rc2.end(), rc.begin(), rc.end());
  run_mx({"D", x, MxElem::e4m3, 1, 0x7f, fl2});
  run_mx({"D", x, MxElem::e4m3, 2, 0x80, rc2});
}

}  // namespace
