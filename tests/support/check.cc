// support/check.cc — row-buffer comparison and tensor extraction for check.h.
#include "support/check.h"

#include <iomanip>

#include "support/problem.h"
#include "support/ref_float.h"

namespace epcomm::testing {

namespace {

bool is_float_dtype(DType dtype) {
  return dtype == DType::bf16 || dtype == DType::f16 || dtype == DType::f32;
}

std::string hex_element(const uint8_t* p, size_t size) {
  std::ostringstream os;
  os << "0x" << std::hex << std::setfill('0');
  for (size_t b = size; b-- > 0;) os << std::setw(2) << static_cast<unsigned>(p[b]);  // little-endian value
  return os.str();
}

}  // namespace

void check_rows_equal(const std::string& what, const uint8_t* actual, const uint8_t* expected,
                      int64_t num_rows, size_t row_bytes, DType dtype) {
  const size_t elem = elem_size(dtype);
  for (int64_t i = 0; i < num_rows; ++i) {
    const uint8_t* a = actual + static_cast<size_t>(i) * row_bytes;
    const uint8_t* e = expected + static_cast<size_t>(i) * row_bytes;
    if (std::memcmp(a, e, row_bytes) == 0) continue;
    size_t byte = 0;
    while (a[byte] == e[byte]) ++byte;
    const size_t column = byte / elem;
    const size_t start = column * elem;
    const size_t width = start + elem <= row_bytes ? elem : row_bytes - start;
    std::ostringstream os;
    os << what << ": row " << i << ", column " << column << " (byte " << byte << " of " << row_bytes
       << "): actual " << hex_element(a + start, width) << ", expected " << hex_element(e + start, width);
    if (is_float_dtype(dtype) && row_bytes % elem == 0) {
      const int64_t hidden = static_cast<int64_t>(row_bytes / elem);
      os << "; actual row " << describe_row_tag(a, hidden, dtype) << ", expected row "
         << describe_row_tag(e, hidden, dtype);
    }
    throw std::runtime_error(os.str());
  }
}

void check_rows_equal(const std::string& what, const std::vector<uint8_t>& actual,
                      const std::vector<uint8_t>& expected, size_t row_bytes, DType dtype) {
  if (actual.size() != expected.size() || (row_bytes > 0 && actual.size() % row_bytes != 0)) {
    std::ostringstream os;
    os << what << ": " << actual.size() << " bytes, expected " << expected.size() << " bytes";
    if (row_bytes > 0)
      os << " (" << actual.size() / row_bytes << " vs " << expected.size() / row_bytes << " rows of "
         << row_bytes << " bytes)";
    throw std::runtime_error(os.str());
  }
  if (row_bytes == 0) return;
  check_rows_equal(what, actual.data(), expected.data(), static_cast<int64_t>(actual.size() / row_bytes),
                   row_bytes, dtype);
}

std::vector<uint8_t> tensor_bytes(const Tensor& tensor) {
  if (!tensor.is_contiguous()) throw std::runtime_error("tensor_bytes: tensor is not contiguous");
  const size_t bytes = static_cast<size_t>(tensor.numel()) * elem_size(tensor.dtype());
  std::vector<uint8_t> out(bytes);
  if (bytes > 0) std::memcpy(out.data(), tensor.data(), bytes);
  return out;
}

std::vector<int64_t> tensor_to_i64(const Tensor& tensor) {
  const std::vector<uint8_t> bytes = tensor_bytes(tensor);
  const size_t n = static_cast<size_t>(tensor.numel());
  std::vector<int64_t> out(n);
  for (size_t i = 0; i < n; ++i) {
    switch (tensor.dtype()) {
      case DType::i64:
        std::memcpy(&out[i], bytes.data() + 8 * i, 8);
        break;
      case DType::i32: {
        int32_t v;
        std::memcpy(&v, bytes.data() + 4 * i, 4);
        out[i] = v;
        break;
      }
      case DType::i8:
        out[i] = static_cast<int8_t>(bytes[i]);
        break;
      case DType::u8:
      case DType::boolean:
        out[i] = bytes[i];
        break;
      default:
        throw std::runtime_error("tensor_to_i64: dtype is not an integer type");
    }
  }
  return out;
}

std::vector<int32_t> tensor_to_i32(const Tensor& tensor) {
  if (tensor.dtype() != DType::i32) throw std::runtime_error("tensor_to_i32: dtype is not i32");
  const std::vector<uint8_t> bytes = tensor_bytes(tensor);
  std::vector<int32_t> out(bytes.size() / 4);
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

std::vector<float> tensor_to_f32(const Tensor& tensor) {
  if (tensor.dtype() != DType::f32) throw std::runtime_error("tensor_to_f32: dtype is not f32");
  const std::vector<uint8_t> bytes = tensor_bytes(tensor);
  std::vector<float> out(bytes.size() / 4);
  if (!out.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

}  // namespace epcomm::testing
