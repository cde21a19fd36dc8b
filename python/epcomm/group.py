"""epcomm.Group: the ranks of a torch.distributed process group, as the C++ core sees them. The core only
uses the group to exchange connection data while Buffers are created (all-gather of bytes, barrier); it
never carries payload."""
import collections
import pickle
import struct

import torch
import torch.distributed as dist

from . import _C


# The last exchanges' gloo work objects, with their tensors. gloo's worker thread drops its reference to a
# collective's work a little after the call returns, and the work may hold tensors whose Python objects torch
# keeps alive: freeing those needs the interpreter, and a thread that asks for it while the interpreter shuts
# down is ended by CPython, which aborts the process ("terminate called without an active exception"). Held
# here, the works are freed by this thread: when they leave this queue, or in the interpreter's own teardown.
# Only the last few are needed (a work is freed by gloo's thread soon after it completes); each entry keeps its
# tensors alive until it leaves, so the queue is short: the alltoall strategy passes payload tensors here.
_recent_exchanges = collections.deque(maxlen=8)


def kept_collective(fn, *args, **kwargs):
    """Runs the torch.distributed collective fn(*args, **kwargs) with async_op=True and waits for it; its work
    and arguments stay in _recent_exchanges, so that this thread frees them (see above)."""
    work = fn(*args, async_op=True, **kwargs)
    _recent_exchanges.append((work, args))
    work.wait()


def _all_gather_bytes(pg, data):
    """Equal-length byte strings of every rank, concatenated in rank order."""
    n = dist.get_world_size(pg)
    # A tensor that owns its memory (one viewing a Python bytearray would need the interpreter to be freed).
    mine = torch.empty(len(data), dtype=torch.uint8)
    if data:
        mine.numpy()[:] = memoryview(data).cast("B")
    out = [torch.empty_like(mine) for _ in range(n)]
    kept_collective(dist.all_gather, out, mine, group=pg)
    return b"".join(t.numpy().tobytes() for t in out)


def all_gather_object(out, obj, group=None):
    """torch.distributed.all_gather_object's contract (out[r] = rank r's obj, pickled), through
    kept_collective: a length exchange, then the pickles padded to the longest."""
    pg = group if group is not None else dist.group.WORLD
    n = dist.get_world_size(pg)
    data = pickle.dumps(obj)
    lengths = _all_gather_bytes(pg, struct.pack("<q", len(data)))
    sizes = [struct.unpack_from("<q", lengths, 8 * r)[0] for r in range(n)]
    width = max(sizes)
    blob = _all_gather_bytes(pg, data + bytes(width - len(data)))
    for r in range(n):
        out[r] = pickle.loads(blob[r * width:r * width + sizes[r]])


def _barrier(pg):
    kept_collective(dist.barrier, group=pg)


class Group:
    """Wraps a torch.distributed ProcessGroup (gloo; None means the default group). Creating one is
    collective over the group."""

    def __init__(self, process_group=None):
        if isinstance(process_group, Group):
            process_group = process_group.process_group
        if not dist.is_available() or not dist.is_initialized():
            raise _invalid("Group: torch.distributed is not initialized (call init_process_group first)")
        pg = process_group if process_group is not None else dist.group.WORLD
        self.process_group = pg
        rank, size = dist.get_rank(pg), dist.get_world_size(pg)
        if rank < 0:
            raise _invalid("Group: this process is not a member of the given process group")
        self._c = _C.Group.from_callbacks(
            rank, size, lambda b: _all_gather_bytes(pg, b), lambda: _barrier(pg)
        )

    @property
    def rank(self):
        return self._c.rank

    @property
    def size(self):
        return self._c.size

    def __repr__(self):
        return f"epcomm.Group(rank={self.rank}, size={self.size})"


def _invalid(message):
    from ._errors import InvalidUsageError

    return InvalidUsageError(message)


def as_group(group):
    """An epcomm.Group for a Group, a ProcessGroup or None (the default group)."""
    return group if isinstance(group, Group) else Group(group)
