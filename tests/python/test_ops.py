"""epcomm.ops on spawned gloo ranks: dispatch_v2 + combine_v2 (+ combine_add_rms_norm) round trips with
identity experts, checked against a plain-torch model of docs/distribute-v2.md built from every
rank's inputs (all-gathered); a shared-expert layout, a 2 EP x 2 TP grid, and error mapping."""
import pytest
import torch
import torch.distributed as dist

import epcomm
from epcomm import _C, ops

from harness import gather, spawn

H, BS, K = 16, 3, 2


def _inputs(rank, E, bs=BS, k=K):
    """Tagged tokens: x[t] = (rank, t, small dyadics), so every product and sum below is exact."""
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randint(-8, 9, (bs, H), generator=g).float() / 4
    x[:, 0], x[:, 1] = rank, torch.arange(bs)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(bs)]).to(torch.int32).reshape(bs, k)
    w = (torch.randint(1, 4, (bs, k), generator=g).float() / 4).reshape(bs, k)
    return x.bfloat16(), ids, w


def _reference(xs, idss, ws, p, W, L, shared_ranks=0):
    """docs/distribute-v2.md for ep rank p (one shared expert with R = shared_ranks replicas when shared_ranks > 0)."""
    rows, tags, scales, cnt = [], [], [], []
    if p >= shared_ranks:
        for el in range(L):
            e = (p - shared_ranks) * L + el
            for r in range(W):
                for t in range(xs[r].shape[0]):
                    for k in range(idss[r].shape[1]):
                        if int(idss[r][t, k]) == e:
                            rows.append(xs[r][t]), tags.append((r, t, k)), scales.append(float(ws[r][t, k]))
                cnt.append(len(rows))
        nums = [cnt[el * W + W - 1] - (cnt[el * W - 1] if el else 0) for el in range(L)]
    else:
        R = shared_ranks
        for r in range(W):
            if r % R == p % R:
                for t in range(xs[r].shape[0]):
                    rows.append(xs[r][t]), tags.append((r, t, idss[r].shape[1])), scales.append(1.0)
            cnt.append(len(rows))
        nums = [len(rows)]
    return rows, tags, scales, cnt, nums


class _CoreAllocates:
    """_C with dispatch_v2's outputs allocated by the C++ operator instead of as torch tensors."""

    def __getattr__(self, name):
        return getattr(_C, name)

    def moe_dispatch_v2(self, ep, tp, kw):
        return _C.moe_dispatch_v2(ep, tp, dict(kw, core_allocates=True))


def _dispatch(*args, **kw):
    """dispatch_v2 with torch-allocated outputs, checked against the operator's own allocation (docs/distribute-v2.md
    shapes, dtypes, zero tails): the same call twice."""
    out = ops.npu_moe_distribute_dispatch_v2(*args, **kw)
    ops._C = _CoreAllocates()
    try:
        core = ops.npu_moe_distribute_dispatch_v2(*args, **kw)
    finally:
        ops._C = _C
    for i, (a, b) in enumerate(zip(out, core)):
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a, b), f"output {i}"
    return out


def _check_dispatch(out, ref, W, tp=0):
    expand_x, dyn, assist, nums, ep_counts, tp_counts, expand_scales = out
    rows, tags, scales, cnt, ref_nums = ref
    n = len(rows)
    assert expand_x.dtype == torch.bfloat16 and expand_x.shape[1] == H and expand_x.shape[0] >= n
    if n:
        assert torch.equal(expand_x[:n], torch.stack(rows))
        assert torch.equal(expand_scales[:n], torch.tensor(scales))
    assert assist.dtype == torch.int32 and assist[: 3 * n].tolist() == [v for tag in tags for v in tag]
    assert nums.dtype == torch.int64 and ep_counts.dtype == torch.int32
    if tp == 0:
        assert torch.count_nonzero(expand_x[n:]) == 0
        assert nums.tolist() == ref_nums and ep_counts.tolist() == cnt and tp_counts.numel() == 0
    return n


def _ep_body(rank, world):
    L = 2
    E = world * L
    pg = dist.group.WORLD
    x, ids, w = _inputs(rank, E)
    xs, idss, ws = zip(*gather((x, ids, w)))
    out = _dispatch(x, ids, pg, world, rank, E, expert_scales=w)
    _check_dispatch(out, _reference(xs, idss, ws, rank, world, L), world)
    expand_x, _, assist, _, ep_counts, _, _ = out
    # Identity experts: expand_x goes straight back; torch_npu's positional order, expand_idx alias.
    y = ops.npu_moe_distribute_combine_v2(expand_x, ids, None, ep_counts, w, pg, world, rank, E, expand_idx=assist)
    ref = (x.float() * w.sum(1, keepdim=True)).bfloat16()
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    # The registered-name form, and combine_add_rms_norm against torch's rms norm.
    ops.register_group("ep_world", pg)
    residual = torch.full((BS, 1, H), 0.5).bfloat16()
    gamma = torch.linspace(0.5, 2, H).bfloat16()
    yn, rstd, xn = ops.npu_moe_distribute_combine_add_rms_norm(
        expand_x, ids, assist, ep_counts, w, residual, gamma, "ep_world", world, rank, E, norm_eps=1e-6)
    xf = x.float() * w.sum(1, keepdim=True) + 0.5
    assert torch.equal(xn, xf.bfloat16().reshape(BS, 1, H))
    ref_rstd = torch.rsqrt(xf.pow(2).mean(1) + 1e-6).reshape(BS, 1, 1)
    assert rstd.dtype == torch.float32 and torch.allclose(rstd, ref_rstd, rtol=1e-5)
    ref_y = (xf * ref_rstd.reshape(BS, 1)).bfloat16().float() * gamma.float()
    assert yn.shape == (BS, 1, H) and torch.allclose(yn.float(), ref_y.reshape(BS, 1, H), rtol=2e-2, atol=1e-2)
    # Error mapping: bad arguments on every rank raise InvalidUsageError naming the parameter, and the
    # group stays usable afterwards.
    with pytest.raises(epcomm.InvalidUsageError, match="expert_ids"):
        ops.npu_moe_distribute_dispatch_v2(x, ids.long(), pg, world, rank, E)
    with pytest.raises(epcomm.InvalidUsageError, match="ep_world_size"):
        ops.npu_moe_distribute_dispatch_v2(x, ids, pg, world + 1, rank, E)
    out = ops.npu_moe_distribute_dispatch_v2(x, ids, "ep_world", world, rank, E, expert_scales=w)
    _check_dispatch(out, _reference(xs, idss, ws, rank, world, L), world)
    # Quantized dispatch (default y_dtype) and global_bs: torch-allocated outputs match the operator's own.
    for mode in (2, 3, 4):
        _dispatch(x, ids, pg, world, rank, E, quant_mode=mode)
    _dispatch(x, ids, pg, world, rank, E, global_bs=2 * BS * world)


def _shared_body(rank, world):
    L = 2
    E = (world - 1) * L  # rank 0 holds the shared expert
    pg = dist.group.WORLD
    x, ids, w = _inputs(rank, E, k=1)
    xs, idss, ws = zip(*gather((x, ids, w)))
    kw = dict(shared_expert_num=1, shared_expert_rank_num=1)
    out = _dispatch(x, ids, pg, world, rank, E, expert_scales=w, **kw)
    _check_dispatch(out, _reference(xs, idss, ws, rank, world, L, shared_ranks=1), world)
    expand_x, _, assist, _, ep_counts, _, _ = out
    y = ops.npu_moe_distribute_combine_v2(expand_x, ids, assist, ep_counts, w, pg, world, rank, E, **kw)
    assert torch.equal(y, (x.float() * (w.sum(1, keepdim=True) + 1)).bfloat16())  # shared rows unweighted


def _tp_body(rank, world):
    # world rank w = ep rank w // 2, tp rank w % 2; EP group j = ranks with tp index j, TP pairs (2i, 2i+1).
    T, W = 2, world // 2
    ep_pgs = [dist.new_group([j + T * i for i in range(W)]) for j in range(T)]
    tp_pgs = [dist.new_group([T * i + j for j in range(T)]) for i in range(W)]
    ep, tp = rank // T, rank % T
    E = W  # L = 1
    x, ids, w = _inputs(rank, E, k=1)
    everyone = gather((x, ids, w))
    mine = [everyone[T * i + tp] for i in range(W)]
    peers = [everyone[T * i + 1 - tp] for i in range(W)]
    own = _reference(*zip(*mine), ep, W, 1)
    peer = _reference(*zip(*peers), ep, W, 1)
    out = _dispatch(x, ids, ep_pgs[tp], W, ep, E, expert_scales=w, group_tp=tp_pgs[ep],
                                             tp_world_size=T, tp_rank_id=tp)
    n_own = _check_dispatch(out, own, W, tp=1)
    expand_x, _, assist, nums, ep_counts, tp_counts, _ = out
    n_peer = len(peer[0])
    if n_peer:
        assert torch.equal(expand_x[n_own:n_own + n_peer], torch.stack(peer[0]))
    assert torch.count_nonzero(expand_x[n_own + n_peer:]) == 0
    assert tp_counts.tolist() == ([n_own, n_peer] if tp == 0 else [n_peer, n_own])
    assert nums.tolist() == [n_own + n_peer] and ep_counts.tolist() == own[3] + peer[3]
    # Identity experts: the TP reduce adds the peer's copy of each own row, so x comes back doubled.
    y = ops.npu_moe_distribute_combine_v2(expand_x, ids, assist, ep_counts, w, ep_pgs[tp], W, ep, E,
                                          tp_send_counts=tp_counts, group_tp=tp_pgs[ep], tp_world_size=T,
                                          tp_rank_id=tp)
    assert torch.equal(y, (x.float() * 2 * w.sum(1, keepdim=True)).bfloat16())


@pytest.mark.parametrize("world", [2, 4])
def test_ep_round_trip(world):
    spawn(_ep_body, world)


def test_shared_expert():
    spawn(_shared_body, 2)


def test_tp_grid():
    spawn(_tp_body, 4)


def _arena_body(rank, world):
    # One node: dispatch_v2's outputs come from the group's output arena, so the senders push (the copy
    # counters say so); a group whose context has no arena stages and pulls the same rows.
    L = 2
    E = world * L
    pg = dist.group.WORLD
    no_arena = dist.new_group(list(range(world)))
    ops.init_group_context(no_arena, num_output_arena_bytes=0)
    x, ids, w = _inputs(rank, E)
    before = ops.group_copy_counters(pg)
    pushed = ops.npu_moe_distribute_dispatch_v2(x, ids, pg, world, rank, E, quant_mode=2)
    after = ops.group_copy_counters(pg)
    assert after["dispatch_pushed_tokens"] - before["dispatch_pushed_tokens"] == BS
    assert after["dispatch_staged_tokens"] == before["dispatch_staged_tokens"]
    staged = ops.npu_moe_distribute_dispatch_v2(x, ids, no_arena, world, rank, E, quant_mode=2)
    c = ops.group_copy_counters(no_arena)
    assert (c["dispatch_staged_tokens"], c["dispatch_pushed_tokens"]) == (BS, 0)
    for i, (a, b) in enumerate(zip(pushed, staged)):  # zero tails included
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a, b), f"output {i}"
    with pytest.raises(epcomm.InvalidUsageError, match="num_output_arena_bytes"):
        ops.init_group_context(dist.new_group(list(range(world))), num_output_arena_bytes=-2)
    with pytest.raises(epcomm.InvalidUsageError, match="num_output_reserve_bytes"):
        ops.init_group_context(dist.new_group(list(range(world))), num_output_reserve_bytes=-1)
    # A reserved arena: the same pushed rows.
    reserved = dist.new_group(list(range(world)))
    ops.init_group_context(reserved, num_output_reserve_bytes=1 << 20)
    again = ops.npu_moe_distribute_dispatch_v2(x, ids, reserved, world, rank, E, quant_mode=2)
    assert ops.group_copy_counters(reserved)["dispatch_pushed_tokens"] == BS
    assert all(torch.equal(a, b) for a, b in zip(again, pushed))


def test_output_arena_push():
    spawn(_arena_body, 2)
