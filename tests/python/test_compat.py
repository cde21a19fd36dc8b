"""Flavors, positional handles and the Ascend port's switches (docs/python.md), on 2 and 4 spawned ranks, against a
brute-force model written from docs/python.md: every rank all-gathers every rank's top-k ids and handles, and the
model derives each positional item from them. send_head is checked against where the rows really landed (the
receivers' recv_src_rank / recv_src_token), rank_prefix_matrix by slicing recv_x with it as DeepEP's tests do."""
import os

import pytest
import torch
import torch.distributed as dist

import epcomm
from harness import gather, spawn, use_mode

T, H, K = 7, 16, 2


def inputs(rank, E, call=0, drop=True):
    g = torch.Generator().manual_seed(100 * rank + call)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if drop:
        ids[torch.rand(T, K, generator=g) < 0.2] = -1
    ws = torch.rand(T, K, generator=g)
    x = torch.randn(T, H, generator=g)
    x[:, 0], x[:, 1] = rank, torch.arange(T)
    return x.to(torch.bfloat16), ids, ws


def model_in_rank(ids, E, R):
    L = E // R
    in_rank = torch.zeros(ids.shape[0], R, dtype=torch.bool)
    for d in range(R):
        in_rank[:, d] = ((ids >= 0) & (ids // L == d)).any(1)
    return in_rank


def model_rows(all_ids, E, R, order):
    """rows[s][d]: rows rank d receives from rank s, PAD excluded (docs/python.md)."""
    L = E // R
    rows = torch.zeros(R, R, dtype=torch.int64)
    for s, ids in enumerate(all_ids):
        for d in range(R):
            if order == "rank_major":
                rows[s, d] = int(model_in_rank(ids, E, R)[:, d].sum())
            else:
                rows[s, d] = int(((ids >= 0) & (ids // L == d)).sum())
    return rows


def check_items(buf, handle, flavor, order, all_ids, ids, ws, E):
    R, me = buf.num_ranks, buf.rank
    assert len(handle) == (6 if flavor == "deepep" else 8)
    rows = model_rows(all_ids, E, R, order)
    rpm = handle[0]
    assert rpm.dtype == torch.int32 and torch.equal(rpm, rows.cumsum(0).to(torch.int32)), (rpm, rows)
    assert torch.equal(handle[1], rows[me].reshape(R, 1).to(torch.int32))
    assert torch.equal(handle[2], torch.zeros(R, 1, dtype=torch.int32))
    assert handle[3] is handle.recv_src_token or torch.equal(handle[3], handle.recv_src_token)
    in_rank = model_in_rank(ids, E, R)
    assert handle[4].dtype == (torch.bool if flavor == "deepep" else torch.int32)
    assert torch.equal(handle[4].bool(), in_rank)
    assert handle[5].shape == (T, R) and handle[5].dtype == torch.int32
    assert handle[-1] is handle[len(handle) - 1]
    if flavor == "ascend":
        assert handle[6] is ids and handle[7] is ws
    assert handle["topk_idx"] is ids and handle["topk_weights"] is ws
    with pytest.raises(IndexError, match="items"):
        handle[len(handle)]
    assert len(list(handle)) == len(handle) and len(handle[1:3]) == 2


def check_send_head(handle, send_heads, srcs, me):
    """send_head[t][d] == the index of token t's first row among the rows d got from this rank."""
    R = len(srcs)
    for d in range(R):
        src_rank, src_token = srcs[d]
        mine = src_token[src_rank == me].tolist()
        for t in range(T):
            got = int(send_heads[me][t, d])
            expect = mine.index(t) if t in mine else -1
            assert got == expect, f"send_head[{t}][{d}] = {got}, rows from rank {me} at rank {d}: {mine}"


def flavor_job(rank, world, flavor, mode):
    use_mode(mode)
    E = 2 * world
    buf = epcomm.Buffer(dist.group.WORLD, flavor=flavor)
    assert f"flavor={flavor!r}" in repr(buf)
    order = "rank_major" if flavor == "deepep" else "expert_major"
    assert buf.receive_order == order
    x, ids, ws = inputs(rank, E)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
    assert in_rank.dtype == (torch.bool if flavor == "deepep" else torch.int32)
    assert torch.equal(in_rank.bool(), model_in_rank(ids, E, world))
    recv_x, _, _, lst, handle, _ = buf.dispatch(x, topk_idx=ids, topk_weights=ws, num_tokens_per_expert=per_expert,
                                                num_tokens_per_rank=per_rank, is_token_in_rank=in_rank)
    all_ids = gather(ids)
    check_items(buf, handle, flavor, order, all_ids, ids, ws, E)
    srcs = gather((handle.recv_src_rank.clone(), handle.recv_src_token.clone()))
    send_heads = gather(handle[5].clone())
    check_send_head(handle, send_heads, srcs, rank)
    if flavor == "deepep":  # DeepEP's tests slice recv_x per source with rank_prefix_matrix[:, rank]
        ends = handle[0][:, rank].tolist()
        for s in range(world):
            block = recv_x[(ends[s - 1] if s else 0): ends[s]]
            assert (block[:, 0].float() == s).all(), f"rows of source {s}: {block[:, 0].tolist()}"
    # The handle passed back works; a tuple rebuilt from its items does not.
    y, _, _ = buf.combine(recv_x, handle)
    assert y.shape == x.shape
    with pytest.raises(epcomm.InvalidUsageError, match="expected the Handle returned by dispatch, got tuple"):
        buf.combine(recv_x, tuple(handle))
    cached = buf.dispatch(x, handle=handle)[0]
    assert torch.equal(cached, recv_x)
    if mode == "alltoall":
        assert handle["input_splits"] == [int(v) for v in model_rows(all_ids, E, world, order)[rank]]
        assert handle["output_splits"] == [int(v) for v in model_rows(all_ids, E, world, order)[:, rank]]
    buf.destroy()


@pytest.mark.parametrize("flavor", ["ascend", "deepep"])
@pytest.mark.parametrize("world", [2, 4])
def test_flavor_items(flavor, world):
    spawn(flavor_job, world, flavor, "shm")


@pytest.mark.parametrize("flavor", ["ascend", "deepep"])
def test_flavor_items_alltoall(flavor):
    spawn(flavor_job, 2, flavor, "alltoall")


def switches_job(rank, world):
    E = 4 * world
    x, ids, ws = inputs(rank, E, call=1)
    # The flavor from the environment; an explicit receive_order still wins.
    os.environ["EPCOMM_FLAVOR"] = "deepep"
    buf = epcomm.Buffer(dist.group.WORLD)
    assert buf.flavor == "deepep" and buf.receive_order == "rank_major"
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
    # DeepEP's first dispatch of its tests: no top-k, rows per (token, rank).
    recv_x, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                         num_tokens_per_expert=per_expert)
    assert recv_x.shape[0] == int(model_rows(gather(ids), E, world, "rank_major")[:, rank].sum())
    buf.destroy()
    os.environ.pop("EPCOMM_FLAVOR")
    b2 = epcomm.Buffer(dist.group.WORLD, receive_order="rank_major")
    assert b2.flavor == "ascend" and b2.receive_order == "rank_major"
    b2.destroy()
    buf = epcomm.Buffer(dist.group.WORLD)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
    # An ascend Buffer's error for a DeepEP-style dispatch names the flavor that fixes it.
    with pytest.raises(epcomm.InvalidUsageError, match='flavor="deepep"'):
        buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    base = buf.dispatch(x, topk_idx=ids, topk_weights=ws, num_tokens_per_expert=per_expert)
    counts = base[3]
    # MOE_EXPERT_TOKEN_NUMS_TYPE=0: inclusive prefix sums.
    os.environ["MOE_EXPERT_TOKEN_NUMS_TYPE"] = "0"
    summed = buf.dispatch(x, topk_idx=ids, topk_weights=ws, num_tokens_per_expert=per_expert)[3]
    assert summed == torch.tensor(counts).cumsum(0).tolist(), (summed, counts)
    os.environ["MOE_EXPERT_TOKEN_NUMS_TYPE"] = "2"
    with pytest.raises(epcomm.InvalidUsageError, match="MOE_EXPERT_TOKEN_NUMS_TYPE: expected an integer in"):
        buf.dispatch(x, topk_idx=ids, topk_weights=ws, num_tokens_per_expert=per_expert)
    os.environ.pop("MOE_EXPERT_TOKEN_NUMS_TYPE")
    # DEEPEP_NORMAL_LONG_SEQ_ROUND=3 (P = ceil(T / 3)): [3 * E] per-round counts, accepted by dispatch.
    os.environ["DEEPEP_NORMAL_LONG_SEQ_ROUND"] = "3"
    per_round = buf.get_dispatch_layout(ids, E)[2]
    P = -(-T // 3)
    assert per_round.shape == (3 * E,) and per_round.dtype == torch.int32
    for i in range(3):
        block = ids[i * P:(i + 1) * P]
        want = torch.bincount(block[block >= 0], minlength=E)
        assert torch.equal(per_round[i * E:(i + 1) * E].long(), want), (i, per_round, want)
    again = buf.dispatch(x, topk_idx=ids, topk_weights=ws, num_tokens_per_expert=per_round)
    assert torch.equal(again[0], base[0]) and again[3] == counts
    os.environ["DEEPEP_NORMAL_LONG_SEQ_PER_ROUND_TOKENS"] = "2"
    with pytest.raises(epcomm.InvalidUsageError, match="fewer than num_tokens = 7"):
        buf.get_dispatch_layout(ids, E)
    os.environ.pop("DEEPEP_NORMAL_LONG_SEQ_ROUND")
    os.environ.pop("DEEPEP_NORMAL_LONG_SEQ_PER_ROUND_TOKENS")
    buf.destroy()
    with pytest.raises(epcomm.InvalidUsageError, match="flavor: expected 'ascend', 'deepep' or None, got 'nvidia'"):
        epcomm.Buffer(dist.group.WORLD, flavor="nvidia")
    os.environ["EPCOMM_FLAVOR"] = "cuda"
    with pytest.raises(epcomm.InvalidUsageError, match="EPCOMM_FLAVOR: expected ascend or deepep, got 'cuda'"):
        epcomm.Buffer(dist.group.WORLD)
    os.environ.pop("EPCOMM_FLAVOR")
    # The Ascend port's normal_strategy="alltoall" selects the alltoall strategy.
    a2a = epcomm.Buffer(dist.group.WORLD, normal_strategy="alltoall", low_latency_strategy="default")
    assert a2a.mode == "alltoall"
    a2a.destroy()


def test_switches():
    spawn(switches_job, 2)
