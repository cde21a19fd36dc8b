"""epcomm.Buffer: the normal-mode API of DeepEP's Ascend port (buffer.py) on torch CPU tensors.

Semantics: the project's docs/normal-mode.md (docs/normal-mode.md, docs/python.md). Two strategies sit
behind the same methods: the shared-memory engine (default) and, with DEEP_USE_MODE=alltoall, collectives on
the torch.distributed group (epcomm.alltoall); both give identical results."""
import atexit
import operator
import os
import warnings
import weakref

import torch
import torch.distributed as dist

from . import _C
from ._dtypes import PLAIN, as_format, byte_view, tuple_formats
from ._errors import INT32, Error, InvalidUsageError, int_arg, number_arg
from .alltoall import AllToAllHandle, AllToAllStrategy
from .event import EventOverlap, c_event
from .group import Group, as_group
from .compat import (apply_token_nums_type, default_receive_order, fold_expert_counts, long_seq_rounds,
                     per_round_expert_counts, resolve_flavor)
from .handle import Handle
from . import ll_ascend, ll_deepep, low_latency

Config = _C.Config

# DeepEP constructor arguments that are accepted without effect (docs/normal-mode.md).
_DEEPEP_IGNORED = ("num_qps_per_rank", "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric",
                   "explicitly_destroy", "comm")

_live_buffers = weakref.WeakSet()


@atexit.register
def _destroy_all():
    # Release segments before the interpreter tears down modules (the communication threads are idle then).
    for b in list(_live_buffers):
        try:
            b.destroy()
        except Exception:
            pass


def _use_mode():
    mode = os.environ.get("DEEP_USE_MODE", "").strip().lower()
    return "alltoall" if mode == "alltoall" else "shm"


def _int_arg(value, name):
    """An integer argument, checked to fit the C++ int64_t it becomes."""
    try:
        v = operator.index(value)
    except TypeError:
        raise InvalidUsageError(f"argument: {name}: expected an int, got {type(value).__name__}") from None
    if not -(1 << 63) <= v < 1 << 63:
        raise InvalidUsageError(f"argument: {name}: expected a 64-bit integer, got {v}")
    return v


def _tensor_arg(value, name, required=False, tuple_ok=False):
    """A tensor argument (None allowed unless required)."""
    if value is None and not required:
        return None
    if not isinstance(value, torch.Tensor):
        what = "a torch.Tensor or a (data, scales) tuple" if tuple_ok else "a torch.Tensor"
        raise InvalidUsageError(f"argument: {name}: expected {what}{'' if required else ' or None'}, "
                                f"got {type(value).__name__}")
    return value


def _config_arg(config, default):
    if config is None:  # Buffer.num_threads may have been assigned directly
        return default()
    if not isinstance(config, _C.Config):
        raise InvalidUsageError(f"argument: config: expected an epcomm.Config or None, got {type(config).__name__}")
    return config


def _check_str(value, name):
    if value is not None and not isinstance(value, str):
        raise InvalidUsageError(f"argument: {name}: expected a string or None, got {type(value).__name__}")
    return value


def _check_area_size(prefix, rows, hidden, dtype):
    """rows x hidden elements of dtype, both >= 0 and within 2^62 bytes (the C++ side multiplies them)."""
    if rows < 0 or hidden < 0:
        raise InvalidUsageError(f"{prefix}argument: expected num_tokens and hidden >= 0, got {rows} x {hidden}")
    if rows * hidden * torch.tensor([], dtype=dtype).element_size() >= 1 << 62:
        raise InvalidUsageError(f"{prefix}capacity: {rows} rows x {hidden} {dtype} exceed 2^62 bytes")


class Buffer:
    """The normal-mode communication buffer. Creation is collective over `group` (a torch.distributed gloo
    ProcessGroup, an epcomm.Group, or None for the default group); so are dispatch and combine: every rank
    calls them in the same order, ranks without tokens included. Use from one thread at a time."""

    #: Class default of Config.num_threads (0: hardware threads / local ranks), see set_num_threads.
    num_threads = 0
    #: DeepEP's class attribute; epcomm copies with CPU threads (num_threads), so this has no effect.
    num_sms = 20

    def __init__(self, group=None, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False,
                 num_qps_per_rank=24, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False,
                 explicitly_destroy=False, enable_shrink=False, comm=None, *, flavor=None, receive_order=None,
                 ranks_per_node=0, timeout_s=None, num_combine_input_bytes=0, num_dispatch_input_bytes=0,
                 num_output_reserve_bytes=0, normal_strategy=None, low_latency_strategy=None, **deepep_compat):
        if deepep_compat:
            warnings.warn(f"epcomm.Buffer: ignoring unknown arguments {sorted(deepep_compat)}", stacklevel=2)
        self.flavor = resolve_flavor(flavor)
        _check_str(receive_order, "receive_order")
        if receive_order is None:
            receive_order = default_receive_order(self.flavor)
        _check_str(normal_strategy, "normal_strategy")
        if normal_strategy not in (None, "default", "alltoall"):
            raise InvalidUsageError(f"Buffer: argument: normal_strategy: expected 'default', 'alltoall' or None, "
                                    f"got {normal_strategy!r}")
        _check_str(low_latency_strategy, "low_latency_strategy")  # the Ascend port's; no effect here
        pre = "Buffer: "
        self.num_nvl_bytes = int_arg(num_nvl_bytes, "num_nvl_bytes", prefix=pre)
        self.num_rdma_bytes = int_arg(num_rdma_bytes, "num_rdma_bytes", prefix=pre)
        ranks_per_node = int_arg(ranks_per_node, "ranks_per_node", INT32, prefix=pre)
        if timeout_s is not None:
            timeout_s = number_arg(timeout_s, "timeout_s", prefix=pre)
        sizes = [int_arg(v, n, prefix=pre) for v, n in ((num_combine_input_bytes, "num_combine_input_bytes"),
                                                         (num_dispatch_input_bytes, "num_dispatch_input_bytes"),
                                                         (num_output_reserve_bytes, "num_output_reserve_bytes"))]
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.mode = "alltoall" if normal_strategy == "alltoall" else _use_mode()
        self._destroyed = False
        if self.mode == "alltoall":
            pg = group.process_group if isinstance(group, Group) else (group if group is not None else dist.group.WORLD)
            self.group = pg
            self._impl = AllToAllStrategy(pg, self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode,
                                          bool(enable_shrink), receive_order, ranks_per_node, timeout_s)
        else:
            g = as_group(group)
            self.group = g.process_group
            self._impl = _C.Buffer(g._c, self.num_nvl_bytes, self.num_rdma_bytes, self.low_latency_mode,
                                   bool(enable_shrink), receive_order, ranks_per_node, timeout_s, *sizes,
                                   flavor=self.flavor)
        self.enable_shrink = bool(enable_shrink)
        _live_buffers.add(self)
        if self.flavor == "ascend" and self.low_latency_mode and self.mode != "alltoall":
            # The operator group of the ascend flavor's low-latency calls (docs/low-latency.md), created here
            # with the Buffer (collectively, warm-up included): the first call then runs like the next ones,
            # and a rank that stops after construction cannot block it.
            ll_ascend._state(self, "Buffer")

    # ---- accessors ---------------------------------------------------------------------------------------

    @property
    def rank(self):
        return self._impl.rank

    @property
    def num_ranks(self):
        return self._impl.num_ranks

    @property
    def group_size(self):
        """DeepEP's name for num_ranks."""
        return self._impl.num_ranks

    @property
    def num_nodes(self):
        return self._impl.num_nodes

    def node_of(self, rank):
        return self._impl.node_of(int_arg(rank, "rank", INT32, prefix="node_of: "))

    def get_num_rdma_ranks(self):
        """Nodes spanned by the Buffer (the seed's runtime.get_num_rdma_ranks())."""
        return self._impl.num_nodes

    @property
    def receive_order(self):
        return self._impl.receive_order

    @property
    def num_output_arena_bytes(self):
        """Address space of this rank's output arena (docs/normal-mode.md, "Output arena"), 0 when it has none
        (EPCOMM_OUTPUT_ARENA=0, DEEP_USE_MODE=alltoall): with an arena, dispatch pushes its rows into the
        receivers' outputs (one node) and combines of those rows read them in place (across nodes, within each
        node)."""
        if isinstance(self._impl, AllToAllStrategy):
            return 0
        return self._impl.num_output_arena_bytes

    @property
    def timeout_s(self):
        return self._impl.timeout_s

    # ---- class-level configuration -----------------------------------------------------------------------

    @classmethod
    def set_num_threads(cls, n):
        """Sets the class default of Config.num_threads (copy threads per rank per call; 0 = automatic)."""
        n = int_arg(n, "n", (0, INT32[1]), prefix="Buffer.set_num_threads: ")
        _C.Buffer.set_num_threads(n)
        cls.num_threads = n

    @staticmethod
    def set_num_sms(new_num_sms):
        """DeepEP compatibility: accepted without effect (see set_num_threads)."""
        Buffer.num_sms = int_arg(new_num_sms, "new_num_sms", INT32, prefix="Buffer.set_num_sms: ")

    @staticmethod
    def get_dispatch_config(num_ranks):
        """The default Config for any num_ranks >= 1, with num_threads = Buffer.num_threads."""
        cfg = _C.Buffer.get_dispatch_config(int_arg(num_ranks, "num_ranks", INT32, "get_dispatch_config: "))
        cfg.num_threads = int(Buffer.num_threads)
        return cfg

    @staticmethod
    def get_combine_config(num_ranks):
        cfg = _C.Buffer.get_combine_config(int_arg(num_ranks, "num_ranks", INT32, "get_combine_config: "))
        cfg.num_threads = int(Buffer.num_threads)
        return cfg

    @staticmethod
    def capture():
        """A completed event (there are no streams on a CPU)."""
        return EventOverlap()

    @staticmethod
    def is_sm90_compiled():
        """DeepEP's switch for its FP8 (SM90) paths: epcomm has them on every CPU, so True."""
        return True

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
        """The num_rdma_bytes with which every low-latency call with these parameters succeeds, on one node
        or several, in every format (DeepEP's name and arguments; docs/low-latency.md)."""
        return low_latency.size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    # ---- lifetime ------------------------------------------------------------------------------------------

    def destroy(self):
        """Local: waits for this rank's queued operations, releases the segment, invalidates the handles."""
        if not self._destroyed:
            self._destroyed = True
            if getattr(self, "_ll_ascend_state", None) is not None:  # its low-latency worker thread
                ll_ascend.shutdown(self)
            self._impl.destroy()
        _live_buffers.discard(self)

    # ---- get_dispatch_layout -------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        """Local. Returns (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
        is_token_in_rank, event)."""
        try:  # local: a bad argument raises here only
            _tensor_arg(topk_idx, "topk_idx", required=True)
            num_experts = _int_arg(num_experts, "num_experts")
            if not 1 <= num_experts < 1 << 31:
                raise InvalidUsageError(f"argument: num_experts: expected 1 to 2^31 - 1, got {num_experts}")
            prev = c_event(previous_event)
        except InvalidUsageError as e:
            raise InvalidUsageError(f"epcomm[rank {self.rank}] get_dispatch_layout: {e}") from None
        if isinstance(self._impl, AllToAllStrategy):
            if prev is not None:
                prev.wait()
            per_rank, per_rdma, per_expert, in_rank = self._impl.get_dispatch_layout(topk_idx, num_experts)
            event = EventOverlap()
        else:
            per_rank, per_rdma, per_expert, in_rank, event = self._impl.get_dispatch_layout(
                topk_idx, num_experts, prev, bool(async_finish), bool(allocate_on_comm_stream))
            event = EventOverlap(event)
        if self.flavor == "ascend":  # the Ascend port's layout: i32 membership, per-round expert counts
            event.wait()
            in_rank = in_rank.to(torch.int32)
            n, P = long_seq_rounds(int(topk_idx.shape[0]))
            if n > 1:
                per_expert = per_round_expert_counts(topk_idx, int(num_experts), n, P)
        return per_rank, per_rdma, per_expert, in_rank, event

    # ---- dispatch ------------------------------------------------------------------------------------------

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False, dispatch_wait_recv_cost_stats=None, quant_mode=None,
                 receive_order=None):
        """Collective. Returns (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event); recv_x is a tensor, or a (data, scales) tuple for quantized payloads. A cached dispatch
        (handle given) returns (recv_x, None, None, None, None, event). An argument this rank cannot use fails
        the call on every rank: InvalidUsageError here, AbortedError quoting it on the peers; the Buffer stays
        usable."""
        op = "dispatch" if handle is None else "cached_dispatch"

        def prepare():
            _check_str(quant_mode, "quant_mode")
            _check_str(receive_order, "receive_order")
            if isinstance(x, (tuple, list)):
                if len(x) != 2:
                    raise InvalidUsageError(f"argument: x: expected a tensor or a (data, scales) tuple, got "
                                            f"{len(x)} items")
                _tensor_arg(x[0], "x[0]", required=True)
                _tensor_arg(x[1], "x[1]", required=True)
                data, data_dtype, scales, scales_dtype = tuple_formats(x[0], x[1], quant_mode)
            else:
                _tensor_arg(x, "x", required=True, tuple_ok=True)
                data, data_dtype = byte_view(x)
                scales = scales_dtype = None
            counts = fold_expert_counts(_tensor_arg(num_tokens_per_expert, "num_tokens_per_expert"))
            for t, name in ((num_tokens_per_rank, "num_tokens_per_rank"),
                            (num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank"),
                            (is_token_in_rank, "is_token_in_rank"), (num_tokens_per_expert, "num_tokens_per_expert"),
                            (topk_idx, "topk_idx"), (topk_weights, "topk_weights"),
                            (dispatch_wait_recv_cost_stats, "dispatch_wait_recv_cost_stats")):
                _tensor_arg(t, name)
            return dict(data=data, data_dtype=data_dtype, scales=scales, scales_dtype=scales_dtype, counts=counts,
                        handle=self._handle_impl(handle), prev=c_event(previous_event),
                        alignment=_int_arg(expert_alignment, "expert_alignment"),
                        worst=_int_arg(num_worst_tokens, "num_worst_tokens"),
                        config=_config_arg(config, lambda: self.get_dispatch_config(self.num_ranks)))

        p = self._guarded(op, prepare)
        if isinstance(self._impl, AllToAllStrategy):
            if p["prev"] is not None:
                p["prev"].wait()
            args = dict(x=dict(data=p["data"], data_dtype=p["data_dtype"], scales=p["scales"],
                               scales_dtype=p["scales_dtype"], quant_mode=quant_mode),
                        handle=p["handle"], num_tokens_per_rank=num_tokens_per_rank,
                        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                        num_tokens_per_expert=p["counts"], topk_idx=topk_idx, topk_weights=topk_weights,
                        expert_alignment=p["alignment"], num_worst_tokens=p["worst"], config=p["config"],
                        dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats, quant_mode=quant_mode,
                        receive_order=receive_order)
            r = self._impl.dispatch(args)
            event = None
        else:
            r = self._guarded_call(op, self._impl.dispatch,
                                   p["data"], p["scales"], p["data_dtype"], p["scales_dtype"], p["handle"],
                                   num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                   p["counts"], topk_idx, topk_weights, p["alignment"], p["worst"],
                                   p["config"], p["prev"], bool(async_finish), bool(allocate_on_comm_stream),
                                   dispatch_wait_recv_cost_stats, quant_mode, receive_order)
            event = r[8]
        recv_data, data_name, recv_scales, scales_name, recv_idx, recv_w, lst, new_handle = r[:8]
        recv_x = as_format(recv_data, data_name)
        if recv_scales is not None:
            recv_x = (recv_x, as_format(recv_scales, scales_name))
        if new_handle is not None:
            new_handle = Handle(new_handle, event, flavor=self.flavor, topk_idx=topk_idx, topk_weights=topk_weights,
                                rank=self.rank, node_of=[self.node_of(r) for r in range(self.num_ranks)],
                                alltoall=isinstance(self._impl, AllToAllStrategy), recv_topk_weights=recv_w)
        if self.flavor == "ascend":
            lst = apply_token_nums_type(lst)
        return recv_x, recv_idx, recv_w, lst, new_handle, EventOverlap(event)

    def _guarded(self, op, prepare):
        """Runs the local checks and conversions of the collective call `op`. Whatever they raise fails the call
        on every rank (the peers' same call raises AbortedError quoting it), so that no rank falls a call behind
        its peers and pairs its next call with their previous one."""
        try:
            return prepare()
        except Error as e:
            message = str(e)
        except Exception as e:  # a malformed argument Python or torch rejected
            message = f"argument: {type(e).__name__}: {e}"
        self._impl.fail_call(op, message)

    def _guarded_call(self, op, fn, *args):
        """Calls the extension; an argument it cannot convert (TypeError, raised before the call starts) fails
        the call on every rank as in _guarded."""
        try:
            return fn(*args)
        except TypeError as e:
            message = f"argument: {str(e).splitlines()[0]}"
        self._impl.fail_call(op, message)

    def _handle_impl(self, handle, prefix=""):
        if handle is None:
            return None
        if not isinstance(handle, Handle):
            raise InvalidUsageError(f"{prefix}argument: handle: expected the Handle returned by dispatch, got "
                                    f"{type(handle).__name__}")
        impl = handle._impl
        ours = AllToAllHandle if isinstance(self._impl, AllToAllStrategy) else _C.Handle
        if not isinstance(impl, ours):
            raise InvalidUsageError(f"{prefix}argument: handle: it belongs to another Buffer (one using the "
                                    f"{'shared-memory' if ours is AllToAllHandle else 'alltoall'} strategy)")
        return impl

    def get_combine_input(self, handle, dtype=torch.bfloat16, hidden=0):
        """A [handle.num_recv_rows (or num_worst_tokens), hidden] tensor of `dtype` in this rank's shared
        combine-input area (num_combine_input_bytes at construction; InvalidUsageError when too small). Write
        the expert outputs into it and pass it to combine: on one node combine then copies nothing and each
        origin reads its tokens' rows in place. The memory belongs to the Buffer: every call returns the same
        area, valid until destroy(); do not overwrite it while a combine reading it is in flight. hidden=0:
        the dispatched hidden size. With DEEP_USE_MODE=alltoall this is an ordinary new tensor."""
        pre = f"epcomm[rank {self.rank}] get_combine_input: "
        if handle is None:
            raise InvalidUsageError(f"{pre}argument: handle: required, got None")
        impl = self._handle_impl(handle, pre)
        name = PLAIN.get(dtype) if isinstance(dtype, torch.dtype) else None
        if name not in ("bf16", "f16", "f32"):
            raise InvalidUsageError(f"{pre}argument: dtype: expected torch.bfloat16, torch.float16 or "
                                    f"torch.float32, got {dtype}")
        hidden = int_arg(hidden, "hidden", prefix=pre)
        if hidden:  # 0: the dispatched hidden size, known to fit
            _check_area_size(pre, impl.num_rows, hidden, dtype)
        if isinstance(self._impl, AllToAllStrategy):
            return torch.empty(impl.num_rows, hidden or impl.hidden, dtype=dtype)
        t = self._impl.get_combine_input(impl, name, hidden)
        t._epcomm_buffer = self  # the area lives in this Buffer: keep it alive with the tensor
        return t

    def get_dispatch_input(self, num_tokens, hidden, dtype=torch.bfloat16):
        """A [num_tokens, hidden] tensor of `dtype` in this rank's shared dispatch-input area
        (num_dispatch_input_bytes at construction; InvalidUsageError when too small). Write the tokens into it
        (or let the layer before dispatch write its output there) and pass it, or its first rows, as x of a
        plain (unquantized) dispatch: on one node the sender then stages only the routing and every receiver
        reads its rows in place. Same lifetime rules as get_combine_input. With DEEP_USE_MODE=alltoall this
        is an ordinary new tensor."""
        pre = f"epcomm[rank {self.rank}] get_dispatch_input: "
        name = PLAIN.get(dtype) if isinstance(dtype, torch.dtype) else None
        if name not in ("bf16", "f16", "f32"):
            raise InvalidUsageError(f"{pre}argument: dtype: expected torch.bfloat16, torch.float16 or "
                                    f"torch.float32, got {dtype}")
        num_tokens, hidden = int_arg(num_tokens, "num_tokens", prefix=pre), int_arg(hidden, "hidden", prefix=pre)
        _check_area_size(pre, num_tokens, hidden, dtype)
        if isinstance(self._impl, AllToAllStrategy):
            return torch.empty(num_tokens, hidden, dtype=dtype)
        t = self._impl.get_dispatch_input(num_tokens, hidden, name)
        t._epcomm_buffer = self  # the area lives in this Buffer: keep it alive with the tensor
        return t

    def copy_counters(self):
        """What this rank's calls copied and what its peers read in place since the Buffer was created, as a
        dict: dispatch_staged_tokens, dispatch_in_place_tokens (shared dispatch input),
        dispatch_pushed_tokens (rows written straight into the receivers' outputs: the output arena),
        combine_copied_rows, combine_in_place_rows (shared combine input), combine_direct_tokens (own tokens
        combined straight from the holders' outputs, without windows), combine_shared_tokens (other ranks'
        tokens it reduced for them once done with its own, in such combines). Shows whether the shared areas are
        in use. All zero with DEEP_USE_MODE=alltoall."""
        if isinstance(self._impl, AllToAllStrategy):
            return dict(dispatch_staged_tokens=0, dispatch_in_place_tokens=0, dispatch_pushed_tokens=0,
                        combine_copied_rows=0, combine_in_place_rows=0, combine_direct_tokens=0,
                        combine_shared_tokens=0)
        return self._impl.copy_counters()

    # ---- combine -------------------------------------------------------------------------------------------

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False, combine_send_cost_stats=None):
        """Collective. Returns (combined_x, combined_topk_weights, event). An argument this rank cannot use
        fails the call on every rank, as in dispatch."""

        def prepare():
            if handle is None:
                raise InvalidUsageError("argument: handle: required, got None")
            _tensor_arg(x, "x", required=True)
            for t, name in ((topk_weights, "topk_weights"), (combine_send_cost_stats, "combine_send_cost_stats")):
                _tensor_arg(t, name)
            bias0 = bias1 = None
            if isinstance(bias, (tuple, list)):
                if len(bias) != 2:
                    raise InvalidUsageError(f"argument: bias: expected a tensor or a 2-tuple, got {len(bias)} items")
                bias0, bias1 = bias
                if bias0 is None and bias1 is not None:
                    bias0, bias1 = bias1, None
                _tensor_arg(bias0, "bias[0]")
                _tensor_arg(bias1, "bias[1]")
            else:
                bias0 = _tensor_arg(bias, "bias")
            return dict(handle=self._handle_impl(handle), bias0=bias0, bias1=bias1, prev=c_event(previous_event),
                        config=_config_arg(config, lambda: self.get_combine_config(self.num_ranks)))

        p = self._guarded("combine", prepare)
        if isinstance(self._impl, AllToAllStrategy):
            if p["prev"] is not None:
                p["prev"].wait()
            biases = [(b, n) for b, n in ((p["bias0"], "bias[0]" if p["bias1"] is not None else "bias"),
                                          (p["bias1"], "bias[1]")) if b is not None]
            out, w = self._impl.combine(dict(x=x, handle=p["handle"], topk_weights=topk_weights, biases=biases,
                                             config=p["config"], combine_send_cost_stats=combine_send_cost_stats))
            return out, w, EventOverlap()
        out, w, event = self._guarded_call("combine", self._impl.combine, x, p["handle"], topk_weights, p["bias0"],
                                           p["bias1"], p["config"], p["prev"], bool(async_finish),
                                           bool(allocate_on_comm_stream), combine_send_cost_stats)
        return out, w, EventOverlap(event)

    # ---- low-latency mode (docs/low-latency.md) -----------------------------------------------------------

    def _ll(self, op):
        if not self.low_latency_mode:
            raise InvalidUsageError(f"epcomm[rank {self.rank}] {op}: argument: low_latency_mode: this Buffer was "
                                    f"created with low_latency_mode=False; pass low_latency_mode=True")
        if isinstance(self._impl, AllToAllStrategy):
            raise InvalidUsageError(f"epcomm[rank {self.rank}] {op}: low-latency mode runs on the shared-memory "
                                    f"strategy; this Buffer uses DEEP_USE_MODE=alltoall")
        return ll_ascend if self.flavor == "ascend" else ll_deepep

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, *args, **kwargs):
        """Collective. Low-latency dispatch of the Buffer's flavor: returns (recv_x, recv_count, handle, event,
        hook). flavor "deepep": DeepEP's positional order and 3-D [L, R*T_max, H] outputs; flavor "ascend":
        the Ascend port's order and 2-D rows in dispatch_v2 order (docs/low-latency.md)."""
        return self._ll("low_latency_dispatch").dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank,
                                                          num_experts, *args, **kwargs)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, *args, **kwargs):
        """Collective. Low-latency combine of the Buffer's flavor: returns (combined_x, event, hook); the
        weighted sum over each token's top-k slots of the expert outputs (docs/low-latency.md)."""
        return self._ll("low_latency_combine").combine(self, x, topk_idx, topk_weights, handle, *args, **kwargs)

    def get_next_low_latency_combine_buffer(self, handle):
        """The tensor to write the expert outputs into for low_latency_combine(..., zero_copy=True): its peers
        read it in place."""
        return self._ll("get_next_low_latency_combine_buffer").combine_buffer(self, handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Accepted for DeepEP code: epcomm needs no cleaning between normal and low-latency calls. Validates
        its arguments and returns; with ``enable_shrink=True`` it is collective, and a peer that misses its
        deadline is masked (docs/low-latency.md, "Masks and shrink")."""
        self._ll("clean_low_latency_buffer")
        low_latency.check_ll_shape(num_max_dispatch_tokens_per_rank, hidden, self.num_ranks, num_experts,
                                   f"epcomm[rank {self.rank}] clean_low_latency_buffer: ")
        if self.enable_shrink:
            self._masks("clean_low_latency_buffer").clean_low_latency_buffer(
                int(num_max_dispatch_tokens_per_rank), int(hidden), int(num_experts))

    def _masks(self, op):
        if isinstance(self._impl, AllToAllStrategy):
            raise InvalidUsageError(f"epcomm[rank {self.rank}] {op}: rank masks run on the shared-memory "
                                    f"strategy; this Buffer uses DEEP_USE_MODE=alltoall")
        return self._impl

    def low_latency_update_mask_buffer(self, rank_to_mask, mask=False):
        """Masks (``mask=True``) or unmasks ``rank_to_mask`` on this rank (local; every rank sets the same
        mask). Low-latency calls skip a masked rank: nothing is sent to it or awaited from it, and its
        experts' pairs are absent (recv_count 0 for its rows, weight 0 in combine)."""
        r = int_arg(rank_to_mask, "rank_to_mask", INT32, prefix=f"epcomm[rank {self.rank}] "
                    "low_latency_update_mask_buffer: ")
        self._masks("low_latency_update_mask_buffer").low_latency_update_mask_buffer(r, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status):
        """Fills ``mask_status`` (``[num_ranks]`` int32) with 1 for masked ranks, 0 for the others."""
        st = self._masks("low_latency_query_mask_buffer").low_latency_query_mask_buffer()
        if (not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32
                or tuple(mask_status.shape) != (self.num_ranks,)):
            got = (f"{mask_status.dtype} {list(mask_status.shape)}" if isinstance(mask_status, torch.Tensor)
                   else type(mask_status).__name__)
            raise InvalidUsageError(f"epcomm[rank {self.rank}] low_latency_query_mask_buffer: argument: "
                                    f"mask_status: expected a [{self.num_ranks}] torch.int32 tensor, got {got}")
        mask_status.copy_(torch.tensor(st, dtype=torch.int32))

    def low_latency_clean_mask_buffer(self):
        """Clears the mask (collective among the unmasked ranks): every rank takes part in the next calls."""
        self._masks("low_latency_clean_mask_buffer").low_latency_clean_mask_buffer()

    def __repr__(self):
        return (f"epcomm.Buffer(rank={self.rank}, num_ranks={self.num_ranks}, flavor={self.flavor!r}, "
                f"mode={self.mode!r}, receive_order={self.receive_order!r})")
