"""Low-latency mode, flavor "ascend" (docs/low-latency-ascend.md): the Ascend port's low_latency_dispatch /
low_latency_combine, run on epcomm's dispatch_v2 / combine_v2 (docs/distribute-v2.md).

dispatch: one dispatch_v2 call with global_bs = R * T_max (so T_s may differ per rank and be 0), expert ids
as int32 and, when some slot is negative, a 2-D x_active_mask (negative ids mean "no expert"). recv_x is
dispatch_v2's expand_x: [R*T_max*min(K, L), H] rows in its EP receive order (local expert, source rank,
token), valid rows first. combine: one combine_v2 call with expert_scales = topk_weights and the dispatch's ids,
mask and layout (kept on the handle).

Rank masks (docs/low-latency.md, "Masks and shrink"): on one node a call runs among the unmasked ranks only
(the operators' live_ranks, ids and handle items renumbered around them), with enable_shrink after an
agreement round on the operator group; across nodes every rank calls and masked pairs are sent as absent.

Every low_latency_mode Buffer gets its own epcomm.Group over the Buffer's process group (created collectively
with the Buffer) and one worker thread: calls with return_recv_hook or async_finish run on it, in issue order; a call
with neither waits for what is queued there and runs on the caller's thread."""
import concurrent.futures
import os
import threading
import weakref

import torch

from . import _C
from ._dtypes import as_format, torch_dtype
from ._errors import Error, InvalidUsageError
from .compat import expert_token_nums_prefix_sums
from .event import EventOverlap
from .low_latency import NamedItems, RecvHook, check_ll_shape, check_stats, check_tokens, check_topk_ids, hook_flags, size_hint

# LL format -> (dispatch_v2 quant_mode, y_dtype name). mx_fp4_e2m1 has no dispatch_v2 mode: it is quantized
# here (epcomm.quantize, quant.md mxfp4_e2m1 FLOOR) and its bytes travel as bf16 rows in mode 0.
FORMATS = {
    "bf16": (0, None),
    "int8": (2, "i8"),
    "pertoken_fp8_e4m3": (2, "f8e4m3"),
    "mx_fp8_e4m3": (4, "f8e4m3"),
    "mx_fp8_e5m2": (4, "f8e5m2"),
    "mx_fp4_e2m1": (0, None),
}
QUANT_MODES = (None, "int8", "pertoken_fp8_e4m3", "mx_fp8_e4m3", "mx_fp8_e5m2", "mx_fp4_e2m1")

class LowLatencyHandle(NamedItems):
    """The Ascend port's 7-item low-latency handle (src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts, packed_recv_count, expand_scales), with accessors of those names:
    src_info = dispatch_v2's assist_info_for_combine ([A*128] i32, triples (src rank, token, slot));
    layout_range = its ep_recv_counts ([L*R] i32, inclusive prefix over blocks j*R + s); packed_recv_count =
    recv_count; expand_scales = the rows' topk weights ([A] f32) when topk_weights was given, else empty.
    Tied to the Buffer that made it; pass it back as it is."""

    ITEMS = ("src_info", "layout_range", "num_max_dispatch_tokens_per_rank", "hidden", "num_experts",
             "packed_recv_count", "expand_scales")

    def __new__(cls, items, meta):
        self = super().__new__(cls, items)
        self._meta = meta
        return self

    def __repr__(self):
        return (f"LowLatencyHandle(flavor='ascend', num_max_dispatch_tokens_per_rank={self[2]}, hidden={self[3]}, "
                f"num_experts={self[4]}, format={self._meta.format!r})")


class _Meta:
    """What combine needs from the dispatch besides the handle's items."""

    __slots__ = ("owner", "ids", "sent_ids", "mask", "masked", "T", "K", "L", "t_max", "rows", "global_bs",
                 "shared_ranks", "format", "combine_buffer", "widen", "ran", "topk_ref")


class _State:
    """Per Buffer: its operator group and its worker thread (created on first use)."""

    def __init__(self, group):
        self.group = group
        self.c = group._c
        self.token = object()  # identifies the Buffer's handles
        self._executor = None
        self._last = None
        self._lock = threading.Lock()
        self.closed = False

    def submit(self, fn):
        with self._lock:
            if self.closed:
                raise InvalidUsageError("low-latency mode: the Buffer was destroyed")
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                       thread_name_prefix="epcomm_ll_ascend")
            self._last = self._executor.submit(fn)
            return self._last

    def drain(self):
        """Waits for every call queued on the worker (their errors go to their hooks and events)."""
        last = self._last
        if last is not None:
            concurrent.futures.wait([last])

    def shutdown(self):
        with self._lock:
            self.closed = True
            ex, self._executor = self._executor, None
        if ex is not None:
            ex.shutdown(wait=True)


def _arena_empty(c, shape, name):
    """An uninitialized tensor of epcomm format `name` in the output arena of the operator group `c`
    (moe::output_buffer), viewed as the torch dtype the format comes back as."""
    return as_format(_C.moe_output_buffer(c, list(shape), name), name)


def _prefix(buffer, op):
    return f"epcomm[rank {buffer.rank}] {op}: "


def _ranks_per_node(buffer):
    """The Buffer's nodes as ranks_per_node (consecutive equal nodes), else 0 (the group context's default)."""
    R, n = buffer.num_ranks, buffer.num_nodes
    if n < 1 or R % n:
        return 0
    p = R // n
    return p if all(buffer.node_of(r) == r // p for r in range(R)) else 0


def _check_masks_usable(buffer, shared_ranks, pre):
    """Rank masks and shrink need the operators to run among some ranks only (one node), and no shared-expert
    ranks (their replicas would have to be renumbered too)."""
    shrink = bool(getattr(buffer, "enable_shrink", False))
    if shrink and buffer.num_nodes > 1:
        raise InvalidUsageError(f"{pre}enable_shrink=True works on one node only; this Buffer spans "
                                f"{buffer.num_nodes} nodes")
    if shared_ranks and (shrink or any(buffer._impl.low_latency_query_mask_buffer())):
        raise InvalidUsageError(f"{pre}rank masks and enable_shrink with shared expert ranks "
                                f"(MOE_SHARED_EXPERT_RANK_NUM = {shared_ranks}) are not available in flavor "
                                f"'ascend'; clear the mask (low_latency_clean_mask_buffer) or use no shared "
                                f"expert ranks")


class _Among:
    """The ranks one call runs among (docs/low-latency.md, "Masks and shrink"), decided in call order: the
    Buffer's mask after the shrink agreement. `masked`: [R] 0/1, or None when no rank is masked (_PLAIN, the
    plain call); `ranks`: the real ranks of the operator call, ascending (the unmasked ones on one node, only
    this rank when it is masked itself; every rank across nodes, where masked ranks keep calling), or None."""

    __slots__ = ("masked", "ranks")

    def __init__(self, masked, ranks):
        self.masked, self.ranks = masked, ranks

    def active(self, r):
        return self.masked is None or not self.masked[r]

    @property
    def narrowed(self):
        """Whether the call runs among fewer ranks than the Buffer has (its ranks are renumbered)."""
        return self.ranks is not None and len(self.ranks) < len(self.masked)

    def kw(self, me, L, t_max):
        """The operator arguments that count the call's ranks (none when it runs among all of them)."""
        if not self.narrowed:
            return {}
        W = len(self.ranks)
        return dict(ep_world_size=W, ep_rank_id=self.ranks.index(me), live_ranks=list(self.ranks),
                    moe_expert_num=W * L, global_bs=W * t_max)


_PLAIN = _Among(None, None)


def _among(buffer, st):
    """The ranks of the next call, on the thread that runs the calls in order: with enable_shrink first the
    agreement round among the unmasked ranks (moe_agree_on_mask on the operator group), whose newly masked
    ranks are added to the Buffer's mask (a warning names them)."""
    R, me = buffer.num_ranks, buffer.rank
    masked = buffer._impl.low_latency_query_mask_buffer()
    if getattr(buffer, "enable_shrink", False) and buffer.num_nodes == 1:
        agreed = _C.moe_agree_on_mask(st.c, masked, buffer.timeout_s)
        for r in range(R):
            if agreed[r] and not masked[r]:
                buffer._impl.low_latency_update_mask_buffer(r, True)
        masked = agreed
    if not any(masked):
        return _PLAIN
    masked = tuple(int(m) for m in masked)
    if buffer.num_nodes > 1:
        return _Among(masked, tuple(range(R)))
    if masked[me]:
        return _Among(masked, (me,))
    return _Among(masked, tuple(r for r in range(R) if not masked[r]))


def _sent_ids(ids, among, me, L):
    """(ids, x_active_mask): ids (real numbering, -1 absent) with the pairs to masked ranks' experts made
    absent (all of them when this rank is masked: it sends nothing), and the slots still active (None when
    all are)."""
    if among.masked[me]:
        sent = torch.full_like(ids, -1)
    else:
        live = torch.tensor([not m for m in among.masked])
        keep = (ids < 0) | live[ids.clamp(min=0) // L]
        sent = torch.where(keep, ids, torch.full_like(ids, -1))
    active = sent >= 0
    return sent, (None if bool(active.all()) else active)


def _renumber(ids, among, R, L):
    """Real expert ids (-1 absent) in the numbering of the call's ranks: expert j of the v-th rank of the call
    is v*L + j; experts of ranks outside the call must be absent already."""
    if among.ranks is None or len(among.ranks) == R:
        return ids
    table = torch.full((R * L + 1,), -1, dtype=torch.int32)  # index 0 stands for -1
    for v, r in enumerate(among.ranks):
        table[r * L + 1:(r + 1) * L + 1] = torch.arange(v * L, (v + 1) * L, dtype=torch.int32)
    return table[(ids + 1).long()]


def _widen_counts(op_counts, ranks, R, L):
    """A [L*W] inclusive prefix over blocks j*W + v (the call's ranks) as the [L*R] prefix over the real
    ranks' blocks j*R + s (ranks outside the call add nothing)."""
    W = len(ranks)
    per = torch.diff(op_counts.to(torch.int64), prepend=op_counts.new_zeros(1, dtype=torch.int64)).view(L, W)
    real = torch.zeros(L, R, dtype=torch.int64)
    real[:, list(ranks)] = per
    return real.view(-1).cumsum(0).to(torch.int32)


def _narrow_counts(layout_range, ranks, R, L, keep_src):
    """The [L*R] real prefix as the [L*W] prefix of the call's ranks, counting only the sources keep_src
    allows ([R] bool)."""
    per = torch.diff(layout_range.to(torch.int64),
                     prepend=layout_range.new_zeros(1, dtype=torch.int64)).view(L, R)
    per = per * keep_src.to(torch.int64).view(1, R)
    return per[:, list(ranks)].reshape(-1).cumsum(0).to(torch.int32)


def _dispatch_among(buffer, st, kw, meta):
    """The operator arguments of a dispatch among the ranks decided now (_among). Sets the handle's meta:
    sent_ids (real numbering), mask, masked, and widen (the call's ranks and the counts tensor it writes) when
    the call runs among fewer ranks, whose outputs _widen_dispatch renumbers afterwards."""
    R, me, L = buffer.num_ranks, buffer.rank, meta.L
    among = _among(buffer, st)
    meta.ran = True
    if among is _PLAIN:  # prepare() set kw and meta for it
        return kw
    sent, mask = _sent_ids(meta.ids, among, me, L)
    meta.sent_ids, meta.mask, meta.masked = sent, mask, among.masked
    if not among.narrowed:
        return dict(kw, expert_ids=sent, x_active_mask=mask)
    op_counts = torch.empty(len(among.ranks) * L, dtype=torch.int32)
    meta.widen = (among.ranks, op_counts)
    return dict(kw, expert_ids=_renumber(sent, among, R, L), x_active_mask=mask, ep_recv_counts_out=op_counts,
                **among.kw(me, L, meta.t_max))


def _widen_dispatch(buffer, meta, handle):
    """After a dispatch among fewer ranks: layout_range and the sources in src_info in the real numbering."""
    ranks, op_counts = meta.widen
    handle.layout_range.copy_(_widen_counts(op_counts, ranks, buffer.num_ranks, meta.L))
    n_own = int(op_counts[-1]) if op_counts.numel() else 0
    if n_own:
        src = handle.src_info[:3 * n_own:3]
        src.copy_(torch.tensor(ranks, dtype=torch.int32)[src.long()])


def _combine_among(buffer, st, kw, meta, handle):
    """The operator arguments of a combine among the ranks decided now. With the dispatch's mask and every rank
    in the call, the handle's items as they are; else the pairs whose holder and origin are both unmasked now:
    this rank returns the rows of its sources that are (a copy of them when some are left out), renumbered to
    the call's ranks, and expects rows for its slots whose holders are."""
    R, me, L = buffer.num_ranks, buffer.rank, meta.L
    if not meta.ran:
        raise InvalidUsageError(f"{_prefix(buffer, 'low_latency_combine')}argument: handle: its dispatch did not "
                                f"run (it raised); dispatch again")
    among = _among(buffer, st)
    if among.masked == meta.masked and not among.narrowed:
        kw["expert_ids"], kw["x_active_mask"] = meta.sent_ids, meta.mask
        return kw
    sent, mask = _sent_ids(meta.sent_ids, among, me, L) if among is not _PLAIN else (meta.sent_ids, meta.mask)
    ranks = among.ranks if among.ranks is not None else tuple(range(R))
    keep_src = torch.tensor([among.active(r) and among.active(me) for r in range(R)])
    lr = handle.layout_range
    n_own = int(lr[-1]) if lr.numel() else 0
    trip = handle.src_info[:3 * n_own].view(-1, 3)
    keep = keep_src[trip[:, 0].long()]
    rows = kw["expand_x"]
    if bool(keep.all()):
        assist = trip.clone()
    else:
        idx = keep.nonzero().squeeze(1)
        assist, rows = trip[idx], rows[idx]
    if among.narrowed:
        inv = torch.full((R,), -1, dtype=torch.int32)
        inv[list(ranks)] = torch.arange(len(ranks), dtype=torch.int32)
        assist[:, 0] = inv[assist[:, 0].long()]
    return dict(kw, expand_x=rows, expert_ids=_renumber(sent, among, R, L), x_active_mask=mask,
                assist_info_for_combine=assist.reshape(-1), ep_send_counts=_narrow_counts(lr, ranks, R, L, keep_src),
                **among.kw(me, L, meta.t_max))


def _state(buffer, op):
    st = getattr(buffer, "_ll_ascend_state", None)
    if st is None or st.closed:
        if getattr(buffer, "_destroyed", False):
            raise InvalidUsageError(f"{_prefix(buffer, op)}the Buffer was destroyed")
        if st is not None:
            raise InvalidUsageError(f"{_prefix(buffer, op)}low-latency mode of this Buffer was shut down")
        from .group import Group

        # Collective: called by the Buffer's constructor on every rank.
        g = Group(buffer.group)
        # The operators' output arena gets the Buffer's low-latency reserve (num_rdma_bytes, which the size
        # hint makes two calls' outputs), so that the first calls' rows land on pages every rank has mapped.
        reserve = buffer.num_rdma_bytes if buffer.low_latency_mode else 0
        _C.moe_init_group_context(g._c, 0, buffer.timeout_s, _ranks_per_node(buffer), 0, -1, reserve)
        st = _State(g)
        buffer._ll_ascend_state = st
        buffer._ll_ascend_finalizer = weakref.finalize(buffer, st.shutdown)
    if getattr(buffer, "_destroyed", False):
        st.shutdown()
        raise InvalidUsageError(f"{_prefix(buffer, op)}the Buffer was destroyed")
    return st


def shutdown(buffer):
    """Waits for the Buffer's queued LL calls and stops its worker (Buffer.destroy may call this)."""
    st = getattr(buffer, "_ll_ascend_state", None)
    if st is not None:
        st.shutdown()


def _prepared(buffer, st, core_op, pre, prepare):
    """Runs the local checks `prepare` (which returns the call's plan). Whatever they raise fails the call on
    every rank of the group, or the ranks it runs among (moe_fail_call: InvalidUsageError here, AbortedError
    quoting it on the peers), after the calls already queued on the worker, so that no rank falls a call
    behind its peers."""
    try:
        return prepare()
    except Error as e:
        message = str(e)
    except Exception as e:  # a malformed argument Python or torch rejected
        message = f"{pre}argument: {type(e).__name__}: {e}"
    if not message.startswith(pre):
        message = pre + message
    st.drain()
    among = _among(buffer, st)
    live = list(among.ranks) if among.narrowed else []
    _C.moe_fail_call(st.c, None, core_op, 0, message, live)
    raise InvalidUsageError(message)  # not reached: moe_fail_call raises


def _wrapped(pre, note, fn):
    """fn(), with epcomm errors re-raised under the LL prefix (same class) plus a note on this call."""
    def run():
        try:
            fn()
        except Error as e:
            text = str(e)
            if note:
                text += f" [{note()}]"
            raise type(e)(text if text.startswith(pre) else pre + text) from None
    return run


def _launch(st, run, async_finish, return_recv_hook, hook_runs_here=False):
    """(event, hook) of a prepared call: queued on the worker with return_recv_hook, else run here in order.
    async_finish completes the call before returning, as the Ascend port does (its kernels run on the
    current stream and its event is empty, so its callers read the results without waiting): the event
    returned is complete. hook_runs_here: a hooked call that runs here too (a dispatch on one node, whose
    sending, the rows written into the receivers' memory, is its whole work); its hook is then done."""
    if return_recv_hook and not hook_runs_here:
        fut = st.submit(run)
        return EventOverlap(), RecvHook(fut.result)
    st.drain()
    run()
    return EventOverlap(), RecvHook()


def _format(quant_mode, use_fp8, round_scale, use_ue8m0, use_mxfp4, pre):
    if quant_mode is not None:
        if quant_mode not in QUANT_MODES:
            raise InvalidUsageError(f"{pre}argument: quant_mode: expected one of "
                                    f"{', '.join(repr(m) for m in QUANT_MODES)}, got {quant_mode!r}")
        return quant_mode
    if use_mxfp4:
        return "mx_fp4_e2m1"
    if use_ue8m0:
        return "mx_fp8_e4m3"
    if use_fp8:
        return "int8"
    return "bf16"


def _shared_expert_ranks(R, pre):
    raw = os.environ.get("MOE_SHARED_EXPERT_RANK_NUM", "").strip()
    if not raw:
        return 0
    try:
        v = int(raw)
    except ValueError:
        v = -1
    if not 0 <= v < R:
        raise InvalidUsageError(f"{pre}MOE_SHARED_EXPERT_RANK_NUM: expected an integer in [0, {R - 1}] (fewer than "
                                f"the {R} ranks), got {raw!r}")
    return v


def _weights(w, T, K, name, pre, required):
    if w is None:
        if required:
            raise InvalidUsageError(f"{pre}argument: {name}: expected a [{T}, {K}] float tensor, got None")
        return None
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or list(w.shape) != [T, K]:
        got = f"{list(w.shape)} {w.dtype}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise InvalidUsageError(f"{pre}argument: {name}: expected a [{T}, {K}] float tensor, got {got}")
    return w.to(torch.float32).contiguous()


def _packed_width(H):
    """bf16 columns of one mx_fp4_e2m1 row on the wire: H/2 code bytes and ceil(H/32) scale bytes, padded."""
    return (H // 2 + (H + 31) // 32 + 1) // 2


def dispatch(buffer, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
             cumulative_local_expert_recv_stats=None, use_fp8=True, round_scale=False, use_ue8m0=False,
             use_mxfp4=False, async_finish=False, return_recv_hook=False, topk_weights=None, quant_mode=None):
    """The Ascend port's low_latency_dispatch: returns (recv_x, recv_count, handle, event, hook).

    recv_x: [A, H] with A = R*T_max*min(K, L) (dispatch_v2's capacity with global_bs = R*T_max), bf16, or a
    (codes, scales) pair: int8 / float8_e4m3fn codes with f32 scales [A] (int8, pertoken_fp8_e4m3),
    float8_e4m3fn / float8_e5m2 codes with float8_e8m0fnu scales [A*ceil(H/32)] (mx_fp8_*), or
    float4_e2m1fn_x2 codes [A, H/2] with float8_e8m0fnu scales [A*ceil(H/32)] (mx_fp4_e2m1). recv_count [L] i64:
    rows per local expert (inclusive prefix sums with MOE_EXPERT_TOKEN_NUMS_TYPE=0)."""
    op = "low_latency_dispatch"
    pre = _prefix(buffer, op)
    st = _state(buffer, op)
    R, rank = buffer.num_ranks, buffer.rank

    def prepare():
        af, rh = hook_flags(async_finish, return_recv_hook, pre)
        s_r = _shared_expert_ranks(R, pre)
        t_max, _, _, E = check_ll_shape(num_max_dispatch_tokens_per_rank, 1, R - s_r, num_experts, pre)
        # Ids are range-checked here only where one is >= E (int64 ids must not wrap in the int32 conversion);
        # dispatch_v2 checks the active ones (range, distinct within a row) on every call and fails the call on
        # every rank, naming the token and both slots.
        T, H, K = check_tokens(x, topk_idx, t_max, E, rank, pre, check_ids=False)
        lo, hi = (int(v) for v in topk_idx.aminmax()) if T else (0, 0)  # one pass (a decode step's calls are short)
        if hi >= E:
            check_topk_ids(topk_idx, E, rank, pre)
        if H < 1:
            raise InvalidUsageError(f"{pre}argument: x: expected hidden >= 1, got {H}")
        fmt = _format(quant_mode, use_fp8, round_scale, use_ue8m0, use_mxfp4, pre)
        if fmt == "mx_fp4_e2m1" and H % 2:
            raise InvalidUsageError(f"{pre}argument: x: mx_fp4_e2m1 needs an even hidden size, got {H}")
        hint = size_hint(t_max, H, R - s_r, E) if buffer.num_rdma_bytes > 0 else 0
        if 0 < buffer.num_rdma_bytes < hint:
            raise InvalidUsageError(f"{pre}argument: num_rdma_bytes: the Buffer's low-latency region has "
                                    f"{buffer.num_rdma_bytes} bytes, this call needs {hint} "
                                    f"(Buffer.get_low_latency_rdma_size_hint({t_max}, {H}, {R}, {E}))")
        shared = rank < s_r
        L = E // (R - s_r)
        Lp = 1 if shared else L
        stats = check_stats(cumulative_local_expert_recv_stats, "cumulative_local_expert_recv_stats", Lp,
                            (torch.int32,), pre)
        w = _weights(topk_weights, T, K, "topk_weights", pre, False)
        prefix_sums = expert_token_nums_prefix_sums()
        rows = t_max * -(-R // s_r) if shared else R * t_max * min(K, L)
        mode, y_dtype = FORMATS[fmt]

        _check_masks_usable(buffer, s_r, pre)
        # A copy (int32 ids come in too): negative ids become -1.
        ids = topk_idx.to(torch.int32, copy=True, memory_format=torch.contiguous_format)
        mask = None
        if lo < 0:
            ids.clamp_(min=-1)
            mask = ids >= 0

        send = x
        if fmt == "mx_fp4_e2m1":
            from .quant import quantize

            codes, sc = quantize(x, "mx_fp4_e2m1") if T else (None, None)
            Wp = _packed_width(H)
            packed = torch.zeros(T, 2 * Wp, dtype=torch.uint8)
            if T:
                packed[:, :H // 2] = codes.view(torch.uint8).reshape(T, H // 2)
                packed[:, H // 2:H // 2 + (H + 31) // 32] = sc.view(torch.uint8).reshape(T, -1)
            send = packed.view(torch.bfloat16)
        width = int(send.shape[1])

        # Outputs, allocated here (unspecified past the valid rows), so that they exist before the call runs.
        # The rows and their scales lie in the group's output arena: on one node the senders write every row
        # straight into them (docs/distribute-v2.md, "Output arena").
        G = (H + 31) // 32
        if mode == 0:
            expand_x = _arena_empty(st.c, (rows, width), "bf16")
            dyn = torch.empty(rows, dtype=torch.float32)
        elif mode == 2:
            expand_x = _arena_empty(st.c, (rows, H), y_dtype)
            dyn = _arena_empty(st.c, (rows,), "f32")
        else:
            expand_x = _arena_empty(st.c, (rows, H), y_dtype)
            dyn = _arena_empty(st.c, (rows, G + (G & 1)), "e8m0")
        assist = torch.empty(rows * 128, dtype=torch.int32)
        token_nums = torch.empty(Lp, dtype=torch.int64)
        ep_counts = torch.empty(R * Lp, dtype=torch.int32)
        expand_scales = torch.empty(rows if w is not None else 0, dtype=torch.float32)

        if fmt == "bf16":
            recv_x, post = expand_x, None
        elif mode == 2:
            recv_x, post = (expand_x, dyn), None
        elif mode == 4:
            if G & 1:  # dispatch_v2 stores Align2(ceil(H/32)) bytes per row: compacted after the call
                flat = torch.empty(rows * G, dtype=dyn.dtype)
                post = ("compact", flat)
            else:
                flat, post = dyn.reshape(-1), None
            recv_x = (expand_x, flat)
        else:
            fcodes = torch.empty(rows, H // 2, dtype=torch_dtype("f4x2"))
            fscales = torch.empty(rows * G, dtype=torch_dtype("e8m0"))
            recv_x, post = (fcodes, fscales), ("fp4", fcodes, fscales)

        kw = dict(x=send, expert_ids=ids, x_active_mask=mask, expert_scales=w, ep_world_size=R, ep_rank_id=rank,
                  moe_expert_num=E, tp_world_size=0, tp_rank_id=0, expert_shard_type=0,
                  shared_expert_num=1 if s_r else 0, shared_expert_rank_num=s_r, quant_mode=mode,
                  global_bs=R * t_max, expert_token_nums_type=0 if prefix_sums else 1, y_dtype=y_dtype,
                  expand_x_out=expand_x, dynamic_scales_out=dyn, assist_info_for_combine_out=assist,
                  expert_token_nums_out=token_nums, ep_recv_counts_out=ep_counts,
                  expand_scales_out=expand_scales if w is not None else None, hccl_buffsize_mb=200,
                  no_result=True)
        meta = _Meta()
        meta.owner, meta.ids, meta.T, meta.K, meta.L, meta.t_max = st.token, ids, T, K, L, t_max
        meta.topk_ref = (topk_idx, topk_idx._version)
        # As the plain call (no rank masked) sends them; _dispatch_among changes them under a mask.
        meta.sent_ids, meta.mask, meta.masked, meta.widen, meta.ran = ids, mask, None, None, False
        meta.rows, meta.global_bs, meta.shared_ranks, meta.format = rows, R * t_max, s_r, fmt
        meta.combine_buffer = None
        handle = LowLatencyHandle((assist, ep_counts, t_max, H, E, token_nums, expand_scales), meta)
        def note():  # built only for an error message
            return (f"this rank: num_max_dispatch_tokens_per_rank={t_max} (dispatch_v2 global_bs = num_ranks * it = "
                    f"{R * t_max}), num_experts={E}, hidden={H}, format {fmt} (dispatch_v2 quant_mode {mode}); "
                    f"expert_ids = topk_idx")
        return dict(kw=kw, post=post, stats=stats, prefix_sums=prefix_sums, recv_x=recv_x, H=H, G=G,
                    token_nums=token_nums, handle=handle, note=note, flags=(af, rh), meta=meta)

    p = _prepared(buffer, st, "dispatch_v2", pre, prepare)
    c = st.c

    def call():
        meta = p["meta"]
        _C.moe_dispatch_v2(c, None, _dispatch_among(buffer, st, p["kw"], meta))
        if meta.widen is not None:
            _widen_dispatch(buffer, meta, p["handle"])
        post = p["post"]
        if post is not None and post[0] == "compact":
            dyn = p["kw"]["dynamic_scales_out"]
            post[1].view(-1, p["G"]).copy_(dyn[:, :p["G"]])
        elif post is not None:
            H, G = p["H"], p["G"]
            raw = p["kw"]["expand_x_out"].view(torch.uint8)
            post[1].view(torch.uint8).copy_(raw[:, :H // 2])
            post[2].view(torch.uint8).view(-1, G).copy_(raw[:, H // 2:H // 2 + G])
        stats = p["stats"]
        if stats is not None:
            n = p["token_nums"]
            if p["prefix_sums"]:
                n = torch.diff(n, prepend=n.new_zeros(1))
            stats += n.to(stats.dtype)

    event, hook = _launch(st, _wrapped(pre, p["note"], call), *p["flags"], hook_runs_here=buffer.num_nodes == 1)
    return p["recv_x"], p["token_nums"], p["handle"], event, hook


def _own_handle(st, handle, pre):
    if isinstance(handle, LowLatencyHandle):
        if handle._meta.owner is not st.token:
            raise InvalidUsageError(f"{pre}argument: handle: it belongs to another Buffer; pass the handle that this "
                                    f"Buffer's low_latency_dispatch returned")
        return handle._meta
    from .handle import Handle

    if isinstance(handle, Handle):
        raise InvalidUsageError(f"{pre}argument: handle: expected the handle of low_latency_dispatch, got a "
                                f"normal-mode handle (from Buffer.dispatch)")
    if isinstance(handle, tuple):
        raise InvalidUsageError(f"{pre}argument: handle: expected the handle of low_latency_dispatch, got a plain "
                                f"tuple; pass the handle itself")
    raise InvalidUsageError(f"{pre}argument: handle: expected the handle of low_latency_dispatch, got "
                            f"{type(handle).__name__}")


def _check_same_ids(topk_idx, meta, pre):
    """topk_idx [T, K] equals the dispatch's ids (negative ids all mean "no expert"). The dispatch's own
    tensor, not written since (torch counts in-place writes in _version), is equal without a comparison."""
    if topk_idx is meta.topk_ref[0] and topk_idx._version == meta.topk_ref[1]:
        return
    given = topk_idx.clamp(min=-1)
    want = meta.ids.to(given.dtype)
    if not torch.equal(given, want):
        t, k = (int(v) for v in (given != want).nonzero()[0])
        raise InvalidUsageError(f"{pre}argument: topk_idx: differs from the dispatch's at [{t}, {k}]: "
                                f"{int(topk_idx[t, k])}, the dispatch had {int(meta.ids[t, k])}")


def combine_buffer(buffer, handle):
    """The [rows, H] bf16 tensor to write the expert outputs into for combine(..., zero_copy=True), kept on the
    handle (the same tensor on every call for a handle). It lies in the operator group's output arena: on one
    node every origin reads its rows there in place (distribute-v2.md, "Output arena")."""
    op = "get_next_low_latency_combine_buffer"
    pre = _prefix(buffer, op)
    st = _state(buffer, op)
    meta = _own_handle(st, handle, pre)
    if meta.combine_buffer is None:
        meta.combine_buffer = _arena_empty(st.c, (meta.rows, handle.hidden), "bf16")
    return meta.combine_buffer


def combine(buffer, x, topk_idx, topk_weights, handle, zero_copy=False, async_finish=False,
            return_recv_hook=False, out=None):
    """The Ascend port's low_latency_combine: returns (combined_x, event, hook); combined_x [T, H] bf16 is
    combine_v2's weighted sum of each token's expert outputs with expert_scales = topk_weights (written into
    `out` when given)."""
    op = "low_latency_combine"
    pre = _prefix(buffer, op)
    st = _state(buffer, op)

    def prepare():
        af, rh = hook_flags(async_finish, return_recv_hook, pre)
        meta = _own_handle(st, handle, pre)
        T, K, H, rows = meta.T, meta.K, handle.hidden, meta.rows
        if (not isinstance(topk_idx, torch.Tensor) or topk_idx.dtype not in (torch.int64, torch.int32)
                or list(topk_idx.shape) != [T, K]):
            got = f"{list(topk_idx.shape)} {topk_idx.dtype}" if isinstance(topk_idx, torch.Tensor) else \
                type(topk_idx).__name__
            raise InvalidUsageError(f"{pre}argument: topk_idx: expected the dispatch's [{T}, {K}] int64 (or int32) "
                                    f"tensor, got {got}")
        _check_same_ids(topk_idx, meta, pre)
        w = _weights(topk_weights, T, K, "topk_weights", pre, True)
        _check_masks_usable(buffer, meta.shared_ranks, pre)
        if zero_copy:
            if meta.combine_buffer is None:
                raise InvalidUsageError(f"{pre}argument: zero_copy: True, but the combine buffer of this handle "
                                        f"was never requested (call get_next_low_latency_combine_buffer(handle) "
                                        f"and write the expert outputs into it)")
            src = meta.combine_buffer
        else:
            if (not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2
                    or int(x.shape[1]) != H or int(x.shape[0]) > rows):
                got = f"{list(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise InvalidUsageError(f"{pre}argument: x: expected a [{rows}, {H}] torch.bfloat16 tensor (the "
                                        f"dispatch's rows), got {got}")
            src = x.contiguous()
        if out is not None:  # at least T rows (the port's callers pass padded buffers): the first T are written
            if (not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or out.dim() != 2
                    or int(out.shape[0]) < T or int(out.shape[1]) != H):
                got = f"{list(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
                raise InvalidUsageError(f"{pre}argument: out: expected a [>= {T}, {H}] torch.bfloat16 tensor, "
                                        f"got {got}")
            result = out if int(out.shape[0]) == T else out[:T]
        else:
            result = torch.empty(T, H, dtype=torch.bfloat16)
        target = result if result.is_contiguous() else torch.empty(T, H, dtype=torch.bfloat16)
        s_r = meta.shared_ranks
        # expert_ids and x_active_mask are set when the call runs (_combine_among).
        kw = dict(expand_x=src, assist_info_for_combine=handle.src_info,
                  ep_send_counts=handle.layout_range, expert_scales=w, ep_world_size=buffer.num_ranks,
                  ep_rank_id=buffer.rank, moe_expert_num=handle.num_experts,
                  tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1 if s_r else 0,
                  shared_expert_rank_num=s_r, global_bs=meta.global_bs, comm_quant_mode=0, x_out=target,
                  hccl_buffsize_mb=200)
        return dict(kw=kw, result=result, target=target, flags=(af, rh), meta=meta)

    p = _prepared(buffer, st, "combine_v2", pre, prepare)
    c = st.c

    def call():
        _C.moe_combine_v2(c, None, _combine_among(buffer, st, p["kw"], p["meta"], handle))
        if p["target"] is not p["result"]:
            p["result"].copy_(p["target"])

    event, hook = _launch(st, _wrapped(pre, "", call), *p["flags"])
    return p["result"], event, hook
