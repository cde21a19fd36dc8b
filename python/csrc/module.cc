// python/csrc/module.cc — the epcomm._C extension module (import torch before it: epcomm/__init__.py does).
#include "bindings.h"
#include "epcomm/version.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "epcomm C++ core (private; use the epcomm package)";
  m.attr("__version__") = epcomm::version();
  epcomm::python::bind_errors(m);
  epcomm::python::bind_core(m);
  epcomm::python::bind_buffer(m);
  epcomm::python::bind_ops(m);
}
