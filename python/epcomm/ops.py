"""epcomm.ops: torch_npu-style distribute operators (spec distribute-v2.md §2.2).

NOT SUPPORTED YET: the C++ operator family (dispatch_v2 / combine_v2 / combine_add_rms_norm) has not landed,
so the three functions check their group arguments and then raise NotImplementedError. Their signatures are
final (torch_npu's positional order, keyword names and defaults, plus epcomm's keywords), so callers can be
written against them now. register_group works."""
import torch.distributed as dist

from ._errors import InvalidUsageError

_registry = {}

_PENDING = "not supported yet: the distribute-v2 operators have not landed"


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


def _pending(op):
    raise NotImplementedError(f"epcomm.ops.{op}: {_PENDING}")


def npu_moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                   scales=None, x_active_mask=None, expert_scales=None, elastic_info=None,
                                   performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                   expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                                   quant_mode=0, global_bs=0, expert_token_nums_type=1, comm_alg="",
                                   zero_expert_num=0, copy_expert_num=0, const_expert_num=0, y_dtype=None,
                                   x_dtype=None, scales_dtype=None, ep_group=None, tp_group=None,
                                   strict_hardware_limits=None, hccl_buffsize_mb=200, timeout=None):
    """Returns (expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums, ep_recv_counts,
    tp_recv_counts, expand_scales). Not supported yet (raises NotImplementedError)."""
    op = "npu_moe_distribute_dispatch_v2"
    _resolve(op, "group_ep", group_ep, ep_group, True)
    if tp_world_size > 1:
        _resolve(op, "group_tp", group_tp, tp_group, True)
    _pending(op)


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
    """Returns x. Not supported yet (raises NotImplementedError). `expand_idx` is torch_npu's name for
    assist_info_for_combine."""
    op = "npu_moe_distribute_combine_v2"
    _resolve(op, "group_ep", group_ep if group_ep is not None else "", ep_group, True)
    if tp_world_size > 1:
        _resolve(op, "group_tp", group_tp, tp_group, True)
    _pending(op)


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
    """Returns (y, rstd, x). Not supported yet (raises NotImplementedError)."""
    op = "npu_moe_distribute_combine_add_rms_norm"
    _resolve(op, "group_ep", group_ep if group_ep is not None else "", ep_group, True)
    if tp_world_size > 1:
        _resolve(op, "group_tp", group_tp, tp_group, True)
    _pending(op)
