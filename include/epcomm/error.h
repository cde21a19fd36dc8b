// epcomm/error.h — the one exception type epcomm throws, and its error codes.
// Every public call reports failures as epcomm::Error; docs/errors.md says what state each code leaves.
#pragma once

#include <stdexcept>
#include <string>

namespace epcomm {

enum class ErrorCode {
  InvalidUsage,  // a bad argument, or ranks that disagree about a collective call
  Timeout,       // a peer did not arrive (or stopped making progress) before the deadline
  Aborted,       // a peer reported a failure, or this Buffer failed earlier
  SystemError,   // an operating-system call failed (shm_open, mmap, socket, ...)
  Internal,      // a broken invariant inside epcomm: a bug, please report it
};

const char* error_code_name(ErrorCode code);

// Thrown by every epcomm call. what() is the full message; code() tells the category.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace epcomm
