// common/check.h — argument and invariant checks that print the failing expression and the values.
// EPCOMM_CHECK* throw epcomm::Error(InvalidUsage); EPCOMM_CHECK_ERRNO throws SystemError with strerror.
#pragma once

#include <cerrno>
#include <charconv>
#include <cstring>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>

#include "epcomm/error.h"

namespace epcomm::detail {

// Appends one value as `std::ostream <<` writes it: text and integers directly (call names are built on
// every call of the operator family, where a stream's construction cost ~0.3 us), anything else (floating
// point, pointers, types with their own operator<<) through a stream.
template <typename T>
void append_streamed(std::string& s, const T& v) {
  if constexpr (std::is_pointer_v<T> && std::is_convertible_v<const T&, std::string_view>) {
    s.append(v ? std::string_view(v) : std::string_view("(null)"));  // a stream would drop the rest
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    s.append(std::string_view(v));
  } else if constexpr (std::is_same_v<T, char> || std::is_same_v<T, signed char> ||
                       std::is_same_v<T, unsigned char>) {
    s.push_back(static_cast<char>(v));  // as a character, like the stream
  } else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    char buf[24];
    const char* end = std::to_chars(buf, buf + sizeof buf, v).ptr;
    s.append(buf, static_cast<size_t>(end - buf));
  } else {
    std::ostringstream os;
    os << v;
    s.append(os.str());
  }
}

// Concatenates any streamable values into one string, formatted as `std::ostream <<` formats them.
template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (append_streamed(s, args), ...);
  return s;
}

[[noreturn]] void throw_error(ErrorCode code, const std::string& message);

}  // namespace epcomm::detail

#define EPCOMM_THROW(code, ...) \
  ::epcomm::detail::throw_error(::epcomm::ErrorCode::code, ::epcomm::detail::cat(__VA_ARGS__))

#define EPCOMM_CHECK(cond, ...)                           \
  do {                                                    \
    if (!(cond)) EPCOMM_THROW(InvalidUsage, __VA_ARGS__); \
  } while (0)

#define EPCOMM_CHECK_OP_(a, b, op, ...)                                                                     \
  do {                                                                                                      \
    const auto& epcomm_a_ = (a);                                                                            \
    const auto& epcomm_b_ = (b);                                                                            \
    if (!(epcomm_a_ op epcomm_b_))                                                                          \
      EPCOMM_THROW(InvalidUsage, __VA_ARGS__, " (", #a, " = ", epcomm_a_, ", expected " #op " ", #b, " = ", \
                   epcomm_b_, ")");                                                                         \
  } while (0)
#define EPCOMM_CHECK_EQ(a, b, ...) EPCOMM_CHECK_OP_(a, b, ==, __VA_ARGS__)
#define EPCOMM_CHECK_NE(a, b, ...) EPCOMM_CHECK_OP_(a, b, !=, __VA_ARGS__)
#define EPCOMM_CHECK_GE(a, b, ...) EPCOMM_CHECK_OP_(a, b, >=, __VA_ARGS__)
#define EPCOMM_CHECK_GT(a, b, ...) EPCOMM_CHECK_OP_(a, b, >, __VA_ARGS__)
#define EPCOMM_CHECK_LE(a, b, ...) EPCOMM_CHECK_OP_(a, b, <=, __VA_ARGS__)
#define EPCOMM_CHECK_LT(a, b, ...) EPCOMM_CHECK_OP_(a, b, <, __VA_ARGS__)

// For calls that return -1 and set errno.
#define EPCOMM_CHECK_ERRNO(call)                                                                             \
  do {                                                                                                       \
    if ((call) == -1) {                                                                                      \
      int epcomm_errno_ = errno;                                                                             \
      EPCOMM_THROW(SystemError, #call, " failed: ", std::strerror(epcomm_errno_), " (errno ", epcomm_errno_, \
                   ")");                                                                                     \
    }                                                                                                        \
  } while (0)

// Internal invariants (not user input): always on, they guard memory safety of the copy loops.
// A broken invariant of epcomm's own (a bug) whose message says what broke: Internal, with the message as
// given.
#define EPCOMM_CHECK_INTERNAL(cond, ...)              \
  do {                                                \
    if (!(cond)) EPCOMM_THROW(Internal, __VA_ARGS__); \
  } while (0)

#define EPCOMM_ASSERT(cond, ...)                                                               \
  do {                                                                                         \
    if (!(cond)) EPCOMM_THROW(Internal, "internal invariant failed: " #cond " ", __VA_ARGS__); \
  } while (0)
