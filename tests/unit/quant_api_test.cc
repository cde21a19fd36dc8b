// unit/quant_api_test.cc — the public epcomm::quantize / dequantize on tensors (shapes, dtypes, strides,
// threads, error messages) and the engine's row interface of quant/row.h (byte sizes, H checks, unaligned
// records).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "epcomm/error.h"
#include "epcomm/quant.h"
#include "quant/block.h"
#include "quant/row.h"

namespace {

using epcomm::DType;
using epcomm::QuantMode;
using epcomm::Shape;
using epcomm::Tensor;
namespace q = epcomm::quant;

const QuantMode kAllModes[] = {QuantMode::bf16,
                               QuantMode::int8,
                               QuantMode::pertoken_fp8_e4m3,
                               QuantMode::pergroup_fp8_e4m3,
                               QuantMode::mx_fp8_e4m3,
                               QuantMode::mx_fp8_e5m2,
                               QuantMode::mx_fp4_e2m1};
const QuantMode kQuantModes[] = {
    QuantMode::int8,        QuantMode::pertoken_fp8_e4m3, QuantMode::pergroup_fp8_e4m3,
    QuantMode::mx_fp8_e4m3, QuantMode::mx_fp8_e5m2,       QuantMode::mx_fp4_e2m1};

// Runs f and returns the InvalidUsage message (fails the test if nothing or something else is thrown).
template <class F>
std::string invalid_usage(F&& f) {
  try {
    f();
  } catch (const epcomm::Error& e) {
    EXPECT_EQ(e.code(), epcomm::ErrorCode::InvalidUsage) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected epcomm::Error(InvalidUsage)";
  return "";
}

Tensor random_bf16(int64_t T, int64_t H, uint32_t seed) {
  Tensor x = epcomm::empty(DType::bf16, {T, H});
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  for (int64_t i = 0; i < T * H; ++i) x.data_as<uint16_t>()[i] = epcomm::to_bf16_bits(d(rng));
  return x;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// ---- row.h ----

TEST(quant_row_api, ByteSizesFollowNormalModeTable) {
  const int64_t H = 7168;
  EXPECT_EQ(q::row_data_bytes(QuantMode::bf16, H), 2u * H);
  EXPECT_EQ(q::row_scale_bytes(QuantMode::bf16, H), 0u);
  EXPECT_EQ(q::row_data_bytes(QuantMode::int8, H) + q::row_scale_bytes(QuantMode::int8, H), H + 4u);
  EXPECT_EQ(q::row_data_bytes(QuantMode::pertoken_fp8_e4m3, H) +
                q::row_scale_bytes(QuantMode::pertoken_fp8_e4m3, H),
            H + 4u);
  EXPECT_EQ(q::row_scale_bytes(QuantMode::pergroup_fp8_e4m3, H), 4u * 56);
  EXPECT_EQ(q::row_scale_bytes(QuantMode::pergroup_fp8_e4m3, 7169), 4u * 57);  // G = ceil(H/128)
  EXPECT_EQ(q::row_data_bytes(QuantMode::mx_fp8_e4m3, H), size_t(H));
  EXPECT_EQ(q::row_scale_bytes(QuantMode::mx_fp8_e5m2, H), H / 32u);
  EXPECT_EQ(q::row_data_bytes(QuantMode::mx_fp4_e2m1, H), H / 2u);
  EXPECT_EQ(q::row_scale_bytes(QuantMode::mx_fp4_e2m1, H), H / 32u);
}

TEST(quant_row_api, Dtypes) {
  EXPECT_EQ(q::data_dtype(QuantMode::bf16), DType::bf16);
  EXPECT_EQ(q::data_dtype(QuantMode::int8), DType::i8);
  EXPECT_EQ(q::scale_dtype(QuantMode::int8), DType::f32);
  EXPECT_EQ(q::data_dtype(QuantMode::pertoken_fp8_e4m3), DType::f8e4m3);
  EXPECT_EQ(q::scale_dtype(QuantMode::pergroup_fp8_e4m3), DType::f32);
  EXPECT_EQ(q::data_dtype(QuantMode::mx_fp8_e5m2), DType::f8e5m2);
  EXPECT_EQ(q::scale_dtype(QuantMode::mx_fp8_e4m3), DType::e8m0);
  EXPECT_EQ(q::data_dtype(QuantMode::mx_fp4_e2m1), DType::f4x2);
  EXPECT_EQ(q::scale_dtype(QuantMode::mx_fp4_e2m1), DType::e8m0);
}

TEST(quant_row_api, CheckHidden) {
  for (QuantMode m : kAllModes) {
    EXPECT_NO_THROW(q::check_hidden(m, 7168));
    EXPECT_NE(invalid_usage([&] { q::check_hidden(m, 0); }).find("hidden"), std::string::npos);
  }
  for (QuantMode m :
       {QuantMode::bf16, QuantMode::int8, QuantMode::pertoken_fp8_e4m3, QuantMode::pergroup_fp8_e4m3})
    EXPECT_NO_THROW(q::check_hidden(m, 100));
  for (QuantMode m : {QuantMode::mx_fp8_e4m3, QuantMode::mx_fp8_e5m2, QuantMode::mx_fp4_e2m1}) {
    std::string msg = invalid_usage([&] { q::check_hidden(m, 100); });
    EXPECT_NE(msg.find("hidden"), std::string::npos) << msg;
    EXPECT_NE(msg.find("100"), std::string::npos) << msg;
    EXPECT_NE(msg.find(epcomm::quant_mode_name(m)), std::string::npos) << msg;
  }
}

// quantize_row writes exactly what the named block algorithm writes, into records at any byte offset.
TEST(quant_row_api, QuantizeRowMatchesBlockAlgorithmsUnaligned) {
  const int64_t H = 160;
  Tensor x = random_bf16(1, H, 3);
  const void* xp = x.data();
  for (QuantMode m : kAllModes) {
    size_t db = q::row_data_bytes(m, H), sb = q::row_scale_bytes(m, H);
    std::vector<uint8_t> rec(1 + sb + db + 8, 0xEE);
    uint8_t* scales = rec.data() + 1;  // deliberately misaligned
    uint8_t* data = scales + sb;
    q::quantize_row(m, DType::bf16, xp, H, data, scales);
    std::vector<uint8_t> want_d(db), want_s(sb + 4);
    switch (m) {
      case QuantMode::bf16:
        std::memcpy(want_d.data(), xp, db);
        break;
      case QuantMode::int8:
        q::int8_per_token_a3(DType::bf16, xp, H, {}, reinterpret_cast<int8_t*>(want_d.data()),
                             reinterpret_cast<float*>(want_s.data()));
        break;
      case QuantMode::pertoken_fp8_e4m3:
        q::fp8_per_token(q::Fp8Format::e4m3, DType::bf16, xp, H, {}, want_d.data(),
                         reinterpret_cast<float*>(want_s.data()));
        break;
      case QuantMode::pergroup_fp8_e4m3:
        q::fp8_per_group128(q::Fp8Format::e4m3, DType::bf16, xp, H, {}, want_d.data(), want_s.data());
        break;
      case QuantMode::mx_fp8_e4m3:
        q::mxfp8_e4m3(DType::bf16, xp, H, want_d.data(), want_s.data());
        break;
      case QuantMode::mx_fp8_e5m2:
        q::mxfp8_e5m2(DType::bf16, xp, H, want_d.data(), want_s.data());
        break;
      case QuantMode::mx_fp4_e2m1:
        q::mxfp4_e2m1(DType::bf16, xp, H, want_d.data(), want_s.data());
        break;
    }
    EXPECT_EQ(std::memcmp(data, want_d.data(), db), 0) << epcomm::quant_mode_name(m);
    EXPECT_EQ(std::memcmp(scales, want_s.data(), sb), 0) << epcomm::quant_mode_name(m);
    EXPECT_EQ(rec[0], 0xEE);
    EXPECT_EQ(rec[1 + sb + db], 0xEE) << "wrote past the record";
    // dequantize_row reads the same misaligned record; a coarse sanity bound (quant_blocks_test has the exact
    // ones).
    std::vector<float> out(H);
    q::dequantize_row(m, data, scales, H, out.data());
    float amax = 0;
    for (int64_t i = 0; i < H; ++i)
      amax = std::max(amax, std::fabs(epcomm::bf16_to_float(x.data_as<uint16_t>()[i])));
    for (int64_t i = 0; i < H; ++i) {
      float xi = epcomm::bf16_to_float(x.data_as<uint16_t>()[i]);
      float tol = m == QuantMode::mx_fp4_e2m1 ? 0.26f * std::fabs(xi) + amax / 16
                                              : 0.13f * std::fabs(xi) + amax / 200;
      EXPECT_LE(std::fabs(out[i] - xi), tol) << epcomm::quant_mode_name(m) << " " << i;
    }
  }
  EXPECT_NE(invalid_usage([&] {
              float f[160] = {};
              uint8_t d[320];
              q::quantize_row(QuantMode::bf16, DType::f32, f, 160, d, nullptr);
            }).find("bf16"),
            std::string::npos);
  EXPECT_NE(invalid_usage([&] {
              int32_t v[160] = {};
              uint8_t d[160], s[4];
              q::quantize_row(QuantMode::int8, DType::i32, v, 160, d, s);
            }).find("i32"),
            std::string::npos);
}

// ---- public tensor API ----

TEST(quant_tensor_api, ShapesAndDtypes) {
  const int64_t T = 3, H = 256;
  Tensor x = random_bf16(T, H, 1);
  struct Want {
    QuantMode m;
    DType d;
    Shape ds;
    DType s;
    Shape ss;
  };
  const Want wants[] = {
      {QuantMode::int8, DType::i8, {T, H}, DType::f32, {T}},
      {QuantMode::pertoken_fp8_e4m3, DType::f8e4m3, {T, H}, DType::f32, {T}},
      {QuantMode::pergroup_fp8_e4m3, DType::f8e4m3, {T, H}, DType::f32, {T, 2}},
      {QuantMode::mx_fp8_e4m3, DType::f8e4m3, {T, H}, DType::e8m0, {T, 8}},
      {QuantMode::mx_fp8_e5m2, DType::f8e5m2, {T, H}, DType::e8m0, {T, 8}},
      {QuantMode::mx_fp4_e2m1, DType::f4x2, {T, H / 2}, DType::e8m0, {T, 8}},
  };
  for (const auto& w : wants) {
    auto [d, s] = epcomm::quantize(x, w.m);
    EXPECT_EQ(d.dtype(), w.d);
    EXPECT_EQ(d.shape(), w.ds);
    EXPECT_EQ(s.dtype(), w.s);
    EXPECT_EQ(s.shape(), w.ss);
    for (DType out : {DType::f32, DType::bf16, DType::f16}) {
      Tensor y = epcomm::dequantize(d, s, w.m, out);
      EXPECT_EQ(y.dtype(), out);
      EXPECT_EQ(y.shape(), (Shape{T, H}));
    }
  }
  auto [d, s] = epcomm::quantize(x, QuantMode::bf16);
  EXPECT_TRUE(same_bytes(d, x));
  EXPECT_FALSE(s.defined());
  Tensor y = epcomm::dequantize(d, Tensor(), QuantMode::bf16, DType::bf16);
  EXPECT_TRUE(same_bytes(y, x));
}

// Tensor results equal the row functions, bf16/f16 outputs are the RNE of the fp32 dequantization, and the
// thread count never changes a byte.
TEST(quant_tensor_api, MatchesRowsAndIsThreadInvariant) {
  const int64_t T = 37, H = 7168;
  Tensor x = random_bf16(T, H, 2);
  for (QuantMode m : kQuantModes) {
    auto [d1, s1] = epcomm::quantize(x, m);
    for (int threads : {2, 3, 8, 64}) {
      auto [d, s] = epcomm::quantize(x, m, {threads, nullptr});
      EXPECT_TRUE(same_bytes(d, d1) && same_bytes(s, s1))
          << epcomm::quant_mode_name(m) << " threads " << threads;
    }
    std::vector<uint8_t> rd(q::row_data_bytes(m, H)), rs(q::row_scale_bytes(m, H));
    q::quantize_row(m, DType::bf16, x.data_as<uint16_t>() + 5 * H, H, rd.data(), rs.data());
    EXPECT_EQ(std::memcmp(rd.data(), d1.data_as<uint8_t>() + 5 * rd.size(), rd.size()), 0);
    EXPECT_EQ(std::memcmp(rs.data(), s1.data_as<uint8_t>() + 5 * rs.size(), rs.size()), 0);
    Tensor f = epcomm::dequantize(d1, s1, m, DType::f32);
    Tensor b = epcomm::dequantize(d1, s1, m, DType::bf16, {4, nullptr});
    Tensor h = epcomm::dequantize(d1, s1, m, DType::f16, {3, nullptr});
    for (int64_t i = 0; i < T * H; ++i) {
      float v = f.data_as<float>()[i];
      ASSERT_EQ(b.data_as<uint16_t>()[i], epcomm::to_bf16_bits(v)) << i;
      ASSERT_EQ(h.data_as<uint16_t>()[i], epcomm::to_fp16_bits(v)) << i;
    }
    EXPECT_TRUE(same_bytes(epcomm::dequantize(d1, s1, m, DType::f32, {5, nullptr}), f));
  }
}

TEST(quant_tensor_api, InputDtypesStridesAndOneDimensionalRows) {
  const int64_t T = 4, H = 128;
  Tensor xb = random_bf16(T, H, 4);
  Tensor xf = epcomm::empty(DType::f32, {T, H});
  for (int64_t i = 0; i < T * H; ++i)
    xf.data_as<float>()[i] = epcomm::bf16_to_float(xb.data_as<uint16_t>()[i]);
  // Rows with padding between them: a [T, H] view into a [T, H + 16] buffer.
  Tensor padded = epcomm::empty(DType::bf16, {T, H + 16});
  for (int64_t r = 0; r < T; ++r)
    std::memcpy(padded.data_as<uint16_t>() + r * (H + 16), xb.data_as<uint16_t>() + r * H, 2 * H);
  Tensor view = Tensor::wrap(padded.data(), DType::bf16, {T, H}, {H + 16, 1}, padded.owner());
  for (QuantMode m : kQuantModes) {
    auto [d0, s0] = epcomm::quantize(xb, m);
    auto [d1, s1] = epcomm::quantize(xf, m);
    auto [d2, s2] = epcomm::quantize(view, m);
    EXPECT_TRUE(same_bytes(d0, d1) && same_bytes(s0, s1)) << "f32 input differs";
    EXPECT_TRUE(same_bytes(d0, d2) && same_bytes(s0, s2)) << "strided input differs";
    Tensor row = Tensor::wrap(xb.data_as<uint16_t>() + H, DType::bf16, {H});
    auto [d3, s3] = epcomm::quantize(row, m);
    EXPECT_EQ(d3.size(0), 1);
    EXPECT_EQ(std::memcmp(d3.data(), d0.data_as<uint8_t>() + d3.nbytes(), d3.nbytes()), 0);
  }
  // Strided scales: pergroup scales stored column-major, MX scales flat.
  auto [d, s] = epcomm::quantize(xb, QuantMode::pergroup_fp8_e4m3);  // scales [T, 1]
  Tensor big = random_bf16(T, 512, 9);
  auto [gd, gs] = epcomm::quantize(big, QuantMode::pergroup_fp8_e4m3);  // scales [T, 4]
  Tensor colmaj = epcomm::empty(DType::f32, {4, T});
  for (int64_t r = 0; r < T; ++r)
    for (int64_t g = 0; g < 4; ++g) colmaj.data_as<float>()[g * T + r] = gs.data_as<float>()[r * 4 + g];
  Tensor cm = Tensor::wrap(colmaj.data(), DType::f32, {T, 4}, {1, T}, colmaj.owner());
  EXPECT_TRUE(same_bytes(epcomm::dequantize(gd, cm, QuantMode::pergroup_fp8_e4m3),
                         epcomm::dequantize(gd, gs, QuantMode::pergroup_fp8_e4m3)));
  auto [md, ms] = epcomm::quantize(big, QuantMode::mx_fp4_e2m1);
  Tensor flat = Tensor::wrap(ms.data(), DType::e8m0, {T * 16}, {}, ms.owner());
  EXPECT_TRUE(same_bytes(epcomm::dequantize(md, flat, QuantMode::mx_fp4_e2m1),
                         epcomm::dequantize(md, ms, QuantMode::mx_fp4_e2m1)));
  // Zero rows are fine.
  auto [zd, zs] = epcomm::quantize(epcomm::empty(DType::bf16, {0, H}), QuantMode::int8);
  EXPECT_EQ(zd.shape(), (Shape{0, H}));
  EXPECT_EQ(epcomm::dequantize(zd, zs, QuantMode::int8).shape(), (Shape{0, H}));
}

TEST(quant_tensor_api, ErrorMessages) {
  Tensor x = random_bf16(2, 64, 5);
  auto has = [](const std::string& msg, std::initializer_list<const char*> parts) {
    for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  };
  has(invalid_usage([&] {
        epcomm::quantize(epcomm::empty(DType::bf16, {2, 2, 64}), QuantMode::int8);
      }),
      {"x", "[2, 2, 64]"});
  has(invalid_usage([&] {
        epcomm::quantize(epcomm::empty(DType::i32, {2, 64}), QuantMode::int8);
      }),
      {"x dtype", "i32", "bf16"});
  has(invalid_usage([&] {
        epcomm::quantize(epcomm::empty(DType::f32, {2, 64}), QuantMode::bf16);
      }),
      {"x dtype", "f32", "bf16"});
  has(invalid_usage([&] {
        epcomm::quantize(epcomm::empty(DType::bf16, {2, 48}), QuantMode::mx_fp8_e4m3);
      }),
      {"hidden", "48", "32"});
  has(invalid_usage([&] {
        epcomm::quantize(Tensor::wrap(x.data(), DType::bf16, {2, 32}, {1, 2}, x.owner()), QuantMode::int8);
      }),
      {"x", "contiguous"});
  has(invalid_usage([&] { epcomm::quantize(x, QuantMode::int8, {0, nullptr}); }), {"num_threads"});

  auto [d, s] = epcomm::quantize(x, QuantMode::pergroup_fp8_e4m3);
  has(invalid_usage([&] { epcomm::dequantize(d, s, QuantMode::pergroup_fp8_e4m3, DType::i8); }),
      {"out", "i8", "f32"});
  has(invalid_usage([&] { epcomm::dequantize(d, s, QuantMode::int8); }), {"data", "i8", "f8e4m3 [2, 64]"});
  Tensor s1 = Tensor::wrap(s.data(), DType::f32, {2}, {}, s.owner());  // pergroup needs 2-D scales
  has(invalid_usage([&] { epcomm::dequantize(d, s1, QuantMode::pergroup_fp8_e4m3); }),
      {"scales", "f32 [2, 1]", "got f32 [2]"});
  auto [md, ms] = epcomm::quantize(x, QuantMode::mx_fp8_e5m2);
  Tensor bad = Tensor::wrap(ms.data(), DType::u8, {2, 2}, {}, ms.owner());
  has(invalid_usage([&] { epcomm::dequantize(md, bad, QuantMode::mx_fp8_e5m2); }),
      {"scales", "e8m0 [2, 2] or [4]", "got u8 [2, 2]"});
  has(invalid_usage([&] { epcomm::dequantize(md, Tensor(), QuantMode::mx_fp8_e5m2); }),
      {"scales", "undefined"});
  has(invalid_usage([&] { epcomm::dequantize(Tensor(), ms, QuantMode::mx_fp8_e5m2); }),
      {"data", "undefined"});
}

// The documented example of docs/quant.md.
TEST(quant_tensor_api, DocExample) {
  Tensor x = epcomm::empty(DType::bf16, {2, 64});
  auto value = [](int i) { return 0.5f * static_cast<float>(i % 16 - 8); };  // exact in e4m3 after scaling
  for (int i = 0; i < 128; ++i) x.data_as<uint16_t>()[i] = epcomm::to_bf16_bits(value(i));
  auto [codes, scales] = epcomm::quantize(x, QuantMode::mx_fp8_e4m3);
  Tensor y = epcomm::dequantize(codes, scales, QuantMode::mx_fp8_e4m3, DType::f32);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(y.data_as<float>()[i], value(i));
  EXPECT_EQ(epcomm::decode_e4m3(epcomm::encode_e4m3(3.0f)), 3.0f);
}

}  // namespace
