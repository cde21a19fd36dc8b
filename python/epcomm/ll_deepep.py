"""Low-latency mode, flavor "deepep" (docs/low-latency.md): NVIDIA DeepEP V1's low_latency_dispatch /
low_latency_combine on the shared-memory engine. Rows land in a [L, R*T_max, H] output, expert j's valid
rows first, in (source rank, token) order; combine is the weighted sum over each token's top-k slots."""
import torch

from ._dtypes import as_format
from ._errors import Error, InvalidUsageError, int_arg
from .event import EventOverlap
from .low_latency import NamedItems, RecvHook, hook_flags


class LowLatencyHandle(NamedItems):
    """DeepEP's 5-item low-latency handle (src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
    num_experts), with accessors of those names. src_info [L, R*T_max] i32: source token of each valid row;
    layout_range [L, R] i64: (begin << 32) | count of the rows of each local expert from each source rank.
    Tied to the Buffer that made it."""

    ITEMS = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts")

    def __new__(cls, items, impl, owner):
        self = super().__new__(cls, items)
        self._impl = impl
        self._owner = owner  # id of the epcomm.Buffer
        self._combine_buffer = None
        return self

    def __repr__(self):
        return (f"LowLatencyHandle(num_max_dispatch_tokens_per_rank={self[2]}, hidden={self[3]}, "
                f"num_experts={self[4]})")


def _prefix(buffer, op):
    return f"epcomm[rank {buffer.rank}] {op}: "


def _fail(buffer, op, message):
    """An argument error found here fails the collective call on every rank (Buffer.fail_call)."""
    buffer._impl.fail_call(op, message)


def _results(event, async_finish, hook_requested):
    """(event, hook) of a call: with return_recv_hook the hook waits for the call; with async_finish the event
    does; otherwise both are already complete."""
    if hook_requested:
        return EventOverlap(), RecvHook(event.wait)
    return (EventOverlap(event) if async_finish else EventOverlap()), RecvHook()


def dispatch(buffer, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
             cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None, use_fp8=True,
             round_scale=False, use_ue8m0=False, async_finish=False, return_recv_hook=False):
    """DeepEP's low_latency_dispatch: returns (recv_x, recv_count, handle, event, hook); recv_x is
    [L, R*T_max, H] bf16, or with use_fp8 a (codes float8_e4m3fn [L, R*T_max, H], scales) pair whose scales
    are [L, R*T_max, H/128] f32 (or, with use_ue8m0, [L, R*T_max, H/512] i32 of packed ue8m0 bytes) with
    DeepEP's column-major strides. recv_count [L] i32 counts the valid rows of each local expert."""
    op = "low_latency_dispatch"
    try:
        async_finish, hook = hook_flags(async_finish, return_recv_hook, "")
        t_max = int_arg(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank")
        n_exp = int_arg(num_experts, "num_experts", (1, 1 << 20))
        for t, name in ((x, "x"), (topk_idx, "topk_idx")):
            if not isinstance(t, torch.Tensor):
                raise InvalidUsageError(f"argument: {name}: expected a torch.Tensor, got {type(t).__name__}")
    except Error as e:
        _fail(buffer, op, str(e))
    r = buffer._guarded_call(op, buffer._impl.low_latency_dispatch, x, topk_idx, t_max, n_exp,
                             cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, bool(use_fp8),
                             bool(round_scale), bool(use_ue8m0), async_finish, hook)
    data, data_name, scales, count, src_info, layout_range, impl, event = r
    recv_x = as_format(data, data_name)
    if scales is not None:
        recv_x = (recv_x, scales.transpose(1, 2))  # allocated [L, groups, R*T_max]: column-major last two dims
    handle = LowLatencyHandle((src_info, layout_range, t_max, int(x.shape[1]), n_exp), impl, id(buffer))
    ev, h = _results(event, async_finish, hook)
    return recv_x, count, handle, ev, h


def _own_handle(buffer, handle, prefix):
    if not isinstance(handle, LowLatencyHandle):
        what = "a normal-mode dispatch's handle" if type(handle).__name__ == "Handle" else type(handle).__name__
        raise InvalidUsageError(f"{prefix}argument: handle: expected the handle of this Buffer's "
                                f"low_latency_dispatch, got {what}")
    if handle._owner != id(buffer):
        raise InvalidUsageError(f"{prefix}argument: handle: it belongs to another Buffer")
    return handle


def combine_buffer(buffer, handle):
    """get_next_low_latency_combine_buffer: a [L, R*T_max, H] bf16 tensor in this rank's output arena, one
    per handle (the same tensor for the same handle). Write the expert outputs there and call
    low_latency_combine(..., zero_copy=True): the origins read the rows in place."""
    handle = _own_handle(buffer, handle, _prefix(buffer, "get_next_low_latency_combine_buffer"))
    if handle._combine_buffer is None:
        t = buffer._impl.low_latency_combine_buffer(handle._impl)
        t._epcomm_buffer = buffer
        handle._combine_buffer = t
    return handle._combine_buffer


def combine(buffer, x, topk_idx, topk_weights, handle, use_logfmt=False, zero_copy=False, async_finish=False,
            return_recv_hook=False, out=None, combine_wait_recv_cost_stats=None):
    """DeepEP's low_latency_combine: returns (combined_x, event, hook). combined_x[t] = bf16 of the f32 sum,
    over k ascending with topk_idx[t, k] >= 0, of topk_weights[t, k] * the expert output of that pair.
    use_logfmt is accepted and changes nothing (epcomm sends bf16 rows exactly). zero_copy: x was written
    into get_next_low_latency_combine_buffer(handle) and is not read."""
    op = "low_latency_combine"
    try:
        async_finish, hook = hook_flags(async_finish, return_recv_hook, "")
        handle = _own_handle(buffer, handle, "")
        if zero_copy:
            if handle._combine_buffer is None:
                raise InvalidUsageError("argument: zero_copy: True, but get_next_low_latency_combine_buffer was "
                                        "never called for this handle (write the expert outputs into it first)")
            x = handle._combine_buffer
        for t, name in ((x, "x"), (topk_idx, "topk_idx"), (topk_weights, "topk_weights")):
            if not isinstance(t, torch.Tensor):
                raise InvalidUsageError(f"argument: {name}: expected a torch.Tensor, got {type(t).__name__}")
        if out is not None and not isinstance(out, torch.Tensor):
            raise InvalidUsageError(f"argument: out: expected a torch.Tensor or None, got {type(out).__name__}")
    except Error as e:
        _fail(buffer, op, str(e))
    combined, event = buffer._guarded_call(op, buffer._impl.low_latency_combine, x, topk_idx, topk_weights,
                                           handle._impl, async_finish or hook, out, combine_wait_recv_cost_stats)
    ev, h = _results(event, async_finish, hook)
    return (out if out is not None else combined), ev, h
