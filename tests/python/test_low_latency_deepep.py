"""Low-latency mode, flavor "deepep" (docs/low-latency.md), against a reference written from the spec: every
rank regenerates every rank's inputs from one seed and derives what it must receive (rows and their order,
recv_count, src_info, layout_range, FP8 codes and scales bitwise) and what combine must return (the canonical
f32 sum over top-k slots, bitwise)."""
import struct
import time

import pytest
import torch

import epcomm
from harness import spawn

M_E4M3 = 448.0


# ---- reference (low-latency.md §3, quant.md fp8_per_group128) --------------------------------------------

def inputs(seed, rank, T, H, E, K, pattern="random"):
    """Rank `rank`'s x [T, H] bf16 and topk_idx [T, K] i64 (distinct experts per row, some -1 slots)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = (torch.randn(T, H, generator=g) * 3).to(torch.bfloat16)
    if pattern == "one_expert":
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, 0] = 1
        return x, idx
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    idx = idx.to(torch.int64)
    if T:
        drop = torch.rand(T, K, generator=g) < 0.15
        idx[drop] = -1
    return x, idx


def f32_bits(v):
    return struct.unpack("<I", struct.pack("<f", v))[0]


def quant_group128(x_row, pow2):
    """fp8_per_group128 (e4m3) of one bf16 row: (codes as uint8 [H], scale_inv f32 [G], ue8m0 bytes [G])."""
    xf = x_row.float().reshape(-1, 128)
    amax = xf.abs().amax(dim=1)
    a = torch.maximum(amax, torch.tensor(1e-4, dtype=torch.float32))
    inv_m = torch.tensor(1.0 / M_E4M3, dtype=torch.float32)
    t = a * inv_m
    if pow2:
        ks = []
        for v in t.tolist():
            b = f32_bits(v)
            ks.append(((b >> 23) & 0xFF) - 127 + (1 if b & 0x7FFFFF else 0))
        k = torch.tensor(ks, dtype=torch.float32)
        scale_inv = torch.pow(2.0, k)
        d = torch.pow(2.0, -k)
        ue8m0 = (torch.tensor(ks) + 127).to(torch.uint8)
    else:
        scale_inv = t
        d = torch.tensor(M_E4M3, dtype=torch.float32) / a
        ue8m0 = None
    y = (xf * d[:, None]).clamp(-M_E4M3, M_E4M3)
    codes = y.reshape(-1).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale_inv, ue8m0


def expected(all_inputs, d, L, t_max, R):
    """What rank d must receive: per local expert j, the list of (s, t, k) in order."""
    rows = []
    for j in range(L):
        e = d * L + j
        rows.append([(s, t, k) for s in range(R) for t in range(all_inputs[s][1].shape[0])
                     for k in range(all_inputs[s][1].shape[1]) if int(all_inputs[s][1][t, k]) == e])
    return rows


def expert_fn(row, e):
    """The test's expert: a bf16 row scaled by a per-expert factor (exact inputs, rounded once)."""
    return (row.float() * (1.0 + e / 16.0)).to(torch.bfloat16)


def combine_ref(x, idx, w, E):
    """combined_x[t] = bf16(sum over k ascending with idx >= 0 of f32(w) * f32(y)); +0 start, no FMA."""
    T, H = x.shape
    out = torch.empty(T, H, dtype=torch.bfloat16)
    for t in range(T):
        acc = torch.zeros(H, dtype=torch.float32)
        for k in range(idx.shape[1]):
            e = int(idx[t, k])
            if e >= 0:
                acc = acc + w[t, k] * expert_fn(x[t], e).float()
        out[t] = acc.to(torch.bfloat16)
    return out


def dense(t):
    """A copy with standard strides (contiguous() keeps odd strides of one-element dimensions)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(dense(a).view(torch.uint8), dense(b).view(torch.uint8))


# ---- checks ---------------------------------------------------------------------------------------------

def check_dispatch(rank, R, all_inputs, t_max, E, H, result, fmt):
    recv_x, count, handle, event, hook = result
    hook()
    event.wait()
    L = E // R
    rows = expected(all_inputs, rank, L, t_max, R)
    assert count.dtype == torch.int32 and count.tolist() == [len(r) for r in rows]
    assert len(handle) == 5 and handle.num_max_dispatch_tokens_per_rank == t_max and handle.hidden == H
    assert handle.num_experts == E and handle[2] == t_max
    src, rng = handle.src_info, handle.layout_range
    assert src.shape == (L, R * t_max) and src.dtype == torch.int32
    assert rng.shape == (L, R) and rng.dtype == torch.int64
    for j, rj in enumerate(rows):
        assert src[j, :len(rj)].tolist() == [t for (_, t, _) in rj], f"rank {rank} expert {j}: src_info"
        begin = 0
        for s in range(R):
            c = sum(1 for (s2, _, _) in rj if s2 == s)
            assert int(rng[j, s]) == (begin << 32) | c, f"rank {rank} expert {j} source {s}: layout_range"
            begin += c
    if fmt == "bf16":
        assert recv_x.shape == (L, R * t_max, H) and recv_x.dtype == torch.bfloat16
        for j, rj in enumerate(rows):
            for i, (s, t, _) in enumerate(rj):
                assert same_bits(recv_x[j, i], all_inputs[s][0][t]), f"rank {rank} expert {j} row {i}"
        return
    codes, scales = recv_x
    assert codes.shape == (L, R * t_max, H) and codes.dtype == torch.float8_e4m3fn
    G = H // 128
    if fmt == "ue8m0":
        assert scales.shape == (L, R * t_max, G // 4) and scales.dtype == torch.int32
    else:
        assert scales.shape == (L, R * t_max, G) and scales.dtype == torch.float32
    # DeepEP's strides: column-major in the last two dimensions.
    assert scales.stride(1) == 1 and scales.stride(2) == R * t_max
    for j, rj in enumerate(rows):
        for i, (s, t, _) in enumerate(rj):
            c, si, ue = quant_group128(all_inputs[s][0][t], fmt != "fp8")
            assert torch.equal(codes[j, i].view(torch.uint8), c), f"rank {rank} expert {j} row {i}: codes"
            if fmt == "ue8m0":
                packed = dense(scales[j, i]).view(torch.uint8)
                assert torch.equal(packed, ue), f"rank {rank} expert {j} row {i}: ue8m0 bytes"
            else:
                assert same_bits(scales[j, i], si), f"rank {rank} expert {j} row {i}: scales"


def expert_outputs(recv_x, count, rank, L, fill):
    """The test's expert applied to the valid rows of a bf16 recv_x; NaN past recv_count (never read)."""
    y = fill if fill is not None else torch.empty_like(recv_x)
    y[:] = float("nan")
    for j in range(L):
        n = int(count[j])
        y[j, :n] = expert_fn(recv_x[j, :n], rank * L + j)
    return y


# ---- bodies ---------------------------------------------------------------------------------------------

def body_round_trip(rank, R, seed, Ts, t_max, H, E, K, pattern):
    all_inputs = [inputs(seed, s, Ts[s], H, E, K, pattern) for s in range(R)]
    x, idx = all_inputs[rank]
    buf = epcomm.Buffer(None, low_latency_mode=True, flavor="deepep",
                        num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(t_max, H, R, E))
    L = E // R
    for fmt in ("bf16", "fp8", "pow2", "ue8m0"):
        if fmt == "ue8m0" and H % 512:
            continue
        stats = torch.zeros(L, dtype=torch.int32)
        r = buf.low_latency_dispatch(x, idx, t_max, E, cumulative_local_expert_recv_stats=stats,
                                     use_fp8=fmt != "bf16", round_scale=fmt in ("pow2", "ue8m0"),
                                     use_ue8m0=fmt == "ue8m0")
        check_dispatch(rank, R, all_inputs, t_max, E, H, r, fmt)
        assert torch.equal(stats, r[1])
    # Combine: plain x, out=, zero copy; each bitwise against the reference.
    w = torch.rand(x.shape[0], K, generator=torch.Generator().manual_seed(seed + rank))
    ref = combine_ref(x, idx, w, E)
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, t_max, E, use_fp8=False)
    y = expert_outputs(recv_x, count, rank, L, None)
    out, event, hook = buf.low_latency_combine(y, idx, w, handle)
    hook()
    assert same_bits(out, ref), f"rank {rank}: combine"
    given = torch.empty_like(ref)
    out2, _, _ = buf.low_latency_combine(y, idx, w, handle, out=given, use_logfmt=True)
    assert out2 is given and same_bits(given, ref), f"rank {rank}: combine out="
    zc = buf.get_next_low_latency_combine_buffer(handle)
    assert zc.shape == (L, R * t_max, H) and zc.dtype == torch.bfloat16
    assert buf.get_next_low_latency_combine_buffer(handle) is zc
    expert_outputs(recv_x, count, rank, L, zc)
    out3, _, _ = buf.low_latency_combine(None, idx, w, handle, zero_copy=True)
    assert same_bits(out3, ref), f"rank {rank}: combine zero_copy"


def test_round_trip_two_ranks():
    spawn(body_round_trip, 2, 1, [5, 7], 8, 512, 8, 3, "random")


def test_round_trip_three_ranks_one_rank_empty():
    spawn(body_round_trip, 3, 2, [4, 0, 6], 6, 256, 6, 2, "random")


def test_round_trip_two_virtual_nodes():
    # Two nodes of one rank each (UCX over loopback); num_rdma_bytes is the size hint.
    spawn(body_round_trip, 2, 6, [5, 3], 8, 512, 8, 3, "random", env={"EPCOMM_RANKS_PER_NODE": "1"})


def test_round_trip_one_rank_and_one_expert():
    spawn(body_round_trip, 1, 3, [9], 9, 128, 4, 4, "random")
    spawn(body_round_trip, 2, 4, [6, 6], 6, 128, 4, 2, "one_expert")


def body_overlap(rank, R, seed):
    """Hooks, async, two results alive, a normal-mode call between them, interleaved hooks."""
    T, t_max, H, E, K = 6, 8, 256, 8, 2
    all_a = [inputs(seed, s, T, H, E, K) for s in range(R)]
    all_b = [inputs(seed + 7, s, T - 2, H, E, K) for s in range(R)]
    buf = epcomm.Buffer(None, low_latency_mode=True, flavor="deepep")
    ra = buf.low_latency_dispatch(*all_a[rank], t_max, E, use_fp8=False, return_recv_hook=True)
    rb = buf.low_latency_dispatch(*all_b[rank], t_max, E, use_fp8=True, return_recv_hook=True)
    rb[4]()
    ra[4]()
    ra[4]()  # idempotent
    check_dispatch(rank, R, all_a, t_max, E, H, ra, "bf16")
    check_dispatch(rank, R, all_b, t_max, E, H, rb, "fp8")
    # A normal-mode dispatch and combine on the same Buffer, between low-latency calls.
    x, idx = all_a[rank]
    w = torch.rand(T, K)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv, _, _, _, nh, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=per_rank,
                                        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    buf.combine(recv, nh)
    with pytest.raises(epcomm.InvalidUsageError, match="low_latency_dispatch"):
        buf.low_latency_combine(recv, idx, w, nh)
    # The first result is still intact after later calls; async combine of it.
    check_dispatch(rank, R, all_a, t_max, E, H, ra, "bf16")
    y = expert_outputs(ra[0], ra[1], rank, E // R, None)
    out, event, hook = buf.low_latency_combine(y, idx, w, ra[2], async_finish=True)
    event.wait()
    assert same_bits(out, combine_ref(x, idx, w, E))


def test_hooks_async_and_two_results_alive():
    spawn(body_overlap, 2, 5)


def body_hook_returns_after_send(rank, R, seed):
    """return_recv_hook: the call returns once this rank's rows are written into the receivers' outputs; the
    hook waits for the rows of every source. Every rank returns, meets the others (a barrier), and then finds
    the rows of every *other* source already in place, before calling its hook."""
    T, t_max, H, E, K = 64, 64, 2048, 8, 4
    all_in = [inputs(seed, s, T, H, E, K) for s in range(R)]
    buf = epcomm.Buffer(None, low_latency_mode=True, flavor="deepep")
    store = torch.distributed.distributed_c10d._get_default_store()
    if rank == 1:  # late: rank 0 cannot write into rank 1's outputs before rank 1 made its call
        time.sleep(0.5)
        store.set("rank1_called", "1")
    r = buf.low_latency_dispatch(*all_in[rank], t_max, E, use_fp8=False, return_recv_hook=True)
    if rank == 0:  # so rank 0's call, which returns only once its rows are written, returned after that
        assert store.check(["rank1_called"]), "return_recv_hook returned before this rank's rows were sent"
    torch.distributed.barrier()
    recv_x, L = r[0], E // R
    for j, rj in enumerate(expected(all_in, rank, L, t_max, R)):
        for i, (s, t, _) in enumerate(rj):
            if s != rank:
                assert same_bits(recv_x[j, i], all_in[s][0][t]), f"rank {rank} expert {j} row {i} (source {s})"
    check_dispatch(rank, R, all_in, t_max, E, H, r, "bf16")


def test_hook_returns_after_the_rows_are_sent():
    spawn(body_hook_returns_after_send, 2, 11)


def body_errors(rank, R):
    t_max, H, E, K = 4, 256, 4, 2
    buf = epcomm.Buffer(None, low_latency_mode=True, flavor="deepep")
    x, idx = inputs(9, rank, 3, H, E, K)
    err = epcomm.InvalidUsageError
    every = (epcomm.InvalidUsageError, epcomm.AbortedError)  # this rank's error, or a peer's quoted

    def raises(match, fn, local=True):
        with pytest.raises(err if local else every, match=match if local else None):
            fn()

    bad = idx.clone()
    bad[1] = torch.tensor([2, 2])
    raises("expert 2 twice", lambda: buf.low_latency_dispatch(x, bad, t_max, E))
    raises("more than num_max_dispatch_tokens_per_rank", lambda: buf.low_latency_dispatch(x, idx, 2, E))
    raises("multiple of 128", lambda: buf.low_latency_dispatch(x[:, :200].contiguous(), idx, t_max, E))
    raises("multiple of 512", lambda: buf.low_latency_dispatch(x, idx, t_max, E, round_scale=True,
                                                                use_ue8m0=True))
    raises("requires round_scale", lambda: buf.low_latency_dispatch(x, idx, t_max, E, use_ue8m0=True))
    raises("async_finish and return_recv_hook", lambda: buf.low_latency_dispatch(
        x, idx, t_max, E, async_finish=True, return_recv_hook=True))
    raises("bf16", lambda: buf.low_latency_dispatch(x.float(), idx, t_max, E))
    raises("out of range", lambda: buf.low_latency_dispatch(x, idx + E, t_max, E))
    raises("num_experts", lambda: buf.low_latency_dispatch(x, idx, t_max, E + 1))
    raises("cumulative_local_expert_recv_stats", lambda: buf.low_latency_dispatch(
        x, idx, t_max, E, cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int64)))
    raises("dispatch_wait_recv_cost_stats", lambda: buf.low_latency_dispatch(
        x, idx, t_max, E, dispatch_wait_recv_cost_stats=torch.zeros(R, R, dtype=torch.int64)))
    # A rank-local error fails the call on every rank.
    raises(None, lambda: buf.low_latency_dispatch(x, bad if rank == R - 1 else idx, t_max, E), local=False)
    # Parameters that differ across ranks: every rank names them.
    raises("num_max_dispatch_tokens_per_rank", lambda: buf.low_latency_dispatch(x, idx, t_max + rank, E))
    raises("quant_mode", lambda: buf.low_latency_dispatch(x, idx, t_max, E, use_fp8=rank == 0))
    # Combine.
    recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, idx, t_max, E, use_fp8=False)
    w = torch.rand(3, K)
    raises("x: expected", lambda: buf.low_latency_combine(recv_x[:, :1], idx, w, handle))
    raises("differs from the dispatch", lambda: buf.low_latency_combine(recv_x, idx.flip(1), w, handle))
    raises("topk_weights", lambda: buf.low_latency_combine(recv_x, idx, w[:, :1], handle))
    raises("out", lambda: buf.low_latency_combine(recv_x, idx, w, handle, out=torch.empty(3, H)))
    raises("zero_copy", lambda: buf.low_latency_combine(recv_x, idx, w, handle, zero_copy=True))
    raises("combine_wait_recv_cost_stats", lambda: buf.low_latency_combine(
        recv_x, idx, w, handle, combine_wait_recv_cost_stats=torch.zeros(R, dtype=torch.int32)))
    other = epcomm.Buffer(None, low_latency_mode=True, flavor="deepep")
    raises("another Buffer", lambda: other.low_latency_combine(recv_x, idx, w, handle))
    # The Buffer is still usable after all of that.
    out, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    assert out.shape == (3, H)


def test_errors():
    spawn(body_errors, 2)


def body_flavor_mismatch(rank, R):
    with pytest.raises(epcomm.InvalidUsageError, match="flavor"):
        epcomm.Buffer(None, low_latency_mode=True, flavor="deepep" if rank == 0 else "ascend")


def test_flavor_mismatch_fails_at_creation():
    spawn(body_flavor_mismatch, 2)


def test_size_hint():
    hint = epcomm.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256)
    assert hint > 0 and hint % 128 == 0
    assert epcomm.Buffer.get_low_latency_rdma_size_hint(256, 7168, 8, 256) > hint
    with pytest.raises(epcomm.InvalidUsageError, match="num_experts"):
        epcomm.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 100)
