"""Low-latency (LL) mode: the pieces both flavors share (docs/low-latency.md).

Buffer.low_latency_dispatch / low_latency_combine hand their arguments to the flavor's module: ll_deepep
(flavor "deepep": 3-D [L, R*T_max, H] outputs on the shared-memory engine) or ll_ascend (flavor "ascend": 2-D
rows of dispatch_v2 / combine_v2). This module holds what is common: the receive hook, the size hint and the
checks of the arguments every LL call shares."""
import threading

import torch

from ._errors import InvalidUsageError, int_arg

#: Largest top-k of an LL call (low-latency.md §2).
MAX_TOPK = 32


class RecvHook:
    """The `hook` an LL call returns. Calling it waits until the call's results are defined (they are not
    before, with return_recv_hook=True) and raises the call's error, every time it is called; calling it again
    after success returns at once. A call made without return_recv_hook returns a hook that is already done."""

    __slots__ = ("_wait", "_done", "_error", "_lock")

    def __init__(self, wait=None):
        self._wait = wait
        self._done = wait is None
        self._error = None
        self._lock = threading.Lock()

    def __call__(self):
        with self._lock:
            if not self._done:
                try:
                    self._wait()
                except BaseException as e:  # noqa: BLE001 - kept and raised on every call
                    self._error = e
                self._done = True
                self._wait = None
        if self._error is not None:
            raise self._error

    def is_complete(self):
        return self._done

    def __repr__(self):
        return f"RecvHook(complete={self._done})"


class NamedItems(tuple):
    """A tuple whose items also have names (ITEMS, set by each flavor's handle class): DeepEP code unpacks
    the handle positionally, the Ascend port's reads its fields by name."""

    ITEMS = ()

    def __getattr__(self, name):
        try:
            return self[type(self).ITEMS.index(name)]
        except ValueError:
            raise AttributeError(f"{type(self).__name__} has no item {name!r} (items: "
                                 f"{', '.join(type(self).ITEMS)})") from None


def hook_flags(async_finish, return_recv_hook, prefix):
    """Both flags at once raise (low-latency.md §3.1)."""
    async_finish, return_recv_hook = bool(async_finish), bool(return_recv_hook)
    if async_finish and return_recv_hook:
        raise InvalidUsageError(f"{prefix}argument: async_finish and return_recv_hook: expected at most one of "
                                f"them to be True, got both")
    return async_finish, return_recv_hook


def check_ll_shape(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts, prefix):
    """T_max >= 1, H >= 1, R >= 1, E >= 1 with E % R == 0; returns them as ints."""
    t_max = int_arg(num_max_dispatch_tokens_per_rank, "num_max_dispatch_tokens_per_rank", prefix=prefix)
    hidden = int_arg(hidden, "hidden", prefix=prefix)
    num_ranks = int_arg(num_ranks, "num_ranks", prefix=prefix)
    num_experts = int_arg(num_experts, "num_experts", prefix=prefix)
    for v, name in ((t_max, "num_max_dispatch_tokens_per_rank"), (hidden, "hidden"), (num_ranks, "num_ranks"),
                    (num_experts, "num_experts")):
        if v < 1:
            raise InvalidUsageError(f"{prefix}argument: {name}: expected >= 1, got {v}")
    if num_experts % num_ranks:
        raise InvalidUsageError(f"{prefix}argument: num_experts: expected a multiple of the {num_ranks} ranks, "
                                f"got {num_experts} (num_experts % num_ranks = {num_experts % num_ranks})")
    return t_max, hidden, num_ranks, num_experts


def check_tokens(x, topk_idx, t_max, num_experts, rank, prefix, check_ids=True):
    """x [T, H] bf16 and topk_idx [T, K] i64/i32 (1 <= K <= 32, ids < E, no expert twice in a row), T <= T_max.
    Returns (T, H, K). Negative ids mean "no expert"."""
    if not isinstance(x, torch.Tensor):
        raise InvalidUsageError(f"{prefix}argument: x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise InvalidUsageError(f"{prefix}argument: x: expected a [num_tokens, hidden] torch.bfloat16 tensor, got "
                                f"{list(x.shape)} {x.dtype}")
    if not isinstance(topk_idx, torch.Tensor):
        raise InvalidUsageError(f"{prefix}argument: topk_idx: expected a torch.Tensor, got "
                                f"{type(topk_idx).__name__}")
    T, H = int(x.shape[0]), int(x.shape[1])
    if topk_idx.dtype not in (torch.int64, torch.int32) or topk_idx.dim() != 2 or int(topk_idx.shape[0]) != T:
        raise InvalidUsageError(f"{prefix}argument: topk_idx: expected a [{T}, num_topk] torch.int64 (or int32) "
                                f"tensor, got {list(topk_idx.shape)} {topk_idx.dtype}")
    K = int(topk_idx.shape[1])
    if not 1 <= K <= MAX_TOPK:
        raise InvalidUsageError(f"{prefix}argument: topk_idx: expected 1 <= num_topk <= {MAX_TOPK}, got {K}")
    if T > t_max:
        raise InvalidUsageError(f"{prefix}argument: x: rank {rank} has {T} tokens, more than "
                                f"num_max_dispatch_tokens_per_rank = {t_max}")
    if check_ids and T:
        check_topk_ids(topk_idx, num_experts, rank, prefix)
    return T, H, K


def check_topk_ids(topk_idx, num_experts, rank, prefix):
    """Every id < E; no expert listed twice in one row (an LL output holds R*T_max rows per expert)."""
    ids = topk_idx.to(torch.int64)
    big = ids >= num_experts
    if bool(big.any()):
        t, k = (int(v) for v in big.nonzero()[0])
        raise InvalidUsageError(f"{prefix}argument: topk_idx[{t}, {k}] = {int(ids[t, k])} on rank {rank} is out "
                                f"of range [0, {num_experts})")
    if ids.shape[1] < 2:
        return
    ordered, order = ids.sort(dim=1)
    dup = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(dup.any()):
        t, i = (int(v) for v in dup.nonzero()[0])
        k1, k2 = sorted((int(order[t, i]), int(order[t, i + 1])))
        raise InvalidUsageError(f"{prefix}argument: topk_idx: rank {rank}, token {t} lists expert "
                                f"{int(ids[t, k1])} twice (slots {k1} and {k2}); low-latency mode needs the "
                                f"experts of one token to be distinct")


def check_stats(t, name, length, dtypes, prefix):
    """A statistics tensor: None, or [length] of one of `dtypes` (accumulated in place)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.dim() != 1 or int(t.shape[0]) != length:
        got = f"{list(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        want = " or ".join(str(d) for d in dtypes)
        raise InvalidUsageError(f"{prefix}argument: {name}: expected a [{length}] {want} tensor, got {got}")
    return t



def size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
    """Buffer.get_low_latency_rdma_size_hint: room for two calls in flight of E * T_max rows each at the
    widest row any format sends, and at least the internode lanes' minimum for any node partition
    (docs/low-latency.md, "Sizes")."""
    from . import _C

    t_max, hidden, num_ranks, num_experts = check_ll_shape(num_max_dispatch_tokens_per_rank, hidden, num_ranks,
                                                           num_experts, "get_low_latency_rdma_size_hint: ")
    return _C.Buffer.get_low_latency_rdma_size_hint(t_max, hidden, num_ranks, num_experts)
