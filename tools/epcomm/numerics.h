// tools/epcomm/numerics.h — seeded counter-based random values (equal on every rank, in any order), element
// conversions between the token dtypes and fp32, and reading a dispatched row (plain or quantized) as fp32.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "epcomm/buffer.h"
#include "epcomm/tensor.h"
#include "epcomm/types.h"

namespace epcomm::cli {

// Independent streams of random values; each is addressed by (kind, id) and an element index.
enum class StreamKind : uint64_t {
  tokens = 1,
  router = 2,
  gate = 3,
  up = 4,
  down = 5,
  routing = 6,
  weights = 7
};

// Stream (kind, id) under `seed`: value `index` is a pure function of the four, so every rank can
// regenerate any other rank's inputs without communication, in any order.
class RandomStream {
 public:
  RandomStream(uint64_t seed, StreamKind kind, uint64_t id);
  uint64_t bits(uint64_t index) const;
  float uniform(uint64_t index) const;  // in [-1, 1), 24 random bits (exact in fp32)

 private:
  uint64_t key_;
};

// Element conversions (round to nearest even, docs/quant.md) for bf16, f16 and f32.
float load_elem(DType dtype, const void* base, int64_t i);
void store_elem(DType dtype, void* base, int64_t i, float v);
void load_row(DType dtype, const void* row, int64_t n, float* out);
void store_row(DType dtype, const float* in, int64_t n, void* row);
float round_to(DType dtype, float v);
// Unit roundoff of the dtype: 2^-8 (bf16), 2^-11 (f16), 2^-24 (f32).
double unit_roundoff(DType dtype);

// Rank r's routing: `topk` distinct experts of `experts` per token, uniform, from stream (routing, r) of
// `seed`; [tokens * topk], token-major.
std::vector<int32_t> uniform_routing(uint64_t seed, int r, int64_t tokens, int topk, int experts);

// Token t of rank s: H random values rounded to `dtype`, written to `row` (H * dtype_size bytes).
void make_token(uint64_t seed, int s, int64_t t, int64_t H, DType dtype, void* row);

// The values a receiver sees for a token row after dispatch: the row itself, or the quantized row
// dequantized (quant/row.h), as fp32.
void seen_token_f32(std::optional<QuantMode> quant, DType dtype, const void* row, int64_t H, float* out);

// Row i of a dispatch result as fp32: plain rows convert, (data, scales) rows dequantize.
void recv_row_f32(const Payload& recv_x, std::optional<QuantMode> quant, int64_t H, int64_t i, float* out);

}  // namespace epcomm::cli
