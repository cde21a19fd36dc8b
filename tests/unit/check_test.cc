// tests/unit/check_test.cc — detail::cat, which builds every message and call name: each value comes out as
// std::ostream's operator<< writes it (the fast paths for text and integers included).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>

#include "common/check.h"
#include "epcomm/tensor.h"

namespace epcomm {
namespace {

template <typename... Args>
std::string streamed(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

#define EXPECT_LIKE_STREAM(...) EXPECT_EQ(detail::cat(__VA_ARGS__), streamed(__VA_ARGS__))

TEST(Cat, IntegersOfEveryWidthAsTheStreamWritesThem) {
  EXPECT_LIKE_STREAM(0, -1, std::numeric_limits<int>::min(), std::numeric_limits<int>::max());
  EXPECT_LIKE_STREAM(std::numeric_limits<int64_t>::min(), " ", std::numeric_limits<uint64_t>::max());
  EXPECT_LIKE_STREAM(int16_t{-7}, uint16_t{65535}, uint32_t{4000000000u}, size_t{12345});
  EXPECT_LIKE_STREAM(static_cast<long long>(-42), static_cast<unsigned long>(42));
}

TEST(Cat, CharactersTextAndTheRestAsTheStreamWritesThem) {
  EXPECT_LIKE_STREAM('a', static_cast<signed char>('b'), static_cast<unsigned char>('c'), uint8_t{'d'});
  EXPECT_LIKE_STREAM("text ", std::string("string "), std::string_view("view"), "");
  EXPECT_LIKE_STREAM(true, false, 1.5, 0.1, -2.0e-9, 3.0f, 1e300);
  const int value = 3;
  EXPECT_LIKE_STREAM(&value, static_cast<const void*>(nullptr));
  EXPECT_EQ(detail::cat("rank ", 3, ": ", dtype_name(DType::bf16), shape_str({2, 3})), "rank 3: bf16[2, 3]");
  // A null C string (which a stream treats as an error, dropping everything after it) reads "(null)".
  const char* none = nullptr;
  EXPECT_EQ(detail::cat("name ", none, " here"), "name (null) here");
}

}  // namespace
}  // namespace epcomm
