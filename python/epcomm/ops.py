"""epcomm.ops: torch_npu-style distribute operators (docs/distribute-v2.md) on torch CPU tensors.

    epcomm.ops.register_group("ep0", ep_process_group)      # optional: lets group_ep="ep0" work
    expand_x, dynamic_scales, assist_info, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = \
        epcomm.ops.npu_moe_distribute_dispatch_v2(x, expert_ids, "ep0", W, rank, E, expert_scales=w)
    x = epcomm.ops.npu_moe_distribute_combine_v2(expert_out, expert_ids, assist_info, ep_recv_counts, w,
                                                 "ep0", W, rank, E)

The three functions keep torch_npu's names, positional order, keyword names, defaults and output order, and
call the C++ operators (epcomm::moe::dispatch_v2 / combine_v2 / combine_add_rms_norm). Every call is
collective and blocking over the EP group (and the TP pair when tp_world_size = 2). `group_ep`/`group_tp` is a
torch.distributed ProcessGroup (gloo), an epcomm.Group, or a name registered with register_group; the
epcomm.Group made for a ProcessGroup is created once (collectively, on its first use) and cached, and so is
the operator context the C++ side keeps per Group."""
import math

import torch
import torch.distributed as dist

from . import _C
from ._dtypes import PLAIN, _NAME_OF_REAL, as_format
from ._errors import INT32, Error, InvalidUsageError, int_arg, number_arg

_registry = {}
# ProcessGroup -> epcomm.Group. Keyed by the ProcessGroup object itself (kept alive here), so a group
# created again after destroy_process_group gets a new epcomm.Group.
_groups = {}


def register_group(name, group):
    """Registers a group under a name, so that torch_npu code passing HCCL group names (group_ep="ep0")
    runs unchanged. `group` is an epcomm.Group or a torch.distributed ProcessGroup."""
    from .group import Group

    if not isinstance(name, str) or not name:
        raise InvalidUsageError(f"register_group: name: expected a non-empty string, got {name!r}")
    if not isinstance(group, (Group, dist.ProcessGroup)):
        raise InvalidUsageError(
            f"register_group: group: expected an epcomm.Group or a torch.distributed ProcessGroup, got "
            f"{type(group).__name__}")
    _registry[name] = group


def unregister_group(name):
    _registry.pop(name, None)


def init_group_context(group, segment_bytes=0, timeout_s=None, ranks_per_node=0, num_rdma_bytes=0,
                       num_output_arena_bytes=-1, num_output_reserve_bytes=0):
    """Creates the operator context of `group` (a ProcessGroup, an epcomm.Group or a registered name) with
    these options, collectively over the group; raises InvalidUsageError when it already has one. Optional:
    without it the context gets the defaults on the group's first call.

    segment_bytes: shared memory per rank (0 = 64 MiB; larger transfers move in rounds). timeout_s: the
    group's deadline (default EPCOMM_TIMEOUT_S, else 100). ranks_per_node: P > 0 splits the group into nodes of
    P consecutive ranks that talk over UCX (virtual nodes on one host); 0 = EPCOMM_RANKS_PER_NODE, else one
    node per host. num_rdma_bytes: across nodes, the per-rank lanes (0 = 64 MiB). See docs/internode.md.
    num_output_arena_bytes: one node, the address space of each rank's output arena, which dispatch_v2's
    expand_x / dynamic_scales and output_buffer's tensors come from so that senders write rows straight into
    them (-1 = EPCOMM_OUTPUT_ARENA, else the physical memory; 0 = none: rows are staged and pulled).
    num_output_reserve_bytes: arena memory written through at creation and mapped by every peer then, so that
    the first calls' rows land on pages that exist (0 = none)."""
    from .group import Group

    pre = "init_group_context: "
    segment_bytes, num_rdma_bytes = int_arg(segment_bytes, "segment_bytes", prefix=pre), int_arg(
        num_rdma_bytes, "num_rdma_bytes", prefix=pre)
    ranks_per_node = int_arg(ranks_per_node, "ranks_per_node", INT32, prefix=pre)
    num_output_arena_bytes = int_arg(num_output_arena_bytes, "num_output_arena_bytes", prefix=pre)
    num_output_reserve_bytes = int_arg(num_output_reserve_bytes, "num_output_reserve_bytes", prefix=pre)
    if timeout_s is not None:
        timeout_s = number_arg(timeout_s, "timeout_s", prefix=pre)
    g = _resolve("init_group_context", "group", group, None, True)
    if isinstance(g, dist.ProcessGroup):
        if g in _groups:
            raise InvalidUsageError("init_group_context: argument: the group already has a context (created "
                                    "by an earlier call)")
        c = Group(g)
        _C.moe_init_group_context(c._c, segment_bytes, timeout_s, ranks_per_node, num_rdma_bytes,
                                  num_output_arena_bytes, num_output_reserve_bytes)
        _groups[g] = c
        return
    if not isinstance(g, Group):
        raise InvalidUsageError(f"init_group_context: argument: group: expected a torch.distributed ProcessGroup, "
                                f"an epcomm.Group or a registered name, got {type(g).__name__}")
    _C.moe_init_group_context(g._c, segment_bytes, timeout_s, ranks_per_node, num_rdma_bytes, num_output_arena_bytes,
                              num_output_reserve_bytes)


def group_copy_counters(group):
    """What this rank's dispatch_v2 and combine calls did with their rows since `group`'s context was
    created, as a dict: dispatch_staged_tokens (staged for the receivers to pull), dispatch_pushed_tokens
    (rows written straight into the receivers' outputs, which lay in their output arenas), combine_copied_rows
    (rows copied into other origins' windows) and combine_in_place_rows (rows other origins read in place,
    every rank's expand_x lying in its output arena). Zeros before the context exists."""
    from .group import Group

    g = _resolve("group_copy_counters", "group", group, None, True)
    if isinstance(g, dist.ProcessGroup):
        c = _groups.get(g)
        if c is None:
            return {"dispatch_staged_tokens": 0, "dispatch_pushed_tokens": 0, "combine_copied_rows": 0,
                    "combine_in_place_rows": 0}
        g = c
    if not isinstance(g, Group):
        raise InvalidUsageError(f"group_copy_counters: argument: group: expected a torch.distributed "
                                f"ProcessGroup, an epcomm.Group or a registered name, got {type(g).__name__}")
    return _C.moe_group_copy_counters(g._c)


def group_network_counters(group):
    """What this rank sent over the network for `group` since its context was created, as a dict: rows
    (dispatch records sent to other nodes, one per distinct (active token, node), plus combine rows returned
    as proxy), row_bytes, network_bytes, network_writes, and num_nodes (0 before the context exists)."""
    from .group import Group

    g = _resolve("group_network_counters", "group", group, None, True)
    if isinstance(g, dist.ProcessGroup):
        c = _groups.get(g)
        if c is None:
            return {"rows": 0, "row_bytes": 0, "network_bytes": 0, "network_writes": 0, "num_nodes": 0}
        g = c
    if not isinstance(g, Group):
        raise InvalidUsageError(f"group_network_counters: argument: group: expected a torch.distributed "
                                f"ProcessGroup, an epcomm.Group or a registered name, got {type(g).__name__}")
    return _C.moe_group_network_counters(g._c)


def _resolve(op, which, value, override, required):
    """The group named by group_ep/group_tp (a Group, a ProcessGroup or a registered name), unless the
    matching epcomm keyword (ep_group/tp_group) is given."""
    if override is not None:
        return override
    if isinstance(value, str):
        if value == "":
            if required:
                raise InvalidUsageError(f"{op}: argument: {which}: empty group name and no "
                                        f"{'ep_group' if which == 'group_ep' else 'tp_group'} given")
            return None
        if value not in _registry:
            raise InvalidUsageError(f"{op}: argument: {which}: no group registered under the name '{value}' "
                                    "(use epcomm.ops.register_group)")
        return _registry[value]
    return value


def _c_group(op, which, group):
    """The C++ Group behind an epcomm.Group or a ProcessGroup (None stays None). For a ProcessGroup the
    epcomm.Group and its operator context are created on first use (collective over the group) and cached."""
    from .group import Group

    if group is None:
        return None
    if isinstance(group, Group):
        return group._c
    if isinstance(group, dist.ProcessGroup):
        g = _groups.get(group)
        if g is None:
            g = Group(group)
            # Collective: creating the context up front lets the operators' deadline (not the bootstrap's)
            # report a rank that misses the first call.
            _C.moe_init_group_context(g._c)
            _groups[group] = g
        return g._c
    raise InvalidUsageError(f"{op}: argument: {which}: expected a torch.distributed ProcessGroup, an "
                            f"epcomm.Group or a registered name, got {type(group).__name__}")


def _groups_of(op, group_ep, group_tp, ep_group, tp_group, tp_world_size):
    """(EP group, TP group or None, the error that resolving the TP group raised or None). An EP group that
    cannot be resolved raises here (locally: there is no group to tell); a TP group is needed only with
    tp_world_size = 2, and its error fails the call on the EP group (raised by the call's checks)."""
    ep = _c_group(op, "group_ep", _resolve(op, "group_ep", group_ep if group_ep is not None else "", ep_group,
                                           True))
    if type(tp_world_size) is not int or tp_world_size != 2:
        return ep, None, None
    try:
        return ep, _c_group(op, "group_tp", _resolve(op, "group_tp", group_tp if group_tp is not None else "",
                                                     tp_group, True)), None
    except InvalidUsageError as e:
        return ep, None, e


def _dtype_name(which, dtype):
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        name = PLAIN.get(dtype) or _NAME_OF_REAL.get(dtype)
        if name is not None:
            return name
    raise InvalidUsageError(f"argument: {which}: expected a torch.dtype epcomm knows or None, got {dtype!r}")


def _require(**values):
    for name, value in values.items():
        if value is None:
            raise InvalidUsageError(f"argument: {name}: required, got None")


def _options(kw, strict_hardware_limits, hccl_buffsize_mb, timeout):
    kw["strict_hardware_limits"] = strict_hardware_limits
    kw["hccl_buffsize_mb"] = hccl_buffsize_mb
    if timeout is not None:
        kw["timeout"] = timeout  # a number of seconds, checked by the binding
    return kw


def _name_or_empty(value):
    return value if isinstance(value, str) else ""


def _assist(assist_info_for_combine, expand_idx):
    if assist_info_for_combine is not None and expand_idx is not None:
        raise InvalidUsageError("argument: expand_idx: is torch_npu's name for assist_info_for_combine; give one "
                                "of them")
    return assist_info_for_combine if assist_info_for_combine is not None else expand_idx


def _collective(core_op, ep, tp, tp_world_size, prepare, call):
    """Runs the Python-level checks of one operator call (`prepare`, which returns the binding's kwargs), then
    the call itself. Whatever the checks raise fails the call on every rank of the groups (the binding's
    moe_fail_call: InvalidUsageError here, AbortedError quoting it on the peers), so that no rank falls one
    call behind its peers; the binding does the same for what it cannot convert. Only a group that cannot be
    resolved raises locally (there is no group to tell)."""
    try:
        kw = prepare()
    except Error as e:
        message = str(e)
    except Exception as e:  # a malformed argument Python or torch rejected
        message = f"argument: {type(e).__name__}: {e}"
    else:
        return call(ep, tp, kw)
    usable_tp = tp_world_size if type(tp_world_size) is int and 0 <= tp_world_size <= 2 else 0
    _C.moe_fail_call(ep, tp, core_op, usable_tp, message)


def npu_moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                   scales=None, x_active_mask=None, expert_scales=None, elastic_info=None,
                                   performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                   expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                                   quant_mode=0, global_bs=0, expert_token_nums_type=1, comm_alg="",
                                   zero_expert_num=0, copy_expert_num=0, const_expert_num=0, y_dtype=None,
                                   x_dtype=None, scales_dtype=None, ep_group=None, tp_group=None,
                                   strict_hardware_limits=None, hccl_buffsize_mb=200, timeout=None):
    """Returns (expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums, ep_recv_counts,
    tp_recv_counts, expand_scales), shaped as in docs/distribute-v2.md (zero past the valid part). fp8 outputs come as
    the real torch dtype where torch has it, else as uint8; mode-4 dynamic_scales are E8M0 bytes."""
    op = "npu_moe_distribute_dispatch_v2"
    ep, tp, tp_error = _groups_of(op, group_ep, group_tp, ep_group, tp_group, tp_world_size)

    def prepare():
        if tp_error is not None:
            raise tp_error
        _require(ep_world_size=ep_world_size, ep_rank_id=ep_rank_id, moe_expert_num=moe_expert_num)
        kw = dict(x=x, expert_ids=expert_ids, scales=scales, x_active_mask=x_active_mask,
                  expert_scales=expert_scales, elastic_info=elastic_info, performance_info=performance_info,
                  group_ep=_name_or_empty(group_ep), group_tp=_name_or_empty(group_tp), comm_alg=comm_alg,
                  ep_world_size=ep_world_size, ep_rank_id=ep_rank_id, moe_expert_num=moe_expert_num,
                  tp_world_size=tp_world_size, tp_rank_id=tp_rank_id, expert_shard_type=expert_shard_type,
                  shared_expert_num=shared_expert_num, shared_expert_rank_num=shared_expert_rank_num,
                  quant_mode=quant_mode, global_bs=global_bs, expert_token_nums_type=expert_token_nums_type,
                  zero_expert_num=zero_expert_num, copy_expert_num=copy_expert_num,
                  const_expert_num=const_expert_num, y_dtype=_dtype_name("y_dtype", y_dtype),
                  x_dtype=_dtype_name("x_dtype", x_dtype), scales_dtype=_dtype_name("scales_dtype", scales_dtype))
        return _options(kw, strict_hardware_limits, hccl_buffsize_mb, timeout)

    r = _collective("dispatch_v2", ep, tp, tp_world_size, prepare, _C.moe_dispatch_v2)
    expand_x, dynamic_scales, assist, token_nums, ep_counts, tp_counts, expand_scales, x_fmt, s_fmt = r
    return (as_format(expand_x, x_fmt), as_format(dynamic_scales, s_fmt), assist, token_nums, ep_counts, tp_counts,
            expand_scales)


# The binding's keywords of the combine family besides the ones _combine_call derives.
_COMBINE_KEYS = ("expand_x", "expert_ids", "ep_send_counts", "expert_scales", "ep_world_size", "ep_rank_id",
                 "moe_expert_num", "tp_send_counts", "x_active_mask", "expand_scales", "shared_expert_x",
                 "elastic_info", "ori_x", "const_expert_alpha_1", "const_expert_alpha_2", "const_expert_v",
                 "performance_info", "tp_world_size", "tp_rank_id", "expert_shard_type", "shared_expert_num",
                 "shared_expert_rank_num", "global_bs", "comm_quant_mode", "comm_alg", "zero_expert_num",
                 "copy_expert_num", "const_expert_num")
_RMS_NORM_KEYS = ("residual_x", "gamma", "activation_scale", "weight_scale", "group_list", "out_dtype",
                  "group_list_type")


def _combine_call(op, core_op, a, keys, check=None):
    """One call of the combine family from its arguments `a` (the wrapper's locals): the groups, then the
    collective checks (`check` adds the operator's own) and the binding's call."""
    ep, tp, tp_error = _groups_of(op, a["group_ep"], a["group_tp"], a["ep_group"], a["tp_group"],
                                  a["tp_world_size"])

    def prepare():
        if tp_error is not None:
            raise tp_error
        assist = _assist(a["assist_info_for_combine"], a["expand_idx"])
        _require(assist_info_for_combine=assist, **{k: a[k] for k in ("ep_send_counts", "expert_scales",
                                                                       "ep_world_size", "ep_rank_id",
                                                                       "moe_expert_num")})
        kw = {k: a[k] for k in keys}
        kw.update(assist_info_for_combine=assist, group_ep=_name_or_empty(a["group_ep"]),
                  group_tp=_name_or_empty(a["group_tp"]))
        if check is not None:
            check(kw)
        return _options(kw, a["strict_hardware_limits"], a["hccl_buffsize_mb"], a["timeout"])

    return _collective(core_op, ep, tp, a["tp_world_size"], prepare, getattr(_C, "moe_" + core_op))


def npu_moe_distribute_combine_v2(expand_x, expert_ids, assist_info_for_combine=None, ep_send_counts=None,
                                  expert_scales=None, group_ep=None, ep_world_size=None, ep_rank_id=None,
                                  moe_expert_num=None, *, tp_send_counts=None, x_active_mask=None,
                                  expand_scales=None, shared_expert_x=None, elastic_info=None, ori_x=None,
                                  const_expert_alpha_1=None, const_expert_alpha_2=None, const_expert_v=None,
                                  performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                  expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, global_bs=0,
                                  comm_quant_mode=0, comm_alg="", zero_expert_num=0, copy_expert_num=0,
                                  const_expert_num=0, ep_group=None, tp_group=None, strict_hardware_limits=None,
                                  hccl_buffsize_mb=200, timeout=None, expand_idx=None):
    """Returns x (Bs, H) in expand_x's dtype. `expand_idx` is torch_npu's name for assist_info_for_combine;
    ep_send_counts/tp_send_counts are dispatch's ep_recv_counts/tp_recv_counts."""
    return _combine_call("npu_moe_distribute_combine_v2", "combine_v2", dict(locals()), _COMBINE_KEYS)


def npu_moe_distribute_combine_add_rms_norm(expand_x, expert_ids, assist_info_for_combine=None,
                                            ep_send_counts=None, expert_scales=None, residual_x=None, gamma=None,
                                            group_ep=None, ep_world_size=None, ep_rank_id=None,
                                            moe_expert_num=None, *, tp_send_counts=None, x_active_mask=None,
                                            activation_scale=None, weight_scale=None, group_list=None,
                                            expand_scales=None, shared_expert_x=None, elastic_info=None,
                                            ori_x=None, const_expert_alpha_1=None, const_expert_alpha_2=None,
                                            const_expert_v=None, performance_info=None, group_tp="",
                                            tp_world_size=0, tp_rank_id=0, expert_shard_type=0,
                                            shared_expert_num=1, shared_expert_rank_num=0, global_bs=0,
                                            out_dtype=0, comm_quant_mode=0, group_list_type=0, comm_alg="",
                                            zero_expert_num=0, copy_expert_num=0, const_expert_num=0,
                                            norm_eps=1e-6, ep_group=None, tp_group=None,
                                            strict_hardware_limits=None, hccl_buffsize_mb=200, timeout=None,
                                            expand_idx=None):
    """Returns (y, rstd, x): y = rms_norm(x + residual_x) * gamma (Bs,1,H), rstd (Bs,1,1) float32, and the
    combined x + residual_x (Bs,1,H)."""
    def check(kw):
        _require(residual_x=residual_x, gamma=gamma)
        if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not math.isfinite(norm_eps):
            raise InvalidUsageError(f"argument: norm_eps: expected a finite number >= 0, got {norm_eps!r}")
        kw["norm_eps"] = float(norm_eps)

    return _combine_call("npu_moe_distribute_combine_add_rms_norm", "combine_add_rms_norm", dict(locals()),
                         _COMBINE_KEYS + _RMS_NORM_KEYS, check)
