// common/check.h — argument and invariant checks that print the failing expression and the values.
// EPCOMM_CHECK* throw epcomm::Error(InvalidUsage); EPCOMM_CHECK_ERRNO throws SystemError with strerror.
#pragma once

#include <cerrno>
#include <cstring>
#include <sstream>
#include <string>

#include "epcomm/error.h"

namespace epcomm::detail {

// Concatenates any streamable values into one string.
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
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
