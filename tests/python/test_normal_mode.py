"""Normal mode through the Python front on 2 and 4 spawned ranks, both receive orders, both strategies (the
shared-memory engine and DEEP_USE_MODE=alltoall), every output compared bit for bit with the plain-torch
reference built from all-gathered inputs; then the two strategies are compared with each other."""
import os

import torch
import torch.distributed as dist

import epcomm
from harness import gather, spawn, use_mode
from reference import Problem, layout, same_bits

ORDERS = ("expert_major", "rank_major")


def tag(s, t, c, hidden, dtype):
    """An expert output that encodes its row's source (s, t) and slot or rank c."""
    base = torch.arange(hidden, dtype=torch.float32) * 0.25
    return (base + (s * 100 + t * 3 + c * 7 + 1) / 8).to(dtype)


def cases(world):
    """(name, spec) pairs; T lists tokens per rank (zeros included)."""
    z = [0] * world
    return [
        ("bf16 random bits", dict(T=[7, 0, 11, 3][:world], E=2 * world, K=2, H=16, dtype=torch.bfloat16,
                                  bits=True, align=1)),
        ("f32 aligned worst", dict(T=[5, 9, 0, 6][:world], E=3 * world, K=3, H=24, dtype=torch.float32,
                                   align=4, worst=True)),
        ("f16 odd hidden", dict(T=[4, 6, 2, 0][:world], E=world, K=1, H=7, dtype=torch.float16, align=1,
                                idx32=True)),
        ("bf16 all to rank 0", dict(T=[6, 3, 5, 2][:world], E=2 * world, K=4, H=8, dtype=torch.bfloat16,
                                    align=2, to_rank0=True)),
        ("all ranks empty", dict(T=z, E=2 * world, K=2, H=8, dtype=torch.bfloat16, align=1)),
    ]


def make_problem(rank, world, seed, spec):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    T, E, K, H = spec["T"][rank], spec["E"], spec["K"], spec["H"]
    ids = torch.randint(-1, E, (T, K), generator=g)
    if spec.get("to_rank0"):
        ids = torch.randint(-1, E // world, (T, K), generator=g)
    if T > 1 and K > 1:
        ids[1, 1] = ids[1, 0]  # an expert listed twice in one token
    if T > 2:
        ids[2, :] = -1  # a token that goes nowhere
    if spec.get("idx32"):
        ids = ids.to(torch.int32)
    ws = torch.rand(T, K, generator=g)
    if spec.get("bits"):
        x = torch.randint(-(2**15), 2**15, (T, H), dtype=torch.int32, generator=g).to(torch.int16)
        x = x.view(torch.bfloat16)  # NaNs, -0, subnormals: must arrive byte for byte
    else:
        x = torch.randn(T, H, generator=g).to(spec["dtype"])
    mine = dict(x=x, ids=ids, ws=ws)
    every = gather(mine)
    prob = Problem(world, E, [e["x"] for e in every], [e["ids"].to(torch.int64) for e in every],
                   [e["ws"] for e in every])
    return prob, mine


def check(cond, what):
    if not cond:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")


def bytes_of(t):
    """One-byte formats (fp8, e8m0, fp4x2) as uint8; wider dtypes unchanged."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def check_bits(got, expected, what):
    check(same_bits(got, expected), f"{what}: got {got!r}, expected {expected!r}")


def check_dispatch(out, ref, K, what):
    recv_x, recv_idx, recv_w, lst, handle, event = out
    check(event.is_complete(), f"{what}: event complete")
    check_bits(recv_x, ref["x"], f"{what}: recv_x")
    if K:
        check_bits(recv_idx, ref["idx"].to(recv_idx.dtype), f"{what}: recv_topk_idx")
        check_bits(recv_w, ref["w"], f"{what}: recv_topk_weights")
    check(handle.num_recv_rows == ref["N"] and handle.num_rows == ref["num_rows"], f"{what}: handle rows")
    check(handle.num_recv_tokens_per_expert == ref["list"], f"{what}: handle list")
    check(handle.num_recv_pairs_per_expert == ref["cnt"], f"{what}: handle cnt {handle.num_recv_pairs_per_expert}")
    check(handle.num_recv_rows_per_source == ref["per_source"], f"{what}: rows per source")
    for i, name in enumerate(("recv_src_rank", "recv_src_token", "recv_src_slot")):
        check_bits(getattr(handle, name), ref["src"][i], f"{what}: handle.{name}")
    check(isinstance(handle, tuple), f"{what}: handle is tuple-like")


def run_case(buf, rank, world, prob, mine, spec, order):
    """One case in one order on one Buffer; returns its outputs for the cross-strategy comparison."""
    E, K, H, align = spec["E"], spec["K"], spec["H"], spec["align"]
    what = f"{order}"
    results = {}
    # Layout (local).
    per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(mine["ids"], E)
    ref_rank, ref_expert, ref_in = layout(mine["ids"], E, world)
    check_bits(per_rank, ref_rank, "num_tokens_per_rank")
    check_bits(per_expert, ref_expert, "num_tokens_per_expert")
    # The default (ascend) flavor gives the Ascend port's i32 0/1 membership (docs/python.md).
    check_bits(in_rank, ref_in.to(torch.int32), "is_token_in_rank")
    check(per_rdma is None and ev.is_complete(), "num_tokens_per_rdma_rank is None on one node")

    # Fresh dispatch, with every layout tensor passed and checked; statistics accumulate.
    stats = torch.zeros(world, dtype=torch.int64)
    out = buf.dispatch(mine["x"], num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                       num_tokens_per_expert=per_expert, topk_idx=mine["ids"], topk_weights=mine["ws"],
                       expert_alignment=align, receive_order=order, dispatch_wait_recv_cost_stats=stats)
    ref = prob.dispatch(rank, order, align, idx_dtype=mine["ids"].dtype)
    check_dispatch(out, ref, K, f"{what} dispatch")
    check(out[3] == ref["list"], f"{what}: num_recv_tokens_per_expert_list {out[3]} vs {ref['list']}")
    check(bool((stats >= 0).all()), "dispatch statistics are non-negative")
    recv_x, recv_idx, recv_w, lst, handle, _ = out
    results["dispatch"] = (recv_x, recv_idx, recv_w, lst, handle.recv_src_rank, handle.recv_src_token,
                           handle.recv_src_slot)
    check(len(ref["rows"]) == recv_x.shape[0], "row count")

    # Combine 1: expert outputs that encode their source, another width and dtype, weights and a bias tuple.
    H2, dt2 = H + 3, torch.float32 if spec["dtype"] != torch.float32 else torch.float16
    y = torch.full((handle.num_rows, H2), float("nan"), dtype=dt2)  # PAD and tail rows are never read
    src_r, src_t, src_k = handle.recv_src_rank, handle.recv_src_token, handle.recv_src_slot
    for i in range(handle.num_rows):
        if int(src_r[i]) >= 0:
            c = int(src_k[i]) if order == "expert_major" else rank
            y[i] = tag(int(src_r[i]), int(src_t[i]), c, H2, dt2)
    g = torch.Generator().manual_seed(rank + 77)
    T = prob.T(rank)
    b0, b1 = torch.randn(T, H2, generator=g).to(dt2), torch.randn(T, H2, generator=g).to(dt2)
    w2 = torch.rand(T, K, generator=g)
    stats_c = torch.zeros(world, dtype=torch.int32)
    if order == "expert_major":
        cx, cw, ev = buf.combine(y, handle, topk_weights=w2, bias=(b0, b1), combine_send_cost_stats=stats_c)
        every_w2 = gather(w2)
        ref_x, ref_w = prob.combine(rank, order, H2, lambda d, s, t, k: tag(s, t, k, H2, dt2), weights=every_w2[rank],
                                    biases=(b0, b1), out_dtype=dt2)
    else:
        cx, cw, ev = buf.combine(y, handle, topk_weights=recv_w, bias=(b0, b1), combine_send_cost_stats=stats_c)
        every_g = gather((recv_w, handle.recv_src_rank, handle.recv_src_token))

        def g_of(d, s, t):
            w_d, r_d, t_d = every_g[d]
            i = int(((r_d == s) & (t_d == t)).nonzero()[0, 0])
            return w_d[i]

        ref_x, ref_w = prob.combine(rank, order, H2, lambda d, s, t, k: tag(s, t, d, H2, dt2), biases=(b0, b1),
                                    out_dtype=dt2, g_of=g_of)
        valid = mine["ids"] >= 0
        check_bits(cw, torch.where(valid, mine["ws"], torch.zeros_like(mine["ws"])),
                   "rank_major: fed-back recv_topk_weights return the original weights")
    check_bits(cx, ref_x, f"{what} combine (tagged, bias tuple)")
    check_bits(cw, ref_w, f"{what} combined_topk_weights")
    check(bool((stats_c >= 0).all()), "combine statistics are non-negative")
    results["combine tagged"] = (cx, cw)

    # Combine 2: recv_x fed back, no weights, one bias tensor (skipped for random bit patterns).
    if not spec.get("bits"):
        b = b0[:, :H].to(recv_x.dtype).contiguous()
        cx, cw, _ = buf.combine(recv_x, handle, bias=b)
        ref_x, ref_w = prob.combine(rank, order, H, lambda d, s, t, k: prob.xs[s][t], biases=(b,),
                                    out_dtype=recv_x.dtype)
        check_bits(cx, ref_x, f"{what} combine (fed back)")
        if order == "expert_major":
            check_bits(cw, ref_w, f"{what} combine (fed back) weights")
        else:
            check(cw is None, "rank_major without topk_weights returns None weights")
        results["combine fed back"] = (cx,)

    # Cached re-dispatch: another width and dtype along the same routes.
    x2 = (torch.arange(T * (H + 5), dtype=torch.float32).reshape(T, H + 5) + 1000 * rank)
    every_x2 = gather(x2)
    r2 = buf.dispatch(x2, handle=handle)
    check(r2[1] is None and r2[2] is None and r2[3] is None and r2[4] is None, "cached dispatch returns Nones")
    ref2 = prob.dispatch(rank, order, align, payload=lambda s: every_x2[s])
    check_bits(r2[0], ref2["x"], f"{what} cached dispatch")
    results["cached"] = (r2[0],)

    # Asynchronous calls chained through previous_event, with tiny chunks and one copy thread: results equal
    # the synchronous ones; statistics keep accumulating.
    before = stats.clone()
    out_a = buf.dispatch(mine["x"], num_tokens_per_expert=per_expert, topk_idx=mine["ids"], topk_weights=mine["ws"],
                         expert_alignment=align, receive_order=order, async_finish=True,
                         config=epcomm.Config(1, 1, 2, 1, 2), dispatch_wait_recv_cost_stats=stats)
    out_a[5].wait()
    check_dispatch(out_a, ref, K, f"{what} async dispatch")
    check(bool((stats >= before).all()), "statistics never decrease")
    with out_a[5]:
        pass
    cx_a, _, ev_a = buf.combine(y, out_a[4], topk_weights=w2 if order == "expert_major" else recv_w, bias=(b0, b1),
                                previous_event=out_a[5], async_finish=True)
    with ev_a:
        pass
    check(ev_a.is_complete(), "with event: waited")
    check_bits(cx_a, results["combine tagged"][0], f"{what} async combine")

    # Worst-case outputs: exact prefix, zero / -1 tail, empty list.
    if spec.get("worst"):
        N_max = max(gather(ref["N"]))
        worst = N_max + 3
        out_w = buf.dispatch(mine["x"], num_tokens_per_expert=per_expert, topk_idx=mine["ids"],
                             topk_weights=mine["ws"], expert_alignment=align, receive_order=order,
                             num_worst_tokens=worst)
        ref_w_ = prob.dispatch(rank, order, align, num_worst_tokens=worst, idx_dtype=mine["ids"].dtype)
        check_dispatch(out_w, ref_w_, K, f"{what} worst")
        check(out_w[3] == [], "worst case: empty list")
        h = out_w[4]
        yw = torch.full((worst, H2), float("nan"), dtype=dt2)
        yw[: handle.num_rows] = y
        cx, _, _ = buf.combine(yw, h, topk_weights=w2 if order == "expert_major" else out_w[2], bias=(b0, b1))
        check_bits(cx, results["combine tagged"][0], f"{what} worst combine (NaN tail never read)")
        results["worst"] = out_w[:3]
    return results


def no_topk_case(buf, rank, world, seed):
    """rank_major without top-k: is_token_in_rank alone decides; the list comes from num_tokens_per_expert."""
    g = torch.Generator().manual_seed(seed + rank)
    T, H, E = [3, 5, 0, 4][rank % 4], 6, 2 * world
    itr = torch.randint(0, 2, (T, world), generator=g).to(torch.bool)
    npe = torch.randint(0, 4, (E,), generator=g).to(torch.int32)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    every = gather((x, itr, npe))
    prob = Problem(world, E, [e[0] for e in every], in_ranks=[e[1] for e in every], npes=[e[2] for e in every])
    out = buf.dispatch(x, is_token_in_rank=itr, num_tokens_per_expert=npe, receive_order="rank_major",
                       expert_alignment=2)
    ref = prob.dispatch(rank, "rank_major", 2)
    check(out[1] is None and out[2] is None, "no top-k: no recv_topk_idx/weights")
    check_dispatch(out, ref, 0, "rank_major without top-k")
    cx, cw, _ = buf.combine(out[0], out[4])
    ref_x, _ = prob.combine(rank, "rank_major", H, lambda d, s, t, k: prob.xs[s][t])
    check_bits(cx, ref_x, "rank_major without top-k: combine")
    check(cw is None, "no weights")
    return (out[0], cx)


def quant_cases(buf, rank, world, seed):
    """Quantized payloads: the environment switch, quant_mode, and tuple input moved verbatim."""
    g = torch.Generator().manual_seed(seed + 31 * rank)
    T, E, K = [5, 0, 4, 3][rank % 4], 2 * world, 2
    ids = torch.randint(-1, E, (T, K), generator=g)
    ws = torch.rand(T, K, generator=g)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
    results = {}
    for label, H, mode, env in (("int8 env", 40, None, "1"), ("pergroup", 200, "pergroup_fp8_e4m3", None),
                                ("mxfp4", 64, "mx_fp4_e2m1", None), ("mxfp8 e5m2", 64, "mx_fp8_e5m2", None)):
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        every_x = gather(x)
        prob = Problem(world, E, every_x, [e.to(torch.int64) for e in gather(ids)], gather(ws))
        qmode = mode or "int8"
        quant = [epcomm.quantize(xs, qmode) for xs in every_x]
        if env:
            os.environ["DEEP_NORMAL_MODE_USE_INT8_QUANT"] = env
        try:
            for order in ORDERS:
                out = buf.dispatch(x, num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=ws,
                                   receive_order=order, quant_mode=mode)
                data, scales = out[0]
                ref_d = prob.dispatch(rank, order, payload=lambda s: quant[s][0].view(torch.uint8))
                # One-byte scales (float8_e8m0fnu) are compared as their bytes.
                ref_s = prob.dispatch(rank, order,
                                      payload=lambda s: bytes_of(quant[s][1]).reshape(quant[s][0].shape[0], -1))
                check_bits(data.view(torch.uint8), ref_d["x"], f"{label} {order}: data")
                exp_s = ref_s["x"].reshape(scales.shape) if mode and mode.startswith("mx") else \
                    ref_s["x"].reshape(-1) if qmode == "int8" else ref_s["x"]
                check_bits(bytes_of(scales), exp_s, f"{label} {order}: scales")
                results[(label, order)] = (data.view(torch.uint8), scales)
                if mode == "mx_fp8_e5m2":  # the same bytes as a pre-quantized tuple: moved verbatim
                    q = epcomm.quantize(x, mode)
                    out_t = buf.dispatch((q[0], q[1]), num_tokens_per_expert=per_expert, topk_idx=ids,
                                         topk_weights=ws, receive_order=order, quant_mode=mode)
                    check_bits(out_t[0][0].view(torch.uint8), data.view(torch.uint8), f"tuple input {order}")
        finally:
            os.environ.pop("DEEP_NORMAL_MODE_USE_INT8_QUANT", None)
    return results


def compare_results(a, b, where):
    for key in a:
        for i, (u, v) in enumerate(zip(a[key], b[key])):
            if isinstance(u, torch.Tensor):
                check(same_bits(u, v), f"{where} {key}[{i}]: shm and alltoall differ")
            else:
                check(u == v, f"{where} {key}[{i}]: shm and alltoall differ: {u} vs {v}")


def normal_mode_job(rank, world, seed):
    per_mode = {}
    for mode in ("shm", "alltoall"):
        use_mode(mode)
        buf = epcomm.Buffer(dist.group.WORLD)
        check(buf.mode == mode and buf.num_ranks == world and buf.rank == rank, "Buffer accessors")
        res = {}
        for name, spec in cases(world):
            prob, mine = make_problem(rank, world, seed, spec)
            for order in ORDERS:
                res[(name, order)] = run_case(buf, rank, world, prob, mine, spec, order)
        res[("no topk", "rank_major")] = {"out": no_topk_case(buf, rank, world, seed)}
        res[("quant", "")] = quant_cases(buf, rank, world, seed)
        buf.destroy()
        per_mode[mode] = res
    for key in per_mode["shm"]:
        compare_results(per_mode["shm"][key], per_mode["alltoall"][key], str(key))


def test_normal_mode_2_ranks():
    spawn(normal_mode_job, 2, 1)


def test_normal_mode_4_ranks():
    spawn(normal_mode_job, 4, 2)


def distinct_routing(seed, T, H, E, K):
    """bf16 tokens, K distinct experts per token and their weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int64)
    return x, ids, torch.rand(T, K, generator=g)


def routed_args(buf, ids, w, E, **extra):
    """The dispatch keyword arguments of a fresh call: the layout of `ids` plus top-k."""
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=ids, topk_weights=w, **extra)


def expect_no_area(call, option, allowed=False):
    """call() on a Buffer without the shared area raises InvalidUsageError naming `option` = 0 (unless
    `allowed`: then it may also succeed, e.g. an empty area request)."""
    try:
        call()
        check(allowed, f"no error without {option}")
    except epcomm.InvalidUsageError as e:
        check(f"{option} = 0" in str(e), f"message: {e}")


def shared_input_job(rank, world):
    """combine from Buffer.get_combine_input equals combine from the dispatched tensor, bit for bit, in both
    modes and orders; the area is the same memory on every call; too small an area raises InvalidUsageError."""
    E, K, H, T = 4 * world, 3, 64, 20 + rank
    x, ids, w = distinct_routing(10 + rank, T, H, E, K)
    for mode in ("shm", "alltoall"):
        use_mode(mode)
        buf = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=4 << 20, num_combine_input_bytes=4 << 20)
        for order in ORDERS:
            recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, **routed_args(buf, ids, w, E, receive_order=order))
            weights = recv_w if order == "rank_major" else None
            a, aw, _ = buf.combine(recv_x, handle, topk_weights=weights)
            sx = buf.get_combine_input(handle)
            check(sx.shape == recv_x.shape and sx.dtype == torch.bfloat16, f"shape {tuple(sx.shape)}")
            sx.copy_(recv_x)
            b, bw, _ = buf.combine(sx, handle, topk_weights=weights)
            check(torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{mode} {order}: combine differs")
            check((aw is None) == (bw is None) and (aw is None or torch.equal(aw, bw)), "weights differ")
            if mode == "shm":
                check(buf.get_combine_input(handle).data_ptr() == sx.data_ptr(), "the area moved")
                f32 = buf.get_combine_input(handle, torch.float32, 8)
                check(f32.shape == (handle.num_rows, 8) and f32.dtype == torch.float32, "f32 view")
        buf.destroy()
    use_mode("shm")
    small = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=4 << 20)
    handle = small.dispatch(x, **routed_args(small, ids, w, E))[4]
    expect_no_area(lambda: small.get_combine_input(handle), "num_combine_input_bytes", allowed=handle.num_rows == 0)
    small.destroy()


def test_combine_shared_input_2_ranks():
    spawn(shared_input_job, 2)


def shared_dispatch_input_job(rank, world):
    """dispatch from Buffer.get_dispatch_input equals dispatch from a private x, bit for bit, in both modes
    and orders, fresh and cached; the copy counters show that no token was staged; outputs are large
    enough to come from the caching allocator (>= 2 MiB) and stay valid after the Buffer reuses memory."""
    E, K, H, T = 4 * world, 3, 4096, 300 + rank
    x, ids, w = distinct_routing(20 + rank, T, H, E, K)
    for mode in ("shm", "alltoall"):
        use_mode(mode)
        buf = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=4 << 20, num_dispatch_input_bytes=(300 + world) * H * 2,
                            num_output_reserve_bytes=64 << 20)
        for order in ORDERS:
            args = routed_args(buf, ids, w, E, receive_order=order)
            c0 = buf.copy_counters()
            a = buf.dispatch(x, **args)
            if mode == "shm":  # one node: an arena unless the environment turned it off
                check((buf.num_output_arena_bytes > 0) == (os.environ.get("EPCOMM_OUTPUT_ARENA") != "0"),
                      f"num_output_arena_bytes {buf.num_output_arena_bytes}")
            if mode == "shm" and buf.num_output_arena_bytes > 0:
                # A private x is pushed; its recv_x fed back is combined straight from the holders (no windows);
                # a cached dispatch on its handle pushes to the same rows.
                cx = buf.combine(a[0], a[4])[0]
                ca = buf.dispatch(x, handle=a[4])[0]
                c1 = buf.copy_counters()
                check(c1["dispatch_pushed_tokens"] - c0["dispatch_pushed_tokens"] == 2 * T, f"pushed: {c0} -> {c1}")
                check(c1["combine_direct_tokens"] - c0["combine_direct_tokens"] == T, f"direct: {c0} -> {c1}")
                check(torch.equal(ca.view(torch.int16), a[0].view(torch.int16)), f"{order}: pushed cached differs")
                check(cx.shape == (T, H), f"combined shape {tuple(cx.shape)}")
            sx = buf.get_dispatch_input(T, H)
            check(sx.shape == (T, H) and sx.dtype == torch.bfloat16, f"shape {tuple(sx.shape)}")
            sx.copy_(x)
            before = buf.copy_counters()
            b = buf.dispatch(sx, **args)
            cb = buf.dispatch(sx, handle=b[4])[0]
            after = buf.copy_counters()
            for i in (0, 1, 2):
                check(torch.equal(a[i].view(torch.int16) if i == 0 else a[i], b[i].view(torch.int16) if i == 0
                                  else b[i]), f"{mode} {order}: output {i} differs")
            check(torch.equal(cb.view(torch.int16), a[0].view(torch.int16)), f"{mode} {order}: cached differs")
            if mode == "shm":
                check(after["dispatch_in_place_tokens"] - before["dispatch_in_place_tokens"] == 2 * T,
                      f"in place: {before} -> {after}")
                check(after["dispatch_staged_tokens"] == before["dispatch_staged_tokens"],
                      f"staged: {before} -> {after}")
                check(buf.get_dispatch_input(T, H).data_ptr() == sx.data_ptr(), "the area moved")
        buf.destroy()
    use_mode("shm")
    small = epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=4 << 20)
    expect_no_area(lambda: small.get_dispatch_input(T, H), "num_dispatch_input_bytes")
    small.destroy()


def test_dispatch_shared_input_2_ranks():
    spawn(shared_dispatch_input_job, 2)
