// quant/block.h — every named block quantizer of docs/quant.md and its dequantization (docs/quant.md), one
// row at a time. Function names are the spec's algorithm names; distribute-v2 and normal mode call these
// through row.h or directly.
#pragma once

#include <cstddef>
#include <cstdint>

#include "epcomm/tensor.h"

namespace epcomm::quant {

// Conventions for every function here:
// - `x` points at one row of `n` elements of dtype `in` (bf16, f16 or f32); results depend only on the fp32
//   values. Outputs are caller-owned buffers: codes hold n bytes (n/2 for fp4), scales one entry per group.
// - Groups (128), MX blocks (32) and combine groups (8) are consecutive elements; a partial last one is
//   computed from the elements it has.
// - Calls are pure and thread-safe. A bad dtype or size throws Error(InvalidUsage); nothing else throws.

// The optional smoothing factor c of docs/quant.md: xf_i = fp32(x_i) ⊗ c_i (none, one scalar, or one fp32 per
// element, caller-owned and at least n long).
class Smoothing {
 public:
  enum class Kind { none, scalar, vector };
  Smoothing() = default;
  static Smoothing none() { return {}; }
  static Smoothing scalar(float c) { return Smoothing(Kind::scalar, c, nullptr); }
  static Smoothing vector(const float* c) { return Smoothing(Kind::vector, 1.0f, c); }
  Kind kind() const { return kind_; }
  float scalar_value() const { return scalar_; }
  const float* vector_data() const { return vector_; }

 private:
  Smoothing(Kind k, float s, const float* v) : kind_(k), scalar_(s), vector_(v) {}
  Kind kind_ = Kind::none;
  float scalar_ = 1.0f;
  const float* vector_ = nullptr;
};

enum class Fp8Format { e4m3, e5m2 };     // M = 448 / 57344
enum class MxElem { e4m3, e5m2, e2m1 };  // (emax, M) = (8, 448), (15, 57344), (2, 6)
enum class ScaleRule { floor, rceil };   // MX scale rule (docs/quant.md); FLOOR is what every mode uses

inline constexpr int64_t kGroup128 = 128;
inline constexpr int64_t kMxBlock = 32;
inline constexpr int64_t kCombineGroup = 8;

// ---- docs/quant.md per-token and per-group ----

// s = 127 ∕ amax; q_i = int8_sat(xf_i ⊗ s, ±127); *scale = 1 ∕ s. Degenerate row: q = 0, scale +0.
void int8_per_token_a3(DType in, const void* x, int64_t n, const Smoothing& c, int8_t* q, float* scale);
// scale = amax ⊗ fp32(1/127); q_i = int8_sat(xf_i ∕ scale, ±127).
void int8_per_token_950(DType in, const void* x, int64_t n, const Smoothing& c, int8_t* q, float* scale);
// d = M ∕ amax; codes_i = fp8_sat(xf_i ⊗ d); *scale = 1 ∕ d.
void fp8_per_token(Fp8Format fmt, DType in, const void* x, int64_t n, const Smoothing& c, uint8_t* codes,
                   float* scale);

struct Group128Options {
  bool pow2_scale = false;  // DeepEP round_scale: scale_inv = 2^k, d = 2^-k
  bool ue8m0 = false;       // store one e8m0 byte per group instead of fp32 (requires pow2_scale)
};
// DeepEP arithmetic per 128-group: a = max(1e-4, amax); scale_inv = a ⊗ fp32(1/M); d = M ∕ a.
// `scales` holds ceil(n/128) floats (any alignment), or bytes when options.ue8m0.
void fp8_per_group128(Fp8Format fmt, DType in, const void* x, int64_t n, const Smoothing& c, uint8_t* codes,
                      void* scales, Group128Options options = {});
// fp8_per_token on each 128-group; scales holds ceil(n/128) floats (distribute-v2 quant_mode 3).
void fp8_per_group128_a3(Fp8Format fmt, DType in, const void* x, int64_t n, const Smoothing& c,
                         uint8_t* codes, float* scales);

// ---- docs/quant.md MX (no smoothing) ----

// One e8m0 byte per 32-block in `scales` (ceil(n/32) bytes); codes are n bytes, or n/2 packed f4x2 bytes for
// e2m1 (n must be even).
void mx_quantize(MxElem elem, ScaleRule rule, DType in, const void* x, int64_t n, uint8_t* codes,
                 uint8_t* scales);
inline void mxfp8_e4m3(DType in, const void* x, int64_t n, uint8_t* codes, uint8_t* scales,
                       ScaleRule rule = ScaleRule::floor) {
  mx_quantize(MxElem::e4m3, rule, in, x, n, codes, scales);
}
inline void mxfp8_e5m2(DType in, const void* x, int64_t n, uint8_t* codes, uint8_t* scales,
                       ScaleRule rule = ScaleRule::floor) {
  mx_quantize(MxElem::e5m2, rule, in, x, n, codes, scales);
}
inline void mxfp4_e2m1(DType in, const void* x, int64_t n, uint8_t* packed, uint8_t* scales,
                       ScaleRule rule = ScaleRule::floor) {
  mx_quantize(MxElem::e2m1, rule, in, x, n, packed, scales);
}

// ---- docs/quant.md static and combine ----

// q_i = int8_sat(fp32(x_i) ⊗ c_i, −128, 127); no scale (distribute-v2 quant_mode 1).
void int8_static(DType in, const void* x, int64_t n, const Smoothing& c, int8_t* q);
// codes_i = hif8_sat(fp32(x_i) ⊗ c_i); no scale.
void hif8_static(DType in, const void* x, int64_t n, const Smoothing& c, uint8_t* codes);
// Combine communication quantization (docs/distribute-v2.md, comm_quant_mode 2), groups of 8 of `y` in dtype
// `dt` (bf16 or f16): s32 = amax ⊗ fp32(1/127); sigma = RNE_dt(s32) (bits of dtype dt); q = RNE_int(fp32(y) ∕
// s32). Zero group (s32 = 0): q = 0, sigma = +0. Group with NaN/Inf: q = 0, sigma = canonical NaN of dt.
// `sigma` holds ceil(n/8) entries.
void int8_group8_combine(DType dt, const void* y, int64_t n, int8_t* q, uint16_t* sigma);

// ---- docs/quant.md dequantization (fp32 out) ----

// out_i = fp32(q_i) ⊗ scale (both int8 per-token variants).
void dequant_int8_per_token(const int8_t* q, float scale, int64_t n, float* out);
// out_i = decode(c_i) ⊗ scale.
void dequant_fp8_per_token(Fp8Format fmt, const uint8_t* codes, float scale, int64_t n, float* out);
// out_i = decode(c_i) ⊗ scales[i/128]; scales are floats, or e8m0 bytes b (multiplier 2^(b−127)) when ue8m0.
// Serves fp8_per_group128 and fp8_per_group128_a3; float scales may have any alignment.
void dequant_fp8_per_group128(Fp8Format fmt, const uint8_t* codes, const void* scales, int64_t n, float* out,
                              bool ue8m0 = false);
// out_i = decode(c_i) ⊗ e8m0_decode(scales[i/32]) (exact; NaN for a 0xFF scale).
void dequant_mx(MxElem elem, const uint8_t* codes, const uint8_t* scales, int64_t n, float* out);
// The receiver's decode of int8_group8_combine: out_i = RNE_dt(fp32(q_i) ⊗ fp32(sigma[i/8])), bits of dt.
void int8_group8_combine_dequant(DType dt, const int8_t* q, const uint16_t* sigma, int64_t n, uint16_t* out);

}  // namespace epcomm::quant
