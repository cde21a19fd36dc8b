"""Error mapping on 2 spawned ranks (docs/normal-mode.md): mismatches and peer failures raise on every rank with the
engine's messages and leave the Buffer usable; worst-case overflow; asynchronous errors through wait();
a rank that skips a call times out (epcomm.TimeoutError, also the builtin) and fails the Buffer; capacity
below the minimum; the GIL is released while a call waits for a peer."""
import threading
import time

import pytest
import torch
import torch.distributed as dist

import epcomm
from harness import spawn, use_mode


def expect(exc_type, match, fn, *args, **kwargs):
    with pytest.raises(exc_type) as info:
        fn(*args, **kwargs)
    assert match in str(info.value), f"rank {dist.get_rank()}: {match!r} not in {str(info.value)!r}"
    return info.value


def inputs(rank, T=6, H=16, K=2, E=4, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(-1, E, (T, K), generator=g)
    ws = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g).to(dtype)
    return x, ids, ws


def dispatch(buf, x, ids, ws, E=4, **kw):
    per_expert = torch.bincount(ids[(ids >= 0) & (ids < E)], minlength=E).to(torch.int32)
    return buf.dispatch(x, topk_idx=ids, topk_weights=ws, num_tokens_per_expert=per_expert, **kw)


def collective_errors(buf, rank):
    """Errors every strategy reports the same way; each is followed by a call that succeeds."""
    x, ids, ws = inputs(rank)
    # Cross-rank mismatch: every rank raises InvalidUsage naming the parameter and each rank's value.
    xm = inputs(rank, H=16 if rank == 0 else 8)[0]
    e = expect(epcomm.InvalidUsageError, "mismatch: ranks disagree on hidden: rank 0 = 16, rank 1 = 8",
               dispatch, buf, xm, ids, ws)
    assert isinstance(e, ValueError)
    dispatch(buf, x, ids, ws)
    # A rank whose own validation fails: it raises the argument error, its peer raises Aborted quoting it.
    if rank == 1:
        expect(epcomm.InvalidUsageError, "topk_weights: shape [6, 1], expected [6, 2] = [num_tokens, num_topk]",
               dispatch, buf, x, ids, ws[:, :1].contiguous())
    else:
        expect(epcomm.AbortedError, "peer failure: rank 1 failed this call", dispatch, buf, x, ids, ws)
    # Out-of-range expert ids (on every rank).
    bad = ids.clone()
    bad[1, 1] = 7
    expect(epcomm.InvalidUsageError, "topk_idx[1, 1] = 7 is out of range [0, 4)", dispatch, buf, x, bad, ws)
    # Worst-case overflow raises on every rank before data moves.
    expect(epcomm.InvalidUsageError, "capacity: receiving rank", dispatch, buf, x, ids, ws, num_worst_tokens=1)
    # Mismatched receive order.
    expect(epcomm.InvalidUsageError, "mismatch: ranks disagree on receive_order", dispatch, buf, x, ids, ws,
           receive_order="rank_major" if rank else "expert_major")
    # The Buffer is still usable, and the handle works.
    recv_x, _, _, _, handle, _ = dispatch(buf, x, ids, ws)
    out, _, _ = buf.combine(recv_x, handle)
    assert out.shape == x.shape
    # A handle of another Buffer is rejected.
    return handle


def async_error(buf, rank, handle):
    """A combine whose mismatch is found after the call returned surfaces through event.wait()."""
    H = 16 if rank == 0 else 12
    y = torch.zeros(handle.num_rows, H, dtype=torch.bfloat16)
    _, _, event = buf.combine(y, handle, async_finish=True)
    for _ in range(2):  # wait() rethrows every time
        expect(epcomm.InvalidUsageError, "mismatch: ranks disagree on hidden", event.wait)
    with pytest.raises(epcomm.InvalidUsageError):
        with event:
            pass


def gil_released(buf, rank):
    """While rank 0 waits inside dispatch for rank 1 (which sleeps first), another Python thread runs."""
    x, ids, ws = inputs(rank)
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
        dispatch(buf, x, ids, ws)
        return
    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.05)
    before = ticks[0]
    t0 = time.monotonic()
    dispatch(buf, x, ids, ws)
    waited = time.monotonic() - t0
    stop.set()
    th.join()
    assert waited > 0.5, f"dispatch returned after {waited:.2f} s although rank 1 slept"
    assert ticks[0] - before > 100, f"only {ticks[0] - before} ticks of the other thread while dispatch waited"


def timeout_and_failed_buffer(rank):
    """Rank 1 skips a dispatch: rank 0 times out naming it; its Buffer is failed afterwards."""
    buf = epcomm.Buffer(dist.group.WORLD, timeout_s=2)
    x, ids, ws = inputs(rank)
    dispatch(buf, x, ids, ws)
    if rank == 0:
        e = expect(epcomm.TimeoutError, "still waiting for rank 1", dispatch, buf, x, ids, ws)
        assert isinstance(e, TimeoutError) and "timeout" in str(e)
        expect(epcomm.AbortedError, "the Buffer failed earlier", dispatch, buf, x, ids, ws)
    buf.destroy()
    dist.barrier()


def capacity(rank):
    """A segment one byte below the minimum for a call's record raises naming the minimum; the minimum works."""
    x, ids, ws = inputs(rank, H=64)
    minimum = epcomm.min_nvl_bytes(64 * 2, 2, 2)
    small = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=minimum - 1)
    expect(epcomm.InvalidUsageError, "capacity: num_nvl_bytes", dispatch, small, x, ids, ws)
    small.destroy()
    ok = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=minimum)
    recv_x, _, _, _, handle, _ = dispatch(ok, x, ids, ws)  # moves in many rounds
    out, _, _ = ok.combine(recv_x, handle)
    assert out.shape == x.shape
    ok.destroy()


def errors_job(rank, world):
    for mode in ("shm", "alltoall"):
        use_mode(mode)
        buf = epcomm.Buffer(dist.group.WORLD)
        handle = collective_errors(buf, rank)
        other = epcomm.Buffer(dist.group.WORLD)
        x, ids, ws = inputs(rank)
        expect(epcomm.InvalidUsageError, "handle", other.combine, torch.zeros(handle.num_rows, 16,
                                                                              dtype=torch.bfloat16), handle)
        other.destroy()
        if mode == "shm":
            async_error(buf, rank, handle)
            gil_released(buf, rank)
        buf.destroy()
        expect(epcomm.InvalidUsageError, "destroyed", dispatch, buf, x, ids, ws)
    use_mode("shm")
    capacity(rank)
    timeout_and_failed_buffer(rank)


def test_errors_2_ranks():
    spawn(errors_job, 2)
