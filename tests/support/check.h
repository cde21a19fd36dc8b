// support/check.h — comparison helpers for multi-rank tests. Each throws std::runtime_error with a precise
// message on the first mismatch (what, where, both values in hex, decoded row tags); nothing is printed
// on success. Floats are always compared bitwise (NaN payloads and -0 included).
#pragma once

#include <cstdint>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "epcomm/tensor.h"

namespace epcomm::testing {

// ---------------------------------------------------------------------------------------------------------
// Row buffers
// ---------------------------------------------------------------------------------------------------------

// Compares num_rows rows of row_bytes bytes. `dtype` is the element type (column = element index; for
// bf16/f16/f32 rows both rows' tags are decoded in the message). Message:
//   "<what>: row 3, column 5 (byte 10): actual 0x7fc0, expected 0x4040; actual row (s=1, t=7), expected row
//    (s=0, t=2)"
void check_rows_equal(const std::string& what, const uint8_t* actual, const uint8_t* expected,
                      int64_t num_rows, size_t row_bytes, DType dtype);
// Same over whole buffers; a size difference is reported first (in bytes and rows).
void check_rows_equal(const std::string& what, const std::vector<uint8_t>& actual,
                      const std::vector<uint8_t>& expected, size_t row_bytes, DType dtype);

// ---------------------------------------------------------------------------------------------------------
// Tensor access (Tensor bookkeeping only; the tensor must be contiguous)
// ---------------------------------------------------------------------------------------------------------

std::vector<uint8_t> tensor_bytes(const Tensor& tensor);
std::vector<int64_t> tensor_to_i64(const Tensor& tensor);  // i64, i32, i8, u8 or bool, widened
std::vector<int32_t> tensor_to_i32(const Tensor& tensor);  // i32 only
std::vector<float> tensor_to_f32(const Tensor& tensor);    // f32 only, bit copy

// ---------------------------------------------------------------------------------------------------------
// Vectors of integers or floats
// ---------------------------------------------------------------------------------------------------------

namespace detail {

template <typename T>
std::string value_str(T value) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, float>) {
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    os << value << " (0x" << std::hex << bits << ")";
  } else if constexpr (std::is_same_v<T, double>) {
    uint64_t bits;
    std::memcpy(&bits, &value, 8);
    os << value << " (0x" << std::hex << bits << ")";
  } else {
    using Wide = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
    os << static_cast<Wide>(value);
  }
  return os.str();
}

template <typename T>
bool same_bits(T a, T b) {
  if constexpr (std::is_floating_point_v<T>) {
    return std::memcmp(&a, &b, sizeof(T)) == 0;
  } else {
    return a == b;
  }
}

}  // namespace detail

// Element-wise (floats bitwise). With cols > 0 the index is reported as [i / cols, i % cols].
template <typename T>
void check_equal(const std::string& what, const std::vector<T>& actual, const std::vector<T>& expected,
                 int64_t cols = 0) {
  if (actual.size() != expected.size()) {
    std::ostringstream os;
    os << what << ": size " << actual.size() << ", expected " << expected.size();
    if (cols > 0)
      os << " (" << actual.size() / cols << " vs " << expected.size() / cols << " rows of " << cols << ")";
    throw std::runtime_error(os.str());
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    if (detail::same_bits(actual[i], expected[i])) continue;
    std::ostringstream os;
    os << what;
    if (cols > 0)
      os << "[" << i / static_cast<size_t>(cols) << ", " << i % static_cast<size_t>(cols) << "]";
    else
      os << "[" << i << "]";
    os << ": actual " << detail::value_str(actual[i]) << ", expected " << detail::value_str(expected[i]);
    throw std::runtime_error(os.str());
  }
}

// A scalar check: throws "<what>: actual A, expected B".
template <typename T>
void check_scalar(const std::string& what, T actual, T expected) {
  if (detail::same_bits(actual, expected)) return;
  throw std::runtime_error(what + ": actual " + detail::value_str(actual) + ", expected " +
                           detail::value_str(expected));
}

}  // namespace epcomm::testing
