"""Low-latency mode, flavor "ascend" (low-latency.md §4; docs/low-latency-ascend.md) on spawned gloo ranks,
checked bit for bit against ll_reference.py (written from the specs): rows and their order, recv_count (both
MOE_EXPERT_TOKEN_NUMS_TYPE values), the handle's items, codes and scales of every format, and combine against
the canonical f32 sum; plus bitwise agreement with npu_moe_distribute_dispatch_v2 called directly, hooks, async
events, out=, zero copy, two results alive, normal-mode calls interleaved, and the §6 errors on every rank."""
import os

import pytest
import torch
import torch.distributed as dist

import epcomm
from epcomm import _C, ops

import ll_reference as ref
from harness import spawn
from reference import bits, same_bits

FORMATS = ("bf16", "int8", "pertoken_fp8_e4m3", "mx_fp8_e4m3", "mx_fp8_e5m2", "mx_fp4_e2m1")
V2 = {"bf16": (0, None), "int8": (2, torch.int8), "pertoken_fp8_e4m3": (2, torch.float8_e4m3fn),
      "mx_fp8_e4m3": (4, torch.float8_e4m3fn), "mx_fp8_e5m2": (4, torch.float8_e5m2)}


def make_problem(R, E, K, H, Ts, seed, kind="random"):
    """Every rank's inputs from one seed: tagged tokens (x[:, 0] = rank - 128, x[:, 1] = token), an all-zero
    block in token 0 (MX zero blocks), distinct top-k ids with some -1 slots (a token without any expert
    too), f32 weights, and the expert outputs Y[s] [T_s, K, H] bf16 that combine sends back."""
    xs, ids, ws, ys = [], [], [], []
    for s in range(R):
        g = torch.Generator().manual_seed(seed * 1000 + s)
        T = Ts[s]
        x = torch.randn(T, H, generator=g) * torch.exp2(torch.randint(-3, 4, (T, 1), generator=g).float())
        if T:
            x[:, 0], x[:, 1] = s - 128, torch.arange(T)
            x[0, 32:64] = 0
        if kind == "one":  # every token of every rank to expert E - 1 (slot 0), the other slots empty
            idx = torch.full((T, K), -1, dtype=torch.int64)
            idx[:, 0] = E - 1
        else:
            idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
                torch.zeros(0, K, dtype=torch.int64)
            drop = torch.rand(T, K, generator=g) < 0.25
            idx[drop] = -1
            if T > 2:
                idx[2] = -1
        xs.append(x.bfloat16())
        ids.append(idx)
        ws.append(torch.rand(T, K, generator=g))
        ys.append(torch.randn(T, K, H, generator=g).bfloat16())
    return xs, ids, ws, ys


def check_dispatch(out, fmt, p, R, E, K, H, T_max, xs, ids, ws, cache, prefix=False):
    recv_x, recv_count, handle, event, hook = out
    L = E // R
    rows, cnt, nums = ref.rows_of(p, ids, E, R)
    A, n = ref.capacity(R, T_max, K, L), len(rows)
    # The handle: 7 items, tuple-like, with accessors.
    assert len(handle) == 7
    src_info, layout_range, t_max, hidden, num_experts, packed, expand_scales = handle
    assert (t_max, hidden, num_experts) == (T_max, H, E)
    assert handle.num_max_dispatch_tokens_per_rank == T_max and handle.hidden == H and handle.num_experts == E
    assert handle[-1] is handle.expand_scales and handle[0] is handle.src_info and list(handle)[1] is layout_range
    assert handle.layout_range is layout_range and handle.packed_recv_count is packed
    assert recv_count.dtype == torch.int64 and recv_count.tolist() == (ref.prefix_sums(nums) if prefix else nums)
    assert torch.equal(packed, recv_count)
    assert layout_range.dtype == torch.int32 and layout_range.tolist() == cnt
    assert src_info.dtype == torch.int32 and src_info.numel() == A * 128
    assert src_info[:3 * n].tolist() == [v for r in rows for v in r]
    if ws is not None:
        assert expand_scales.dtype == torch.float32 and expand_scales.shape == (A,)
        assert torch.equal(expand_scales[:n], torch.tensor([float(ws[s][t, k]) for s, t, k in rows]))
    else:
        assert expand_scales.numel() == 0
    # The rows, bit for bit.
    G = (H + 31) // 32
    if fmt == "bf16":
        assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (A, H)
        if n:
            assert same_bits(recv_x[:n], torch.stack([xs[s][t] for s, t, _ in rows]))
        return
    codes, scales = recv_x
    want_dtype = {"int8": torch.int8, "pertoken_fp8_e4m3": torch.float8_e4m3fn, "mx_fp8_e4m3": torch.float8_e4m3fn,
                  "mx_fp8_e5m2": torch.float8_e5m2, "mx_fp4_e2m1": torch.float4_e2m1fn_x2}[fmt]
    assert codes.dtype == want_dtype and codes.shape == ((A, H // 2) if fmt == "mx_fp4_e2m1" else (A, H))
    if fmt in ("int8", "pertoken_fp8_e4m3"):
        assert scales.dtype == torch.float32 and scales.shape == (A,)
    else:
        assert scales.dtype == torch.float8_e8m0fnu and scales.shape == (A * G,)
        scales = scales.view(torch.uint8).view(A, G)
    for i, (s, t, _) in enumerate(rows):
        key = (fmt, id(xs[s]), t)  # callers keep xs alive while they reuse the cache
        if key not in cache:
            cache[key] = ref.quantize_row(xs[s][t], fmt)
        c, sc = cache[key]
        want = c.view(torch.uint8) if c.dtype != torch.int8 else c
        assert torch.equal(bits(codes[i]), want), \
            f"{fmt} rank {p} row {i} (s={s}, t={t}): codes {bits(codes[i]).tolist()} != {want.tolist()}"
        if scales.dtype == torch.float32:
            assert bits(scales[i]).item() == bits(sc.reshape(1)).item(), f"{fmt} rank {p} row {i}: scale"
        else:
            assert torch.equal(scales[i], sc), f"{fmt} rank {p} row {i}: scale bytes"
    if fmt != "mx_fp4_e2m1" and n:  # dequantized values within quant.md §4's bounds
        xf = torch.stack([xs[s][t].float() for s, t, _ in rows])
        if fmt in ("int8", "pertoken_fp8_e4m3"):
            S = scales[:n].reshape(n, 1)
            deq = codes[:n].float() * S
            if fmt == "int8":
                assert ((deq - xf).abs() <= (0.5 + 2 ** -12) * S).all()
            else:
                assert ((deq - xf).abs() <= 2 ** -4 * xf.abs() * (1 + 2 ** -20) + 2 ** -10 * S).all()
        else:
            S = torch.exp2(scales[:n].float() - 127).repeat_interleave(32, 1)[:, :H]
            m, emin = (3, -6) if fmt == "mx_fp8_e4m3" else (2, -14)
            deq = codes[:n].float() * S
            M = 448.0 if fmt == "mx_fp8_e4m3" else 57344.0
            unsat = xf.abs() <= M * S
            bound = 2.0 ** -(m + 1) * xf.abs() * (1 + 2 ** -20) + 2.0 ** (emin - m - 1) * S
            assert ((deq - xf).abs() <= bound)[unsat].all()
            assert ((deq - xf).abs() < (2.0 ** ((8 if M == 448 else 15) + 1) - M) * S)[~unsat].all()


def combine_input(rows, ys, A, H):
    """The expert outputs in the dispatch's row order, NaN past the valid rows (they are never read)."""
    x = torch.full((A, H), float("nan")).bfloat16()
    for i, (s, t, k) in enumerate(rows):
        x[i] = ys[s][t, k]
    return x


def expect_combine(p, ids, ws, ys, H):
    return ref.combine(lambda t, k: ys[p][t, k], ids[p], ws[p], H)


def new_buffer(**kw):
    return epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, flavor="ascend", **kw)


# ---- rows, formats and combine over 1-4 ranks -----------------------------------------------------------

CONFIGS = {1: (4, 2), 2: (4, 3), 3: (6, 2), 4: (4, 2)}  # world -> (E, K): L > K, L < K, L = K, L = 1


def _main_body(rank, world):
    E, K = CONFIGS[world]
    H, T_max = 128, 4
    buf = new_buffer()
    pg = dist.group.WORLD
    cache = {}
    cases = [([T_max] * world, "random", 1), ([(3 * s + 2) % (T_max + 1) for s in range(world)], "random", 2),
             ([T_max - s % 2 for s in range(world)], "one", 3)]
    if world > 1:
        cases.append(([0] + [T_max] * (world - 1), "random", 4))
    for Ts, kind, seed in cases:
        xs, ids, ws, ys = make_problem(world, E, K, H, Ts, seed, kind)
        cache = {}
        for fmt in FORMATS:
            w = ws[rank] if fmt != "int8" else None
            out = buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, topk_weights=w,
                                           quant_mode=None if fmt == "bf16" else fmt, use_fp8=fmt != "bf16")
            check_dispatch(out, fmt, rank, world, E, K, H, T_max, xs, ids, ws if w is not None else None, cache)
            # recv_x lies in the operator group's output arena: every call pushed its rows (one node).
            copies = _C.moe_group_copy_counters(buf._ll_ascend_state.c)
            assert copies["dispatch_staged_tokens"] == 0, copies
            if fmt in V2:  # the same call made directly on npu_moe_distribute_dispatch_v2
                mode, y = V2[fmt]
                idx = ids[rank].to(torch.int32)
                mask = idx >= 0 if bool((idx < 0).any()) else None
                d = ops.npu_moe_distribute_dispatch_v2(xs[rank], idx, pg, world, rank, E, x_active_mask=mask,
                                                       expert_scales=w, quant_mode=mode, y_dtype=y,
                                                       global_bs=world * T_max)
                rows, _, _ = ref.rows_of(rank, ids, E, world)
                n = len(rows)
                recv_x, recv_count, handle = out[:3]
                codes = recv_x[0] if isinstance(recv_x, tuple) else recv_x
                assert codes.shape == d[0].shape and same_bits(codes[:n], d[0][:n])
                if mode == 2:
                    assert same_bits(recv_x[1][:n], d[1][:n])
                if mode == 4:
                    G = H // 32
                    assert same_bits(recv_x[1].view(-1, G)[:n], d[1][:n, :G].view(torch.float8_e8m0fnu))
                assert torch.equal(handle.src_info[:3 * n], d[2][:3 * n]) and torch.equal(recv_count, d[3])
                assert torch.equal(handle.layout_range, d[4])
            if fmt in ("bf16", "mx_fp8_e4m3"):
                rows, _, _ = ref.rows_of(rank, ids, E, world)
                A = ref.capacity(world, T_max, K, E // world)
                y, event, hook = buf.low_latency_combine(combine_input(rows, ys, A, H), ids[rank], ws[rank], out[2])
                assert same_bits(y, expect_combine(rank, ids, ws, ys, H)), f"combine, case {seed}"
    assert _C.moe_group_copy_counters(buf._ll_ascend_state.c)["dispatch_pushed_tokens"] > 0
    # MOE_EXPERT_TOKEN_NUMS_TYPE=0: inclusive prefix sums; an odd number of MX scale bytes per row (H = 96).
    xs, ids, ws, ys = make_problem(world, E, K, 96, [T_max] * world, 5)
    cache = {}
    os.environ["MOE_EXPERT_TOKEN_NUMS_TYPE"] = "0"
    try:
        for fmt in ("bf16", "mx_fp8_e5m2", "mx_fp4_e2m1"):
            out = buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, quant_mode=None if fmt == "bf16" else fmt,
                                           use_fp8=False)
            check_dispatch(out, fmt, rank, world, E, K, 96, T_max, xs, ids, None, cache, prefix=True)
    finally:
        del os.environ["MOE_EXPERT_TOKEN_NUMS_TYPE"]
    # The flags select the format when quant_mode is None.
    for flags, fmt in ((dict(use_fp8=False), "bf16"), (dict(), "int8"), (dict(use_ue8m0=True), "mx_fp8_e4m3"),
                       (dict(use_mxfp4=True), "mx_fp4_e2m1")):
        out = buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, **flags)
        check_dispatch(out, fmt, rank, world, E, K, 96, T_max, xs, ids, None, cache)
    buf.destroy()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rows_formats_combine(world):
    spawn(_main_body, world)


# ---- hooks, async, out=, zero copy, two results alive, normal mode interleaved ------------------------------

def _normal_round_trip(buf, rank, world, E, H):
    g = torch.Generator().manual_seed(77 + rank)
    x = torch.randn(5, H, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=g)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                              num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    y, _, _ = buf.combine(recv_x, handle)
    want = (x.float() * w.sum(1, keepdim=True)).bfloat16()
    assert (y.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()
    return handle


def _hooks_body(rank, world):
    E, K, H, T_max = 4, 2, 128, 4
    buf = new_buffer()
    L, A = E // world, ref.capacity(world, T_max, K, E // world)
    p1 = make_problem(world, E, K, H, [T_max, 3], 11)
    p2 = make_problem(world, E, K, H, [2, T_max], 12)
    cache = {}

    def dispatch(p, **kw):
        xs, ids, ws, _ = p
        return buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, use_fp8=False, topk_weights=ws[rank], **kw)

    def check(out, p):
        xs, ids, ws, _ = p
        check_dispatch(out, "bf16", rank, world, E, K, H, T_max, xs, ids, ws, cache)

    def combine_x(p):
        rows, _, _ = ref.rows_of(rank, p[1], E, world)
        return combine_input(rows, p[3], A, H)

    # Two dispatches whose hooks are called in reverse order, each twice; a normal-mode round trip between the
    # dispatches and their hooks; cumulative stats. On one node a hooked dispatch runs in the call: its hook is
    # done on return (docs/low-latency-ascend.md).
    stats = torch.zeros(L, dtype=torch.int32)
    o1 = dispatch(p1, return_recv_hook=True, cumulative_local_expert_recv_stats=stats)
    o2 = dispatch(p2, return_recv_hook=True, cumulative_local_expert_recv_stats=stats)
    assert "complete=True" in repr(o1[4]) and "complete=True" in repr(o2[4]), (o1[4], o2[4])
    normal_handle = _normal_round_trip(buf, rank, world, E, H)
    o2[4]()
    o2[4]()
    o1[4]()
    o1[4]()
    assert o1[3].is_complete()
    check(o1, p1)
    check(o2, p2)
    n1, n2 = ref.rows_of(rank, p1[1], E, world)[2], ref.rows_of(rank, p2[1], E, world)[2]
    assert stats.tolist() == [a + b for a, b in zip(n1, n2)]
    # Two results alive: combine the second first, with hooks, into out=; then the first with async_finish.
    out2 = torch.full((2 if rank == 0 else T_max, H), 7.0).bfloat16()
    y2, ev2, hook2 = buf.low_latency_combine(combine_x(p2), p2[1][rank], p2[2][rank], o2[2], return_recv_hook=True,
                                             out=out2)
    assert y2 is out2
    y1, ev1, hook1 = buf.low_latency_combine(combine_x(p1), p1[1][rank], p1[2][rank], o1[2], async_finish=True)
    ev1.wait()
    assert ev1.is_complete()
    ev1.current_stream_wait()
    hook1()
    hook2()
    hook2()
    assert same_bits(y1, expect_combine(rank, p1[1], p1[2], p1[3], H))
    assert same_bits(out2, expect_combine(rank, p2[1], p2[2], p2[3], H))
    # async dispatch, then zero copy into the handle's combine buffer (x is not read).
    o3 = dispatch(p1, async_finish=True)
    o3[3].wait()
    with o3[3]:
        pass
    check(o3, p1)
    zb = buf.get_next_low_latency_combine_buffer(o3[2])
    assert zb.shape == (A, H) and zb.dtype == torch.bfloat16
    assert buf.get_next_low_latency_combine_buffer(o3[2]) is zb
    zb.copy_(combine_x(p1))
    before = _C.moe_group_copy_counters(buf._ll_ascend_state.c)
    y3, _, hook3 = buf.low_latency_combine(torch.empty(0), p1[1][rank], p1[2][rank], o3[2], zero_copy=True)
    hook3()
    assert same_bits(y3, expect_combine(rank, p1[1], p1[2], p1[3], H))
    # Every rank's combine buffer lies in its output arena: no row was copied into a window.
    after = _C.moe_group_copy_counters(buf._ll_ascend_state.c)
    assert after["combine_copied_rows"] == before["combine_copied_rows"], (before, after)
    # Hooked calls and sync ones keep the order; results of earlier calls stay valid.
    o4 = dispatch(p2, return_recv_hook=True)
    o5 = dispatch(p1)
    check(o5, p1)
    o4[4]()
    check(o4, p2)
    check(o1, p1)
    # int32 ids, and other negative ids than -1, mean the same.
    xs, ids, ws, _ = p1
    odd = torch.where(ids[rank] < 0, -7, ids[rank]).to(torch.int32)
    o6 = buf.low_latency_dispatch(xs[rank], odd, T_max, E, use_fp8=False, topk_weights=ws[rank])
    check(o6, p1)
    y6, _, _ = buf.low_latency_combine(combine_x(p1), odd, ws[rank].double(), o6[2])
    assert same_bits(y6, expect_combine(rank, p1[1], p1[2], p1[3], H))
    # A non-contiguous out=.
    wide = torch.zeros(p1[0][rank].shape[0], 2 * H).bfloat16()
    y6, _, _ = buf.low_latency_combine(combine_x(p1), p1[1][rank], p1[2][rank], o5[2], out=wide[:, ::2])
    assert same_bits(wide[:, ::2], expect_combine(rank, p1[1], p1[2], p1[3], H))
    assert not bool(wide[:, 1::2].float().any())
    _normal_round_trip(buf, rank, world, E, H)
    del normal_handle
    # After destroy, LL calls raise and the worker thread is gone.
    import threading
    assert any(t.name.startswith("epcomm_ll_ascend") for t in threading.enumerate())
    buf.destroy()
    with pytest.raises(epcomm.InvalidUsageError, match="destroyed"):
        dispatch(p1)
    assert not any(t.name.startswith("epcomm_ll_ascend") for t in threading.enumerate())


def test_hooks_async_zero_copy_interleaved():
    spawn(_hooks_body, 2)


# ---- MOE_SHARED_EXPERT_RANK_NUM: shared-expert ranks first ---------------------------------------------

def _shared_body(rank, world):
    S_r, E, K, H, T_max = 1, 4, 2, 128, 3
    buf = new_buffer()
    xs, ids, ws, ys = make_problem(world, E, K, H, [T_max, 2, T_max], 31)
    zs = [(x.float() * 0.5 + 1).bfloat16() for x in xs]  # the shared expert's outputs
    recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, use_fp8=False,
                                                                topk_weights=ws[rank])
    rows, cnt, nums = ref.rows_of(rank, ids, E, world, shared_ranks=S_r)
    L = E // (world - S_r)
    A = ref.capacity(world, T_max, K, L, shared_rank=S_r if rank < S_r else 0)
    n = len(rows)
    assert recv_x.shape == (A, H) and recv_count.tolist() == nums and handle.layout_range.tolist() == cnt
    assert handle.src_info[:3 * n].tolist() == [v for r in rows for v in r]
    assert same_bits(recv_x[:n], torch.stack([xs[s][t] for s, t, _ in rows]))
    x = torch.full((A, H), float("nan")).bfloat16()
    for i, (s, t, k) in enumerate(rows):
        x[i] = zs[s][t] if k == K else ys[s][t, k]
    y, _, _ = buf.low_latency_combine(x, ids[rank], ws[rank], handle)
    want = ref.combine(lambda t, k: ys[rank][t, k], ids[rank], ws[rank], H, shared_of=lambda t: zs[rank][t])
    assert same_bits(y, want)
    buf.destroy()


def test_shared_expert_ranks():
    spawn(_shared_body, 3, env={"MOE_SHARED_EXPERT_RANK_NUM": "1"})


# ---- errors: on every rank, before data moves; the Buffer stays usable -----------------------------------

def _expect(rank, bad_rank, what, fn):
    """fn() raises on every rank: the rank with the bad argument InvalidUsageError naming `what`, the others
    (when only one rank was bad) an epcomm error quoting it."""
    with pytest.raises(epcomm.Error) as info:
        fn()
    msg = str(info.value)
    if bad_rank is None or rank == bad_rank:
        assert isinstance(info.value, epcomm.InvalidUsageError), msg
        assert what in msg, f"{what!r} not in {msg!r}"
        assert "low_latency" in msg or "low-latency" in msg or "low_latency_mode" in msg, msg
    else:
        assert what in msg or f"rank {bad_rank}" in msg or f"ep {bad_rank}" in msg, msg


def _errors_body(rank, world):
    E, K, H, T_max = 4, 2, 128, 4
    buf = new_buffer()
    other = new_buffer()
    xs, ids, ws, ys = make_problem(world, E, K, H, [T_max, 3], 21)
    x, idx, w = xs[rank], ids[rank], ws[rank]
    A = ref.capacity(world, T_max, K, E // world)
    cache = {}

    def good():
        out = buf.low_latency_dispatch(x, idx, T_max, E, use_fp8=False, topk_weights=w)
        check_dispatch(out, "bf16", rank, world, E, K, H, T_max, xs, ids, ws, cache)
        rows, _, _ = ref.rows_of(rank, ids, E, world)
        y, _, _ = buf.low_latency_combine(combine_input(rows, ys, A, H), idx, w, out[2])
        assert same_bits(y, expect_combine(rank, ids, ws, ys, H))
        return out

    def D(b=None, **kw):
        args = dict(x=x, topk_idx=idx, num_max_dispatch_tokens_per_rank=T_max, num_experts=E, use_fp8=False)
        if b == rank:
            args.update(kw)
        a = dict(args)
        return lambda: buf.low_latency_dispatch(a.pop("x"), a.pop("topk_idx"),
                                                a.pop("num_max_dispatch_tokens_per_rank"), a.pop("num_experts"), **a)

    repeated = idx.clone()
    if repeated.shape[0]:
        repeated[0] = torch.tensor([1, 1])
    dispatch_errors = [
        (1, "more than num_max_dispatch_tokens_per_rank", dict(x=torch.zeros(T_max + 1, H).bfloat16(),
                                                               topk_idx=torch.zeros(T_max + 1, K, dtype=torch.long))),
        (1, "argument: x", dict(x=x.float())),
        (1, "argument: x", dict(x=x.reshape(-1))),
        (1, "argument: topk_idx", dict(topk_idx=idx[:, :1].t())),
        (1, "argument: topk_idx", dict(topk_idx=idx.float())),
        (1, "out of range", dict(topk_idx=torch.where(idx >= 0, idx, E))),
        (0, "slots 0 and 1 both select expert 1", dict(topk_idx=repeated)),
        (1, "async_finish and return_recv_hook", dict(async_finish=True, return_recv_hook=True)),
        (1, "quant_mode", dict(quant_mode="int4")),
        (1, "cumulative_local_expert_recv_stats",
         dict(cumulative_local_expert_recv_stats=torch.zeros(3, dtype=torch.int32))),
        (1, "cumulative_local_expert_recv_stats", dict(cumulative_local_expert_recv_stats=torch.zeros(2))),
        (1, "topk_weights", dict(topk_weights=w[:, :1])),
        (1, "num_experts", dict(num_experts=3)),
        (None, "num_experts", dict(num_experts=5)),  # E % R on every rank
        (1, "num_max_dispatch_tokens_per_rank", dict(num_max_dispatch_tokens_per_rank=T_max + 1)),
        (1, "num_experts", dict(num_experts=2 * E)),  # E differs across ranks
        (1, "hidden", dict(x=torch.zeros(x.shape[0], 2 * H).bfloat16())),
        (1, "quant_mode", dict(use_fp8=True)),  # format differs across ranks
    ]
    out = good()
    for bad, what, kw in dispatch_errors:
        if bad is None:
            fn = lambda kw=kw: buf.low_latency_dispatch(x, idx, T_max, kw["num_experts"], use_fp8=False)
        else:
            fn = D(bad, **kw)
        _expect(rank, bad, what, fn)
    good()
    # Combine errors.
    handle = out[2]
    rows, _, _ = ref.rows_of(rank, ids, E, world)
    cx = combine_input(rows, ys, A, H)
    normal = _normal_round_trip(buf, rank, world, E, H)
    other_out = other.low_latency_dispatch(x, idx, T_max, E, use_fp8=False)
    combine_errors = [
        (1, "argument: x", dict(x=cx.float())),
        (1, "argument: x", dict(x=cx[:, :H // 2])),
        (1, "argument: topk_idx: differs", dict(topk_idx=torch.where(idx >= 0, (idx + 1) % E, idx))),
        (1, "argument: topk_idx", dict(topk_idx=idx[:, :1])),
        (1, "argument: topk_weights", dict(topk_weights=w[:1])),
        (1, "argument: out", dict(out=torch.zeros(x.shape[0], H))),
        (1, "argument: out", dict(out=torch.zeros(x.shape[0], H + 1).bfloat16())),
        (1, "another Buffer", dict(handle=other_out[2])),
        (1, "normal-mode handle", dict(handle=normal)),
        (1, "plain tuple", dict(handle=tuple(handle))),
        (None, "zero_copy", dict(zero_copy=True)),
        (1, "async_finish and return_recv_hook", dict(async_finish=True, return_recv_hook=True)),
    ]
    for bad, what, kw in combine_errors:
        args = dict(x=cx, topk_idx=idx, topk_weights=w, handle=handle)
        if bad is None or bad == rank:
            args.update(kw)
        _expect(rank, bad, what, lambda a=args: buf.low_latency_combine(a.pop("x"), a.pop("topk_idx"),
                                                                       a.pop("topk_weights"), a.pop("handle"), **a))
    # The dispatch's own topk_idx, written in place since its dispatch, is compared too.
    idx2 = idx.clone()
    out2 = buf.low_latency_dispatch(x, idx2, T_max, E, use_fp8=False, topk_weights=w)
    if rank == 1:
        idx2.copy_(torch.where(idx2 >= 0, (idx2 + 1) % E, idx2))
    _expect(rank, 1, "argument: topk_idx: differs", lambda: buf.low_latency_combine(cx, idx2, w, out2[2]))
    good()
    # A region too small (every rank), low_latency_mode=False, mx_fp4 with an odd hidden size.
    small = epcomm.Buffer(dist.group.WORLD, num_rdma_bytes=1024, low_latency_mode=True, flavor="ascend")
    hint = epcomm.Buffer.get_low_latency_rdma_size_hint(T_max, H, world, E)
    _expect(rank, None, "num_rdma_bytes", lambda: small.low_latency_dispatch(x, idx, T_max, E))
    _expect(rank, None, f"needs {hint}", lambda: small.low_latency_dispatch(x, idx, T_max, E))
    plain = epcomm.Buffer(dist.group.WORLD, flavor="ascend")
    _expect(rank, None, "low_latency_mode", lambda: plain.low_latency_dispatch(x, idx, T_max, E))
    _expect(rank, None, "even hidden", lambda: buf.low_latency_dispatch(torch.zeros(x.shape[0], 33).bfloat16(), idx,
                                                                         T_max, E, quant_mode="mx_fp4_e2m1"))
    good()
    # An error found by the call itself (T_max differs across ranks): a hooked dispatch on one node runs in the
    # call, which raises it (as the deepep flavor's does); then a late argument error on one rank after a
    # hooked dispatch: the order holds.
    bad_t = T_max + (rank == 1)
    with pytest.raises(epcomm.InvalidUsageError, match="num_max_dispatch_tokens_per_rank"):
        buf.low_latency_dispatch(x, idx, bad_t, E, use_fp8=False, return_recv_hook=True)
    # async_finish completes the call before returning (the Ascend port's behaviour): the error is raised here.
    with pytest.raises(epcomm.InvalidUsageError, match="global_bs"):
        buf.low_latency_dispatch(x, idx, bad_t, E, use_fp8=False, async_finish=True)
    good()
    o = buf.low_latency_dispatch(x, idx, T_max, E, use_fp8=False, return_recv_hook=True)
    _expect(rank, 1, "argument: x", D(1, x=x.float()))
    o[4]()
    check_dispatch(o, "bf16", rank, world, E, K, H, T_max, xs, ids, None, cache)
    good()
    for b in (small, plain, other, buf):
        b.destroy()


def test_errors_on_every_rank():
    spawn(_errors_body, 2)
