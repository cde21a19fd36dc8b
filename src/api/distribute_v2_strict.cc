// api/distribute_v2_strict.cc — the optional per-product hardware limits of docs/distribute-v2.md. They
// are size and support limits, not consistency rules: checked only when OpOptions::strict_hardware_limits
// names a product, so that a configuration can be vetted on CPU. A violation raises InvalidUsage("exceeds
// <product> limit: <rule>").
#include <algorithm>

#include "api/distribute_v2_args.h"
#include "common/check.h"

namespace epcomm::moe::detail {
namespace {

int64_t align(int64_t v, int64_t n) {
  return (v + n - 1) / n * n;
}

struct Limits {
  std::string product;
  std::string comm_alg, group_ep, group_tp;
  enum class Op { dispatch, combine, add_rms_norm } op = Op::dispatch;
  int64_t bs = 0, H = 0, W = 0, E = 0, K = 0, L = 0, S = 0, Sr = 0, T = 0;  // T: tp_world_size as passed
  int64_t global_bs = 0, max_bs = 0, A = 0;  // A: the largest capacity of any rank (window rules)
  int64_t A_me = 0;                          // this rank's capacity (buffer rules)
  int64_t quant_mode = 0, comm_quant = 0, mask_dims = 0, MB = 200;
  bool dispatch_expert_scales = false;
  int64_t assist_elems = -1, expand_rows = -1;  // combine buffers (-1: dispatch)
  DType dt = DType::bf16;
};

[[noreturn]] void exceed(const Limits& l, const std::string& rule) {
  EPCOMM_THROW(InvalidUsage, "argument: exceeds ", l.product, " limit: ", rule);
}

void range(const Limits& l, const char* name, int64_t v, int64_t lo, int64_t hi, const char* note = "") {
  if (v < lo || v > hi) exceed(l, epcomm::detail::cat(name, " = ", v, " outside [", lo, ", ", hi, "]", note));
}

void check_names(const Limits& l) {
  if (l.group_ep.empty() || l.group_ep.size() > 127)
    exceed(l, epcomm::detail::cat("group_ep length ", l.group_ep.size(), " outside [1, 127]"));
  if (l.T == 2 && l.group_tp == l.group_ep) exceed(l, "group_tp must differ from group_ep");
}

void check_combine_buffers(const Limits& l) {
  if (l.assist_elems < 0) return;
  const int64_t Tp = std::max<int64_t>(l.T, 1);
  if (l.assist_elems < 128 * l.A_me)
    exceed(l, epcomm::detail::cat("assist_info_for_combine has ", l.assist_elems,
                                  " elements, below 128·A = ", 128 * l.A_me));
  if (l.expand_rows < Tp * l.A_me)
    exceed(l, epcomm::detail::cat("expand_x has ", l.expand_rows, " rows, below T·A = ", Tp * l.A_me));
}

void check_a3(const Limits& l) {
  const bool v2 = l.comm_alg == "fullmesh_v2";
  if (l.comm_alg != "" && l.comm_alg != "fullmesh_v1" && !v2)
    exceed(l, "comm_alg \"" + l.comm_alg + "\" not in {\"\", \"fullmesh_v1\", \"fullmesh_v2\"}");
  range(l, "Bs", l.bs, 1, v2 ? 256 : 512, v2 ? " (fullmesh_v2)" : "");
  range(l, "H", l.H, 1024, 8192);
  range(l, "ep_world_size", l.W, 2, 768);
  range(l, "moe_expert_num", l.E, 1, 1024);
  range(l, "K", l.K, 1, v2 ? 12 : 16, v2 ? " (fullmesh_v2)" : "");
  if (l.L * l.W > 2048) exceed(l, epcomm::detail::cat("local experts L·W = ", l.L * l.W, " above 2048"));
  range(l, "shared_expert_num", l.S, 0, 4);
  range(l, "tp_world_size", l.T, 0, 2);
  if (l.op == Limits::Op::dispatch && l.quant_mode != 0 && l.quant_mode != 2)
    exceed(l, epcomm::detail::cat("quant_mode ", l.quant_mode, " not in {0, 2}"));
  if (l.comm_quant == 2 && l.T == 2) exceed(l, "comm_quant_mode 2 needs tp_world_size < 2");
  const bool varies = l.global_bs > l.bs * l.W;
  if (l.mask_dims > 0 && varies)
    exceed(l, epcomm::detail::cat("x_active_mask with varying Bs (global_bs = ", l.global_bs,
                                  " > Bs·W = ", l.bs * l.W, ")"));
  if (l.op == Limits::Op::dispatch && l.dispatch_expert_scales)
    exceed(l, "expert_scales on dispatch must be absent");
  if (v2) {
    if (l.mask_dims == 2) exceed(l, "fullmesh_v2 takes no 2-D x_active_mask");
    if (l.T == 2) exceed(l, "fullmesh_v2 takes no tp_world_size = 2");
    if (varies) exceed(l, "fullmesh_v2 takes no Bs variation (global_bs > Bs·W)");
  }
  check_combine_buffers(l);
  if (l.op == Limits::Op::add_rms_norm) {
    if (l.dt != DType::bf16) exceed(l, "combine_add_rms_norm needs bf16");
    if (l.S != 0 || l.Sr != 0) exceed(l, "combine_add_rms_norm takes no shared experts");
    if (l.T > 1) exceed(l, "combine_add_rms_norm needs tp_world_size <= 1");
    if (l.comm_quant != 0) exceed(l, "combine_add_rms_norm needs comm_quant_mode 0");
  }
  check_names(l);
  if (l.MB < 2) exceed(l, epcomm::detail::cat("hccl_buffsize_mb = ", l.MB, " below 2"));
  const int64_t B = l.MB << 20;
  if (l.op == Limits::Op::add_rms_norm) {
    const int64_t need = l.bs * 2 * (l.H + 128) * (l.W * l.L + l.K + 1);
    const int64_t have = (int64_t{1} << 20) * (l.MB - 2) / 2;
    if (have < need)
      exceed(l,
             epcomm::detail::cat("window 2^20·(MB−2)/2 = ", have, " below Bs·2·(H+128)·(W·L+K+1) = ", need));
    return;
  }
  const int64_t D = v2 ? (align(2 * l.H, 32) + 44 + 479) / 480 * 512 : align(align(2 * l.H, 32) + 44, 512);
  const int64_t C = align(2 * l.H, 512);
  const int64_t need = 2 * (l.max_bs * D * l.W * l.L + l.max_bs * C * (l.K + l.S));
  if (need > B)
    exceed(l, epcomm::detail::cat("window 2·(maxBs·D·W·L + maxBs·C·(K+S)) = ", need, " above MB·2^20 = ", B));
  if (l.T == 2 && 2 * l.A * (D + C) > B)
    exceed(l, epcomm::detail::cat("TP window 2·A·(D+C) = ", 2 * l.A * (D + C), " above MB·2^20 = ", B));
}

void check_a2(const Limits& l) {
  const bool hier = l.comm_alg == "hierarchy";
  if (l.comm_alg != "" && l.comm_alg != "fullmesh" && !hier)
    exceed(l, "comm_alg \"" + l.comm_alg + "\" not in {\"\", \"fullmesh\", \"hierarchy\"}");
  if (l.op == Limits::Op::add_rms_norm) exceed(l, "combine_add_rms_norm is not available");
  range(l, "Bs", l.bs, 1, hier ? 512 : 256, hier ? " (hierarchy)" : " (fullmesh)");
  range(l, "H", l.H, 1, hier ? 10240 : 7168, hier ? " (hierarchy)" : " (fullmesh)");
  if (l.H % 32) exceed(l, epcomm::detail::cat("H = ", l.H, " is not a multiple of 32"));
  if (hier) {
    if (l.W != 16 && l.W != 32 && l.W != 64)
      exceed(l, epcomm::detail::cat("ep_world_size = ", l.W, " not in {16, 32, 64} (hierarchy)"));
  } else {
    const bool ok = (l.W >= 2 && l.W <= 8) || l.W == 16 || l.W == 32 || l.W == 64 || l.W == 128 ||
                    l.W == 192 || l.W == 256 || l.W == 384;
    if (!ok)
      exceed(l, epcomm::detail::cat("ep_world_size = ", l.W,
                                    " not in {2..8, 16, 32, 64, 128, 192, 256, 384} (fullmesh)"));
    if (l.L > 24) exceed(l, epcomm::detail::cat("local experts L = ", l.L, " above 24 (fullmesh)"));
  }
  range(l, "moe_expert_num", l.E, 1, 512);
  range(l, "K", l.K, 1, 16);
  if (l.S != 0 || l.Sr != 0) exceed(l, "no shared experts (shared_expert_num = shared_expert_rank_num = 0)");
  range(l, "tp_world_size", l.T, 0, 1);
  if (l.op == Limits::Op::dispatch && l.quant_mode != 0 && l.quant_mode != 2)
    exceed(l, epcomm::detail::cat("quant_mode ", l.quant_mode, " not in {0, 2}"));
  if (l.comm_quant == 2 && !hier) exceed(l, "comm_quant_mode 2 needs comm_alg \"hierarchy\"");
  if (l.mask_dims == 2) exceed(l, "x_active_mask must be 1-D");
  if (l.mask_dims > 0 && hier) exceed(l, "no x_active_mask with hierarchy");
  check_combine_buffers(l);
  check_names(l);
  if (l.MB < 2) exceed(l, epcomm::detail::cat("hccl_buffsize_mb = ", l.MB, " below 2"));
  const int64_t B = l.MB << 20;
  int64_t need;
  if (hier)
    need = (l.E + l.W / 4) * align(l.max_bs * (2 * l.H + 16 * align(l.K, 8)), 512) + (int64_t{1} << 23);
  else
    need = 2 * (l.bs * l.W * std::min(l.L, l.K) * 2 * l.H + (int64_t{1} << 21));
  if (need > B) exceed(l, epcomm::detail::cat("window ", need, " above MB·2^20 = ", B));
}

void check_950(const Limits& l) {
  if (l.comm_alg != "") exceed(l, "comm_alg \"" + l.comm_alg + "\" must be \"\"");
  range(l, "Bs", l.bs, 1, 512);
  range(l, "H", l.H, 1024, 8192);
  range(l, "ep_world_size", l.W, 2, 768);
  range(l, "moe_expert_num", l.E, 1, 1024);
  range(l, "K", l.K, 1, 16);
  range(l, "shared_expert_num", l.S, 0, 4);
  range(l, "tp_world_size", l.T, 0, 1);
  if (l.comm_quant == 2) exceed(l, "comm_quant_mode 2 not in {0, 3, 4}");
  if (l.op == Limits::Op::dispatch && l.dispatch_expert_scales)
    exceed(l, "expert_scales on dispatch must be absent");
  check_combine_buffers(l);
  if (l.op == Limits::Op::add_rms_norm) {
    if (l.dt != DType::bf16) exceed(l, "combine_add_rms_norm needs bf16");
    if (l.S != 0 || l.Sr != 0) exceed(l, "combine_add_rms_norm takes no shared experts");
    if (l.comm_quant != 0) exceed(l, "combine_add_rms_norm needs comm_quant_mode 0");
  }
  check_names(l);
  if (l.MB < 2) exceed(l, epcomm::detail::cat("hccl_buffsize_mb = ", l.MB, " below 2"));
  const int64_t B = l.MB << 20;
  const int64_t Hp = l.quant_mode == 3   ? align(l.H, 128)
                     : l.quant_mode == 4 ? align(l.H, 256)
                                         : align(l.H, 32);
  const int64_t need = 65536 + 2 * l.W * (l.max_bs * align(2 * Hp, 512) * l.L + 512);
  if (need > B)
    exceed(l, epcomm::detail::cat("window 65536 + 2·W·(maxBs·Align512(2·H')·L + 512) = ", need,
                                  " above MB·2^20 = ", B));
}

void check(const Limits& l) {
  if (l.product == "A3") check_a3(l);
  if (l.product == "A2") check_a2(l);
  if (l.product == "950") check_950(l);
}

Limits common(const OpOptions& o, const engine::v2::Layout& lay, const Routing& routing, int64_t me,
              int64_t H, int64_t W_passed, int64_t T_passed, int64_t global_bs, const std::string& comm_alg,
              const std::string& group_ep, const std::string& group_tp) {
  Limits l;
  l.product = o.strict_hardware_limits;
  l.comm_alg = comm_alg;
  l.group_ep = group_ep;
  l.group_tp = group_tp;
  l.bs = routing.bs;
  l.H = H;
  l.W = W_passed;
  l.E = lay.E;
  l.K = lay.K;
  l.L = lay.L;
  l.S = lay.S;
  l.Sr = lay.Sr;
  l.T = T_passed;
  l.global_bs = global_bs;
  l.max_bs = lay.max_bs;
  l.A = std::max(lay.G * std::min(lay.L, lay.K), lay.Sr > 0 ? lay.max_bs * ((lay.W + lay.R - 1) / lay.R) : 0);
  l.mask_dims = routing.mask_dims;
  l.MB = o.hccl_buffsize_mb;
  l.A_me = lay.capacity(static_cast<int>(me));
  return l;
}

}  // namespace

void check_strict_dispatch(const OpOptions& o, const DispatchV2Args& a, const engine::v2::Layout& lay,
                           const Routing& routing, int64_t H) {
  if (o.strict_hardware_limits.empty()) return;
  Limits l = common(o, lay, routing, a.ep_rank_id, H, a.ep_world_size, a.tp_world_size, a.global_bs,
                    a.comm_alg, a.group_ep, a.group_tp);
  l.op = Limits::Op::dispatch;
  l.quant_mode = a.quant_mode;
  l.dispatch_expert_scales = a.expert_scales.has_value();
  l.dt = a.x.dtype();
  check(l);
}

void check_strict_combine(const OpOptions& o, const CombineV2Args& a, const engine::v2::Layout& lay,
                          const Routing& routing, int64_t H, DType dt, bool add_rms_norm) {
  if (o.strict_hardware_limits.empty()) return;
  Limits l = common(o, lay, routing, a.ep_rank_id, H, a.ep_world_size, a.tp_world_size, a.global_bs,
                    a.comm_alg, a.group_ep, a.group_tp);
  l.op = add_rms_norm ? Limits::Op::add_rms_norm : Limits::Op::combine;
  l.comm_quant = a.comm_quant_mode;
  l.assist_elems = a.assist_info_for_combine.numel();
  l.expand_rows = a.expand_x.size(0);
  l.dt = dt;
  check(l);
}

}  // namespace epcomm::moe::detail
