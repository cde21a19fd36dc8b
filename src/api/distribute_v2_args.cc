// api/distribute_v2_args.cc — the checks of docs/distribute-v2.md that every call makes locally, and the
// engine inputs and outputs (docs/distribute-v2.md) they lead to.
#include "api/distribute_v2_args.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "api/moe_context.h"
#include "common/check.h"
#include "quant/block.h"

namespace epcomm::moe::detail {
namespace {

using engine::v2::ceil_div;
using engine::v2::Layout;

std::string describe(const Tensor& t) {
  return epcomm::detail::cat(dtype_name(t.dtype()), shape_str(t.shape()));
}

void check_dtype(const Tensor& t, const char* name, std::initializer_list<DType> ok) {
  for (DType d : ok)
    if (t.dtype() == d) return;
  std::string list;
  for (DType d : ok) list += epcomm::detail::cat(list.empty() ? "" : " or ", dtype_name(d));
  EPCOMM_THROW(InvalidUsage, "argument: ", name, ": dtype ", dtype_name(t.dtype()), ", expected ", list);
}

void check_shape(const Tensor& t, const char* name, const Shape& want, const char* meaning) {
  EPCOMM_CHECK(t.shape() == want, "argument: ", name, ": shape ", shape_str(t.shape()), ", expected ",
               shape_str(want), " = ", meaning);
}

// Element (i, j) of a 1-D or 2-D tensor, honouring strides.
template <typename T>
T at(const Tensor& t, int64_t i, int64_t j = 0) {
  int64_t off = i * t.strides()[0];
  if (t.dim() > 1) off += j * t.strides()[1];
  return t.data_as<T>()[off];
}

void check_absent(const std::optional<Tensor>& t, const char* name) {
  EPCOMM_CHECK(!t, "argument: ", name, ": not supported by epcomm yet (must be absent), got ", describe(*t));
}
void check_zero(int64_t v, const char* name) {
  EPCOMM_CHECK(v == 0, "argument: ", name, ": not supported by epcomm yet (must be 0), got ", v);
}

void check_int32(int64_t v, const char* name) {
  EPCOMM_CHECK(v <= std::numeric_limits<int32_t>::max(), "argument: ", name, " = ", v,
               ": at most 2^31 - 1 is supported");
}

// The outputs of dispatch_v2 are sized from its validated layout: T·A_p rows of expand_x, scales and
// expand_scales, 128·A_p assist_info entries, the counts. Every value may be legal alone while global_bs
// (A_p) or moe_expert_num (L_p) asks for more memory than the host has: raise before anything is allocated.
void check_output_bytes(const DispatchV2Args& a, int64_t A, double rows_bytes, int64_t Lp,
                        const Layout& lay) {
  const double need = rows_bytes + 512.0 * static_cast<double>(A) + (4.0 * lay.W * lay.T + 8.0) * Lp;
  const double have =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGESIZE));
  EPCOMM_CHECK(need <= have, "capacity: the outputs of this call take ", static_cast<int64_t>(need),
               " bytes (A = ", A, " rows of receive capacity, from global_bs = ", a.global_bs,
               ", Bs and min(L, K); L_p = ", Lp, " from moe_expert_num = ", a.moe_expert_num,
               "), more than this host's memory (", static_cast<int64_t>(have),
               " bytes); nothing was allocated");
}

// A caller output buffer (docs/distribute-v2.md): exact dtype, first dim >= required, other dims exact,
// contiguous. Without one, a zero-filled tensor from `alloc` (default_allocator() when null); `zero` false
// leaves it to the caller (the call writes its valid rows and zeroes the rest after it).
Tensor output(const std::optional<Tensor>& given, const char* name, DType dtype, const Shape& shape,
              Allocator* alloc, std::initializer_list<DType> also_ok = {}, bool zero = true) {
  if (!given) {
    Tensor t = empty(dtype, shape, alloc);
    if (zero && t.nbytes()) std::memset(t.data(), 0, t.nbytes());
    return t;
  }
  const Tensor& g = *given;
  bool dtype_ok = g.dtype() == dtype;
  for (DType d : also_ok) dtype_ok |= g.dtype() == d;
  EPCOMM_CHECK(dtype_ok, "argument: ", name, ": dtype ", dtype_name(g.dtype()), ", expected ",
               dtype_name(dtype));
  bool shape_ok = g.dim() == static_cast<int64_t>(shape.size()) && (shape.empty() || g.size(0) >= shape[0]);
  for (size_t d = 1; shape_ok && d < shape.size(); ++d)
    shape_ok = g.size(static_cast<int64_t>(d)) == shape[d];
  EPCOMM_CHECK(shape_ok, "argument: ", name, ": shape ", shape_str(g.shape()), ", expected ",
               shape_str(shape), " (the first dimension may be larger)");
  EPCOMM_CHECK(g.is_contiguous(), "argument: ", name, ": must be contiguous (shape ", shape_str(g.shape()),
               ", strides ", shape_str(g.strides()), ")");
  return g;
}

// docs/distribute-v2.md group and layout rules; T = 2 also needs L = 1.
// (size, rank) of the call in its EP group: the group's, or among OpOptions::live_ranks (Call checked them).
std::pair<int, int> ep_extent(Group& ep, const std::vector<int>& live) {
  if (live.empty()) return {ep.size(), ep.rank()};
  const auto at = std::find(live.begin(), live.end(), ep.rank());
  return {static_cast<int>(live.size()), static_cast<int>(at - live.begin())};
}

Layout check_layout(Group& ep, Group* tp, const LayoutArgs& c, int64_t bs, int K,
                    const std::vector<int>& live) {
  const auto [size, rank] = ep_extent(ep, live);
  const char* among = live.empty() ? "the ep_group size " : "the number of live_ranks ";
  EPCOMM_CHECK(c.W >= 1 && c.W == size, "argument: ep_world_size: expected ", among, size, ", got ", c.W);
  EPCOMM_CHECK(c.ep_rank == rank, "argument: ep_rank_id: expected ",
               live.empty() ? "the rank in ep_group " : "this rank's index in live_ranks ", rank, ", got ",
               c.ep_rank);
  EPCOMM_CHECK(c.tp_world_size >= 0 && c.tp_world_size <= 2,
               "argument: tp_world_size: expected 0, 1 or 2, got ", c.tp_world_size);
  if (c.tp_world_size == 2) {
    EPCOMM_CHECK(tp != nullptr, "argument: tp_group: tp_world_size = 2 needs a TP group of size 2, got null");
    EPCOMM_CHECK(tp->size() == 2, "argument: tp_group: expected a group of size 2, got size ", tp->size());
    EPCOMM_CHECK(c.tp_rank == tp->rank(), "argument: tp_rank_id: expected the rank in tp_group ", tp->rank(),
                 ", got ", c.tp_rank);
  } else {
    EPCOMM_CHECK(c.tp_rank == 0, "argument: tp_rank_id: expected 0 when tp_world_size = ", c.tp_world_size,
                 ", got ", c.tp_rank);
  }
  EPCOMM_CHECK(c.shard == 0, "argument: expert_shard_type: expected 0 (shared-expert ranks first), got ",
               c.shard);
  EPCOMM_CHECK(c.Sr >= 0 && c.Sr < c.W,
               "argument: shared_expert_rank_num: expected in [0, ep_world_size = ", c.W, "), got ", c.Sr);
  int64_t S = c.shared_expert_num;
  if (c.Sr == 0) {
    EPCOMM_CHECK(S == 0 || S == 1,
                 "argument: shared_expert_num: expected 0 or 1 when shared_expert_rank_num = 0, got ", S);
    S = 0;  // torch_npu's default 1 means none here
  } else {
    EPCOMM_CHECK(S >= 1, "argument: shared_expert_num: expected >= 1 when shared_expert_rank_num = ", c.Sr,
                 ", got ", S);
    EPCOMM_CHECK(c.Sr % S == 0,
                 "argument: shared_expert_rank_num: expected a multiple of shared_expert_num = ", S, ", got ",
                 c.Sr);
  }
  const int64_t moe_ranks = c.W - c.Sr;
  EPCOMM_CHECK(c.E >= 1 && c.E % moe_ranks == 0,
               "argument: moe_expert_num: expected a positive multiple of the ", moe_ranks,
               " MoE ranks (ep_world_size - shared_expert_rank_num), got ", c.E);
  EPCOMM_CHECK(c.E <= engine::kMaxExperts - engine::v2::kNumParams - 4, "argument: moe_expert_num: at most ",
               engine::kMaxExperts - engine::v2::kNumParams - 4, " experts are supported, got ", c.E);
  const int64_t L = c.E / moe_ranks;
  EPCOMM_CHECK(c.tp_world_size < 2 || L == 1,
               "argument: tp_world_size = 2 requires one expert per MoE rank (L = moe_expert_num / MoE ranks "
               "= 1), got L = ",
               L);
  EPCOMM_CHECK(K >= 1 && K <= c.E, "argument: expert_ids: K = ", K,
               " (columns) must lie in [1, moe_expert_num = ", c.E, "]");
  EPCOMM_CHECK(c.global_bs >= 0, "argument: global_bs: expected >= 0, got ", c.global_bs);
  if (c.global_bs > 0) {
    EPCOMM_CHECK(c.global_bs % c.W == 0, "argument: global_bs: expected a multiple of ep_world_size = ", c.W,
                 ", got ", c.global_bs);
    EPCOMM_CHECK(bs <= c.global_bs / c.W, "argument: global_bs: Bs = ", bs,
                 " exceeds global_bs / ep_world_size = ", c.global_bs / c.W);
  }
  check_int32(c.global_bs, "global_bs");
  check_int32(bs, "Bs (tokens)");
  Layout lay;
  lay.W = static_cast<int>(c.W);
  lay.E = static_cast<int>(c.E);
  lay.K = K;
  lay.S = static_cast<int>(S);
  lay.Sr = static_cast<int>(c.Sr);
  lay.R = S > 0 ? static_cast<int>(c.Sr / S) : 1;
  lay.L = static_cast<int>(L);
  lay.T = static_cast<int>(std::max<int64_t>(c.tp_world_size, 1));
  lay.max_bs = c.global_bs > 0 ? c.global_bs / c.W : bs;
  lay.G = c.global_bs > 0 ? c.global_bs : bs * c.W;
  return lay;
}

// expert_ids and x_active_mask (docs/distribute-v2.md).
Routing read_routing(const Tensor& ids, const std::optional<Tensor>& mask, int64_t E) {
  EPCOMM_CHECK(ids.defined() && ids.dim() == 2,
               "argument: expert_ids: expected a 2-D (Bs, K) int32 tensor, got ",
               ids.defined() ? describe(ids) : std::string("None"));
  check_dtype(ids, "expert_ids", {DType::i32});
  Routing r;
  r.bs = ids.size(0);
  r.K = static_cast<int>(ids.size(1));
  const int K = r.K;
  EPCOMM_CHECK(K >= 1 && K <= E, "argument: expert_ids: K = ", K,
               " (columns) must lie in [1, moe_expert_num = ", E, "]");
  r.ids.assign(static_cast<size_t>(r.bs) * K, -1);
  r.active.assign(static_cast<size_t>(r.bs), 1);
  std::vector<uint8_t> slot_active(r.ids.size(), 1);
  if (mask) {
    const Tensor& m = *mask;
    check_dtype(m, "x_active_mask", {DType::boolean});
    EPCOMM_CHECK((m.dim() == 1 && m.size(0) == r.bs) || (m.dim() == 2 && m.size(0) == r.bs && m.size(1) == K),
                 "argument: x_active_mask: shape ", shape_str(m.shape()), ", expected (Bs,) = (", r.bs,
                 ",) or (Bs, K) = (", r.bs, ", ", K, ")");
    r.mask_dims = static_cast<int>(m.dim());
    if (m.dim() == 1) {
      int64_t first_false = -1;
      for (int64_t t = 0; t < r.bs; ++t) {
        const bool v = at<uint8_t>(m, t) != 0;
        if (!v && first_false < 0) first_false = t;
        EPCOMM_CHECK(!v || first_false < 0, "argument: x_active_mask: token ", t, " is true after token ",
                     first_false, " is false (a 1-D mask must be a true-prefix)");
        r.active[t] = v;
        for (int k = 0; k < K; ++k) slot_active[t * K + k] = v;
      }
    } else {
      for (int64_t t = 0; t < r.bs; ++t) {
        bool any = false;
        for (int k = 0; k < K; ++k) {
          const bool v = at<uint8_t>(m, t, k) != 0;
          slot_active[t * K + k] = v;
          any |= v;
        }
        r.active[t] = any;
      }
    }
  }
  for (int64_t t = 0; t < r.bs; ++t) {
    for (int k = 0; k < K; ++k) {
      if (!slot_active[t * K + k]) continue;
      const int32_t v = at<int32_t>(ids, t, k);
      EPCOMM_CHECK(v >= 0 && v < E, "argument: expert_ids: token ", t, ", slot ", k, ": expert id ", v,
                   " outside [0,", E, ")");
      for (int j = 0; j < k; ++j)
        EPCOMM_CHECK(r.ids[t * K + j] != v, "argument: expert_ids: token ", t, ": slots ", j, " and ", k,
                     " both select expert ", v, " (active ids must be distinct within a row)");
      r.ids[t * K + k] = v;
    }
  }
  return r;
}

std::vector<float> read_expert_scales(const Tensor& s, int64_t bs, int K) {
  check_dtype(s, "expert_scales", {DType::f32});
  check_shape(s, "expert_scales", {bs, K}, "(Bs, K)");
  std::vector<float> v(static_cast<size_t>(bs) * K);
  for (int64_t t = 0; t < bs; ++t)
    for (int k = 0; k < K; ++k) v[t * K + k] = at<float>(s, t, k);
  return v;
}

// Rows of a (rows, H) tensor as contiguous bytes: the tensor's own memory when its rows are packed, else a
// copy in `copy`.
const uint8_t* packed_rows(const Tensor& t, int64_t rows, int64_t H, std::vector<uint8_t>& copy) {
  const size_t elem = dtype_size(t.dtype());
  if (t.is_contiguous()) return t.data_as<uint8_t>();
  copy.resize(static_cast<size_t>(rows * H) * elem);
  // Any layout: walk the logical (rows, H) view through the last two strides (leading dims fold into rows).
  const int64_t d = t.dim();
  for (int64_t i = 0; i < rows; ++i) {
    int64_t base = 0, rem = i;
    for (int64_t k = d - 2; k >= 0; --k) {
      base += (rem % t.size(k)) * t.strides()[k];
      rem /= t.size(k);
    }
    for (int64_t h = 0; h < H; ++h)
      std::memcpy(copy.data() + (i * H + h) * elem,
                  t.data_as<uint8_t>() + (base + h * t.strides()[d - 1]) * elem, elem);
  }
  return copy.data();
}

engine::v2::Params params_of(const Layout& lay, const LayoutArgs& c, int64_t H, int64_t bs) {
  engine::v2::Params p;
  p.v[engine::v2::kParamW] = lay.W;
  p.v[engine::v2::kParamE] = lay.E;
  p.v[engine::v2::kParamT] = static_cast<int32_t>(c.tp_world_size);
  p.v[engine::v2::kParamShard] = static_cast<int32_t>(c.shard);
  p.v[engine::v2::kParamS] = lay.S;
  p.v[engine::v2::kParamSr] = lay.Sr;
  p.v[engine::v2::kParamGlobalBs] = static_cast<int32_t>(c.global_bs);
  p.v[engine::v2::kParamH] = static_cast<int32_t>(H);
  p.v[engine::v2::kParamK] = lay.K;
  p.v[engine::v2::kParamBs] = static_cast<int32_t>(bs);
  p.v[engine::v2::kParamEpRank] = static_cast<int32_t>(c.ep_rank);
  return p;
}

// expand_x's dtype (docs/distribute-v2.md): x's in mode 0, else y_dtype where the mode allows it, else the
// mode's default.
DType dispatch_out_dtype(const DispatchV2Args& a) {
  const int64_t mode = a.quant_mode;
  EPCOMM_CHECK(mode >= 0 && mode <= 4, "argument: quant_mode: expected 0 to 4, got ", mode);
  const DType xdt = a.x.dtype();
  auto allow = [&](std::initializer_list<DType> ok, DType def) {
    if (!a.y_dtype) return def;
    for (DType d : ok)
      if (*a.y_dtype == d) return d;
    std::string list;
    for (DType d : ok) list += epcomm::detail::cat(list.empty() ? "" : " or ", dtype_name(d));
    EPCOMM_THROW(InvalidUsage, "argument: y_dtype: ", dtype_name(*a.y_dtype),
                 " is not allowed with quant_mode ", mode, ", expected ", list);
  };
  switch (mode) {
    case 0:
      return allow({xdt}, xdt);
    case 1:
      return allow({DType::i8}, DType::i8);
    case 2:
      return allow({DType::i8, DType::f8e4m3, DType::f8e5m2}, DType::i8);
    default:
      return allow({DType::f8e4m3, DType::f8e5m2}, DType::f8e4m3);
  }
}

// The smoothing `scales` of quant modes 1-3 (docs/distribute-v2.md): a scalar, an (H,) vector or an (S+E, H)
// table.
void read_smoothing(const DispatchV2Args& a, int64_t H, int64_t table_rows, DispatchPlan& p) {
  const int64_t mode = a.quant_mode;
  auto& in = p.in;
  in.smooth = {};
  if (a.scales) {
    const Tensor& s = *a.scales;
    EPCOMM_CHECK(mode >= 1 && mode <= 3, "argument: scales: must be absent with quant_mode ", mode, ", got ",
                 describe(s));
    check_dtype(s, "scales", {DType::f32});
    using Kind = engine::v2::SmoothingSource::Kind;
    Kind kind;
    if (mode == 1 && s.dim() == 1 && s.size(0) == 1)
      kind = Kind::scalar;
    else if (mode == 1 && s.dim() == 1 && s.size(0) == H)
      kind = Kind::vector;
    else if (s.dim() == 2 && s.size(0) == table_rows && s.size(1) == H)
      kind = Kind::table;
    else
      EPCOMM_THROW(InvalidUsage, "argument: scales: shape ", shape_str(s.shape()), ", expected ",
                   mode == 1 ? epcomm::detail::cat("(1,), (H,) = (", H, ",) or ") : std::string(),
                   "(shared_expert_num + moe_expert_num, H) = (", table_rows, ", ", H, ")");
    in.smooth.kind = kind;
    if (s.is_contiguous()) {
      in.smooth.data = s.data_as<float>();
    } else {
      const int64_t rows = s.dim() == 2 ? s.size(0) : 1, cols = s.dim() == 2 ? s.size(1) : s.size(0);
      p.scales_copy.resize(static_cast<size_t>(rows * cols));
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j)
          p.scales_copy[i * cols + j] = s.dim() == 2 ? at<float>(s, i, j) : at<float>(s, j);
      in.smooth.data = p.scales_copy.data();
    }
  } else {
    EPCOMM_CHECK(mode != 1,
                 "argument: scales: quant_mode 1 (static int8) needs scales of shape (1,), (H,) or (",
                 table_rows, ", H), got None");
  }
}

// The outputs of docs/distribute-v2.md: the caller's buffers, checked, or zero-filled tensors from
// o.allocator once their total size is known to fit this host. expand_x and the scale rows come from the
// group's output arena (`rows_alloc`), so that senders can write rows into them; the call writes their valid
// rows and dispatch_v2 zeroes the tail after it.
void allocate_dispatch_outputs(const DispatchV2Args& a, const OpOptions& o, const Layout& lay, DType out_dt,
                               int64_t H, Allocator* rows_alloc, DispatchPlan& p) {
  const int64_t mode = a.quant_mode;
  const auto& in = p.in;
  const int me = in.me;
  p.A = lay.capacity(me);
  const int64_t rows = lay.T * p.A;
  const int Lp = lay.local_experts(me);
  check_output_bytes(a, p.A,
                     static_cast<double>(rows) *
                         static_cast<double>(in.fmt.data_bytes + in.fmt.scale_bytes + sizeof(float) * 2),
                     Lp, lay);
  Allocator* alloc = o.allocator.get();
  DispatchV2Result& r = p.result;
  r.expand_x = output(a.expand_x_out, "expand_x_out", out_dt, {rows, H}, rows_alloc, {}, false);
  p.zero_tail_x = !a.expand_x_out;
  const bool scale_rows = in.fmt.scale_bytes > 0;  // written per row (modes 2-4); else zeros throughout
  Allocator* scales_alloc = scale_rows ? rows_alloc : alloc;
  if (mode == 3)
    r.dynamic_scales = output(a.dynamic_scales_out, "dynamic_scales_out", DType::f32,
                              {rows, ceil_div(H, 128)}, scales_alloc, {}, false);
  else if (mode == 4)
    r.dynamic_scales =
        output(a.dynamic_scales_out, "dynamic_scales_out", DType::u8,
               {rows, static_cast<int64_t>(in.fmt.scale_bytes)}, scales_alloc, {DType::e8m0}, false);
  else
    r.dynamic_scales =
        output(a.dynamic_scales_out, "dynamic_scales_out", DType::f32, {rows}, scales_alloc, {}, !scale_rows);
  p.zero_tail_scales = scale_rows && !a.dynamic_scales_out;
  r.assist_info_for_combine =
      output(a.assist_info_for_combine_out, "assist_info_for_combine_out", DType::i32, {p.A * 128}, alloc);
  r.expert_token_nums = output(a.expert_token_nums_out, "expert_token_nums_out", DType::i64, {Lp}, alloc);
  r.ep_recv_counts = output(a.ep_recv_counts_out, "ep_recv_counts_out", DType::i32,
                            {static_cast<int64_t>(lay.W) * lay.T * Lp}, alloc);
  r.tp_recv_counts = output(a.tp_recv_counts_out, "tp_recv_counts_out", DType::i32, {a.tp_world_size}, alloc);
  r.expand_scales =
      output(a.expand_scales_out, "expand_scales_out", DType::f32, {a.expert_scales ? rows : 0}, alloc);
}

// Reserved inputs of combine (docs/distribute-v2.md, Appendix A) and comm_quant_mode.
void check_combine_reserved(const CombineV2Args& a, int64_t H) {
  check_absent(a.activation_scale, "activation_scale");
  check_absent(a.weight_scale, "weight_scale");
  check_absent(a.group_list, "group_list");
  check_absent(a.performance_info, "performance_info");
  check_absent(a.elastic_info, "elastic_info");
  check_absent(a.ori_x, "ori_x");
  check_absent(a.const_expert_alpha_1, "const_expert_alpha_1");
  check_absent(a.const_expert_alpha_2, "const_expert_alpha_2");
  check_absent(a.const_expert_v, "const_expert_v");
  check_zero(a.out_dtype, "out_dtype");
  check_zero(a.group_list_type, "group_list_type");
  check_zero(a.zero_expert_num, "zero_expert_num");
  check_zero(a.copy_expert_num, "copy_expert_num");
  check_zero(a.const_expert_num, "const_expert_num");
  EPCOMM_CHECK(a.comm_quant_mode != 3 && a.comm_quant_mode != 4,
               "argument: comm_quant_mode: not supported by epcomm yet (MXFP8 combine, modes 3 and 4), got ",
               a.comm_quant_mode);
  EPCOMM_CHECK(a.comm_quant_mode == 0 || a.comm_quant_mode == 2,
               "argument: comm_quant_mode: expected 0 or 2, got ", a.comm_quant_mode);
  EPCOMM_CHECK(a.comm_quant_mode != 2 || H % 8 == 0,
               "argument: comm_quant_mode = 2 needs H % 8 == 0, got H = ", H);
}

// combine's outputs (x; y and rstd for combine_add_rms_norm, whose residual_x, gamma and norm_eps are
// checked here): the caller's buffers, checked, or zero-filled tensors from o.allocator.
void combine_outputs(const CombineV2Args& a, const CombineAddRmsNormArgs* norm, const OpOptions& o,
                     int64_t bs, int64_t H, DType dt, CombinePlan& p) {
  auto& in = p.in;
  Allocator* alloc = o.allocator.get();
  if (!norm) {
    p.x = output(a.x_out, "x_out", dt, {bs, H}, alloc);
  } else {
    const Tensor& res = norm->residual_x;
    EPCOMM_CHECK(res.defined(), "argument: residual_x: expected (Bs, 1, H), got None");
    check_dtype(res, "residual_x", {dt});
    check_shape(res, "residual_x", {bs, 1, H}, "(Bs, 1, H)");
    const Tensor& g = norm->gamma;
    EPCOMM_CHECK(g.defined(), "argument: gamma: expected (H,), got None");
    check_dtype(g, "gamma", {dt});
    check_shape(g, "gamma", {H}, "(H,)");
    EPCOMM_CHECK(std::isfinite(norm->norm_eps) && norm->norm_eps >= 0,
                 "argument: norm_eps: expected finite >= 0, got ", norm->norm_eps);
    in.residual = packed_rows(res, bs, H, p.residual_copy);
    in.gamma = packed_rows(g, 1, H, p.gamma_copy);
    in.norm_eps = norm->norm_eps;
    p.y = output(norm->y_out, "y_out", dt, {bs, 1, H}, alloc);
    p.rstd = output(norm->rstd_out, "rstd_out", DType::f32, {bs, 1, 1}, alloc);
    p.x = output(a.x_out, "x_out", dt, {bs, 1, H}, alloc);
  }
}

}  // namespace

void check_options(const OpOptions& o) {
  const std::string& p = o.strict_hardware_limits;
  EPCOMM_CHECK(p.empty() || p == "A2" || p == "A3" || p == "950",
               "argument: strict_hardware_limits: expected \"\", \"A2\", \"A3\" or \"950\", got \"", p, "\"");
  EPCOMM_CHECK(o.num_threads >= 0, "argument: num_threads: expected >= 0, got ", o.num_threads);
}

void prepare_dispatch(Group& ep, Group* tp, const DispatchV2Args& a, const OpOptions& o, DispatchPlan& p) {
  check_options(o);
  EPCOMM_CHECK(a.x.defined() && a.x.dim() == 2, "argument: x: expected a 2-D (Bs, H) tensor, got ",
               a.x.defined() ? describe(a.x) : std::string("None"));
  check_dtype(a.x, "x", {DType::bf16, DType::f16});
  const int64_t H = a.x.size(1);
  EPCOMM_CHECK(H >= 1, "argument: x: H (columns) must be >= 1, got ", H);
  check_int32(H, "H");
  Routing routing = read_routing(a.expert_ids, a.x_active_mask, a.moe_expert_num);
  EPCOMM_CHECK(routing.bs == a.x.size(0), "argument: expert_ids: ", routing.bs,
               " rows, expected Bs = ", a.x.size(0), " (rows of x)");
  const LayoutArgs c{a.ep_world_size, a.ep_rank_id,        a.moe_expert_num,    a.tp_world_size,
                     a.tp_rank_id,    a.expert_shard_type, a.shared_expert_num, a.shared_expert_rank_num,
                     a.global_bs};
  const Layout lay = check_layout(ep, tp, c, routing.bs, routing.K, o.live_ranks);
  check_absent(a.elastic_info, "elastic_info");
  check_absent(a.performance_info, "performance_info");
  EPCOMM_CHECK(!a.x_dtype, "argument: x_dtype: not supported by epcomm yet (must be absent)");
  EPCOMM_CHECK(!a.scales_dtype, "argument: scales_dtype: not supported by epcomm yet (must be absent)");
  check_zero(a.zero_expert_num, "zero_expert_num");
  check_zero(a.copy_expert_num, "copy_expert_num");
  check_zero(a.const_expert_num, "const_expert_num");
  EPCOMM_CHECK(a.expert_token_nums_type == 0 || a.expert_token_nums_type == 1,
               "argument: expert_token_nums_type: expected 0 or 1, got ", a.expert_token_nums_type);

  // Quantization (docs/distribute-v2.md).
  const int64_t mode = a.quant_mode;
  const DType xdt = a.x.dtype(), out_dt = dispatch_out_dtype(a);
  auto& in = p.in;
  read_smoothing(a, H, lay.S + lay.E, p);

  in.lay = lay;
  in.me = static_cast<int>(a.ep_rank_id);
  in.bs = routing.bs;
  in.fmt.quant_mode = static_cast<int>(mode);
  in.fmt.x_dtype = xdt;
  in.fmt.out_dtype = out_dt;
  in.fmt.H = H;
  in.fmt.data_bytes = static_cast<size_t>(H) * dtype_size(out_dt);
  switch (mode) {
    case 2:
      in.fmt.scale_bytes = sizeof(float);
      break;
    case 3:
      in.fmt.scale_bytes = sizeof(float) * static_cast<size_t>(ceil_div(H, quant::kGroup128));
      break;
    case 4:
      in.fmt.scale_bytes = static_cast<size_t>(ceil_div(ceil_div(H, quant::kMxBlock), 2) * 2);
      break;
    default:
      in.fmt.scale_bytes = 0;
  }
  in.x = packed_rows(a.x, routing.bs, H, p.x_copy);
  in.x_row_bytes = static_cast<size_t>(H) * dtype_size(xdt);
  in.ids = std::move(routing.ids);
  in.active = std::move(routing.active);
  if (a.expert_scales) in.expert_scales = read_expert_scales(*a.expert_scales, in.bs, lay.K);
  in.expert_token_nums_type = static_cast<int>(a.expert_token_nums_type);
  in.params = params_of(lay, c, H, in.bs);
  in.params.v[engine::v2::kParamDtype] = static_cast<int32_t>(xdt);
  in.params.v[engine::v2::kParamQuantMode] = static_cast<int32_t>(mode);
  in.params.v[engine::v2::kParamOutDtype] = static_cast<int32_t>(out_dt);

  Routing for_strict;
  for_strict.bs = in.bs;
  for_strict.K = lay.K;
  for_strict.mask_dims = routing.mask_dims;
  check_strict_dispatch(o, a, lay, for_strict, H);

  p.tp_world_size = static_cast<int>(a.tp_world_size);
  p.tp_rank = static_cast<int>(a.tp_rank_id);
  allocate_dispatch_outputs(a, o, lay, out_dt, H, moe::context_of(ep).output_allocator(o.allocator).get(), p);
}

void prepare_combine(Group& ep, Group* tp, const CombineV2Args& a, const CombineAddRmsNormArgs* norm,
                     const OpOptions& o, CombinePlan& p) {
  check_options(o);
  const Tensor& ex = a.expand_x;
  EPCOMM_CHECK(ex.defined() && ex.dim() == 2, "argument: expand_x: expected a 2-D (rows, H) tensor, got ",
               ex.defined() ? describe(ex) : std::string("None"));
  check_dtype(ex, "expand_x", {DType::bf16, DType::f16});
  const DType dt = ex.dtype();
  const int64_t H = ex.size(1);
  EPCOMM_CHECK(H >= 1, "argument: expand_x: H (columns) must be >= 1, got ", H);
  check_int32(H, "H");
  Routing routing = read_routing(a.expert_ids, a.x_active_mask, a.moe_expert_num);
  const LayoutArgs c{a.ep_world_size, a.ep_rank_id,        a.moe_expert_num,    a.tp_world_size,
                     a.tp_rank_id,    a.expert_shard_type, a.shared_expert_num, a.shared_expert_rank_num,
                     a.global_bs};
  const Layout lay = check_layout(ep, tp, c, routing.bs, routing.K, o.live_ranks);
  const int me = static_cast<int>(a.ep_rank_id);
  const int64_t bs = routing.bs;
  const int K = lay.K;

  check_combine_reserved(a, H);

  // Counts and rows.
  const int Lp = lay.local_experts(me);
  const Tensor& sc = a.ep_send_counts;
  const int64_t n_counts = static_cast<int64_t>(lay.W) * lay.T * Lp;
  EPCOMM_CHECK(sc.defined(), "argument: ep_send_counts: expected an int32 tensor of ", n_counts,
               " elements, got None");
  check_dtype(sc, "ep_send_counts", {DType::i32});
  EPCOMM_CHECK(sc.numel() == n_counts && sc.is_contiguous(), "argument: ep_send_counts: ", sc.numel(),
               " elements (", describe(sc), "), expected ep_world_size·max(tp_world_size,1)·L_p = ", n_counts,
               ", contiguous");
  const int64_t n_own = sc.data_as<int32_t>()[static_cast<int64_t>(lay.W) * Lp - 1];
  const int64_t A = lay.capacity(me);
  EPCOMM_CHECK(n_own >= 0 && n_own <= A, "argument: ep_send_counts[", static_cast<int64_t>(lay.W) * Lp - 1,
               "] = ", n_own, ": the rows this rank owns must lie in [0, A = ", A, "]");
  int64_t n_send = 0;
  if (lay.T == 2 && a.tp_world_size == 2) {
    EPCOMM_CHECK(a.tp_send_counts.has_value(),
                 "argument: tp_send_counts: expected int32 (2,) with tp_world_size = 2, got None");
    const Tensor& ts = *a.tp_send_counts;
    check_dtype(ts, "tp_send_counts", {DType::i32});
    check_shape(ts, "tp_send_counts", {2}, "(tp_world_size,)");
    const int32_t own = at<int32_t>(ts, a.tp_rank_id);
    n_send = at<int32_t>(ts, 1 - a.tp_rank_id);
    EPCOMM_CHECK(own == n_own, "argument: tp_send_counts[tp_rank_id = ", a.tp_rank_id, "] = ", own,
                 ", expected n_own = ep_send_counts[", static_cast<int64_t>(lay.W) * Lp - 1, "] = ", n_own);
    EPCOMM_CHECK(n_send >= 0 && n_send <= A, "argument: tp_send_counts[", 1 - a.tp_rank_id, "] = ", n_send,
                 ": expected in [0, A = ", A, "]");
  }
  EPCOMM_CHECK(ex.size(0) >= n_own + n_send, "argument: expand_x: ", ex.size(0),
               " rows, expected >= ", n_own + n_send, " (n_own", lay.T == 2 ? " + the TP peer's rows" : "",
               ")");
  const Tensor& ai = a.assist_info_for_combine;
  EPCOMM_CHECK(ai.defined(), "argument: assist_info_for_combine: expected an int32 tensor, got None");
  check_dtype(ai, "assist_info_for_combine", {DType::i32});
  EPCOMM_CHECK(ai.numel() >= 3 * n_own, "argument: assist_info_for_combine: ", ai.numel(),
               " elements, expected >= 3·n_own = ", 3 * n_own);
  if (ai.is_contiguous()) {
    p.in.assist = ai.data_as<int32_t>();
  } else {
    EPCOMM_CHECK(ai.dim() == 1, "argument: assist_info_for_combine: must be 1-D or contiguous, got ",
                 describe(ai), " with strides ", shape_str(ai.strides()));
    p.assist_copy.resize(static_cast<size_t>(3 * n_own));
    for (int64_t i = 0; i < 3 * n_own; ++i) p.assist_copy[i] = at<int32_t>(ai, i);
    p.in.assist = p.assist_copy.data();
  }
  EPCOMM_CHECK(a.expert_scales.defined(), "argument: expert_scales: expected fp32 (Bs, K), got None");
  std::vector<float> escales = read_expert_scales(a.expert_scales, bs, K);

  // shared_expert_x (only without shared-expert ranks).
  const uint8_t* shared = nullptr;
  if (a.shared_expert_x) {
    const Tensor& s = *a.shared_expert_x;
    EPCOMM_CHECK(lay.Sr == 0, "argument: shared_expert_x: only allowed when shared_expert_rank_num = 0, got ",
                 lay.Sr);
    check_dtype(s, "shared_expert_x", {dt});
    const bool ok = (s.dim() == 2 && s.size(0) == bs && s.size(1) == H) ||
                    (s.dim() == 3 && s.size(0) * s.size(1) == bs && s.size(2) == H);
    EPCOMM_CHECK(ok, "argument: shared_expert_x: shape ", shape_str(s.shape()), ", expected (Bs, H) = (", bs,
                 ", ", H, ") or (a, b, H) with a·b = Bs");
    shared = packed_rows(s, bs, H, p.shared_copy);
  }
  p.expand_x = packed_rows(ex, ex.size(0), H, p.expand_x_copy);

  auto& in = p.in;
  in.lay = lay;
  in.me = me;
  in.bs = bs;
  in.H = H;
  in.dt = dt;
  in.comm_quant = static_cast<int>(a.comm_quant_mode);
  in.n_own = n_own;
  in.rows = p.expand_x;
  in.ids = std::move(routing.ids);
  in.active = std::move(routing.active);
  in.expert_scales = std::move(escales);
  in.shared_x = shared;
  in.params = params_of(lay, c, H, bs);
  in.params.v[engine::v2::kParamDtype] = static_cast<int32_t>(dt);
  in.params.v[engine::v2::kParamCommQuant] = static_cast<int32_t>(a.comm_quant_mode);
  p.n_send = n_send;
  p.tp_world_size = static_cast<int>(a.tp_world_size);
  p.tp_rank = static_cast<int>(a.tp_rank_id);

  Routing for_strict;
  for_strict.bs = bs;
  for_strict.K = K;
  for_strict.mask_dims = routing.mask_dims;
  check_strict_combine(o, a, lay, for_strict, H, dt, norm != nullptr);

  combine_outputs(a, norm, o, bs, H, dt, p);
}

}  // namespace epcomm::moe::detail
