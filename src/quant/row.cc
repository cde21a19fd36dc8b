// quant/row.cc — normal-mode quant_mode -> block algorithm, and the row byte layout of docs/normal-mode.md.
#include "quant/row.h"

#include <cstring>

#include "common/check.h"
#include "quant/block.h"
#include "quant/element.h"

namespace epcomm::quant {
namespace {

size_t groups(int64_t H, int64_t g) {
  return static_cast<size_t>((H + g - 1) / g);
}

}  // namespace

size_t row_data_bytes(QuantMode mode, int64_t H) {
  size_t h = static_cast<size_t>(H);
  switch (mode) {
    case QuantMode::bf16:
      return 2 * h;
    case QuantMode::mx_fp4_e2m1:
      return h / 2;
    default:
      return h;
  }
}

size_t row_scale_bytes(QuantMode mode, int64_t H) {
  switch (mode) {
    case QuantMode::bf16:
      return 0;
    case QuantMode::int8:
    case QuantMode::pertoken_fp8_e4m3:
      return 4;
    case QuantMode::pergroup_fp8_e4m3:
    case QuantMode::pergroup_fp8_e4m3_pow2:
      return 4 * groups(H, kGroup128);
    case QuantMode::pergroup_fp8_e4m3_ue8m0:
      return groups(H, kGroup128);
    case QuantMode::mx_fp8_e4m3:
    case QuantMode::mx_fp8_e5m2:
    case QuantMode::mx_fp4_e2m1:
      return groups(H, kMxBlock);
  }
  return 0;
}

void check_hidden(QuantMode mode, int64_t H) {
  EPCOMM_CHECK_GE(H, 1, "hidden must be at least 1");
  bool mx =
      mode == QuantMode::mx_fp8_e4m3 || mode == QuantMode::mx_fp8_e5m2 || mode == QuantMode::mx_fp4_e2m1;
  if (mx)
    EPCOMM_CHECK(H % kMxBlock == 0, "hidden: quant_mode ", quant_mode_name(mode),
                 " needs hidden to be a multiple of 32 (hidden = ", H, ", hidden % 32 = ", H % kMxBlock, ")");
}

void quantize_row(QuantMode mode, DType in, const void* x, int64_t H, void* data_out, void* scales_out) {
  check_hidden(mode, H);
  auto* codes = static_cast<uint8_t*>(data_out);
  auto* sbytes = static_cast<uint8_t*>(scales_out);
  switch (mode) {
    case QuantMode::bf16:
      EPCOMM_CHECK(in == DType::bf16, "x dtype: quant_mode bf16 needs x of dtype bf16, got ", dtype_name(in));
      std::memcpy(data_out, x, 2 * static_cast<size_t>(H));
      return;
    case QuantMode::int8: {
      float s;  // scales_out may be unaligned inside a packed record
      int8_per_token_a3(in, x, H, Smoothing::none(), static_cast<int8_t*>(data_out), &s);
      std::memcpy(scales_out, &s, sizeof s);
      return;
    }
    case QuantMode::pertoken_fp8_e4m3: {
      float s;
      fp8_per_token(Fp8Format::e4m3, in, x, H, Smoothing::none(), codes, &s);
      std::memcpy(scales_out, &s, sizeof s);
      return;
    }
    case QuantMode::pergroup_fp8_e4m3:
      fp8_per_group128(Fp8Format::e4m3, in, x, H, Smoothing::none(), codes, scales_out);
      return;
    case QuantMode::pergroup_fp8_e4m3_pow2:
    case QuantMode::pergroup_fp8_e4m3_ue8m0:
      fp8_per_group128(Fp8Format::e4m3, in, x, H, Smoothing::none(), codes, scales_out,
                       {true, mode == QuantMode::pergroup_fp8_e4m3_ue8m0});
      return;
    case QuantMode::mx_fp8_e4m3:
      mxfp8_e4m3(in, x, H, codes, sbytes);
      return;
    case QuantMode::mx_fp8_e5m2:
      mxfp8_e5m2(in, x, H, codes, sbytes);
      return;
    case QuantMode::mx_fp4_e2m1:
      mxfp4_e2m1(in, x, H, codes, sbytes);
      return;
  }
}

void dequantize_row(QuantMode mode, const void* data, const void* scales, int64_t H, float* out) {
  const auto* codes = static_cast<const uint8_t*>(data);
  const auto* sbytes = static_cast<const uint8_t*>(scales);
  // Scales may sit at any byte offset in a packed record: read them with memcpy, not through a float*.
  auto scale0 = [scales] {
    float s;
    std::memcpy(&s, scales, sizeof s);
    return s;
  };
  switch (mode) {
    case QuantMode::bf16: {
      // Rows of a packed record may start at an odd byte: load each element with memcpy.
      for (int64_t i = 0; i < H; ++i) {
        uint16_t b;
        std::memcpy(&b, codes + 2 * i, sizeof b);
        out[i] = bf16_to_float(b);
      }
      return;
    }
    case QuantMode::int8:
      dequant_int8_per_token(static_cast<const int8_t*>(data), scale0(), H, out);
      return;
    case QuantMode::pertoken_fp8_e4m3:
      dequant_fp8_per_token(Fp8Format::e4m3, codes, scale0(), H, out);
      return;
    case QuantMode::pergroup_fp8_e4m3:
    case QuantMode::pergroup_fp8_e4m3_pow2:
      dequant_fp8_per_group128(Fp8Format::e4m3, codes, scales, H, out);
      return;
    case QuantMode::pergroup_fp8_e4m3_ue8m0:
      dequant_fp8_per_group128(Fp8Format::e4m3, codes, scales, H, out, true);
      return;
    case QuantMode::mx_fp8_e4m3:
      dequant_mx(MxElem::e4m3, codes, sbytes, H, out);
      return;
    case QuantMode::mx_fp8_e5m2:
      dequant_mx(MxElem::e5m2, codes, sbytes, H, out);
      return;
    case QuantMode::mx_fp4_e2m1:
      dequant_mx(MxElem::e2m1, codes, sbytes, H, out);
      return;
  }
}

DType data_dtype(QuantMode mode) {
  switch (mode) {
    case QuantMode::bf16:
      return DType::bf16;
    case QuantMode::int8:
      return DType::i8;
    case QuantMode::mx_fp8_e5m2:
      return DType::f8e5m2;
    case QuantMode::mx_fp4_e2m1:
      return DType::f4x2;
    default:
      return DType::f8e4m3;
  }
}

DType scale_dtype(QuantMode mode) {
  switch (mode) {
    case QuantMode::bf16:
      return DType::u8;
    case QuantMode::int8:
    case QuantMode::pertoken_fp8_e4m3:
    case QuantMode::pergroup_fp8_e4m3:
    case QuantMode::pergroup_fp8_e4m3_pow2:
      return DType::f32;
    default:
      return DType::e8m0;
  }
}

}  // namespace epcomm::quant
