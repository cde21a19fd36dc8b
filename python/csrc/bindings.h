// python/csrc/bindings.h — the pieces of the epcomm._C extension module, each registered by one function.
// The module is private: the Python package (python/epcomm) wraps it into the seed's API.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace epcomm::python {

namespace py = pybind11;

void bind_errors(py::module_& m);  // epcomm::Error -> epcomm.InvalidUsageError / TimeoutError / ...
void bind_core(py::module_& m);    // Group, Config, EventOverlap, size functions, quantize/dequantize
void bind_buffer(py::module_& m);  // Buffer and Handle
void bind_ops(py::module_& m);     // the distribute-v2 operators (epcomm.ops)

}  // namespace epcomm::python
