// python/csrc/bind_core.cc — Group (bootstrapped through Python callbacks), Config, EventOverlap, the size
// functions and the quantizers.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <sstream>

#include "bindings.h"
#include "epcomm/buffer.h"
#include "epcomm/quant.h"
#include "torch_bridge.h"

namespace epcomm::python {
namespace {

// A Python callable that C++ keeps beyond the call that handed it over (the Group owns its bootstrap
// callbacks). Whoever drops the last reference may not hold the GIL, so the deleter takes it.
std::shared_ptr<py::object> hold(py::object fn) {
  return std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* p) {
    if (!Py_IsInitialized()) {  // interpreter gone: leak rather than touch it
      p->release();
      delete p;
      return;
    }
    py::gil_scoped_acquire gil;
    delete p;
  });
}

std::shared_ptr<Group> group_from_callbacks(int rank, int size, py::object all_gather, py::object barrier) {
  AllGatherFn gather = [fn = hold(std::move(all_gather))](const std::vector<std::byte>& bytes) {
    py::gil_scoped_acquire gil;
    py::bytes in(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    std::string out = (*fn)(in).cast<std::string>();
    const auto* p = reinterpret_cast<const std::byte*>(out.data());
    return std::vector<std::byte>(p, p + out.size());
  };
  BarrierFn wait_all = [fn = hold(std::move(barrier))] {
    py::gil_scoped_acquire gil;
    (*fn)();
  };
  // Creation is collective and calls the callbacks on this thread (with the GIL held by the caller).
  return Group::create(make_callback_bootstrap(rank, size, std::move(gather), std::move(wait_all)));
}

// An int argument of a Config method within [lo, hi] (InvalidUsage naming it otherwise, not pybind's
// TypeError).
int64_t int_arg(const py::handle& v, const char* op, const char* name, int64_t lo = INT32_MIN,
                int64_t hi = INT32_MAX) {
  int overflow = 0;
  const bool is_int = py::isinstance<py::int_>(v);
  const long long x = is_int ? PyLong_AsLongLongAndOverflow(v.ptr(), &overflow) : 0;
  if (!is_int || overflow || x < lo || x > hi)
    throw Error(ErrorCode::InvalidUsage, std::string(op) + ": argument: " + name + ": expected an int in [" +
                                             std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                                             py::str(v).cast<std::string>());
  return x;
}
int int32_arg(const py::handle& v, const char* op, const char* name) {
  return static_cast<int>(int_arg(v, op, name));
}

std::string config_repr(const Config& c) {
  std::ostringstream os;
  os << "Config(num_threads=" << c.num_threads
     << ", num_max_nvl_chunked_send_tokens=" << c.num_max_nvl_chunked_send_tokens
     << ", num_max_nvl_chunked_recv_tokens=" << c.num_max_nvl_chunked_recv_tokens
     << ", num_max_rdma_chunked_send_tokens=" << c.num_max_rdma_chunked_send_tokens
     << ", num_max_rdma_chunked_recv_tokens=" << c.num_max_rdma_chunked_recv_tokens << ")";
  return os.str();
}

void bind_config(py::module_& m) {
  py::class_<Config>(
      m, "Config",
      "Per-call tuning knobs of dispatch and combine. Results never depend on them.\n"
      "Config(num_threads=0, num_max_nvl_chunked_send_tokens=32, num_max_nvl_chunked_recv_tokens=256,\n"
      "       num_max_rdma_chunked_send_tokens=32, num_max_rdma_chunked_recv_tokens=256)\n"
      "DeepEP's positional Config(num_sms, a, b, c, d) reads num_sms as num_threads.")
      .def(
          py::init([](const py::object& n, const py::object& a, const py::object& b, const py::object& c,
                      const py::object& d) {
            Config cfg;
            cfg.num_threads = int32_arg(n, "Config", "num_threads");
            cfg.num_max_nvl_chunked_send_tokens = int32_arg(a, "Config", "num_max_nvl_chunked_send_tokens");
            cfg.num_max_nvl_chunked_recv_tokens = int32_arg(b, "Config", "num_max_nvl_chunked_recv_tokens");
            cfg.num_max_rdma_chunked_send_tokens = int32_arg(c, "Config", "num_max_rdma_chunked_send_tokens");
            cfg.num_max_rdma_chunked_recv_tokens = int32_arg(d, "Config", "num_max_rdma_chunked_recv_tokens");
            cfg.validate();
            return cfg;
          }),
          py::arg("num_threads") = 0, py::arg("num_max_nvl_chunked_send_tokens") = 32,
          py::arg("num_max_nvl_chunked_recv_tokens") = 256, py::arg("num_max_rdma_chunked_send_tokens") = 32,
          py::arg("num_max_rdma_chunked_recv_tokens") = 256)
      .def_readwrite("num_threads", &Config::num_threads)
      .def_property(
          "num_sms", [](const Config& c) { return c.num_threads; },
          [](Config& c, int n) { c.num_threads = n; }, "DeepEP's name for num_threads")
      .def_readwrite("num_max_nvl_chunked_send_tokens", &Config::num_max_nvl_chunked_send_tokens)
      .def_readwrite("num_max_nvl_chunked_recv_tokens", &Config::num_max_nvl_chunked_recv_tokens)
      .def_readwrite("num_max_rdma_chunked_send_tokens", &Config::num_max_rdma_chunked_send_tokens)
      .def_readwrite("num_max_rdma_chunked_recv_tokens", &Config::num_max_rdma_chunked_recv_tokens)
      .def("validate", &Config::validate)
      .def(
          "get_nvl_buffer_size_hint",
          [](const Config& c, const py::object& hidden_bytes, const py::object& num_ranks,
             const py::object& ranks_per_node) {
            const char* op = "get_nvl_buffer_size_hint";
            const int rpn = ranks_per_node.is_none() ? 0 : int32_arg(ranks_per_node, op, "ranks_per_node");
            return c.get_nvl_buffer_size_hint(int_arg(hidden_bytes, op, "hidden_bytes", 0, int64_t{1} << 40),
                                              int32_arg(num_ranks, op, "num_ranks"), rpn);
          },
          py::arg("hidden_bytes"), py::arg("num_ranks"), py::arg("ranks_per_node") = py::none())
      .def(
          "get_rdma_buffer_size_hint",
          [](const Config& c, const py::object& hidden_bytes, const py::object& num_ranks,
             const py::object& ranks_per_node) {
            const char* op = "get_rdma_buffer_size_hint";
            const int rpn = ranks_per_node.is_none() ? 0 : int32_arg(ranks_per_node, op, "ranks_per_node");
            return c.get_rdma_buffer_size_hint(int_arg(hidden_bytes, op, "hidden_bytes", 0, int64_t{1} << 40),
                                               int32_arg(num_ranks, op, "num_ranks"), rpn);
          },
          py::arg("hidden_bytes"), py::arg("num_ranks"), py::arg("ranks_per_node") = py::none())
      .def("__repr__", &config_repr)
      .def("__eq__",
           [](const Config& a, const Config& b) {
             return a.num_threads == b.num_threads &&
                    a.num_max_nvl_chunked_send_tokens == b.num_max_nvl_chunked_send_tokens &&
                    a.num_max_nvl_chunked_recv_tokens == b.num_max_nvl_chunked_recv_tokens &&
                    a.num_max_rdma_chunked_send_tokens == b.num_max_rdma_chunked_send_tokens &&
                    a.num_max_rdma_chunked_recv_tokens == b.num_max_rdma_chunked_recv_tokens;
           })
      .def(py::pickle(
          [](const Config& c) {
            return py::make_tuple(c.num_threads, c.num_max_nvl_chunked_send_tokens,
                                  c.num_max_nvl_chunked_recv_tokens, c.num_max_rdma_chunked_send_tokens,
                                  c.num_max_rdma_chunked_recv_tokens);
          },
          [](const py::tuple& t) {
            Config c;
            c.num_threads = t[0].cast<int>();
            c.num_max_nvl_chunked_send_tokens = t[1].cast<int>();
            c.num_max_nvl_chunked_recv_tokens = t[2].cast<int>();
            c.num_max_rdma_chunked_send_tokens = t[3].cast<int>();
            c.num_max_rdma_chunked_recv_tokens = t[4].cast<int>();
            return c;
          }));
}

void bind_event(py::module_& m) {
  py::class_<EventOverlap>(m, "Event", "Completion of an operation on a Buffer's communication thread.")
      .def(py::init<>())
      .def(
          "wait",
          [](const EventOverlap& e) {
            py::gil_scoped_release nogil;
            e.wait();
          },
          "Blocks until the operation completed; raises its error (every time).")
      .def("is_complete", &EventOverlap::is_complete);
}

py::tuple quantize_py(const at::Tensor& x, const std::string& mode, int num_threads) {
  Tensor in = from_torch(x, "x");
  QuantMode qm = parse_quant_mode(mode);
  QuantOptions o;
  o.num_threads = num_threads;
  auto alloc = torch_allocator();
  o.allocator = alloc.get();
  std::pair<Tensor, Tensor> r;
  {
    py::gil_scoped_release nogil;
    r = quantize(in, qm, o);
  }
  py::object scales = py::none(), scales_dtype = py::none();
  if (r.second.defined()) {
    scales = py::cast(to_torch(r.second));
    scales_dtype = py::str(dtype_name(r.second.dtype()));
  }
  return py::make_tuple(to_torch(r.first), py::str(dtype_name(r.first.dtype())), scales, scales_dtype);
}

at::Tensor dequantize_py(const at::Tensor& data, const std::optional<at::Tensor>& scales,
                         const std::string& mode, const std::string& out,
                         const std::optional<std::string>& data_dtype,
                         const std::optional<std::string>& scales_dtype, int num_threads) {
  Tensor d = from_torch(data, "data", data_dtype);
  Tensor s = from_torch(scales, "scales", scales_dtype).value_or(Tensor());
  QuantOptions o;
  o.num_threads = num_threads;
  auto alloc = torch_allocator();
  o.allocator = alloc.get();
  Tensor r;
  {
    py::gil_scoped_release nogil;
    r = dequantize(d, s, parse_quant_mode(mode), parse_dtype(out), o);
  }
  return to_torch(r);
}

}  // namespace

void bind_core(py::module_& m) {
  py::class_<Group, std::shared_ptr<Group>>(m, "Group", "The ranks of a Buffer and their bootstrap.")
      .def_static("from_callbacks", &group_from_callbacks, py::arg("rank"), py::arg("size"),
                  py::arg("all_gather"), py::arg("barrier"),
                  "Collective. all_gather(bytes) -> bytes (size * len, rank-major); barrier() -> None.")
      .def_property_readonly("rank", &Group::rank)
      .def_property_readonly("size", &Group::size)
      .def_property_readonly("hosts", &Group::hosts);
  bind_config(m);
  bind_event(m);

  auto opt_rpn = [](std::optional<int> v) { return v.value_or(0); };
  m.def(
      "min_nvl_bytes",
      [opt_rpn](int64_t row_bytes, int num_topk, int num_ranks, std::optional<int> ranks_per_node) {
        return min_nvl_bytes(row_bytes, num_topk, num_ranks, opt_rpn(ranks_per_node));
      },
      py::arg("row_bytes"), py::arg("num_topk"), py::arg("num_ranks"),
      py::arg("ranks_per_node") = py::none());
  m.def(
      "min_rdma_bytes",
      [opt_rpn](int64_t row_bytes, int num_topk, int num_ranks, std::optional<int> ranks_per_node) {
        return min_rdma_bytes(row_bytes, num_topk, num_ranks, opt_rpn(ranks_per_node));
      },
      py::arg("row_bytes"), py::arg("num_topk"), py::arg("num_ranks"),
      py::arg("ranks_per_node") = py::none());
  m.def("quantize", &quantize_py, py::arg("x"), py::arg("mode"), py::arg("num_threads") = 1);
  m.def("dequantize", &dequantize_py, py::arg("data"), py::arg("scales"), py::arg("mode"),
        py::arg("out") = "f32", py::arg("data_dtype") = py::none(), py::arg("scales_dtype") = py::none(),
        py::arg("num_threads") = 1);
  m.def(
      "dtype_size", [](const std::string& name) { return dtype_size(parse_dtype(name)); }, py::arg("name"));
}

}  // namespace epcomm::python
