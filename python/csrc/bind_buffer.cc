// python/csrc/bind_buffer.cc — Buffer and Handle. Arguments are converted with the GIL held; every call that
// may wait for peers or for the communication thread runs with the GIL released.
#include <pybind11/stl.h>

#include <cstring>
#include <string>

#include "bindings.h"
#include "epcomm/buffer.h"
#include "torch_bridge.h"

namespace epcomm::python {
namespace {

// Owns the Buffer. Destruction joins the communication thread, which may need the GIL to drop the last
// reference of a torch tensor it held, so it happens with the GIL released.
struct PyBuffer {
  std::unique_ptr<Buffer> buffer;
  ~PyBuffer() {
    if (buffer && Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      buffer.reset();
    }
    buffer.reset();
  }
  Buffer& get() {
    if (!buffer) throw Error(ErrorCode::InvalidUsage, "Buffer: argument: the Buffer was destroyed");
    return *buffer;
  }
};

struct PyHandle {
  std::shared_ptr<const Handle> handle;
};

// An argument the binding could not convert: the call fails on every rank (Buffer::fail_call), GIL released
// while the failed header is published.
[[noreturn]] void fail_collectively(PyBuffer& self, const char* op, const Error& e) {
  Buffer& b = self.get();
  py::gil_scoped_release nogil;
  b.fail_call(op, e.code(), e.what());
}

py::object tensor_or_none(const std::optional<Tensor>& t) {
  if (!t || !t->defined()) return py::none();
  return py::cast(to_torch(*t));
}

py::object str_or_none(const std::optional<Tensor>& t) {
  if (!t || !t->defined()) return py::none();
  return py::str(dtype_name(t->dtype()));
}

std::unique_ptr<PyBuffer> make_buffer(std::shared_ptr<Group> group, int64_t num_nvl_bytes,
                                      int64_t num_rdma_bytes, bool low_latency_mode, bool enable_shrink,
                                      const std::string& receive_order, int ranks_per_node,
                                      std::optional<double> timeout_s, int64_t num_combine_input_bytes,
                                      int64_t num_dispatch_input_bytes, int64_t num_output_reserve_bytes,
                                      const std::string& flavor) {
  BufferOptions o;
  o.num_nvl_bytes = num_nvl_bytes;
  o.num_rdma_bytes = num_rdma_bytes;
  o.low_latency_mode = low_latency_mode;
  o.enable_shrink = enable_shrink;
  o.receive_order = parse_receive_order(receive_order);
  o.ranks_per_node = ranks_per_node;
  o.timeout_s = timeout_s;
  o.num_combine_input_bytes = num_combine_input_bytes;
  o.num_dispatch_input_bytes = num_dispatch_input_bytes;
  o.num_output_reserve_bytes = num_output_reserve_bytes;
  o.flavor = flavor;
  o.allocator = torch_allocator();
  auto b = std::make_unique<PyBuffer>();
  // Collective through the group's Python callbacks, which run on this thread: keep the GIL.
  b->buffer = std::make_unique<Buffer>(std::move(group), o);
  return b;
}

py::tuple get_dispatch_layout(PyBuffer& self, const at::Tensor& topk_idx, int num_experts,
                              std::optional<EventOverlap> previous_event, bool async_finish,
                              bool allocate_on_comm_stream) {
  Tensor ids = from_torch(topk_idx, "topk_idx");
  LayoutResult r;
  {
    py::gil_scoped_release nogil;
    r = self.get().get_dispatch_layout(ids, num_experts, previous_event, async_finish,
                                       allocate_on_comm_stream);
  }
  return py::make_tuple(to_torch(r.num_tokens_per_rank), tensor_or_none(r.num_tokens_per_rdma_rank),
                        to_torch(r.num_tokens_per_expert), to_torch(r.is_token_in_rank), r.event);
}

// Returns (recv_data, recv_data_dtype, recv_scales, recv_scales_dtype, recv_topk_idx, recv_topk_weights,
// num_recv_tokens_per_expert_list, handle, event); dtypes are epcomm names, so that Python can view one-byte
// formats as the real torch dtypes.
py::tuple dispatch(
    PyBuffer& self, const at::Tensor& x, const std::optional<at::Tensor>& x_scales,
    const std::optional<std::string>& x_dtype, const std::optional<std::string>& scales_dtype,
    const std::shared_ptr<PyHandle>& handle, const std::optional<at::Tensor>& num_tokens_per_rank,
    const std::optional<at::Tensor>& num_tokens_per_rdma_rank,
    const std::optional<at::Tensor>& is_token_in_rank, const std::optional<at::Tensor>& num_tokens_per_expert,
    const std::optional<at::Tensor>& topk_idx, const std::optional<at::Tensor>& topk_weights,
    int64_t expert_alignment, int64_t num_worst_tokens, std::optional<Config> config,
    std::optional<EventOverlap> previous_event, bool async_finish, bool allocate_on_comm_stream,
    const std::optional<at::Tensor>& dispatch_wait_recv_cost_stats,
    const std::optional<std::string>& quant_mode, const std::optional<std::string>& receive_order) {
  DispatchArgs a;
  try {
    a.x.data = from_torch(x, x_scales ? "x[0]" : "x", x_dtype);
    a.x.scales = from_torch(x_scales, "x[1]", scales_dtype);
    if (handle) a.handle = handle->handle;
    a.num_tokens_per_rank = from_torch(num_tokens_per_rank, "num_tokens_per_rank");
    a.num_tokens_per_rdma_rank = from_torch(num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank");
    a.is_token_in_rank = from_torch(is_token_in_rank, "is_token_in_rank");
    a.num_tokens_per_expert = from_torch(num_tokens_per_expert, "num_tokens_per_expert");
    a.topk_idx = from_torch(topk_idx, "topk_idx");
    a.topk_weights = from_torch(topk_weights, "topk_weights");
    a.dispatch_wait_recv_cost_stats =
        from_torch(dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats");
    a.expert_alignment = expert_alignment;
    a.num_worst_tokens = num_worst_tokens;
    a.config = config;
    a.previous_event = previous_event;
    a.async_finish = async_finish;
    a.allocate_on_comm_stream = allocate_on_comm_stream;
    if (quant_mode) a.quant_mode = parse_quant_mode(*quant_mode);
    if (receive_order) a.receive_order = parse_receive_order(*receive_order);
  } catch (const Error& e) {
    fail_collectively(self, handle ? "cached_dispatch" : "dispatch", e);
  }
  DispatchResult r;
  {
    py::gil_scoped_release nogil;
    r = self.get().dispatch(a);
  }
  py::object list = py::none(), h = py::none();
  if (r.num_recv_tokens_per_expert_list) list = py::cast(*r.num_recv_tokens_per_expert_list);
  if (r.handle) h = py::cast(std::make_shared<PyHandle>(PyHandle{r.handle}));
  return py::make_tuple(to_torch(r.recv_x.data), py::str(dtype_name(r.recv_x.data.dtype())),
                        tensor_or_none(r.recv_x.scales), str_or_none(r.recv_x.scales),
                        tensor_or_none(r.recv_topk_idx), tensor_or_none(r.recv_topk_weights), list, h,
                        r.event);
}

py::tuple combine(PyBuffer& self, const at::Tensor& x, const std::shared_ptr<PyHandle>& handle,
                  const std::optional<at::Tensor>& topk_weights, const std::optional<at::Tensor>& bias,
                  const std::optional<at::Tensor>& bias2, std::optional<Config> config,
                  std::optional<EventOverlap> previous_event, bool async_finish, bool allocate_on_comm_stream,
                  const std::optional<at::Tensor>& combine_send_cost_stats) {
  CombineArgs a;
  try {
    a.x = from_torch(x, "x");
    a.topk_weights = from_torch(topk_weights, "topk_weights");
    a.bias = from_torch(bias, bias2 ? "bias[0]" : "bias");
    a.bias2 = from_torch(bias2, "bias[1]");
    a.combine_send_cost_stats = from_torch(combine_send_cost_stats, "combine_send_cost_stats");
  } catch (const Error& e) {
    fail_collectively(self, "combine", e);
  }
  if (handle) a.handle = handle->handle;
  a.config = config;
  a.previous_event = previous_event;
  a.async_finish = async_finish;
  a.allocate_on_comm_stream = allocate_on_comm_stream;
  CombineResult r;
  {
    py::gil_scoped_release nogil;
    r = self.get().combine(a);
  }
  return py::make_tuple(to_torch(r.combined_x), tensor_or_none(r.combined_topk_weights), r.event);
}

// Returns (recv_x, recv_x_dtype, recv_scales, recv_count, src_info, layout_range, handle, event).
py::tuple low_latency_dispatch(PyBuffer& self, const at::Tensor& x, const at::Tensor& topk_idx, int64_t t_max,
                               int num_experts, const std::optional<at::Tensor>& cumulative_stats,
                               const std::optional<at::Tensor>& wait_stats, bool use_fp8, bool round_scale,
                               bool use_ue8m0, bool async_finish, bool return_recv_hook) {
  LowLatencyDispatchArgs a;
  try {
    a.x = from_torch(x, "x");
    a.topk_idx = from_torch(topk_idx, "topk_idx");
    a.cumulative_local_expert_recv_stats = from_torch(cumulative_stats, "cumulative_local_expert_recv_stats");
    a.dispatch_wait_recv_cost_stats = from_torch(wait_stats, "dispatch_wait_recv_cost_stats");
  } catch (const Error& e) {
    fail_collectively(self, "low_latency_dispatch", e);
  }
  a.num_max_dispatch_tokens_per_rank = t_max;
  a.num_experts = num_experts;
  a.use_fp8 = use_fp8;
  a.round_scale = round_scale;
  a.use_ue8m0 = use_ue8m0;
  a.async_finish = async_finish;
  a.return_recv_hook = return_recv_hook;
  LowLatencyDispatchResult r;
  {
    py::gil_scoped_release nogil;
    r = self.get().low_latency_dispatch(a);
  }
  return py::make_tuple(to_torch(r.recv_x), py::str(dtype_name(r.recv_x.dtype())),
                        tensor_or_none(r.recv_scales), to_torch(r.recv_count), to_torch(r.src_info),
                        to_torch(r.layout_range), py::cast(std::make_shared<PyHandle>(PyHandle{r.handle})),
                        r.event);
}

py::tuple low_latency_combine(PyBuffer& self, const at::Tensor& x, const at::Tensor& topk_idx,
                              const at::Tensor& topk_weights, const std::shared_ptr<PyHandle>& handle,
                              bool async_finish, const std::optional<at::Tensor>& out,
                              const std::optional<at::Tensor>& wait_stats) {
  LowLatencyCombineArgs a;
  try {
    a.x = from_torch(x, "x");
    a.topk_idx = from_torch(topk_idx, "topk_idx");
    a.topk_weights = from_torch(topk_weights, "topk_weights");
    a.out = from_torch(out, "out");
    a.combine_wait_recv_cost_stats = from_torch(wait_stats, "combine_wait_recv_cost_stats");
  } catch (const Error& e) {
    fail_collectively(self, "low_latency_combine", e);
  }
  if (handle) a.handle = handle->handle;
  a.async_finish = async_finish;
  LowLatencyCombineResult r;
  {
    py::gil_scoped_release nogil;
    r = self.get().low_latency_combine(a);
  }
  return py::make_tuple(to_torch(r.combined_x), r.event);
}

// A [shape] int32 tensor holding the elements of v (32-bit, copied).
template <typename T>
at::Tensor int32_tensor(const std::vector<T>& v, std::vector<int64_t> shape) {
  static_assert(sizeof(T) == 4);
  at::Tensor t = at::empty(
      shape.size() == 1 && shape[0] < 0 ? std::vector<int64_t>{static_cast<int64_t>(v.size())} : shape,
      at::kInt);
  if (static_cast<size_t>(t.numel()) != v.size())
    throw Error(ErrorCode::Internal, "Handle: internal: " + std::to_string(v.size()) +
                                         " elements for a tensor of " + std::to_string(t.numel()));
  if (!v.empty()) std::memcpy(t.data_ptr(), v.data(), v.size() * sizeof(T));
  return t;
}

void bind_handle(py::module_& m) {
  using H = PyHandle;
  auto tensor_of = [](Tensor (Handle::*f)() const) {
    return [f](const H& h) { return to_torch(((*h.handle).*f)()); };
  };
  py::class_<H, std::shared_ptr<H>>(m, "Handle", "What dispatch leaves for combine and cached re-dispatch.")
      .def_property_readonly(
          "receive_order",
          [](const H& h) { return std::string(receive_order_name(h.handle->receive_order())); })
      .def_property_readonly("num_tokens", [](const H& h) { return h.handle->num_tokens(); })
      .def_property_readonly("num_topk", [](const H& h) { return h.handle->num_topk(); })
      .def_property_readonly("num_experts", [](const H& h) { return h.handle->num_experts(); })
      .def_property_readonly("num_recv_rows", [](const H& h) { return h.handle->num_recv_rows(); })
      .def_property_readonly("num_rows", [](const H& h) { return h.handle->num_rows(); })
      .def_property_readonly("num_recv_tokens_per_expert",
                             [](const H& h) { return h.handle->num_recv_tokens_per_expert(); })
      .def_property_readonly("num_recv_pairs_per_expert",
                             [](const H& h) { return h.handle->num_recv_pairs_per_expert(); })
      .def_property_readonly("num_recv_rows_per_source",
                             [](const H& h) { return h.handle->num_recv_rows_per_source(); })
      .def_property_readonly("recv_src_rank", tensor_of(&Handle::recv_src_rank))
      .def_property_readonly("recv_src_token", tensor_of(&Handle::recv_src_token))
      .def_property_readonly("recv_src_slot", tensor_of(&Handle::recv_src_slot))
      .def_property_readonly("dispatch_id", [](const H& h) { return h.handle->dispatch_id(); })
      .def_property_readonly("num_rows_per_source_and_receiver",
                             [](const H& h) {
                               const std::vector<int64_t> m = h.handle->num_rows_per_source_and_receiver();
                               const auto R =
                                   static_cast<int64_t>(h.handle->num_recv_rows_per_source().size());
                               at::Tensor t = at::empty({R, R}, at::kLong);
                               std::copy(m.begin(), m.end(), t.data_ptr<int64_t>());
                               return t;
                             })
      .def_property_readonly("recv_node_masks",
                             [](const H& h) { return int32_tensor(h.handle->recv_node_masks(), {-1}); })
      .def(
          "rail_entries",
          [](const H& h, int node) {
            const Handle::RailEntries e = h.handle->rail_entries(node);
            const auto n = static_cast<int64_t>(e.tokens.size());
            return py::make_tuple(e.num_tokens, int32_tensor(e.tokens, {n}), int32_tensor(e.masks, {-1}),
                                  int32_tensor(e.ids, {n, h.handle->num_topk()}));
          },
          py::arg("node"),
          "(num_tokens, tokens, masks, ids) of the rail peer on `node` (Handle::rail_entries, int32 tensors)")
      .def_property_readonly("is_token_in_rank", [](const H& h) {
        const std::vector<uint8_t> v = h.handle->is_token_in_rank();
        const int64_t T = h.handle->num_tokens();
        const auto R = static_cast<int64_t>(h.handle->num_recv_rows_per_source().size());
        at::Tensor t = at::empty({T, R}, at::kBool);
        std::copy(v.begin(), v.end(), reinterpret_cast<uint8_t*>(t.data_ptr()));
        return t;
      });
}

}  // namespace

void bind_buffer(py::module_& m) {
  bind_handle(m);
  py::class_<PyBuffer>(m, "Buffer", "The C++ normal-mode Buffer (wrapped by epcomm.Buffer).")
      .def(py::init(&make_buffer), py::arg("group"), py::arg("num_nvl_bytes"), py::arg("num_rdma_bytes"),
           py::arg("low_latency_mode"), py::arg("enable_shrink"), py::arg("receive_order"),
           py::arg("ranks_per_node"), py::arg("timeout_s"), py::arg("num_combine_input_bytes") = 0,
           py::arg("num_dispatch_input_bytes") = 0, py::arg("num_output_reserve_bytes") = 0,
           py::arg("flavor") = std::string())
      .def("low_latency_dispatch", &low_latency_dispatch, py::arg("x"), py::arg("topk_idx"), py::arg("t_max"),
           py::arg("num_experts"), py::arg("cumulative_local_expert_recv_stats"),
           py::arg("dispatch_wait_recv_cost_stats"), py::arg("use_fp8"), py::arg("round_scale"),
           py::arg("use_ue8m0"), py::arg("async_finish"), py::arg("return_recv_hook") = false)
      .def("low_latency_combine", &low_latency_combine, py::arg("x"), py::arg("topk_idx"),
           py::arg("topk_weights"), py::arg("handle"), py::arg("async_finish"), py::arg("out"),
           py::arg("combine_wait_recv_cost_stats"))
      .def(
          "low_latency_combine_buffer",
          [](PyBuffer& b, const PyHandle& h) {
            return to_torch(b.get().low_latency_combine_buffer(*h.handle));
          },
          py::arg("handle"))
      .def(
          "low_latency_update_mask_buffer",
          [](PyBuffer& b, int rank, bool mask) { b.get().low_latency_update_mask_buffer(rank, mask); },
          py::arg("rank"), py::arg("mask"))
      .def("low_latency_query_mask_buffer",
           [](PyBuffer& b) { return b.get().low_latency_query_mask_buffer(); })
      .def("low_latency_clean_mask_buffer",
           [](PyBuffer& b) {
             py::gil_scoped_release nogil;
             b.get().low_latency_clean_mask_buffer();
           })
      .def(
          "set_low_latency_shrink", [](PyBuffer& b, bool on) { b.get().set_low_latency_shrink(on); },
          py::arg("enable"))
      .def(
          "clean_low_latency_buffer",
          [](PyBuffer& b, int64_t t_max, int64_t hidden, int num_experts) {
            py::gil_scoped_release nogil;
            b.get().clean_low_latency_buffer(t_max, hidden, num_experts);
          },
          py::arg("t_max"), py::arg("hidden"), py::arg("num_experts"))
      .def_property_readonly("num_dispatch_input_bytes",
                             [](PyBuffer& b) { return b.get().num_dispatch_input_bytes(); })
      .def(
          "get_dispatch_input",
          [](PyBuffer& b, int64_t num_tokens, int64_t hidden, const std::string& dtype) {
            return to_torch(b.get().get_dispatch_input(num_tokens, hidden, parse_dtype(dtype)));
          },
          py::arg("num_tokens"), py::arg("hidden"), py::arg("dtype"))
      .def("copy_counters",
           [](PyBuffer& b) {
             Buffer::CopyCounters c = b.get().copy_counters();
             py::dict d;
             d["dispatch_staged_tokens"] = c.dispatch_staged_tokens;
             d["dispatch_in_place_tokens"] = c.dispatch_in_place_tokens;
             d["dispatch_pushed_tokens"] = c.dispatch_pushed_tokens;
             d["combine_copied_rows"] = c.combine_copied_rows;
             d["combine_in_place_rows"] = c.combine_in_place_rows;
             d["combine_direct_tokens"] = c.combine_direct_tokens;
             d["combine_shared_tokens"] = c.combine_shared_tokens;
             return d;
           })
      .def_property_readonly("num_output_arena_bytes",
                             [](PyBuffer& b) { return b.get().num_output_arena_bytes(); })
      .def_property_readonly("num_combine_input_bytes",
                             [](PyBuffer& b) { return b.get().num_combine_input_bytes(); })
      .def(
          "get_combine_input",
          [](PyBuffer& b, const PyHandle& h, const std::string& dtype, int64_t hidden) {
            return to_torch(b.get().get_combine_input(*h.handle, parse_dtype(dtype), hidden));
          },
          py::arg("handle"), py::arg("dtype"), py::arg("hidden"))
      .def_property_readonly("rank", [](PyBuffer& b) { return b.get().rank(); })
      .def_property_readonly("num_ranks", [](PyBuffer& b) { return b.get().num_ranks(); })
      .def_property_readonly("num_nodes", [](PyBuffer& b) { return b.get().num_nodes(); })
      .def("node_of", [](PyBuffer& b, int r) { return b.get().node_of(r); })
      .def_property_readonly(
          "receive_order",
          [](PyBuffer& b) { return std::string(receive_order_name(b.get().receive_order())); })
      .def_property_readonly("timeout_s", [](PyBuffer& b) { return b.get().timeout_s(); })
      .def_property_readonly("num_nvl_bytes", [](PyBuffer& b) { return b.get().num_nvl_bytes(); })
      .def("get_dispatch_layout", &get_dispatch_layout, py::arg("topk_idx"), py::arg("num_experts"),
           py::arg("previous_event"), py::arg("async_finish"), py::arg("allocate_on_comm_stream"))
      .def("dispatch", &dispatch, py::arg("x"), py::arg("x_scales"), py::arg("x_dtype"),
           py::arg("scales_dtype"), py::arg("handle"), py::arg("num_tokens_per_rank"),
           py::arg("num_tokens_per_rdma_rank"), py::arg("is_token_in_rank"), py::arg("num_tokens_per_expert"),
           py::arg("topk_idx"), py::arg("topk_weights"), py::arg("expert_alignment"),
           py::arg("num_worst_tokens"), py::arg("config"), py::arg("previous_event"), py::arg("async_finish"),
           py::arg("allocate_on_comm_stream"), py::arg("dispatch_wait_recv_cost_stats"),
           py::arg("quant_mode"), py::arg("receive_order"))
      .def("combine", &combine, py::arg("x"), py::arg("handle"), py::arg("topk_weights"), py::arg("bias"),
           py::arg("bias2"), py::arg("config"), py::arg("previous_event"), py::arg("async_finish"),
           py::arg("allocate_on_comm_stream"), py::arg("combine_send_cost_stats"))
      .def(
          "fail_call",
          [](PyBuffer& b, const std::string& op, const std::string& message) {
            fail_collectively(b, op.c_str(), Error(ErrorCode::InvalidUsage, message));
          },
          py::arg("op"), py::arg("message"),
          "Fails the collective call `op` on every rank (Buffer::fail_call): raises InvalidUsageError here.")
      .def("destroy",
           [](PyBuffer& b) {
             if (!b.buffer) return;
             py::gil_scoped_release nogil;
             b.buffer->destroy();
           })
      .def_static("get_low_latency_rdma_size_hint", &Buffer::get_low_latency_rdma_size_hint,
                  py::arg("num_max_dispatch_tokens_per_rank"), py::arg("hidden"), py::arg("num_ranks"),
                  py::arg("num_experts"))
      .def_static("num_threads", &Buffer::num_threads)
      .def_static("set_num_threads", &Buffer::set_num_threads, py::arg("n"))
      .def_static("get_dispatch_config", &Buffer::get_dispatch_config, py::arg("num_ranks"))
      .def_static("get_combine_config", &Buffer::get_combine_config, py::arg("num_ranks"));
}

}  // namespace epcomm::python
