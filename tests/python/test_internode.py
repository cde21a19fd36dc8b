"""The Python front across virtual nodes (docs/internode.md): the same problem on one node and on two nodes
of two ranks (ranks_per_node=2, UCX over TCP) gives bitwise identical dispatch outputs and handles, and a
rank_major combine of the fed-back rows equal bit for bit (sums of equal values do not depend on the
partition); expert_major combines agree to f32 rounding (docs/normal-mode.md: partials may associate differently).
The per-node handle items (send_rdma_head, offset_outer, count_outer) are checked against a loop reference over
the top-k ids and against where the rows landed; the items built from other ranks' routing
(recv_rdma_channel_prefix_matrix, recv_src_meta, send_nvl_head, offset_inner) against loops over every rank's
top-k ids or destinations."""
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import epcomm
from epcomm.handle import ASCEND_MAX_BATCH, Handle
from harness import gather, spawn


def _body(rank, world):
    E, K, H, T = 8 * world, 4, 96, 37 + 5 * rank
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64)
    ids[::7, 1] = -1
    ws = torch.rand(T, K, generator=g)
    one = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=4 << 20, ranks_per_node=world)
    two = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=4 << 20, num_rdma_bytes=16 << 20, ranks_per_node=2)
    assert one.num_nodes == 1 and two.num_nodes == world // 2, (one.num_nodes, two.num_nodes)
    per_rdma = two.get_dispatch_layout(ids, E)[1]
    assert per_rdma is not None and per_rdma.shape == (world // 2,), per_rdma
    for order in ("expert_major", "rank_major"):
        outs, handles = [], []
        for buf in (one, two):
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
            recv_x, recv_idx, recv_w, lst, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=ids, topk_weights=ws, receive_order=order)
            cx, cw, _ = buf.combine(recv_x, handle, topk_weights=recv_w if order == "rank_major" else None)
            outs.append((recv_x, recv_idx, recv_w, lst, handle.recv_src_rank, handle.recv_src_token, cx, cw))
            handles.append(handle)
        a, b = outs
        for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
            assert torch.equal(a[i].view(torch.uint8) if a[i].dtype == torch.bfloat16 else a[i],
                               b[i].view(torch.uint8) if b[i].dtype == torch.bfloat16 else b[i]), (order, name)
        assert a[3] == b[3], (order, "list")
        assert torch.equal(a[4], b[4]) and torch.equal(a[5], b[5]), (order, "handle sources")
        # The positional layouts across nodes (docs/python.md): items computed from the routing agree with the
        # one-node handle's (offset_inner, built from other ranks' routing: _forwarder_items_body).
        h1, h2 = handles
        assert len(h1) == 8 and len(h2) == 9 and h2.item_names[3:5] == ("topk_idx", "topk_weights")
        assert h2[3] is ids and h2[4] is ws and torch.equal(h2[1], h1[4]) and torch.equal(h2[2], h1[5])
        assert torch.equal(h2[0], h1[3])
        assert h2.item_names[5] == "offset_inner" and h2[5].shape == (world // 2, ASCEND_MAX_BATCH, E)
        gbl = torch.tensor(h1.num_recv_rows_per_source).cumsum(0).to(torch.int32)
        assert torch.equal(h2.item("recv_gbl_rank_prefix_sum"), gbl)
        assert torch.equal(h1[0][:, rank], gbl), "rank_prefix_matrix column vs the rows received per source"
        if order == "rank_major":
            assert torch.equal(a[6].view(torch.uint8), b[6].view(torch.uint8)), "rank_major combine differs"
            assert torch.equal(a[7], b[7]), "rank_major combined weights differ"
        else:
            assert torch.allclose(a[6].float(), b[6].float(), rtol=1e-2, atol=1e-2), "expert_major combine"
    two.destroy()
    one.destroy()
    # DeepEP's 10-item layout across nodes: its tests read handle[-4], the prefix over sources.
    deep = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=4 << 20, num_rdma_bytes=16 << 20, ranks_per_node=2,
                         flavor="deepep")
    per_rank, _, per_expert, in_rank, _ = deep.get_dispatch_layout(ids, E)
    assert in_rank.dtype == torch.bool
    recv_x, _, _, _, h, _ = deep.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                          num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=ws)
    assert len(h) == 10 and h.receive_order == "rank_major"
    assert torch.equal(h[-4], torch.tensor(h.num_recv_rows_per_source).cumsum(0).to(torch.int32))
    assert int(h[-4][-1]) == recv_x.shape[0]
    assert torch.equal(h[0], in_rank)
    node = torch.arange(world) // 2
    assert h[1].reshape(-1).tolist() == [int(in_rank[:, node == m].any(1).sum()) for m in range(world // 2)]
    deep.destroy()


@pytest.mark.parametrize("world", [4])
def test_two_virtual_nodes_match_one_node(world):
    spawn(_body, world, env={"UCX_TLS": "tcp"})


def _v2_body(rank, world):
    """distribute-v2 across two virtual nodes: every output of dispatch_v2 and combine_v2 equals the one-node
    run bit for bit (the reduction order is fixed by docs/normal-mode.md), and rows crossed the network."""
    from epcomm import ops

    E, K, H, bs = 2 * world, 3, 128, 29 + rank
    g = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(bs, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(bs)]).to(torch.int32)
    w = torch.rand(bs, K, generator=g)
    one = dist.new_group(list(range(world)))
    two = dist.new_group(list(range(world)))
    ops.init_group_context(one, segment_bytes=1 << 20, ranks_per_node=world)
    ops.init_group_context(two, segment_bytes=1 << 20, ranks_per_node=2, num_rdma_bytes=4 << 20)
    assert ops.group_network_counters(one)["num_nodes"] == 1
    assert ops.group_network_counters(two)["num_nodes"] == world // 2
    outs = []
    for pg in (one, two):
        d = ops.npu_moe_distribute_dispatch_v2(x, ids, pg, world, rank, E, expert_scales=w, quant_mode=2,
                                               global_bs=40 * world)
        # The "experts": random rows, the same on both runs (the dispatch outputs are equal).
        expert_out = torch.randn(d[0].shape, generator=torch.Generator().manual_seed(7 + rank)).to(torch.bfloat16)
        c = ops.npu_moe_distribute_combine_v2(expert_out, ids, d[2], d[4], w, pg, world, rank, E,
                                              comm_quant_mode=2, global_bs=40 * world)
        outs.append((d, c))
    (d1, c1), (d2, c2) = outs
    for i, (a, b) in enumerate(zip(d1, d2)):
        if a is None:
            assert b is None, i
            continue
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), f"dispatch output {i} differs"
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8)), "combine_v2 differs across nodes"
    assert ops.group_network_counters(two)["rows"] > 0, ops.group_network_counters(two)
    assert ops.group_network_counters(one)["rows"] == 0


@pytest.mark.parametrize("world", [4])
def test_v2_two_virtual_nodes_match_one_node(world):
    spawn(_v2_body, world, env={"UCX_TLS": "tcp"})


def _node_reference(ids, E, R, P):
    """send_rdma_head / offset_outer and count_outer of docs/python.md, by plain loops over the top-k ids:
    head[t][m] = t's index among the tokens that go to some rank of node m (-1 if none), count[t] = its nodes."""
    L, M = E // R, R // P
    head, count, sent = [], [], [0] * M
    for t in range(ids.shape[0]):
        nodes = sorted({(e // L) // P for e in ids[t].tolist() if e >= 0})
        row = [-1] * M
        for m in nodes:
            row[m] = sent[m]
            sent[m] += 1
        head.append(row)
        count.append(len(nodes))
    return head, count


def _node_items_body(rank, world):
    """The internode positional items computed from the routing (docs/python.md), on 2 virtual nodes of 2 ranks,
    for both flavors: against the loop reference, and against where the rows really landed (a token sent to
    node m reached some rank of m, once per token whatever its number of ranks there)."""
    P, E, K, H, T = 2, 4 * world, 3, 16, 23 + 3 * rank
    M = world // P
    g = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64)
    ids[torch.rand(T, K, generator=g) < 0.3] = -1
    ids[0] = -1  # a token sent nowhere
    ids[1] = torch.tensor([0, E // world, -1])  # two ranks of node 0: it crosses to node 0 once
    ws = torch.rand(T, K, generator=g)
    head, count = _node_reference(ids, E, world, P)
    for flavor in ("deepep", "ascend"):
        buf = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=4 << 20, num_rdma_bytes=16 << 20, ranks_per_node=P,
                            flavor=flavor)
        assert buf.num_nodes == M
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
        _, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                        num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=ws)
        if flavor == "deepep":
            srh = h[8]
            assert h.item_names[8] == "send_rdma_head" and h[8] is h.item("send_rdma_head")
            assert srh.shape == (T, M) and srh.dtype == torch.int32, (srh.shape, srh.dtype)
            assert srh.tolist() == head, (srh.tolist(), head)
            assert h[1].reshape(-1).tolist() == [max(col) + 1 for col in zip(*head)], "vs rdma_channel_prefix"
        else:
            outer, cnt = h[6], h[7]
            assert h.item_names[6:8] == ("offset_outer", "count_outer")
            assert outer.shape == (ASCEND_MAX_BATCH, M) and outer.dtype == torch.int32, (outer.shape, outer.dtype)
            assert cnt.shape == (ASCEND_MAX_BATCH,) and cnt.dtype == torch.int32, (cnt.shape, cnt.dtype)
            assert outer[:T].tolist() == head, (outer[:T].tolist(), head)
            assert cnt[:T].tolist() == count, (cnt[:T].tolist(), count)
            assert (outer[T:] == -1).all() and (cnt[T:] == 0).all(), "rows past the tokens: not sent"
            srh = outer[:T]
        # Where the rows landed: own tokens that reached node m's ranks, in token order, are head's column m.
        srcs = gather((h.recv_src_rank.clone(), h.recv_src_token.clone()))
        for m in range(M):
            landed = set()
            for d in range(m * P, (m + 1) * P):
                src_rank, src_token = srcs[d]
                landed |= set(src_token[src_rank == rank].tolist())
            column = srh[:, m].tolist()
            assert sorted(landed) == [t for t in range(T) if column[t] >= 0], (m, sorted(landed), column)
            assert [column[t] for t in sorted(landed)] == list(range(len(landed))), (m, column)
        buf.destroy()


@pytest.mark.parametrize("world", [4])
def test_node_items_from_routing(world):
    spawn(_node_items_body, world, env={"UCX_TLS": "tcp"})


def _rail_entries(dests, rank, P):
    """Per node m, the tokens of the rail peer there (local index of `rank`) that go to some rank of rank's
    node, in token order, each with its destination ranks there (a set of local indices)."""
    a, l = rank // P, rank % P
    out = []
    for m in range(len(dests) // P):
        entries = []
        for t, ds in enumerate(dests[m * P + l]):
            here = sorted(d - a * P for d in ds if d // P == a)
            if here:
                entries.append((t, here))
        out.append(entries)
    return out


def _forwarder_reference(dests, ids, rank, P, E, R):
    """The four items of docs/python.md built from other ranks' routing, by plain loops: dests[s][t] = the
    destination ranks of token t of rank s, ids[s] its top-k ids (None without top-k)."""
    a, l, M, L = rank // P, rank % P, R // P, E // R
    rails = _rail_entries(dests, rank, P)
    prefix = [len(e) for e in rails]
    cols = max(P, 8)
    nvl_head = []
    for entries in rails:
        seen = [0] * cols
        for _, here in entries:
            row = [-1] * cols
            for j in here:
                row[j] = seen[j]
                seen[j] += 1
            nvl_head.append(row)
    inner = None
    if ids[0] is not None:
        rows = max([4096] + [len(ids[m * P + l]) for m in range(M)])
        inner = [[[-1] * E for _ in range(rows)] for _ in range(M)]
        for m in range(M):
            X = ids[m * P + l].tolist()
            for e in range(E):
                node = (e // L) // P
                if m != a and node != a:
                    continue  # only this node's experts in another rail peer's slab
                before = sum(1 for e2 in range(node * P * L, e) for row in X if e2 in row)
                seen = 0
                for t, row in enumerate(X):
                    if e in row:
                        inner[m][t][e] = before + seen
                        seen += 1
    return prefix, nvl_head, inner


def _forwarder_items_body(rank, world, variant):
    """recv_rdma_channel_prefix_matrix, recv_src_meta, send_nvl_head (DeepEP) and offset_inner (Ascend port) on
    2 virtual nodes, against the loop reference over every rank's routing. Variants: random top-k; "proxy":
    rank 0's tokens go only to rank 3, so its rail peer rank 2 receives nothing from it yet must read its
    windows; "windows": a small num_rdma_bytes, so the rail peers' tokens come in several windows; "no_topk":
    DeepEP's dispatch with is_token_in_rank alone."""
    P, E, K, H, T = 2, 4 * world, 3, 16, 37 + 5 * rank
    M, L = world // P, E // world
    g = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64)
    ids[torch.rand(T, K, generator=g) < 0.3] = -1
    ids[0] = -1
    if variant == "proxy" and rank == 0:
        ids = torch.where(ids >= 0, 3 * L + ids % L, ids)  # rank 3's experts only (distinct within a row)
        ids[:, 1:] = -1
    ws = torch.rand(T, K, generator=g)
    rdma = epcomm.min_rdma_bytes(H * 2, K, world, P) * 4 if variant == "windows" else 16 << 20
    flavors = ("deepep",) if variant == "no_topk" else ("deepep", "ascend")
    for flavor in flavors:
        buf = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=4 << 20, num_rdma_bytes=rdma, ranks_per_node=P,
                            flavor=flavor)
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
        if variant == "no_topk":
            _, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert)
        else:
            _, _, _, _, h, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                            num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=ws)
        my_dests = [sorted({int(e) // L for e in row if e >= 0}) for row in ids]
        dests = gather(my_dests)
        all_ids = gather(None if variant == "no_topk" else ids.clone())
        prefix, nvl_head, inner = _forwarder_reference(dests, all_ids, rank, P, E, world)
        if flavor == "deepep":
            m_ = h.item("recv_rdma_channel_prefix_matrix")
            assert h[3] is m_ and m_.shape == (M, 1) and m_.dtype == torch.int32, (m_.shape, m_.dtype)
            assert m_.reshape(-1).tolist() == prefix, (m_.tolist(), prefix)
            head = h[9]
            assert h.item_names[9] == "send_nvl_head" and head.dtype == torch.int32
            assert head.shape == (sum(prefix), 8), (head.shape, prefix)
            assert head.tolist() == nvl_head, (head.tolist(), nvl_head)
            meta = h[7]
            assert h.item_names[7] == "recv_src_meta"
            assert meta.shape == (h.num_rows, 8) and meta.dtype == torch.uint8, (meta.shape, meta.dtype)
            pairs = meta.view(torch.int32).tolist()
            for row, (s, t) in enumerate(zip(h.recv_src_rank.tolist(), h.recv_src_token.tolist())):
                want = [-1, 0] if s < 0 else [s // P, sum(1 << (d - (rank // P) * P) for d in dests[s][t]
                                                          if d // P == rank // P)]
                assert pairs[row] == want, (row, s, t, pairs[row], want)
            assert h.num_rows > 0 or variant == "proxy"
        else:
            got = h[5]
            assert h.item_names[5] == "offset_inner"
            assert got.shape == (M, len(inner[0]), E) and got.dtype == torch.int32, got.shape
            want = torch.tensor(inner, dtype=torch.int32)
            bad = (got != want).nonzero().tolist()
            assert not bad, (len(bad), [(i, got[tuple(i)].item(), want[tuple(i)].item()) for i in bad[:8]])
        buf.destroy()


@pytest.mark.parametrize("variant", ["random", "proxy", "windows", "no_topk"])
def test_forwarder_items_from_routing(variant):
    spawn(_forwarder_items_body, 4, variant, env={"UCX_TLS": "tcp"})


def test_ascend_outer_items_past_max_batch():
    """More tokens than the Ascend port's MAX_BATCH_SIZE: one row per token, no padding (docs/python.md)."""
    T, node_of = ASCEND_MAX_BATCH + 3, [0, 0, 1, 1]
    in_rank = torch.zeros(T, 4, dtype=torch.int32)
    in_rank[::2, 1] = 1
    in_rank[::3, 2] = in_rank[::3, 3] = 1
    impl = SimpleNamespace(is_token_in_rank=in_rank, num_tokens=T, num_recv_rows_per_source=[0] * 4)
    h = Handle(impl, flavor="ascend", node_of=node_of)
    outer, cnt = h.item("offset_outer"), h.item("count_outer")
    assert outer.shape == (T, 2) and cnt.shape == (T,)
    assert outer[:, 0].tolist() == [t // 2 if t % 2 == 0 else -1 for t in range(T)]
    assert outer[:, 1].tolist() == [t // 3 if t % 3 == 0 else -1 for t in range(T)]
    assert cnt.tolist() == [(t % 2 == 0) + (t % 3 == 0) for t in range(T)]
