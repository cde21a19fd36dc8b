// common/error.cc — error code names and the throw helper used by the check macros.
#include "common/check.h"

namespace epcomm {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::InvalidUsage:
      return "InvalidUsage";
    case ErrorCode::Timeout:
      return "Timeout";
    case ErrorCode::Aborted:
      return "Aborted";
    case ErrorCode::SystemError:
      return "SystemError";
    case ErrorCode::Internal:
      return "Internal";
  }
  return "Unknown";
}

namespace detail {
void throw_error(ErrorCode code, const std::string& message) {
  throw Error(code, message);
}
}  // namespace detail

}  // namespace epcomm
