// quant/tensor_api.cc — epcomm::quantize / epcomm::dequantize (include/epcomm/quant.h): shape and dtype
// checks, then the row functions of row.h over the rows, split across threads.
#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "common/check.h"
#include "epcomm/quant.h"
#include "quant/row.h"

namespace epcomm {
namespace {

bool is_mx(QuantMode m) {
  return m == QuantMode::mx_fp8_e4m3 || m == QuantMode::mx_fp8_e5m2 || m == QuantMode::mx_fp4_e2m1;
}

// Runs body(r0, r1) over [0, rows) in num_threads contiguous slices; rethrows the first error.
template <class F>
void parallel_rows(int64_t rows, int num_threads, F&& body) {
  EPCOMM_CHECK_GE(num_threads, 1, "options.num_threads must be positive");
  int64_t nt = std::min<int64_t>(num_threads, std::max<int64_t>(rows, 1));
  if (nt <= 1) {
    body(int64_t{0}, rows);
    return;
  }
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(nt));
  for (int64_t t = 0; t < nt; ++t) {
    int64_t r0 = rows * t / nt, r1 = rows * (t + 1) / nt;
    threads.emplace_back([&, t, r0, r1] {
      try {
        body(r0, r1);
      } catch (...) {
        errors[static_cast<size_t>(t)] = std::current_exception();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// The data tensor's shape and the scales' canonical shape quantize returns for `mode`.
Shape data_shape(QuantMode mode, int64_t T, int64_t H) {
  return {T, mode == QuantMode::mx_fp4_e2m1 ? H / 2 : H};
}
Shape scale_shape(QuantMode mode, int64_t T, int64_t H) {
  switch (mode) {
    case QuantMode::bf16:
      return {};
    case QuantMode::int8:
    case QuantMode::pertoken_fp8_e4m3:
      return {T};
    case QuantMode::pergroup_fp8_e4m3:
    case QuantMode::pergroup_fp8_e4m3_pow2:
    case QuantMode::pergroup_fp8_e4m3_ue8m0:
      return {T, (H + 127) / 128};
    default:
      return {T, H / 32};
  }
}

std::string tensor_desc(const Tensor& t) {
  if (!t.defined()) return "undefined";
  return detail::cat(dtype_name(t.dtype()), " ", shape_str(t.shape()));
}

}  // namespace

std::pair<Tensor, Tensor> quantize(const Tensor& x, QuantMode mode, const QuantOptions& options) {
  EPCOMM_CHECK(x.dim() == 1 || x.dim() == 2, "x: expected a [T, H] or [H] tensor, got ", x.dim(),
               " dimensions ", shape_str(x.shape()));
  DType in = x.dtype();
  EPCOMM_CHECK(in == DType::bf16 || in == DType::f16 || in == DType::f32,
               "x dtype: expected bf16, f16 or f32, got ", dtype_name(in));
  if (mode == QuantMode::bf16)
    EPCOMM_CHECK(in == DType::bf16, "x dtype: quant_mode bf16 needs x of dtype bf16, got ", dtype_name(in));
  int64_t T = x.dim() == 2 ? x.size(0) : 1;
  int64_t H = x.size(x.dim() - 1);
  quant::check_hidden(mode, H);
  EPCOMM_CHECK_EQ(x.strides().back(), 1, "x: the last dimension must be contiguous");
  int64_t row_stride = x.dim() == 2 ? x.strides()[0] : H;
  EPCOMM_CHECK(T <= 1 || row_stride >= H, "x: rows overlap (stride ", row_stride, " < H = ", H, ")");
  EPCOMM_CHECK(T == 0 || x.data() != nullptr, "x: data pointer is null");

  Tensor data = empty(quant::data_dtype(mode), data_shape(mode, T, H), options.allocator);
  Tensor scales;
  if (mode != QuantMode::bf16)
    scales = empty(quant::scale_dtype(mode), scale_shape(mode, T, H), options.allocator);
  size_t in_row = static_cast<size_t>(row_stride) * dtype_size(in);
  size_t data_row = quant::row_data_bytes(mode, H), scale_row = quant::row_scale_bytes(mode, H);
  auto* xin = static_cast<const uint8_t*>(x.data());
  auto* dout = static_cast<uint8_t*>(data.data());
  auto* sout = static_cast<uint8_t*>(scales.data());
  parallel_rows(T, options.num_threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      size_t ur = static_cast<size_t>(r);
      quant::quantize_row(mode, in, xin + ur * in_row, H, dout + ur * data_row,
                          sout ? sout + ur * scale_row : nullptr);
    }
  });
  return {data, scales};
}

Tensor dequantize(const Tensor& data, const Tensor& scales, QuantMode mode, DType out,
                  const QuantOptions& options) {
  EPCOMM_CHECK(out == DType::f32 || out == DType::bf16 || out == DType::f16,
               "out: expected dtype f32, bf16 or f16, got ", dtype_name(out));
  EPCOMM_CHECK(data.defined() && data.dim() == 2,
               "data: expected a contiguous 2-D [T, H] tensor for quant_mode ", quant_mode_name(mode),
               ", got ", tensor_desc(data));
  int64_t T = data.size(0);
  int64_t H = mode == QuantMode::mx_fp4_e2m1 ? 2 * data.size(1) : data.size(1);
  DType want_data = quant::data_dtype(mode);
  EPCOMM_CHECK(data.dtype() == want_data, "data: quant_mode ", quant_mode_name(mode),
               " expects data of dtype ", dtype_name(want_data), ", got ", tensor_desc(data));
  EPCOMM_CHECK(data.is_contiguous(), "data: must be contiguous, got strides ", shape_str(data.strides()));
  quant::check_hidden(mode, H);

  // Scales: canonical shape, or flat [T * H/32] for MX; any strides. Gather them into a packed copy.
  Shape want = scale_shape(mode, T, H);
  int64_t per_row = mode == QuantMode::bf16 ? 0 : (want.size() == 2 ? want[1] : 1);
  const Shape* s_strides = nullptr;
  bool flat_mx = false;
  if (mode != QuantMode::bf16) {
    DType want_s = quant::scale_dtype(mode);
    bool shape_ok = scales.defined() && scales.shape() == want;
    if (!shape_ok && is_mx(mode) && scales.defined() && scales.dim() == 1 && scales.size(0) == T * per_row) {
      shape_ok = true;
      flat_mx = true;
    }
    std::string accepted = shape_str(want);
    if (is_mx(mode)) accepted += detail::cat(" or [", T * per_row, "]");
    EPCOMM_CHECK(shape_ok && scales.dtype() == want_s, "scales: quant_mode ", quant_mode_name(mode),
                 " with data ", tensor_desc(data), " expects scales ", dtype_name(want_s), " ", accepted,
                 ", got ", tensor_desc(scales));
    s_strides = &scales.strides();
  }
  size_t selem = mode == QuantMode::bf16 ? 0 : dtype_size(quant::scale_dtype(mode));

  Tensor result = empty(out, {T, H}, options.allocator);
  auto* din = static_cast<const uint8_t*>(data.data());
  size_t data_row = quant::row_data_bytes(mode, H);
  parallel_rows(T, options.num_threads, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> srow(static_cast<size_t>(per_row) * selem);
    std::vector<float> f32row(out == DType::f32 ? 0 : static_cast<size_t>(H));
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t g = 0; g < per_row; ++g) {
        int64_t off = flat_mx            ? (r * per_row + g) * (*s_strides)[0]
                      : want.size() == 2 ? r * (*s_strides)[0] + g * (*s_strides)[1]
                                         : r * (*s_strides)[0];
        std::memcpy(srow.data() + static_cast<size_t>(g) * selem,
                    static_cast<const uint8_t*>(scales.data()) + off * static_cast<int64_t>(selem), selem);
      }
      size_t ur = static_cast<size_t>(r);
      if (out == DType::f32) {
        quant::dequantize_row(mode, din + ur * data_row, srow.data(), H,
                              result.data_as<float>() + ur * static_cast<size_t>(H));
        continue;
      }
      quant::dequantize_row(mode, din + ur * data_row, srow.data(), H, f32row.data());
      uint16_t* dst = result.data_as<uint16_t>() + ur * static_cast<size_t>(H);
      if (out == DType::bf16)
        for (int64_t i = 0; i < H; ++i) dst[i] = to_bf16_bits(f32row[static_cast<size_t>(i)]);
      else
        for (int64_t i = 0; i < H; ++i) dst[i] = to_fp16_bits(f32row[static_cast<size_t>(i)]);
    }
  });
  return result;
}

}  // namespace epcomm
