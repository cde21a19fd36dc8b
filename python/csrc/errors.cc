// python/csrc/errors.cc — epcomm::Error arrives in Python as the epcomm._errors class of its code, with the
// same message. The classes are Python-defined (they derive from ValueError / the builtin TimeoutError too).
#include "bindings.h"
#include "epcomm/error.h"

namespace epcomm::python {
namespace {

const char* class_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::InvalidUsage:
      return "InvalidUsageError";
    case ErrorCode::Timeout:
      return "TimeoutError";
    case ErrorCode::Aborted:
      return "AbortedError";
    case ErrorCode::SystemError:
      return "SystemError";
    case ErrorCode::Internal:
      return "InternalError";
  }
  return "Error";
}

}  // namespace

void bind_errors(py::module_& m) {
  // Translators run with the GIL held; the classes are looked up at raise time (no static py::object that
  // would outlive the interpreter).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      py::object cls = py::module_::import("epcomm._errors").attr(class_name(e.code()));
      PyErr_SetString(cls.ptr(), e.what());
    }
  });
  m.def(
      "_raise",
      [](const std::string& code, const std::string& message) {
        for (ErrorCode c : {ErrorCode::InvalidUsage, ErrorCode::Timeout, ErrorCode::Aborted,
                            ErrorCode::SystemError, ErrorCode::Internal})
          if (code == error_code_name(c)) throw Error(c, message);
        throw Error(ErrorCode::Internal, message);
      },
      "Throws epcomm::Error(code, message) from C++ (tests the exception mapping).");
}

}  // namespace epcomm::python
