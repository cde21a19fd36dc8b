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

// The arguments of one call, by name. Missing or None entries keep the C++ defaults.
struct Kwargs {
  py::dict d;

  bool has(const char* name) const { return d.contains(name) && !d[name].is_none(); }
  std::optional<at::Tensor> torch(const char* name) const {
    if (!has(name)) return std::nullopt;
    py::object v = d[name];
    if (!THPVariable_Check(v.ptr()))
      invalid(std::string("argument: ") + name + ": expected a torch.Tensor or None, got " +
              py::str(py::type::of(v).attr("__name__")).cast<std::string>());
    return v.cast<at::Tensor>();
  }
  std::optional<Tensor> opt(const char* name) const {
    std::optional<std::string> as;
    std::string fmt = std::string(name) + "_format";  // one-byte formats torch lacks, e.g. "e8m0"
    if (has(fmt.c_str())) as = d[fmt.c_str()].cast<std::string>();
    return from_torch(torch(name), name, as);
  }
  Tensor req(const char* name) const {
    std::optional<Tensor> t = opt(name);
    if (!t) invalid(std::string("argument: ") + name + ": a tensor is required, got None");
    return *t;
  }
  void integer(const char* name, int64_t& out) const {
    if (!has(name)) return;
    py::object v = d[name];
    if (!py::isinstance<py::int_>(v))
      invalid(std::string("argument: ") + name + ": expected an int, got " +
              py::str(py::type::of(v).attr("__name__")).cast<std::string>());
    out = v.cast<int64_t>();
  }
  void string(const char* name, std::string& out) const {
    if (!has(name)) return;
    py::object v = d[name];
    if (!py::isinstance<py::str>(v))
      invalid(std::string("argument: ") + name + ": expected a string, got " +
              py::str(py::type::of(v).attr("__name__")).cast<std::string>());
    out = v.cast<std::string>();
  }
  std::optional<DType> dtype(const char* name) const {
    if (!has(name)) return std::nullopt;
    return parse_dtype(d[name].cast<std::string>());
  }
};

moe::OpOptions op_options(const Kwargs& k) {
  moe::OpOptions o;
  k.string("strict_hardware_limits", o.strict_hardware_limits);
  k.integer("hccl_buffsize_mb", o.hccl_buffsize_mb);
  if (k.has("timeout")) {
    double s = k.d["timeout"].cast<double>();
    if (!std::isfinite(s) || s <= 0) invalid("argument: timeout: expected a finite number of seconds > 0");
    o.timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(s * 1000.0)));
  }
  return o;
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

// Dispatch's outputs with the exact shapes of spec §2.4 (zero-filled torch tensors the operator writes in
// place), when the arguments are well-formed enough to know them; otherwise the operator allocates them and
// reports the bad argument itself.
void torch_dispatch_outputs(moe::DispatchV2Args& a) {
  const Shape& xs = a.x.shape();
  const Shape& is = a.expert_ids.shape();
  if (xs.size() != 2 || is.size() != 2 || (a.x.dtype() != DType::bf16 && a.x.dtype() != DType::f16)) return;
  const int64_t W = a.ep_world_size, Sr = a.shared_expert_rank_num, E = a.moe_expert_num, p = a.ep_rank_id;
  const int64_t Bs = xs[0], H = xs[1], K = is[1], qm = a.quant_mode;
  if (W < 1 || Sr < 0 || Sr >= W || E < 1 || E % (W - Sr) != 0 || p < 0 || p >= W || K < 1) return;
  if (a.tp_world_size < 0 || a.tp_world_size > 2 || qm < 0 || qm > 4 || a.expert_shard_type != 0) return;
  const int64_t S = Sr == 0 ? 0 : a.shared_expert_num;
  if (Sr > 0 && (S < 1 || Sr % S != 0)) return;
  if (a.global_bs < 0 || (a.global_bs > 0 && a.global_bs % W != 0)) return;
  const int64_t T = std::max<int64_t>(a.tp_world_size, 1), L = E / (W - Sr);
  const int64_t maxBs = a.global_bs > 0 ? a.global_bs / W : Bs, G = a.global_bs > 0 ? a.global_bs : Bs * W;
  const bool shared = p < Sr;
  const int64_t A = shared ? maxBs * ((W + Sr / S - 1) / (Sr / S)) : G * std::min(L, K);
  const int64_t Lp = shared ? 1 : L;
  // expand_x's dtype (§5): x's in mode 0, else y_dtype where the mode allows it, else the mode's default.
  DType y = a.x.dtype();
  if (qm == 0) {
    if (a.y_dtype && *a.y_dtype != y) return;
  } else {
    const DType def = qm <= 2 ? DType::i8 : DType::f8e4m3;
    y = a.y_dtype.value_or(def);
    const bool ok = y == def || (qm >= 2 && (y == DType::f8e4m3 || y == DType::f8e5m2));
    if (!ok) return;
  }
  auto zeros = [](DType d, at::IntArrayRef shape, const char* what) {
    at::Tensor t = torch_empty(shape, torch_dtype(d)).zero_();
    const bool one_byte_format = d == DType::f8e4m3 || d == DType::f8e5m2 || d == DType::e8m0;
    return from_torch(t, what, one_byte_format ? std::optional<std::string>(dtype_name(d)) : std::nullopt);
  };
  const int64_t rows = T * A;
  if (!a.expand_x_out) a.expand_x_out = zeros(y, {rows, H}, "expand_x_out");
  if (!a.dynamic_scales_out) {
    if (qm == 3)
      a.dynamic_scales_out = zeros(DType::f32, {rows, (H + 127) / 128}, "dynamic_scales_out");
    else if (qm == 4)
      a.dynamic_scales_out = zeros(DType::u8, {rows, ((H + 31) / 32 + 1) / 2 * 2}, "dynamic_scales_out");
    else
      a.dynamic_scales_out = zeros(DType::f32, {rows}, "dynamic_scales_out");
  }
  if (!a.assist_info_for_combine_out)
    a.assist_info_for_combine_out = zeros(DType::i32, {A * 128}, "assist_info_for_combine_out");
  if (!a.expert_token_nums_out) a.expert_token_nums_out = zeros(DType::i64, {Lp}, "expert_token_nums_out");
  if (!a.ep_recv_counts_out) a.ep_recv_counts_out = zeros(DType::i32, {W * T * Lp}, "ep_recv_counts_out");
  if (!a.tp_recv_counts_out)
    a.tp_recv_counts_out = zeros(DType::i32, {a.tp_world_size}, "tp_recv_counts_out");
  if (!a.expand_scales_out)
    a.expand_scales_out = zeros(DType::f32, {a.expert_scales ? rows : 0}, "expand_scales_out");
}

// Returns (expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums, ep_recv_counts,
// tp_recv_counts, expand_scales, expand_x format, dynamic_scales format).
py::tuple dispatch_v2(const std::shared_ptr<Group>& ep, const py::object& tp, const py::dict& kwargs) {
  Kwargs k{kwargs};
  moe::DispatchV2Args a;
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
  if (!k.has("core_allocates")) torch_dispatch_outputs(a);
  moe::OpOptions o = op_options(k);
  Group* tpg = tp_of(tp);
  moe::DispatchV2Result r;
  {
    py::gil_scoped_release nogil;
    r = moe::dispatch_v2(*ep, tpg, a, o);
  }
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

// An output buffer shaped like `shape` in expand_x's dtype, allocated by torch, when the inputs are
// well-formed enough to know it; otherwise the core allocates (and reports the bad input).
std::optional<Tensor> torch_out(const Kwargs& k, const Tensor& expand_x, at::IntArrayRef shape,
                                const char* what, std::optional<at::ScalarType> type = std::nullopt) {
  if (k.has(what)) return std::nullopt;
  if (expand_x.dtype() != DType::bf16 && expand_x.dtype() != DType::f16) return std::nullopt;
  for (int64_t s : shape)
    if (s < 0) return std::nullopt;
  at::Tensor t = torch_empty(shape, type.value_or(torch_dtype(expand_x.dtype()))).zero_();
  return from_torch(t, what);
}

at::Tensor combine_v2(const std::shared_ptr<Group>& ep, const py::object& tp, const py::dict& kwargs) {
  Kwargs k{kwargs};
  moe::CombineV2Args a;
  combine_args(k, a);
  if (!a.x_out && a.expand_x.shape().size() == 2 && a.expert_ids.shape().size() == 2)
    a.x_out = torch_out(k, a.expand_x, {a.expert_ids.shape()[0], a.expand_x.shape()[1]}, "x_out");
  moe::OpOptions o = op_options(k);
  Group* tpg = tp_of(tp);
  Tensor r;
  {
    py::gil_scoped_release nogil;
    r = moe::combine_v2(*ep, tpg, a, o);
  }
  return to_torch(r);
}

py::tuple combine_add_rms_norm(const std::shared_ptr<Group>& ep, const py::object& tp,
                               const py::dict& kwargs) {
  Kwargs k{kwargs};
  moe::CombineAddRmsNormArgs a;
  combine_args(k, a);
  a.residual_x = k.req("residual_x");
  a.gamma = k.req("gamma");
  if (k.has("norm_eps")) a.norm_eps = k.d["norm_eps"].cast<float>();
  a.y_out = k.opt("y_out");
  a.rstd_out = k.opt("rstd_out");
  if (a.expand_x.shape().size() == 2 && a.expert_ids.shape().size() == 2) {
    const int64_t bs = a.expert_ids.shape()[0], h = a.expand_x.shape()[1];
    if (!a.x_out) a.x_out = torch_out(k, a.expand_x, {bs, 1, h}, "x_out");
    if (!a.y_out) a.y_out = torch_out(k, a.expand_x, {bs, 1, h}, "y_out");
    if (!a.rstd_out) a.rstd_out = torch_out(k, a.expand_x, {bs, 1, 1}, "rstd_out", at::kFloat);
  }
  moe::OpOptions o = op_options(k);
  Group* tpg = tp_of(tp);
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
      "moe_init_group_context",
      [](const std::shared_ptr<Group>& g, int64_t segment_bytes, std::optional<double> timeout_s,
         int ranks_per_node, int64_t num_rdma_bytes) {
        moe::GroupContextOptions o;
        o.segment_bytes = segment_bytes;
        o.timeout_s = timeout_s;
        o.ranks_per_node = ranks_per_node;
        o.num_rdma_bytes = num_rdma_bytes;
        // Collective through the group's Python bootstrap callbacks, which run on this thread: keep the GIL.
        moe::init_group_context(*g, o);
      },
      py::arg("group"), py::arg("segment_bytes") = 0, py::arg("timeout_s") = py::none(),
      py::arg("ranks_per_node") = 0, py::arg("num_rdma_bytes") = 0);
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
