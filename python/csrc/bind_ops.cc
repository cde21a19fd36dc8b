// python/csrc/bind_ops.cc — the distribute-v2 operator family (epcomm::moe::dispatch_v2, combine_v2,
// combine_add_rms_norm) for epcomm.ops. Python passes the operator's arguments by their aclnn names in dicts
// (tensors and scalars), so that errors name the parameter as the C++ core does. Arguments are converted with
// the GIL held; the collective call itself runs with the GIL released.
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <unordered_map>

#include <torch/csrc/autograd/python_variable.h>

#include "bindings.h"
#include "epcomm/moe/distribute_v2.h"
#include "torch_bridge.h"

namespace epcomm::python {
namespace {

namespace moe = epcomm::moe;

[[noreturn]] void invalid(const std::string& message) {
  throw Error(ErrorCode::InvalidUsage, message);
}

// The arguments of one call, by name. Missing entries keep the C++ defaults; None means "not given" for a
// tensor or a string and is an error for an int.
struct Kwargs {
  py::dict d;

  // The Python string of parameter `name` (a string literal: cached by its address) followed by `suffix`,
  // made and hashed once per process: looking up a fresh string would build and hash it on every call, which
  // at one token cost more than the operator. Called with the GIL held.
  static PyObject* key(const char* name, const char* suffix = "") {
    static std::unordered_map<const char*, PyObject*> plain, with_suffix;  // interned, process lifetime
    auto& keys = *suffix ? with_suffix : plain;
    auto it = keys.find(name);
    if (it != keys.end()) return it->second;
    PyObject* s = PyUnicode_InternFromString((std::string(name) + suffix).c_str());
    if (!s) throw py::error_already_set();
    keys.emplace(name, s);
    return s;
  }
  // The value under `name` (+ suffix), borrowed, or null when absent.
  PyObject* find(const char* name, const char* suffix = "") const {
    PyObject* v = PyDict_GetItemWithError(d.ptr(), key(name, suffix));
    if (!v && PyErr_Occurred()) throw py::error_already_set();
    return v;
  }
  bool contains(const char* name) const { return find(name) != nullptr; }
  py::object get(const char* name) const { return py::reinterpret_borrow<py::object>(find(name)); }

  bool has(const char* name) const {
    PyObject* v = find(name);
    return v != nullptr && v != Py_None;
  }
  std::optional<at::Tensor> torch(const char* name) const {
    if (!has(name)) return std::nullopt;
    py::object v = get(name);
    if (!THPVariable_Check(v.ptr()))
      invalid(std::string("argument: ") + name + ": expected a torch.Tensor or None, got " + type_name(v));
    return v.cast<at::Tensor>();
  }
  std::optional<Tensor> opt(const char* name) const {
    std::string fmt;  // one-byte formats torch lacks, e.g. "e8m0": given under "<name>_format"
    if (PyObject* f = find(name, "_format"); f && f != Py_None) {
      if (!PyUnicode_Check(f))
        invalid(std::string("argument: ") + name + "_format: expected a string, got " +
                type_name(py::reinterpret_borrow<py::object>(f)));
      fmt = py::reinterpret_borrow<py::str>(f).cast<std::string>();
    }
    return from_torch(torch(name), name, fmt.empty() ? std::nullopt : std::optional<std::string>(fmt));
  }
  Tensor req(const char* name) const {
    std::optional<Tensor> t = opt(name);
    if (!t) invalid(std::string("argument: ") + name + ": a tensor is required, got None");
    return *t;
  }
  // An int parameter; absent keeps the default, None or another type is an error (torch_npu's schema has
  // ints there), and so is an int beyond 64 bits.
  void integer(const char* name, int64_t& out) const {
    if (!contains(name)) return;
    py::object v = get(name);
    if (!py::isinstance<py::int_>(v))
      invalid(std::string("argument: ") + name + ": expected an int, got " + type_name(v));
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow)
      invalid(std::string("argument: ") + name + ": expected a 64-bit integer, got " +
              py::str(v).cast<std::string>());
    out = x;
  }
  // tp_world_size as far as it is usable (to reach the TP pair when the call fails before it was read).
  int64_t lenient(const char* name) const {
    int64_t v = 0;
    try {
      integer(name, v);
    } catch (const Error&) {
    }
    return v;
  }
  static std::string type_name(const py::object& v) {
    return py::str(py::type::of(v).attr("__name__")).cast<std::string>();
  }
  void string(const char* name, std::string& out) const {
    if (!has(name)) return;
    py::object v = get(name);
    if (!py::isinstance<py::str>(v))
      invalid(std::string("argument: ") + name + ": expected a string, got " + type_name(v));
    out = v.cast<std::string>();
  }
  std::optional<DType> dtype(const char* name) const {
    std::string s;
    string(name, s);
    if (s.empty()) return std::nullopt;
    return parse_dtype(s);
  }
  // A list of ints (absent or None: empty).
  void int_list(const char* name, std::vector<int>& out) const {
    if (!has(name)) return;
    py::object v = get(name);
    if (!py::isinstance<py::list>(v) && !py::isinstance<py::tuple>(v))
      invalid(std::string("argument: ") + name + ": expected a list of ints, got " + type_name(v));
    out.clear();
    for (py::handle e : v) {
      if (!py::isinstance<py::int_>(e) || py::isinstance<py::bool_>(e))
        invalid(std::string("argument: ") + name + ": expected a list of ints, got an element of type " +
                type_name(py::reinterpret_borrow<py::object>(e)));
      out.push_back(e.cast<int>());
    }
  }
  // live_ranks as far as it is usable (to reach the live peers when the call fails before it was read).
  std::vector<int> lenient_list(const char* name) const {
    std::vector<int> v;
    try {
      int_list(name, v);
    } catch (const std::exception&) {
      v.clear();
    }
    return v;
  }
  // A float parameter (an int or a float; not a bool).
  std::optional<double> number(const char* name) const {
    if (!has(name)) return std::nullopt;
    py::object v = get(name);
    if (py::isinstance<py::bool_>(v) || !(py::isinstance<py::int_>(v) || py::isinstance<py::float_>(v)))
      invalid(std::string("argument: ") + name + ": expected a number, got " + type_name(v));
    return v.cast<double>();
  }
};

moe::OpOptions op_options(const Kwargs& k) {
  moe::OpOptions o;
  k.string("strict_hardware_limits", o.strict_hardware_limits);
  k.integer("hccl_buffsize_mb", o.hccl_buffsize_mb);
  k.int_list("live_ranks", o.live_ranks);
  if (std::optional<double> s = k.number("timeout")) {
    if (!std::isfinite(*s) || *s <= 0 || *s > 1e9)
      invalid("argument: timeout: expected a finite number of seconds in (0, 1e9], got " +
              std::to_string(*s));
    o.timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(*s * 1000.0)));
  }
  // Outputs the caller gives no buffer for: torch tensors, allocated by the operator once it checked every
  // argument (so that malformed sizes never allocate); `core_allocates` (tests) keeps epcomm's allocator.
  if (!k.contains("core_allocates")) o.allocator = torch_allocator();
  return o;
}

// Reads the call's arguments with `read`. Whatever it rejects (a wrong type, an int beyond 64 bits, a tensor
// epcomm cannot take) fails the call on every rank of the groups (moe::fail_call) instead of leaving this
// rank one call behind its peers; it raises InvalidUsageError here.
template <class Read>
void read_collectively(Group& ep, Group* tp, const char* op, const Kwargs& k, Read&& read) {
  std::optional<Error> err;
  try {
    read();
    return;
  } catch (const Error& e) {
    err = e;
  } catch (const py::cast_error& e) {
    err = Error(ErrorCode::InvalidUsage, std::string("argument: ") + e.what());
  }
  const int64_t tp_world_size = k.lenient("tp_world_size");
  const std::vector<int> live = k.lenient_list("live_ranks");
  py::gil_scoped_release nogil;
  moe::fail_call(ep, tp, op, tp_world_size, err->code(), err->what(), live);
}

Group* tp_of(const py::object& tp) {
  return tp.is_none() ? nullptr : tp.cast<Group*>();
}

// The integer parameters that dispatch and combine share.
template <class Args>
void common_ints(const Kwargs& k, Args& a) {
  k.string("group_ep", a.group_ep);
  k.string("group_tp", a.group_tp);
  k.string("comm_alg", a.comm_alg);
  k.integer("ep_world_size", a.ep_world_size);
  k.integer("ep_rank_id", a.ep_rank_id);
  k.integer("moe_expert_num", a.moe_expert_num);
  k.integer("tp_world_size", a.tp_world_size);
  k.integer("tp_rank_id", a.tp_rank_id);
  k.integer("expert_shard_type", a.expert_shard_type);
  k.integer("shared_expert_num", a.shared_expert_num);
  k.integer("shared_expert_rank_num", a.shared_expert_rank_num);
  k.integer("global_bs", a.global_bs);
  k.integer("zero_expert_num", a.zero_expert_num);
  k.integer("copy_expert_num", a.copy_expert_num);
  k.integer("const_expert_num", a.const_expert_num);
}

void dispatch_args(const Kwargs& k, moe::DispatchV2Args& a, moe::OpOptions& o) {
  a.x = k.req("x");
  a.expert_ids = k.req("expert_ids");
  a.scales = k.opt("scales");
  a.x_active_mask = k.opt("x_active_mask");
  a.expert_scales = k.opt("expert_scales");
  a.elastic_info = k.opt("elastic_info");
  a.performance_info = k.opt("performance_info");
  common_ints(k, a);
  k.integer("quant_mode", a.quant_mode);
  k.integer("expert_token_nums_type", a.expert_token_nums_type);
  a.y_dtype = k.dtype("y_dtype");
  a.x_dtype = k.dtype("x_dtype");
  a.scales_dtype = k.dtype("scales_dtype");
  a.expand_x_out = k.opt("expand_x_out");
  a.dynamic_scales_out = k.opt("dynamic_scales_out");
  a.assist_info_for_combine_out = k.opt("assist_info_for_combine_out");
  a.expert_token_nums_out = k.opt("expert_token_nums_out");
  a.ep_recv_counts_out = k.opt("ep_recv_counts_out");
  a.tp_recv_counts_out = k.opt("tp_recv_counts_out");
  a.expand_scales_out = k.opt("expand_scales_out");
  o = op_options(k);
}

// Returns (expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums, ep_recv_counts,
// tp_recv_counts, expand_scales, expand_x format, dynamic_scales format), or None with the key "no_result"
// (a caller that passed every *_out buffer it reads: the seven tensors cost more than the call at one token).
py::object dispatch_v2(const std::shared_ptr<Group>& ep, const py::object& tp, const py::dict& kwargs) {
  const Kwargs k{kwargs};
  Group* tpg = tp_of(tp);
  moe::DispatchV2Args a;
  moe::OpOptions o;
  read_collectively(*ep, tpg, "dispatch_v2", k, [&] { dispatch_args(k, a, o); });
  moe::DispatchV2Result r;
  {
    py::gil_scoped_release nogil;
    r = moe::dispatch_v2(*ep, tpg, a, o);
  }
  if (k.contains("no_result")) return py::none();
  return py::make_tuple(to_torch(r.expand_x), to_torch(r.dynamic_scales), to_torch(r.assist_info_for_combine),
                        to_torch(r.expert_token_nums), to_torch(r.ep_recv_counts), to_torch(r.tp_recv_counts),
                        to_torch(r.expand_scales), py::str(dtype_name(r.expand_x.dtype())),
                        py::str(dtype_name(r.dynamic_scales.dtype())));
}

template <class Args>
void combine_args(const Kwargs& k, Args& a) {
  a.expand_x = k.req("expand_x");
  a.expert_ids = k.req("expert_ids");
  a.assist_info_for_combine = k.req("assist_info_for_combine");
  a.ep_send_counts = k.req("ep_send_counts");
  a.expert_scales = k.req("expert_scales");
  a.tp_send_counts = k.opt("tp_send_counts");
  a.x_active_mask = k.opt("x_active_mask");
  a.activation_scale = k.opt("activation_scale");
  a.weight_scale = k.opt("weight_scale");
  a.group_list = k.opt("group_list");
  a.expand_scales = k.opt("expand_scales");
  a.shared_expert_x = k.opt("shared_expert_x");
  a.elastic_info = k.opt("elastic_info");
  a.ori_x = k.opt("ori_x");
  a.const_expert_alpha_1 = k.opt("const_expert_alpha_1");
  a.const_expert_alpha_2 = k.opt("const_expert_alpha_2");
  a.const_expert_v = k.opt("const_expert_v");
  a.performance_info = k.opt("performance_info");
  common_ints(k, a);
  k.integer("out_dtype", a.out_dtype);
  k.integer("comm_quant_mode", a.comm_quant_mode);
  k.integer("group_list_type", a.group_list_type);
  a.x_out = k.opt("x_out");
}

at::Tensor combine_v2(const std::shared_ptr<Group>& ep, const py::object& tp, const py::dict& kwargs) {
  const Kwargs k{kwargs};
  Group* tpg = tp_of(tp);
  moe::CombineV2Args a;
  moe::OpOptions o;
  read_collectively(*ep, tpg, "combine_v2", k, [&] {
    combine_args(k, a);
    o = op_options(k);
  });
  Tensor r;
  {
    py::gil_scoped_release nogil;
    r = moe::combine_v2(*ep, tpg, a, o);
  }
  return to_torch(r);
}

py::tuple combine_add_rms_norm(const std::shared_ptr<Group>& ep, const py::object& tp,
                               const py::dict& kwargs) {
  const Kwargs k{kwargs};
  Group* tpg = tp_of(tp);
  moe::CombineAddRmsNormArgs a;
  moe::OpOptions o;
  read_collectively(*ep, tpg, "combine_add_rms_norm", k, [&] {
    combine_args(k, a);
    a.residual_x = k.req("residual_x");
    a.gamma = k.req("gamma");
    if (std::optional<double> eps = k.number("norm_eps")) a.norm_eps = static_cast<float>(*eps);
    a.y_out = k.opt("y_out");
    a.rstd_out = k.opt("rstd_out");
    o = op_options(k);
  });
  moe::CombineAddRmsNormResult r;
  {
    py::gil_scoped_release nogil;
    r = moe::combine_add_rms_norm(*ep, tpg, a, o);
  }
  return py::make_tuple(to_torch(r.y), to_torch(r.rstd), to_torch(r.x));
}

}  // namespace

void bind_ops(py::module_& m) {
  m.def("moe_dispatch_v2", &dispatch_v2, py::arg("ep_group"), py::arg("tp_group"), py::arg("kwargs"),
        "epcomm::moe::dispatch_v2; kwargs by aclnn name (see epcomm.ops).");
  m.def("moe_combine_v2", &combine_v2, py::arg("ep_group"), py::arg("tp_group"), py::arg("kwargs"),
        "epcomm::moe::combine_v2; kwargs by aclnn name (see epcomm.ops).");
  m.def("moe_combine_add_rms_norm", &combine_add_rms_norm, py::arg("ep_group"), py::arg("tp_group"),
        py::arg("kwargs"), "epcomm::moe::combine_add_rms_norm; kwargs by aclnn name (see epcomm.ops).");
  m.def(
      "moe_fail_call",
      [](const std::shared_ptr<Group>& ep, const py::object& tp, const std::string& op, int64_t tp_world_size,
         const std::string& message, const std::vector<int>& live_ranks) {
        Group* tpg = tp_of(tp);
        py::gil_scoped_release nogil;
        moe::fail_call(*ep, tpg, op, tp_world_size, ErrorCode::InvalidUsage, message, live_ranks);
      },
      py::arg("ep_group"), py::arg("tp_group"), py::arg("op"), py::arg("tp_world_size"), py::arg("message"),
      py::arg("live_ranks") = std::vector<int>{},
      "Fails the operator call `op` on every rank (moe::fail_call), or on the call's live_ranks: raises "
      "InvalidUsageError here.");
  m.def(
      "moe_agree_on_mask",
      [](const std::shared_ptr<Group>& ep, const std::vector<int32_t>& masked,
         std::optional<double> timeout_s) {
        moe::OpOptions o;
        if (timeout_s)
          o.timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(*timeout_s * 1000.0)));
        py::gil_scoped_release nogil;
        return moe::agree_on_mask(*ep, masked, o);
      },
      py::arg("ep_group"), py::arg("masked"), py::arg("timeout_s") = py::none(),
      "moe::agree_on_mask: the shrink agreement round among the unmasked ranks; returns the new mask.");
  m.def(
      "moe_init_group_context",
      [](const std::shared_ptr<Group>& g, int64_t segment_bytes, std::optional<double> timeout_s,
         int ranks_per_node, int64_t num_rdma_bytes, int64_t num_output_arena_bytes,
         int64_t num_output_reserve_bytes) {
        moe::GroupContextOptions o;
        o.num_output_arena_bytes = num_output_arena_bytes;
        o.num_output_reserve_bytes = num_output_reserve_bytes;
        o.segment_bytes = segment_bytes;
        o.timeout_s = timeout_s;
        o.ranks_per_node = ranks_per_node;
        o.num_rdma_bytes = num_rdma_bytes;
        // Collective through the group's Python bootstrap callbacks, which run on this thread: keep the GIL.
        moe::init_group_context(*g, o);
      },
      py::arg("group"), py::arg("segment_bytes") = 0, py::arg("timeout_s") = py::none(),
      py::arg("ranks_per_node") = 0, py::arg("num_rdma_bytes") = 0, py::arg("num_output_arena_bytes") = -1,
      py::arg("num_output_reserve_bytes") = 0);
  m.def(
      "moe_output_buffer",
      [](const std::shared_ptr<Group>& g, const std::vector<int64_t>& shape, const std::string& dtype) {
        const DType dt = parse_dtype(dtype);
        Tensor t;
        {
          py::gil_scoped_release nogil;
          t = moe::output_buffer(*g, dt, shape, torch_allocator());
        }
        return to_torch(t);
      },
      py::arg("group"), py::arg("shape"), py::arg("dtype"),
      "moe::output_buffer: an uninitialized tensor in the group's output arena (one-byte formats as uint8).");
  m.def(
      "moe_group_copy_counters",
      [](const std::shared_ptr<Group>& g) {
        const moe::GroupCopyCounters c = moe::group_copy_counters(*g);
        py::dict d;
        d["dispatch_staged_tokens"] = c.dispatch_staged_tokens;
        d["dispatch_pushed_tokens"] = c.dispatch_pushed_tokens;
        d["combine_copied_rows"] = c.combine_copied_rows;
        d["combine_in_place_rows"] = c.combine_in_place_rows;
        return d;
      },
      py::arg("group"));
  m.def(
      "moe_group_network_counters",
      [](const std::shared_ptr<Group>& g) {
        const moe::GroupNetworkCounters c = moe::group_network_counters(*g);
        py::dict d;
        d["rows"] = c.rows;
        d["row_bytes"] = c.row_bytes;
        d["network_bytes"] = c.network_bytes;
        d["network_writes"] = c.network_writes;
        d["num_nodes"] = moe::group_num_nodes(*g);
        return d;
      },
      py::arg("group"));
}

}  // namespace epcomm::python
