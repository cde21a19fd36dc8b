"""epcomm.Group: the ranks of a torch.distributed process group, as the C++ core sees them. The core only
uses the group to exchange connection data while Buffers are created (all-gather of bytes, barrier); it
never carries payload."""
import torch
import torch.distributed as dist

from . import _C


def _all_gather_bytes(pg, data):
    n = dist.get_world_size(pg)
    # A tensor that owns its memory: one viewing a Python bytearray would need the interpreter when gloo frees
    # it, which may happen on one of gloo's threads while or after the interpreter shuts down (abort at exit).
    mine = torch.empty(len(data), dtype=torch.uint8)
    if data:
        mine.numpy()[:] = memoryview(data).cast("B")
    out = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(out, mine, group=pg)
    return b"".join(t.numpy().tobytes() for t in out)


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
            rank, size, lambda b: _all_gather_bytes(pg, b), lambda: dist.barrier(group=pg)
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
