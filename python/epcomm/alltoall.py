"""The alltoall strategy (DEEP_USE_MODE=alltoall): the same get_dispatch_layout / dispatch / combine as the
shared-memory engine, computed in torch on this rank and moved with torch.distributed collectives on the
Buffer's process group. It is the seed's fallback mode and, sharing no code with the engine, a reference
for it: every output (rows, order, PAD rows, lists, handle accessors, combine bits) equals the engine's.

How data moves (rows travel as bytes through all_to_all_single with uneven splits: gloo has no all_to_all of
lists, and its dtype support varies between torch versions):
- every collective call starts with an all-gather of a pickled header (group.all_gather_object: operation,
  sequence number, the parameters that must match, this rank's validation status and message, and for a
  fresh dispatch its per-expert and per-rank counts); a failed rank or a mismatch makes every rank raise, before data moves;
- dispatch sends, per destination rank, one uint8 record per row (payload bytes, then the routing: source
  token, slot and weight in expert_major; source token, local ids and weights in rank_major) with one
  dist.all_to_all_single; the receiver places each record at the row the spec assigns it;
- combine sends every received row back to its origin along the reversed splits with one
  dist.all_to_all_single, and the origin reduces in fp32 in canonical order (one add per tensor op, so no
  FMA), adds the bias and rounds once.
Calls are synchronous: async_finish returns a completed event. Gloo's own timeout bounds every wait."""
import os
import time

import torch
import torch.distributed as dist

from . import _C
from ._dtypes import TORCH_OF
from ._errors import AbortedError, Error, InvalidUsageError, TimeoutError
from .group import all_gather_object, kept_collective

_ORDERS = ("expert_major", "rank_major")
_ELEM = {"bf16": 2, "f16": 2, "f32": 4, "i8": 1, "u8": 1, "i32": 4, "i64": 8, "bool": 1,
         "f8e4m3": 1, "f8e5m2": 1, "e8m0": 1, "f4x2": 1}
_CANONICAL_NAN = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
_INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


class _Failed(Exception):
    """A local validation error, published in the header before it is raised."""

    def __init__(self, error):
        super().__init__(str(error))
        self.error = error


def _arg(message):
    raise _Failed(InvalidUsageError("argument: " + message))


def _dtype_name(t, override=None):
    if override is not None:
        return override
    from ._dtypes import PLAIN

    return PLAIN.get(t.dtype, str(t.dtype).replace("torch.", ""))


def _shape(t):
    return "[" + ", ".join(str(int(s)) for s in t.shape) + "]"


def _check_dtype(t, name, ok, override=None):
    got = _dtype_name(t, override)
    if got not in ok:
        _arg(f"{name}: dtype {got}, expected {' or '.join(ok)}")


def _check_shape(t, name, expected, meaning):
    if list(t.shape) != list(expected):
        _arg(f"{name}: shape {_shape(t)}, expected [{', '.join(str(int(e)) for e in expected)}] = {meaning}")


def _check_contiguous(t, name):
    if not t.is_contiguous():
        _arg(f"{name}: must be contiguous (shape {_shape(t)}, strides [{', '.join(map(str, t.stride()))}])")


def _view(t, dtype):
    """Reinterprets a slice of uint8 records as dtype (a fresh contiguous copy: slices may start at any byte)."""
    return t.clone(memory_format=torch.contiguous_format).view(dtype)


def _row_bytes(t, rows):
    """The bytes of a tensor whose first dimension has `rows` rows, as [rows, bytes per row] uint8. The width
    comes from the trailing dimensions, so it is right for 0 rows too (records of every rank agree)."""
    per_row = t.element_size()
    for n in t.shape[1:]:
        per_row *= int(n)
    if rows == 0 or per_row == 0:
        return torch.empty(rows, per_row, dtype=torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(rows, per_row)


class _Format:
    """The payload of one dispatch: per-row data bytes and scale bytes, their formats and output shapes."""

    def __init__(self):
        self.mode = None  # None: plain rows
        self.quantize = None  # mode to quantize x with (None: rows are moved as given)
        self.hidden = 0
        self.data_name = None
        self.data_cols = 0
        self.data_row_bytes = 0
        self.scale_name = None
        self.scale_cols = 0
        self.scale_shape = None  # "vec" [n], "mat" [n, G] or "flat" [n * G]
        self.scale_row_bytes = 0

    @property
    def row_bytes(self):
        return self.data_row_bytes + self.scale_row_bytes


def _bad_tuple(d, dn, s, sn):
    _arg("x: a (data, scales) tuple must be one of: (i8 [T,H], f32 [T]) int8; (f8e4m3 [T,H], f32 [T]) "
         "pertoken_fp8_e4m3; (f8e4m3 [T,H], f32 [T, ceil(H/128)]) pergroup_fp8_e4m3; (f8e4m3 or f8e5m2 [T,H], "
         "e8m0 [T, H/32] or [T*H/32]) mx_fp8_e4m3/mx_fp8_e5m2; (f4x2 [T,H/2], e8m0 [T, H/32] or [T*H/32]) "
         f"mx_fp4_e2m1; got ({_dtype_name(d, dn)}{_shape(d)}, {_dtype_name(s, sn)}{_shape(s)})")


def _infer_tuple(d, dn, s, sn):
    """Mode and format of a pre-quantized tuple (docs/normal-mode.md table); returns (_Format, scales as [T, G])."""
    dname, sname = _dtype_name(d, dn), _dtype_name(s, sn)
    if d.dim() != 2:
        _bad_tuple(d, dn, s, sn)
    T, C = int(d.shape[0]), int(d.shape[1])
    f = _Format()
    f.data_name, f.data_cols, f.data_row_bytes = dname, C, C * _ELEM.get(dname, 1)
    f.scale_name = sname
    if dname in ("i8", "f8e4m3") and sname == "f32":
        f.hidden = C
        if s.dim() == 1:
            if int(s.shape[0]) != T:
                _bad_tuple(d, dn, s, sn)
            f.scale_shape, f.scale_cols = "vec", 1
            f.mode = "int8" if dname == "i8" else "pertoken_fp8_e4m3"
        else:
            G = (C + 127) // 128
            if dname != "f8e4m3" or s.dim() != 2 or list(s.shape) != [T, G]:
                _bad_tuple(d, dn, s, sn)
            f.scale_shape, f.scale_cols, f.mode = "mat", G, "pergroup_fp8_e4m3"
    elif dname in ("f8e4m3", "f8e5m2", "f4x2") and sname == "e8m0":
        f.hidden = 2 * C if dname == "f4x2" else C
        if f.hidden % 32:
            _bad_tuple(d, dn, s, sn)
        G = f.hidden // 32
        if not ((s.dim() == 1 and int(s.shape[0]) == T * G) or (s.dim() == 2 and list(s.shape) == [T, G])):
            _bad_tuple(d, dn, s, sn)
        f.scale_shape, f.scale_cols = "flat", G
        f.mode = {"f8e4m3": "mx_fp8_e4m3", "f8e5m2": "mx_fp8_e5m2", "f4x2": "mx_fp4_e2m1"}[dname]
    else:
        _bad_tuple(d, dn, s, sn)
    f.scale_row_bytes = f.scale_cols * _ELEM[sname]
    return f, s.reshape(T, f.scale_cols)


def _env_int8():
    return os.environ.get("DEEP_NORMAL_MODE_USE_INT8_QUANT") == "1" or os.environ.get("EPCOMM_NORMAL_INT8") == "1"


def _payload(x):
    """Selects the payload format (tuple > quant_mode > environment > plain, docs/normal-mode.md) and returns
    (_Format, [T, row_bytes] uint8 payload of every token)."""
    d, dn, s, sn, quant_mode = x["data"], x["data_dtype"], x["scales"], x["scales_dtype"], x["quant_mode"]
    if d.dim() != 2:
        _arg(f"x: expected a 2-D [num_tokens, hidden] tensor, got shape {_shape(d)}")
    if int(d.shape[1]) < 1:
        _arg(f"x: hidden (columns) must be >= 1, got shape {_shape(d)}")
    _check_contiguous(d, "x")
    T = int(d.shape[0])
    if s is not None:
        f, s2 = _infer_tuple(d, dn, s, sn)
        if quant_mode is not None and quant_mode != f.mode:
            _arg(f"quant_mode = {quant_mode} contradicts the (data, scales) tuple, which is {f.mode}")
        return f, torch.cat([_row_bytes(d, T), _row_bytes(s2.contiguous(), T)], dim=1)
    mode = quant_mode
    if mode is None and _env_int8():
        mode = "int8"
    if mode == "bf16":
        if _dtype_name(d, dn) != "bf16":
            _arg(f"x: quant_mode = bf16 requires x of dtype bf16, got {_dtype_name(d, dn)}")
        mode = None
    _check_dtype(d, "x", ("bf16", "f16", "f32"), dn)
    f = _Format()
    f.hidden = int(d.shape[1])
    if mode is None:
        f.data_name, f.data_cols = _dtype_name(d), f.hidden
        f.data_row_bytes = f.hidden * d.element_size()
        return f, _row_bytes(d, T)
    data, data_name, scales, scales_name = _C.quantize(d, mode)  # raises for an H the mode forbids
    f.mode = f.quantize = mode
    f.data_name, f.data_cols = data_name, int(data.shape[1])
    f.data_row_bytes = f.data_cols
    f.scale_name = scales_name
    f.scale_cols = 1 if scales.dim() == 1 else int(scales.shape[1])
    f.scale_shape = "mat" if mode == "pergroup_fp8_e4m3" else ("vec" if scales.dim() == 1 else "flat")
    f.scale_row_bytes = f.scale_cols * _ELEM[scales_name]
    return f, torch.cat([_row_bytes(data, T), _row_bytes(scales.reshape(T, f.scale_cols), T)], dim=1)


def _split_payload(f, rows_bytes):
    """[n, row_bytes] uint8 -> (data, data format, scales or None, scale format or None) tensors."""
    n = int(rows_bytes.shape[0])
    data = _view(rows_bytes[:, : f.data_row_bytes], TORCH_OF.get(f.data_name, torch.uint8))
    data = data.reshape(n, f.data_cols)
    if not f.scale_row_bytes:
        return data, f.data_name, None, None
    scales = _view(rows_bytes[:, f.data_row_bytes:], TORCH_OF.get(f.scale_name, torch.uint8))
    shape = {"vec": [n], "mat": [n, f.scale_cols], "flat": [n * f.scale_cols]}[f.scale_shape]
    return data, f.data_name, scales.reshape(shape), f.scale_name


class AllToAllHandle:
    """The alltoall strategy's handle contents: the accessors of docs/normal-mode.md plus the routes."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def _normalize_ids(topk_idx, E):
    """Negative ids -> -1; the first id >= E (row-major) raises like the engine."""
    V = topk_idx.to(torch.int64)
    bad = (V >= E).nonzero()
    if bad.numel():
        t, k = int(bad[0, 0]), int(bad[0, 1])
        _arg(f"topk_idx[{t}, {k}] = {int(V[t, k])} is out of range [0, {E})")
    return torch.where(V >= 0, V, torch.full_like(V, -1))


def _layout(V, E, R):
    """(num_tokens_per_rank i32 [R], num_tokens_per_expert i32 [E], is_token_in_rank bool [T, R])."""
    T = int(V.shape[0])
    L = E // R
    valid = V >= 0
    dest = torch.where(valid, torch.div(V, L, rounding_mode="floor"), torch.full_like(V, -1))
    in_rank = torch.zeros(T, R, dtype=torch.bool)
    for d in range(R):
        in_rank[:, d] = (dest == d).any(dim=1) if V.shape[1] else False
    per_rank = in_rank.sum(dim=0).to(torch.int32)
    per_expert = torch.bincount(V[valid], minlength=E).to(torch.int32)
    return per_rank, per_expert, in_rank


_MAX_ROWS = 1 << 31  # a rank receives at most 2^31 - 1 rows (the engine's limit)
_MAX_EXPERTS = 16384  # the engine's header capacity (engine::kMaxExperts)


def _check_memory(prefix, d, rows, row_bytes):
    """Raises InvalidUsageError (capacity) when rank d's outputs of `rows` rows would not fit this host's
    memory (a huge expert_alignment or num_worst_tokens), instead of torch failing to allocate them."""
    need = rows * row_bytes
    have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > have:
        raise InvalidUsageError(f"{prefix}capacity: receiving rank {d} gets {rows} rows of {row_bytes} bytes, "
                                f"{need} bytes in all, more than this host's memory ({have} bytes); nothing was "
                                "allocated")


def _align(n, a):
    return (n + a - 1) // a * a


class AllToAllStrategy:
    """One per Buffer when DEEP_USE_MODE=alltoall. Collective calls: every rank, same order."""

    def __init__(self, pg, num_nvl_bytes, num_rdma_bytes, low_latency_mode, enable_shrink, receive_order,
                 ranks_per_node, timeout_s):
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.num_ranks = dist.get_world_size(pg)
        pre = f"epcomm[rank {self.rank}] Buffer: "
        if enable_shrink:
            raise InvalidUsageError(pre + "argument: enable_shrink=True is not supported by epcomm")
        if receive_order not in _ORDERS:
            raise InvalidUsageError(f"receive_order: expected one of expert_major, rank_major, got '{receive_order}'")
        self.receive_order = receive_order
        # Reported like the engine's; the waits themselves are bounded by the process group's own timeout.
        self.timeout_s = float(timeout_s if timeout_s is not None else os.environ.get("EPCOMM_TIMEOUT_S") or 100)
        self.num_nvl_bytes = num_nvl_bytes or (64 << 20)
        self.seq = 0
        self.destroyed = False
        self.failed = None
        sizes = [None] * self.num_ranks
        all_gather_object(sizes, (num_nvl_bytes, num_rdma_bytes, ranks_per_node), group=pg)
        for i, name in enumerate(("num_nvl_bytes", "num_rdma_bytes", "ranks_per_node")):
            values = [s[i] for s in sizes]
            if len(set(values)) > 1:
                listing = ", ".join(f"rank {r} = {v}" for r, v in enumerate(values))
                raise InvalidUsageError(pre + f"mismatch: ranks disagree on {name}: {listing}")
        P, R = ranks_per_node, self.num_ranks
        if P < 0 or (P > 0 and R % P):
            raise InvalidUsageError(pre + f"argument: ranks_per_node = {P} must divide the number of ranks {R}")
        self.num_nodes = R // P if P > 0 else 1
        if self.num_nodes > 1:
            raise InvalidUsageError(
                pre + f"argument: the ranks span {self.num_nodes} nodes; internode dispatch (UCX) is not "
                "supported yet: run all ranks on one host with ranks_per_node = 0 or = the number of ranks")

    def node_of(self, r):
        if not 0 <= r < self.num_ranks:
            raise InvalidUsageError(f"node_of: rank {r} is out of range [0, {self.num_ranks})")
        return 0

    # ---- helpers ---------------------------------------------------------------------------------------

    def _usable(self, op):
        if self.destroyed:
            raise InvalidUsageError(f"epcomm[rank {self.rank}] {op}: argument: the Buffer was destroyed")
        if self.failed:
            raise AbortedError(f"epcomm[rank {self.rank}] {op}: the Buffer failed earlier: {self.failed}")

    def _collective(self, fn, *args, **kwargs):
        """Runs a torch.distributed collective; its failures become epcomm errors and fail the Buffer."""
        try:
            return fn(*args, group=self.pg, **kwargs)
        except RuntimeError as e:
            text = str(e)
            cls = TimeoutError if "timed out" in text.lower() or "timeout" in text.lower() else AbortedError
            err = cls(f"{self.prefix}{'timeout' if cls is TimeoutError else 'peer failure'}: "
                      f"the process group failed: {text.strip()}")
            self.failed = str(err)
            raise err from None

    def _exchange(self, header, failure):
        """All-gathers the headers; raises this rank's own failure, a peer's (Aborted), or a mismatch."""
        header = dict(header, seq=self.seq, failed=None if failure is None else str(failure.error))
        headers = [None] * self.num_ranks
        self._collective(all_gather_object, headers, header)
        if failure is not None:
            raise failure.error
        for r, h in enumerate(headers):
            if h["failed"] is not None:
                raise AbortedError(f"{self.prefix}peer failure: rank {r} failed this call: {h['failed']}")
        for key, name in (("op", "the operation"), ("order", "receive_order"), ("handle_id", "handle (dispatch id)"),
                          ("E", "num_experts"), ("K", "num_topk"), ("H", "hidden"), ("dtype", "payload dtype"),
                          ("mode", "quant_mode"), ("has_topk", "presence of topk_idx"),
                          ("has_weights", "presence of weights"), ("alignment", "expert_alignment"),
                          ("chunk0", "config.num_max_nvl_chunked_send_tokens"),
                          ("chunk1", "config.num_max_nvl_chunked_recv_tokens"),
                          ("chunk2", "config.num_max_rdma_chunked_send_tokens"),
                          ("chunk3", "config.num_max_rdma_chunked_recv_tokens")):
            values = [h.get(key) for h in headers]
            if any(v != values[0] for v in values):
                fmt = (lambda v: "true" if v else "false") if key.startswith("has_") else str
                listing = ", ".join(f"rank {r} = {fmt(v)}" for r, v in enumerate(values))
                raise InvalidUsageError(f"{self.prefix}mismatch: ranks disagree on {name}: {listing}")
        return headers

    def _begin(self, op):
        self._usable(op)
        self.seq += 1
        self.prefix = f"epcomm[rank {self.rank}] {op}#{self.seq}: "

    def _wrap_local(self, fn):
        """Runs local validation; an epcomm error becomes a _Failed to publish, with the call's prefix."""
        try:
            return fn(), None
        except _Failed as f:
            return None, _Failed(type(f.error)(self.prefix + str(f.error)))
        except Error as e:  # raised by the C++ quantizer
            return None, _Failed(type(e)(self.prefix + str(e)))
        except Exception as e:  # a malformed argument torch itself rejected
            return None, _Failed(InvalidUsageError(f"{self.prefix}argument: {type(e).__name__}: {e}"))

    @staticmethod
    def _chunks(config):
        cfg = config if config is not None else _C.Buffer.get_dispatch_config(1)
        cfg.validate()
        return {"chunk0": cfg.num_max_nvl_chunked_send_tokens, "chunk1": cfg.num_max_nvl_chunked_recv_tokens,
                "chunk2": cfg.num_max_rdma_chunked_send_tokens, "chunk3": cfg.num_max_rdma_chunked_recv_tokens}

    @staticmethod
    def _stats(t, name, R):
        if t is None:
            return
        _check_dtype(t, name, ("i64", "i32"))
        _check_shape(t, name, [R], "[num_ranks]")
        _check_contiguous(t, name)

    @staticmethod
    def _add_stats(t, start):
        if t is None:
            return
        us = int((time.monotonic() - start) * 1e6)
        if t.dtype == torch.int64:
            t.add_(us)
        else:
            t.copy_(torch.clamp(t.to(torch.int64) + us, max=2**31 - 1).to(torch.int32))

    def _a2a(self, rows, send_splits, recv_splits):
        """Moves uint8 records: rows [sum(send_splits), B] -> [sum(recv_splits), B]."""
        width = int(rows.shape[1])
        out = torch.empty(sum(recv_splits), width, dtype=torch.uint8)
        if self.num_ranks == 1:
            out.copy_(rows)
            return out
        self._collective(kept_collective, dist.all_to_all_single, out, rows.contiguous(), list(recv_splits),
                         list(send_splits))
        return out

    # ---- get_dispatch_layout ---------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, num_experts):
        self._usable("get_dispatch_layout")
        pre = f"epcomm[rank {self.rank}] get_dispatch_layout: "
        R = self.num_ranks
        try:
            if topk_idx is None or topk_idx.dim() != 2:
                _arg("topk_idx: expected a 2-D [num_tokens, num_topk] tensor, got "
                     + ("None" if topk_idx is None else _shape(topk_idx)))
            _check_dtype(topk_idx, "topk_idx", ("i64", "i32"))
            if not topk_idx.is_contiguous():
                _arg("topk_idx must be contiguous")
            if num_experts < 1 or num_experts % R:
                _arg(f"num_experts = {num_experts} must be a positive multiple of the number of ranks {R}")
            V = _normalize_ids(topk_idx, num_experts)
        except _Failed as f:
            raise type(f.error)(pre + str(f.error)) from None
        per_rank, per_expert, in_rank = _layout(V, num_experts, R)
        return per_rank, None, per_expert, in_rank

    # ---- dispatch ----------------------------------------------------------------------------------------

    def fail_call(self, op, message):
        """Fails the collective call `op` ("dispatch", "cached_dispatch" or "combine") on every rank: this rank
        publishes a failed header (the peers raise AbortedError quoting it) and raises InvalidUsageError."""
        name = {"dispatch": "dispatch", "cached_dispatch": "dispatch(cached)", "combine": "combine"}[op]
        self._begin(name)
        self._exchange({"op": name}, _Failed(InvalidUsageError(self.prefix + message)))

    def dispatch(self, a):
        handle = a["handle"]
        cached = handle is not None
        op = "dispatch(cached)" if cached else "dispatch"
        self._begin(op)
        start = time.monotonic()
        if cached:
            prep, failure = self._wrap_local(lambda: self._prepare_cached(a))
        else:
            prep, failure = self._wrap_local(lambda: self._prepare_fresh(a))
        header = {"op": op}
        if prep is not None:
            header.update(prep["header"])
        headers = self._exchange(header, failure)
        if cached:
            return self._run_cached(prep, a, start)
        return self._run_fresh(prep, headers, a, start)

    def _prepare_common(self, a):
        R = self.num_ranks
        self._stats(a["dispatch_wait_recv_cost_stats"], "dispatch_wait_recv_cost_stats", R)
        if not 1 <= a["expert_alignment"] < _MAX_ROWS:
            _arg(f"expert_alignment: expected 1 to 2^31 - 1, got {a['expert_alignment']}")
        if a["num_worst_tokens"] < 0:
            _arg(f"num_worst_tokens: expected >= 0, got {a['num_worst_tokens']}")
        if a["num_worst_tokens"] >= _MAX_ROWS:
            _arg(f"num_worst_tokens = {a['num_worst_tokens']}, expected below 2^31 (a rank receives at most "
                 "2^31 - 1 rows)")
        return self._chunks(a["config"])

    def _prepare_cached(self, a):
        chunks = self._prepare_common(a)
        h = a["handle"]
        if not isinstance(h, AllToAllHandle) or h.owner is not self:
            _arg("handle: it belongs to another Buffer or to a destroyed one")
        for name in ("topk_idx", "topk_weights", "num_tokens_per_rank", "num_tokens_per_rdma_rank",
                     "is_token_in_rank", "num_tokens_per_expert"):
            if a[name] is not None:
                _arg(f"{name} must be None for a cached dispatch (handle given)")
        if a["expert_alignment"] not in (1, h.expert_alignment):
            _arg(f"expert_alignment = {a['expert_alignment']} differs from the handle's {h.expert_alignment}")
        if a["num_worst_tokens"] not in (0, h.num_worst_tokens):
            _arg(f"num_worst_tokens = {a['num_worst_tokens']} differs from the handle's {h.num_worst_tokens}")
        if a["receive_order"] is not None and a["receive_order"] != h.receive_order:
            _arg(f"receive_order = {a['receive_order']} differs from the handle's {h.receive_order}")
        f, payload = _payload(a["x"])
        if int(a["x"]["data"].shape[0]) != h.num_tokens:
            _arg(f"x: rows must equal handle.num_tokens: {int(a['x']['data'].shape[0])} vs {h.num_tokens}")
        header = dict(chunks, order=h.receive_order, handle_id=h.dispatch_id, E=h.num_experts, K=h.num_topk,
                      H=f.hidden, dtype=f.data_name, mode=f.mode or "plain", has_topk=h.has_topk,
                      has_weights=h.has_topk, alignment=h.expert_alignment)
        return {"header": header, "format": f, "payload": payload, "handle": h}

    def _prepare_fresh(self, a):
        R = self.num_ranks
        chunks = self._prepare_common(a)
        order = a["receive_order"] if a["receive_order"] is not None else self.receive_order
        if order not in _ORDERS:
            _arg(f"receive_order: expected one of expert_major, rank_major, got '{order}'")
        f, payload = _payload(a["x"])
        T = int(a["x"]["data"].shape[0])
        ti, tw = a["topk_idx"], a["topk_weights"]
        if (ti is None) != (tw is None):
            _arg(f"topk_idx and topk_weights must be given together (got topk_idx {'None' if ti is None else 'given'}"
                 f", topk_weights {'None' if tw is None else 'given'})")
        npe = a["num_tokens_per_expert"]
        if npe is None:
            _arg("num_tokens_per_expert: required for a fresh dispatch, got None")
        if npe.dim() != 1:
            _arg(f"num_tokens_per_expert: expected a 1-D [num_experts] tensor, got shape {_shape(npe)}")
        _check_dtype(npe, "num_tokens_per_expert", ("i32", "i64"))
        E = int(npe.shape[0])
        if E < 1 or E % R:
            _arg(f"num_experts = {E} (from num_tokens_per_expert) must be a positive multiple of the number of "
                 f"ranks {R}")
        if E > _MAX_EXPERTS:  # the engine's limit (docs/design.md, "Known limits"): the same calls fail here
            _arg(f"num_experts = {E} exceeds the supported maximum {_MAX_EXPERTS}")
        K = 0
        if ti is not None:
            if ti.dim() != 2 or int(ti.shape[0]) != T:
                _arg(f"topk_idx: shape {_shape(ti)}, expected [{T}, num_topk] = [num_tokens, num_topk]")
            _check_dtype(ti, "topk_idx", ("i64", "i32"))
            _check_contiguous(ti, "topk_idx")
            K = int(ti.shape[1])
            if not 1 <= K <= 1024:
                _arg(f"topk_idx: num_topk = {K}, expected 1 to 1024")
            _check_shape(tw, "topk_weights", [T, K], "[num_tokens, num_topk]")
            _check_dtype(tw, "topk_weights", ("f32",))
            _check_contiguous(tw, "topk_weights")
            V = _normalize_ids(ti, E)
            per_rank, per_expert, in_rank = _layout(V, E, R)
            self._check_equal(npe, "num_tokens_per_expert", per_expert)
            if a["num_tokens_per_rank"] is not None:
                t = a["num_tokens_per_rank"]
                _check_shape(t, "num_tokens_per_rank", [R], "[num_ranks]")
                _check_dtype(t, "num_tokens_per_rank", ("i32", "i64"))
                self._check_equal(t, "num_tokens_per_rank", per_rank)
            if a["is_token_in_rank"] is not None:
                t = a["is_token_in_rank"]
                _check_shape(t, "is_token_in_rank", [T, R], "[num_tokens, num_ranks]")
                _check_dtype(t, "is_token_in_rank", ("bool", "i32"))
                _check_contiguous(t, "is_token_in_rank")
                self._check_equal(t, "is_token_in_rank", in_rank)
            if a["num_tokens_per_rdma_rank"] is not None:
                t = a["num_tokens_per_rdma_rank"]
                _check_shape(t, "num_tokens_per_rdma_rank", [1], "[num_nodes]")
                _check_dtype(t, "num_tokens_per_rdma_rank", ("i32", "i64"))
                self._check_equal(t, "num_tokens_per_rdma_rank", torch.tensor([int(in_rank.any(dim=1).sum())]))
            weights = tw.to(torch.float32)
            pairs = per_expert.to(torch.int64)
        else:
            if order != "rank_major":
                _arg("receive_order = expert_major requires topk_idx and topk_weights (got None); DeepEP's contract "
                     "without top-k is receive_order = rank_major: pass receive_order=\"rank_major\", or in Python create "
                     "the Buffer with flavor=\"deepep\" (or set EPCOMM_FLAVOR=deepep)")
            itr = a["is_token_in_rank"]
            if itr is None:
                _arg("is_token_in_rank: required without topk_idx, got None")
            _check_shape(itr, "is_token_in_rank", [T, R], "[num_tokens, num_ranks]")
            _check_dtype(itr, "is_token_in_rank", ("bool", "i32"))
            _check_contiguous(itr, "is_token_in_rank")
            vals = itr.to(torch.int64)
            bad = ((vals != 0) & (vals != 1)).nonzero()
            if bad.numel():
                t, d = int(bad[0, 0]), int(bad[0, 1])
                _arg(f"is_token_in_rank[{t}, {d}] = {int(vals[t, d])}, expected 0 or 1")
            in_rank = vals.to(torch.bool)
            per_rank = in_rank.sum(dim=0).to(torch.int32)
            if a["num_tokens_per_rank"] is not None:
                t = a["num_tokens_per_rank"]
                _check_shape(t, "num_tokens_per_rank", [R], "[num_ranks]")
                _check_dtype(t, "num_tokens_per_rank", ("i32", "i64"))
                self._check_equal(t, "num_tokens_per_rank (column sums of is_token_in_rank)", per_rank)
            pairs = npe.to(torch.int64)
            bad = ((pairs < 0) | (pairs >= 2**31)).nonzero()
            if bad.numel():
                e = int(bad[0, 0])
                _arg(f"num_tokens_per_expert[{e}] = {int(pairs[e])}, expected 0 to 2^31 - 1")
            V = torch.empty(T, 0, dtype=torch.int64)
            weights = torch.empty(T, 0, dtype=torch.float32)
        header = dict(chunks, order=order, handle_id=0, E=E, K=K, H=f.hidden, dtype=f.data_name,
                      mode=f.mode or "plain", has_topk=K > 0, has_weights=K > 0, alignment=a["expert_alignment"],
                      worst=a["num_worst_tokens"], T=T, pairs=pairs.tolist(), tokens=per_rank.to(torch.int64).tolist())
        return {"header": header, "format": f, "payload": payload, "order": order, "E": E, "K": K, "T": T,
                "V": V, "weights": weights, "in_rank": in_rank,
                "idx_dtype": ti.dtype if ti is not None else None}

    @staticmethod
    def _check_equal(t, name, expected):
        got = t.reshape(-1).to(torch.int64)
        exp = expected.reshape(-1).to(torch.int64)
        diff = (got != exp).nonzero()
        if diff.numel():
            i = int(diff[0, 0])
            _arg(f"{name} disagrees with topk_idx at index {i}: got {int(got[i])}, topk_idx gives {int(exp[i])}")

    def _run_fresh(self, p, headers, a, start):
        R, me = self.num_ranks, self.rank
        E, K, T, order, f = p["E"], p["K"], p["T"], p["order"], p["format"]
        L = E // R
        align = a["expert_alignment"]
        pairs = [h["pairs"] for h in headers]  # [s][e]
        tokens = [h["tokens"] for h in headers]  # [s][d]

        # Receive plans of every rank (the worst-case check needs them all), then this rank's.
        def plan(d):
            cnt = [sum(pairs[s][d * L + j] for s in range(R)) for j in range(L)]
            lst = [_align(c, align) for c in cnt]
            n = sum(lst) if order == "expert_major" else sum(tokens[s][d] for s in range(R))
            return cnt, lst, n

        for d in range(R):
            worst = headers[d]["worst"]
            n = plan(d)[2]
            if worst > 0 and n > worst:
                raise InvalidUsageError(f"{self.prefix}capacity: receiving rank {d} gets N = {n} rows but its "
                                        f"num_worst_tokens = {worst}; nothing was sent (rows are never truncated)")
            # Every rank sees every receiver's rows, so these raise on every rank, before anything is allocated.
            if n >= _MAX_ROWS:
                raise InvalidUsageError(f"{self.prefix}argument: rank {d} would receive {n} rows, more than "
                                        "2^31 - 1")
            _check_memory(self.prefix, d, max(n, worst), f.row_bytes + 12 + K * 12)
        cnt, lst, N = plan(me)
        rows = a["num_worst_tokens"] if a["num_worst_tokens"] > 0 else N

        # Send side: records grouped by destination, in the order the destination stores them.
        V, w, in_rank = p["V"], p["weights"], p["in_rank"]
        if order == "expert_major":
            flat = V.reshape(-1)
            f_idx = (flat >= 0).nonzero().reshape(-1)
            key = flat[f_idx] * max(T * K, 1) + f_idx
            f_idx = f_idx[torch.argsort(key)]
            send_t, send_k = torch.div(f_idx, K, rounding_mode="floor"), f_idx % K
            send_splits = [sum(pairs[me][d * L: (d + 1) * L]) for d in range(R)]
            meta = torch.stack([send_t.to(torch.int32), send_k.to(torch.int32)], dim=1)
            meta = torch.cat([_row_bytes(meta, len(send_t)),
                              _row_bytes(w.reshape(-1)[f_idx].contiguous(), len(send_t))], dim=1)
            recv_splits = [sum(pairs[s][me * L: (me + 1) * L]) for s in range(R)]
        else:
            dt = in_rank.t().nonzero()  # (d, t), ordered by d then t
            send_t = dt[:, 1]
            send_d = dt[:, 0]
            send_k = torch.full_like(send_t, -1)
            send_splits = [tokens[me][d] for d in range(R)]
            recv_splits = [tokens[s][me] for s in range(R)]
            parts = [_row_bytes(send_t.to(torch.int32).reshape(-1, 1), len(send_t))]
            if K > 0:
                Vs = V[send_t]
                local = torch.where((Vs >= 0) & (torch.div(Vs, L, rounding_mode="floor") == send_d[:, None]),
                                    Vs - send_d[:, None] * L, torch.full_like(Vs, -1))
                ws = torch.where(local >= 0, w[send_t], torch.zeros_like(w[send_t]))
                parts += [_row_bytes(local.to(torch.int32).contiguous(), len(send_t)),
                          _row_bytes(ws.contiguous(), len(send_t))]
            meta = torch.cat(parts, dim=1)
        records = torch.cat([p["payload"][send_t], meta], dim=1)
        incoming = self._a2a(records, send_splits, recv_splits)

        # Receive side: the row of each incoming record.
        src_rank = torch.cat([torch.full((n,), s, dtype=torch.int32) for s, n in enumerate(recv_splits)]) \
            if recv_splits else torch.empty(0, dtype=torch.int32)
        rb = f.row_bytes
        meta_in = incoming[:, rb:]
        in_t = _view(meta_in[:, 0:4], torch.int32).reshape(-1)
        if order == "expert_major":
            in_k = _view(meta_in[:, 4:8], torch.int32).reshape(-1)
            in_w = _view(meta_in[:, 8:12], torch.float32).reshape(-1)
            recv_pos = torch.empty(len(in_t), dtype=torch.int64)
            recv_j = torch.empty(len(in_t), dtype=torch.int64)
            block = 0
            offs = [0] * R  # next incoming record of each source
            base = [sum(recv_splits[:s]) for s in range(R)]
            for j in range(L):
                row = block
                for s in range(R):
                    n = pairs[s][me * L + j]
                    i0 = base[s] + offs[s]
                    recv_pos[i0: i0 + n] = torch.arange(row, row + n)
                    recv_j[i0: i0 + n] = j
                    offs[s] += n
                    row += n
                block += lst[j]
        else:
            recv_pos = torch.arange(len(in_t), dtype=torch.int64)
            in_k = torch.full_like(in_t, -1)

        out_bytes = torch.zeros(rows, rb, dtype=torch.uint8)
        out_bytes[recv_pos] = incoming[:, :rb]
        data, data_name, scales, scale_name = _split_payload(f, out_bytes)
        src = torch.full((3, rows), -1, dtype=torch.int32)
        src[0, recv_pos] = src_rank
        src[1, recv_pos] = in_t
        src[2, recv_pos] = in_k
        recv_idx = recv_w = None
        if K > 0:
            recv_idx = torch.full((rows, K), -1, dtype=p["idx_dtype"])
            recv_w = torch.zeros(rows, K, dtype=torch.float32)
            if order == "expert_major":
                recv_idx[recv_pos, in_k.to(torch.int64)] = recv_j.to(recv_idx.dtype)
                recv_w[recv_pos, in_k.to(torch.int64)] = in_w
            else:
                recv_idx[recv_pos] = _view(meta_in[:, 4: 4 + 4 * K], torch.int32).reshape(-1, K) \
                    .to(recv_idx.dtype)
                recv_w[recv_pos] = _view(meta_in[:, 4 + 4 * K: 4 + 8 * K], torch.float32).reshape(-1, K)
        rows_per_source = [int(n) for n in recv_splits]
        handle = AllToAllHandle(
            owner=self, receive_order=order, num_tokens=T, num_topk=K, num_experts=E, num_recv_rows=N,
            num_rows=rows, num_recv_tokens_per_expert=lst, num_recv_pairs_per_expert=cnt,
            num_recv_rows_per_source=rows_per_source, recv_src_rank=src[0].clone(), recv_src_token=src[1].clone(),
            recv_src_slot=src[2].clone(), dispatch_id=self.seq, expert_alignment=align,
            num_worst_tokens=a["num_worst_tokens"], has_topk=K > 0, V=V, weights=w, in_rank=in_rank, hidden=f.hidden,
            send_t=send_t, send_k=send_k, send_splits=send_splits, recv_splits=recv_splits, recv_pos=recv_pos,
            num_rows_per_source_and_receiver=torch.tensor(
                [[sum(pairs[s][d * L: (d + 1) * L]) if order == "expert_major" else tokens[s][d] for d in range(R)]
                 for s in range(R)], dtype=torch.int64).reshape(R, R),
            is_token_in_rank=in_rank)
        self._add_stats(a["dispatch_wait_recv_cost_stats"], start)
        out_list = [] if a["num_worst_tokens"] > 0 else list(lst)
        return data, data_name, scales, scale_name, recv_idx, recv_w, out_list, handle

    def _run_cached(self, p, a, start):
        h, f = p["handle"], p["format"]
        incoming = self._a2a(p["payload"][h.send_t], h.send_splits, h.recv_splits)
        out_bytes = torch.zeros(h.num_rows, f.row_bytes, dtype=torch.uint8)
        out_bytes[h.recv_pos] = incoming
        data, data_name, scales, scale_name = _split_payload(f, out_bytes)
        self._add_stats(a["dispatch_wait_recv_cost_stats"], start)
        return data, data_name, scales, scale_name, None, None, None, None

    # ---- combine -----------------------------------------------------------------------------------------

    def combine(self, a):
        self._begin("combine")
        start = time.monotonic()
        prep, failure = self._wrap_local(lambda: self._prepare_combine(a))
        header = {"op": "combine"}
        if prep is not None:
            header.update(prep["header"])
        self._exchange(header, failure)
        return self._run_combine(prep, a, start)

    def _prepare_combine(self, a):
        R = self.num_ranks
        h = a["handle"]
        if h is None:
            _arg("handle: required, got None")
        if not isinstance(h, AllToAllHandle) or h.owner is not self:
            _arg("handle: it belongs to another Buffer or to a destroyed one")
        chunks = self._chunks(a["config"])
        self._stats(a["combine_send_cost_stats"], "combine_send_cost_stats", R)
        x = a["x"]
        if x is None or x.dim() != 2:
            _arg("x: expected a 2-D [handle.num_rows, hidden] tensor, got " + ("None" if x is None else _shape(x)))
        if int(x.shape[0]) != h.num_rows:
            _arg(f"x: shape {_shape(x)}, expected [{h.num_rows}, hidden] = [handle.num_rows, hidden]")
        if int(x.shape[1]) < 1:
            _arg(f"x: hidden (columns) must be >= 1, got shape {_shape(x)}")
        _check_dtype(x, "x", ("bf16", "f16", "f32"))
        _check_contiguous(x, "x")
        T, K = h.num_tokens, h.num_topk
        tw = a["topk_weights"]
        w_used = recv_g = None
        if h.receive_order == "expert_major":
            w = h.weights
            if tw is not None:
                _check_shape(tw, "topk_weights", [T, K], "[num_tokens, num_topk] on the origin rank (expert_major)")
                _check_dtype(tw, "topk_weights", ("f32",))
                _check_contiguous(tw, "topk_weights")
                w = tw
            w_used = torch.where(h.V >= 0, w, torch.zeros_like(w))
        elif tw is not None:
            if K == 0:
                _arg("topk_weights: the dispatch had no top-k, so combine takes no topk_weights")
            _check_shape(tw, "topk_weights", [h.num_rows, K],
                         "[handle.num_rows, num_topk] on the receiving rank (rank_major)")
            _check_dtype(tw, "topk_weights", ("f32",))
            _check_contiguous(tw, "topk_weights")
            recv_g = tw
        biases = []
        for b, name in a["biases"]:
            _check_shape(b, name, [T, int(x.shape[1])], "[num_tokens, hidden]")
            if b.dtype != x.dtype:
                _arg(f"{name}: dtype {_dtype_name(b)}, expected x's dtype {_dtype_name(x)}")
            _check_contiguous(b, name)
            biases.append(b)
        header = dict(chunks, order=h.receive_order, handle_id=h.dispatch_id, E=h.num_experts, K=K,
                      H=int(x.shape[1]), dtype=_dtype_name(x), mode="plain", has_topk=h.has_topk,
                      has_weights=recv_g is not None, alignment=h.expert_alignment)
        return {"header": header, "handle": h, "w_used": w_used, "recv_g": recv_g, "biases": biases}

    def _run_combine(self, p, a, start):
        h, x = p["handle"], a["x"]
        R, T, K = self.num_ranks, h.num_tokens, h.num_topk
        Hc = int(x.shape[1])
        # Expert side: every received row goes back to its origin, in the order it arrived.
        back_rows = _row_bytes(x, int(x.shape[0]))[h.recv_pos]
        g = p["recv_g"]
        if g is not None:
            back_rows = torch.cat([back_rows, _row_bytes(g, int(g.shape[0]))[h.recv_pos]], dim=1)
        back = self._a2a(back_rows, h.recv_splits, h.send_splits)
        xb = _view(back[:, : Hc * x.element_size()], x.dtype).reshape(-1, Hc).to(torch.float32)

        # Origin: canonical fp32 reduction (docs/normal-mode.md), one tensor op per addition.
        acc = torch.zeros(T, Hc, dtype=torch.float32)
        combined_w = None
        if h.receive_order == "expert_major":
            w_used = p["w_used"]
            for k in range(K):
                sel = (h.send_k == k).nonzero().reshape(-1)
                c = torch.zeros(T, Hc, dtype=torch.float32)
                t = h.send_t[sel]
                c[t] = w_used[t, k].reshape(-1, 1) * xb[sel]
                acc = acc + c
            combined_w = w_used.clone()
        else:
            wacc = torch.zeros(T, K, dtype=torch.float32) if g is not None else None
            if g is not None:
                gb = _view(back[:, Hc * x.element_size():], torch.float32).reshape(-1, K)
            begin = 0
            for d in range(R):
                n = h.send_splits[d]
                t = h.send_t[begin: begin + n]
                c = torch.zeros(T, Hc, dtype=torch.float32)
                c[t] = xb[begin: begin + n]
                acc = acc + c
                if g is not None:
                    cw = torch.zeros(T, K, dtype=torch.float32)
                    cw[t] = gb[begin: begin + n]
                    wacc = wacc + cw
                begin += n
            combined_w = wacc
        for b in p["biases"]:
            acc = acc + b.to(torch.float32)
        out = acc.to(x.dtype)
        nan = torch.tensor([_CANONICAL_NAN[x.dtype]], dtype=_INT_OF[x.dtype]).view(x.dtype)
        out = torch.where(torch.isnan(out), nan, out)
        self._add_stats(a["combine_send_cost_stats"], start)
        return out, combined_w

    def destroy(self):
        self.destroyed = True
