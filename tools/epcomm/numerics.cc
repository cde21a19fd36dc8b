// tools/epcomm/numerics.cc — seeded random values, dtype conversions and dispatched-row readers.
// Conversions round to nearest even through epcomm/quant_element.h; quantized rows go through quant/row.h.
#include "numerics.h"

#include <utility>

#include <cstring>
#include <vector>

#include "epcomm/quant_element.h"
#include "quant/row.h"

namespace epcomm::cli {

namespace {
// splitmix64's finalizer: a bijective mix with good avalanche.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

RandomStream::RandomStream(uint64_t seed, StreamKind kind, uint64_t id)
    : key_(mix64(mix64(seed) + (static_cast<uint64_t>(kind) << 48) + id)) {}

uint64_t RandomStream::bits(uint64_t index) const {
  return mix64(key_ + index * 0x9E3779B97F4A7C15ull);
}

float RandomStream::uniform(uint64_t index) const {
  return static_cast<float>(bits(index) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

float load_elem(DType dtype, const void* base, int64_t i) {
  switch (dtype) {
    case DType::bf16:
      return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::f16:
      return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

void store_elem(DType dtype, void* base, int64_t i, float v) {
  switch (dtype) {
    case DType::bf16:
      static_cast<uint16_t*>(base)[i] = to_bf16_bits(v);
      break;
    case DType::f16:
      static_cast<uint16_t*>(base)[i] = to_fp16_bits(v);
      break;
    default:
      static_cast<float*>(base)[i] = v;
      break;
  }
}

void load_row(DType dtype, const void* row, int64_t n, float* out) {
  if (dtype == DType::f32) {
    std::memcpy(out, row, static_cast<size_t>(n) * 4);
    return;
  }
  const uint16_t* p = static_cast<const uint16_t*>(row);
  if (dtype == DType::bf16)
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(p[i]);
  else
    for (int64_t i = 0; i < n; ++i) out[i] = fp16_to_float(p[i]);
}

void store_row(DType dtype, const float* in, int64_t n, void* row) {
  if (dtype == DType::f32) {
    std::memcpy(row, in, static_cast<size_t>(n) * 4);
    return;
  }
  uint16_t* p = static_cast<uint16_t*>(row);
  if (dtype == DType::bf16)
    for (int64_t i = 0; i < n; ++i) p[i] = to_bf16_bits(in[i]);
  else
    for (int64_t i = 0; i < n; ++i) p[i] = to_fp16_bits(in[i]);
}

float round_to(DType dtype, float v) {
  if (dtype == DType::bf16) return bf16_to_float(to_bf16_bits(v));
  if (dtype == DType::f16) return fp16_to_float(to_fp16_bits(v));
  return v;
}

double unit_roundoff(DType dtype) {
  if (dtype == DType::bf16) return 1.0 / 256;
  if (dtype == DType::f16) return 1.0 / 2048;
  return 1.0 / 16777216;
}

std::vector<int32_t> uniform_routing(uint64_t seed, int r, int64_t tokens, int topk, int experts) {
  RandomStream rs(seed, StreamKind::routing, static_cast<uint64_t>(r));
  std::vector<int32_t> ids(static_cast<size_t>(tokens * topk));
  std::vector<int32_t> pool(static_cast<size_t>(experts));
  uint64_t n = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int e = 0; e < experts; ++e) pool[e] = e;
    for (int k = 0; k < topk; ++k) {  // a partial Fisher-Yates shuffle: the first topk of a permutation
      const int j = k + static_cast<int>(rs.bits(n++) % static_cast<uint64_t>(experts - k));
      std::swap(pool[k], pool[j]);
      ids[t * topk + k] = pool[k];
    }
  }
  return ids;
}

void make_token(uint64_t seed, int s, int64_t t, int64_t H, DType dtype, void* row) {
  const RandomStream rng(seed, StreamKind::tokens, static_cast<uint64_t>(s));
  const uint64_t base = static_cast<uint64_t>(t) * static_cast<uint64_t>(H);
  for (int64_t h = 0; h < H; ++h) store_elem(dtype, row, h, rng.uniform(base + h));
}

void seen_token_f32(std::optional<QuantMode> quant, DType dtype, const void* row, int64_t H, float* out) {
  if (!quant || *quant == QuantMode::bf16) {
    load_row(dtype, row, H, out);
    return;
  }
  std::vector<std::byte> data(quant::row_data_bytes(*quant, H)), scales(quant::row_scale_bytes(*quant, H));
  quant::quantize_row(*quant, dtype, row, H, data.data(), scales.data());
  quant::dequantize_row(*quant, data.data(), scales.data(), H, out);
}

void recv_row_f32(const Payload& recv_x, std::optional<QuantMode> quant, int64_t H, int64_t i, float* out) {
  if (!recv_x.scales) {
    const size_t row_bytes = static_cast<size_t>(H) * dtype_size(recv_x.data.dtype());
    load_row(recv_x.data.dtype(), static_cast<const std::byte*>(recv_x.data.data()) + i * row_bytes, H, out);
    return;
  }
  // Quantized rows: row i owns a fixed slice of the data and of the (possibly flat) scales
  // (docs/normal-mode.md).
  const size_t data_bytes = quant::row_data_bytes(*quant, H), scale_bytes = quant::row_scale_bytes(*quant, H);
  quant::dequantize_row(*quant, static_cast<const std::byte*>(recv_x.data.data()) + i * data_bytes,
                        static_cast<const std::byte*>(recv_x.scales->data()) + i * scale_bytes, H, out);
}

}  // namespace epcomm::cli
