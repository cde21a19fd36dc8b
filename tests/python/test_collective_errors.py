"""Argument errors that the Python layer or the binding finds before the engine sees the call (wrong types,
unknown names, ints out of range, a rebuilt handle) are collective, on 2 spawned ranks and in both strategies:
the rank with the bad argument raises InvalidUsageError naming it, its peer raises AbortedError naming that
rank, and the next call of both ranks pairs correctly (checked against the rows each rank sent). Before, the
bad rank consumed no call number, so its next call was paired with the peer's failed one and returned another
call's data."""
import pytest
import torch
import torch.distributed as dist

import epcomm
from harness import spawn, use_mode

T, H, K, E = 6, 32, 2, 4


def inputs(rank, call):
    g = torch.Generator().manual_seed(1000 * rank + call)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ws = torch.rand(T, K, generator=g)
    # Rows that say where they come from: rank, call and token in the first three columns.
    x = torch.randn(T, H, generator=g)
    x[:, 0], x[:, 1], x[:, 2] = rank, call, torch.arange(T)
    return x.to(torch.bfloat16), ids, ws


def dispatch(buf, x, ids, ws, **kw):
    per_expert = torch.bincount(torch.as_tensor(ids).reshape(-1), minlength=E).to(torch.int32)
    args = dict(topk_idx=ids, topk_weights=ws, num_tokens_per_expert=per_expert)
    args.update(kw)
    return buf.dispatch(x, **args)


def checked_round_trip(buf, rank, call):
    """A valid dispatch and combine whose rows must come from this very call of every rank."""
    x, ids, ws = inputs(rank, call)
    recv_x, _, _, _, handle, _ = dispatch(buf, x, ids, ws)
    src_rank, src_token = handle.recv_src_rank.long(), handle.recv_src_token.long()
    assert (recv_x[:, 1].float() == call).all(), f"rank {rank}: rows of another call: {recv_x[:, 1].tolist()}"
    assert torch.equal(recv_x[:, 0].float().long(), src_rank) and torch.equal(recv_x[:, 2].float().long(), src_token)
    y, _, _ = buf.combine(recv_x, handle)
    want = (x.float() * ws.sum(1, keepdim=True)).to(torch.bfloat16)
    assert (y.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max(), f"rank {rank}: combine"


def bad_dispatch_args(x, ids, ws):
    """(what the message must name, keyword changes) applied on rank 1 only."""
    return [
        ("argument: x: expected a torch.Tensor or a (data, scales) tuple, got NoneType", dict(x=None)),
        ("argument: x: expected a torch.Tensor or a (data, scales) tuple, got str", dict(x="tokens")),
        ("topk_weights", dict(topk_weights=ws.double())),
        ("quant_mode", dict(quant_mode="int7")),
        ("argument: receive_order: expected a string or None, got int", dict(receive_order=5)),
        ("argument: expert_alignment: expected a 64-bit integer, got 18446744073709551616",
         dict(expert_alignment=2 ** 64)),
        ("argument: num_worst_tokens: expected an int, got str", dict(num_worst_tokens="many")),
        ("argument: topk_idx: expected a torch.Tensor or None, got list", dict(topk_idx=ids.tolist())),
        ("argument: config: expected an epcomm.Config or None, got dict", dict(config={})),
    ]


def job(rank, world, mode):
    use_mode(mode)
    buf = epcomm.Buffer(dist.group.WORLD, timeout_s=30)
    call = 0
    checked_round_trip(buf, rank, call)
    x, ids, ws = inputs(rank, 0)
    for name, change in bad_dispatch_args(x, ids, ws):
        kw = dict(x=x, ids=ids, ws=ws)
        if rank == 1:
            kw.update({{"topk_idx": "ids", "topk_weights": "ws"}.get(k, k): v for k, v in change.items()})
        if rank == 1:
            with pytest.raises(epcomm.InvalidUsageError) as info:
                dispatch(buf, **kw)
            assert name in str(info.value), f"{name!r} not in {info.value}"
        else:
            with pytest.raises(epcomm.AbortedError) as info:
                dispatch(buf, **kw)
            assert "rank 1" in str(info.value), str(info.value)
        call += 1
        checked_round_trip(buf, rank, call)
    # Combine: a handle rebuilt as a plain tuple, and a missing x.
    recv_x, _, _, _, handle, _ = dispatch(buf, *inputs(rank, 99))
    for name, args in (("argument: handle: expected the Handle returned by dispatch, got tuple",
                        (recv_x, tuple(handle))),
                       ("argument: x: expected a torch.Tensor, got NoneType", (None, handle))):
        if rank == 1:
            with pytest.raises(epcomm.InvalidUsageError) as info:
                buf.combine(*args)
            assert name in str(info.value), f"{name!r} not in {info.value}"
        else:
            with pytest.raises(epcomm.AbortedError, match="rank 1"):
                buf.combine(recv_x, handle)
    buf.combine(recv_x, handle)
    checked_round_trip(buf, rank, 1000)
    buf.destroy()


@pytest.mark.parametrize("mode", ["shm", "alltoall"])
def test_argument_errors_are_collective(mode):
    spawn(job, 2, mode)
