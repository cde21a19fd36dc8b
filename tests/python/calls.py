"""Random valid calls of the Python API and their expected results, shared by the fuzz (test_fuzz.py) and the
soak (test_soak.py) tests. Every rank builds every rank's arguments from one seed, without communication, so
that it can compute its own expected outputs with the plain-torch reference (reference.py) from the arguments
every rank actually passed (mutated or not), and compare them bit for bit.

Normal mode: NormalCall (a fresh dispatch, then a combine and a cached dispatch on its handle). Operators:
V2Call (dispatch_v2, then combine_v2 with identity experts). Arguments are keyword dicts in the API's own
names; expected_* take the list of every rank's (effective) keyword dicts."""
import torch

import epcomm
from epcomm import ops
from reference import Problem, V2Layout, layout, same_bits, v2_combine, v2_dispatch

ORDERS = ("expert_major", "rank_major")
QUANT_MODES = ("int8", "pertoken_fp8_e4m3", "pergroup_fp8_e4m3", "mx_fp8_e4m3", "mx_fp8_e5m2", "mx_fp4_e2m1")
FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class WrongResult(AssertionError):
    """An output that differs from the reference."""


def check(cond, what):
    if not cond:
        raise WrongResult(what)


def show(t):
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return f"{t.dtype} {list(t.shape)} {t.flatten()[:24].tolist()}{' ...' if t.numel() > 24 else ''}"


def byte_rows(t):
    """One-byte formats (fp8, e8m0, fp4x2) as uint8; wider dtypes unchanged."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.bool else t


def check_bits(got, want, what):
    check(isinstance(got, torch.Tensor) and same_bits(got, want), f"{what}: got {show(got)}, expected {show(want)}")


def tagged(s, t, c, hidden, dtype):
    """An expert output row that encodes its source (s, t) and slot or rank c (exact in every float dtype)."""
    return (torch.arange(hidden, dtype=torch.float32) / 16 + (s * 64 + t * 4 + c + 1) / 4).to(dtype)


# ---- normal mode --------------------------------------------------------------------------------------------

def normal_case(rng, world, max_tokens=8):
    """A random fresh-dispatch problem (all ranks agree) plus the variants of its combine and cached dispatch."""
    E = world * rng.choice((1, 2, 3))
    quant = rng.choice((None,) * 5 + QUANT_MODES)
    H = rng.choice((32, 64)) if quant and quant.startswith("mx") else rng.choice((8, 16, 24, 40))
    dtype = rng.choice(FLOATS)
    case = dict(
        seed=rng.getrandbits(31), E=E, K=rng.randint(1, 4), H=H, dtype=dtype,
        T=[0 if rng.random() < 0.2 else rng.randint(1, max_tokens) for _ in range(world)],
        bits=quant is None and dtype == torch.bfloat16 and rng.random() < 0.3,
        order=rng.choice(ORDERS), align=rng.choice((1, 1, 2, 3)), worst=rng.random() < 0.2,
        worst_extra=rng.randint(0, 3), quant=quant, tuple=quant is not None and rng.random() < 0.3,
        layout=rng.random() < 0.5, in_rank_i32=rng.random() < 0.5, idx32=rng.random() < 0.25,
        async_=rng.random() < 0.2,
        # combine: width, dtype, weights, bias (None, "tensor" or "tuple")
        H2=H + rng.choice((0, 0, 3)), dt2=rng.choice(FLOATS), weights=rng.random() < 0.5,
        bias=rng.choice((None, "tensor", "tuple")),
        # cached dispatch: width, dtype, quant mode
        H3=rng.choice((8, 32)), dt3=rng.choice(FLOATS), quant3=rng.choice((None, None, "int8", "mx_fp8_e4m3")))
    if case["quant3"] == "mx_fp8_e4m3":
        case["H3"] = 32  # MX blocks of 32 columns
    return case


def normal_inputs(case, s):
    """Rank s's tokens (tagged with (s, t) in columns 0 and 1, or random bit patterns), ids (-1 slots and a
    repeated expert included) and weights."""
    g = torch.Generator().manual_seed(case["seed"] * 1009 + s)
    T, E, K, H = case["T"][s], case["E"], case["K"], case["H"]
    ids = torch.randint(-1, E, (T, K), generator=g)
    if T and K > 1:
        ids[0, 1] = ids[0, 0]
    ws = torch.rand(T, K, generator=g)
    if case["bits"]:
        x = torch.randint(-(2**15), 2**15, (T, H), dtype=torch.int32, generator=g).to(torch.int16).view(torch.bfloat16)
    else:
        x = torch.randn(T, H, generator=g)
        x[:, 0], x[:, 1] = s, torch.arange(T)
        x = x.to(case["dtype"])
    return dict(x=x, ids=ids.to(torch.int32) if case["idx32"] else ids, ws=ws)


def payload_of(kw):
    """(data [T, ...], scale rows [T, n] or None) that a dispatch with these arguments sends of each token."""
    x = kw["x"]
    if isinstance(x, tuple):
        data, scales = x
    elif kw.get("quant_mode") is not None:
        data, scales = epcomm.quantize(x, kw["quant_mode"])
    else:
        return x, None
    return data, scales


def scale_rows(scales):
    """Scales as [T, per row] bytes-compatible rows: 1-D scales hold one per token (int8, per-token fp8; the
    tests pass MX scales 2-D, as epcomm.quantize returns them)."""
    s = byte_rows(scales)
    return s.reshape(-1, 1) if s.dim() == 1 else s


def problem_of(kws, world):
    """The reference Problem of every rank's fresh-dispatch arguments."""
    E = int(kws[0]["num_tokens_per_expert"].numel())
    xs = [payload_of(kw)[0] for kw in kws]
    return Problem(world, E, xs, [kw["topk_idx"].to(torch.int64) for kw in kws], [kw["topk_weights"] for kw in kws])


def expected_dispatch(kws, d, world, payloads=None):
    """Rank d's expected dispatch outputs, from every rank's arguments (kws), as a dict: x, scales (None for
    plain rows), idx, w, list, and the handle's N, num_rows, cnt, per_source, src [3, rows]."""
    kw = kws[d]
    prob = problem_of(kws, world)
    order = kw.get("receive_order") or "expert_major"
    align, worst = kw.get("expert_alignment", 1), kw.get("num_worst_tokens", 0)
    payloads = payloads or [payload_of(k) for k in kws]
    ref = prob.dispatch(d, order, align, worst, payload=lambda s: byte_rows(payloads[s][0]),
                        idx_dtype=kw["topk_idx"].dtype)
    ref["scales"] = None
    scales = payloads[d][1]
    if scales is not None:
        rows = prob.dispatch(d, order, align, worst, payload=lambda s: scale_rows(payloads[s][1]))["x"]
        n = rows.shape[0]
        flat = scales.dim() == 1 or scales.element_size() == 1  # [n] per-token, [n * H / 32] e8m0
        ref["scales"] = rows.reshape(n) if scales.dim() == 1 else rows.reshape(-1) if flat else rows
    if worst > 0:
        ref["list"] = []
    return ref


def check_dispatch(out, ref, what):
    recv_x, recv_idx, recv_w, lst, handle, event = out
    check(event.is_complete(), f"{what}: event not complete after wait()")
    if ref["scales"] is None:
        check_bits(recv_x, ref["x"], f"{what}: recv_x")
    else:
        check(isinstance(recv_x, tuple) and len(recv_x) == 2, f"{what}: recv_x is not a (data, scales) tuple")
        check_bits(byte_rows(recv_x[0]), ref["x"], f"{what}: recv_x data")
        check_bits(byte_rows(recv_x[1]), ref["scales"], f"{what}: recv_x scales")
    check_bits(recv_idx, ref["idx"], f"{what}: recv_topk_idx")
    check_bits(recv_w, ref["w"], f"{what}: recv_topk_weights")
    check(lst == ref["list"], f"{what}: num_recv_tokens_per_expert_list {lst}, expected {ref['list']}")
    check_handle(handle, ref, what)


def check_handle(handle, ref, what):
    check(handle.num_recv_rows == ref["N"] and handle.num_rows == ref["num_rows"],
          f"{what}: handle rows {handle.num_recv_rows}/{handle.num_rows}, expected {ref['N']}/{ref['num_rows']}")
    check(handle.num_recv_pairs_per_expert == ref["cnt"], f"{what}: handle.num_recv_pairs_per_expert")
    check(handle.num_recv_rows_per_source == ref["per_source"], f"{what}: handle.num_recv_rows_per_source")
    for i, name in enumerate(("recv_src_rank", "recv_src_token", "recv_src_slot")):
        check_bits(getattr(handle, name), ref["src"][i], f"{what}: handle.{name}")


class NormalCall:
    """A fresh dispatch of `case` on `world` ranks, and the combine and cached dispatch that follow it. Every
    rank builds every rank's arguments (dispatch_kwargs(s), combine_kwargs(s), cached_kwargs(s))."""

    def __init__(self, case, world):
        self.case, self.world = case, world
        self.inputs = [normal_inputs(case, s) for s in range(world)]
        self.worst = 0
        if case["worst"]:
            kws = [self.dispatch_kwargs(s) for s in range(world)]
            prob = problem_of(kws, world)
            n = max(len(prob.rows(d, case["order"], case["align"])[0]) for d in range(world))
            self.worst = n + case["worst_extra"]
        self._expected = {}

    def reference(self):
        """The reference Problem of the unchanged dispatch."""
        return problem_of([self.dispatch_kwargs(s) for s in range(self.world)], self.world)

    def dispatch_kwargs(self, s):
        c, i = self.case, self.inputs[s]
        per_rank, per_expert, in_rank = layout(i["ids"].to(torch.int64), c["E"], self.world)
        kw = dict(x=i["x"], topk_idx=i["ids"], topk_weights=i["ws"], num_tokens_per_expert=per_expert,
                  expert_alignment=c["align"], num_worst_tokens=self.worst, receive_order=c["order"])
        if c["quant"] and c["tuple"]:
            kw["x"] = epcomm.quantize(i["x"], c["quant"])
        elif c["quant"]:
            kw["quant_mode"] = c["quant"]
        if c["layout"]:
            kw.update(num_tokens_per_rank=per_rank,
                      is_token_in_rank=in_rank.to(torch.int32) if c["in_rank_i32"] else in_rank)
        if c["async_"]:
            kw["async_finish"] = True
        return kw

    def expected(self, d):
        """Rank d's expected outputs of the unmutated dispatch."""
        if d not in self._expected:
            self._expected[d] = expected_dispatch([self.dispatch_kwargs(s) for s in range(self.world)], d, self.world)
        return self._expected[d]

    def combine_kwargs(self, d):
        """Rank d's combine arguments except the handle: expert outputs that encode their row's source (PAD
        and tail rows NaN: never read), explicit weights (expert_major) or the received ones (rank_major), a
        bias tensor or tuple."""
        c, ref = self.case, self.expected(d)
        H2, dt2, order = c["H2"], c["dt2"], c["order"]
        y = torch.full((ref["num_rows"], H2), float("nan"), dtype=dt2)
        for i in range(ref["num_rows"]):
            s, t, k = (int(v) for v in ref["src"][:, i])
            if s >= 0:
                y[i] = tagged(s, t, k if order == "expert_major" else d, H2, dt2)
        kw = dict(x=y)
        g = torch.Generator().manual_seed(c["seed"] * 7 + d)
        T = c["T"][d]
        if c["weights"]:
            kw["topk_weights"] = torch.rand(T, c["K"], generator=g) if order == "expert_major" else ref["w"]
        if c["bias"] == "tensor":
            kw["bias"] = torch.randn(T, H2, generator=g).to(dt2)
        elif c["bias"] == "tuple":
            kw["bias"] = (torch.randn(T, H2, generator=g).to(dt2), torch.randn(T, H2, generator=g).to(dt2))
        if c["async_"]:
            kw["async_finish"] = True
        return kw

    def expected_combine(self, ckws, r):
        """(combined_x, combined_topk_weights or None) on origin r, from every rank's combine arguments."""
        order = self.case["order"]
        prob = problem_of([self.dispatch_kwargs(s) for s in range(self.world)], self.world)
        rows = []
        for d in range(self.world):
            src = self.expected(d)["src"]
            rows.append({tuple(int(v) for v in src[:, i]): i for i in range(src.shape[1]) if int(src[0, i]) >= 0})

        def y_of(d, s, t, k):
            return ckws[d]["x"][rows[d][(s, t, k)]]

        def g_of(d, s, t):
            return ckws[d]["topk_weights"][rows[d][(s, t, -1)]]

        bias = ckws[r].get("bias")
        biases = () if bias is None else tuple(bias) if isinstance(bias, tuple) else (bias,)
        x = ckws[r]["x"]
        weights = ckws[r].get("topk_weights") if order == "expert_major" else None
        with_g = order == "rank_major" and ckws[r].get("topk_weights") is not None
        return prob.combine(r, order, x.shape[1], y_of, weights=weights, biases=biases, out_dtype=x.dtype,
                            g_of=g_of if with_g else None)

    def cached_kwargs(self, d):
        c = self.case
        g = torch.Generator().manual_seed(c["seed"] * 13 + d)
        T, H3 = c["T"][d], c["H3"]
        x = torch.randn(T, H3, generator=g)
        x[:, 0], x[:, 1] = d + 0.5, torch.arange(T)
        kw = dict(x=x.to(c["dt3"]))
        if c["quant3"]:
            kw["quant_mode"] = c["quant3"]
        return kw

    def expected_cached(self, xkws, d):
        """Rank d's recv_x (or (data, scales)) of a cached dispatch of every rank's new arguments xkws."""
        kws = [self.dispatch_kwargs(s) for s in range(self.world)]
        return expected_dispatch(kws, d, self.world, payloads=[payload_of(k) for k in xkws])


def check_combine(out, ref, what):
    cx, cw, event = out
    check(event.is_complete(), f"{what}: event not complete after wait()")
    check_bits(cx, ref[0], f"{what}: combined_x")
    if ref[1] is None:
        check(cw is None, f"{what}: combined_topk_weights should be None, got {show(cw)}")
    else:
        check_bits(cw, ref[1], f"{what}: combined_topk_weights")


def check_cached(out, ref, what):
    check(all(v is None for v in out[1:5]), f"{what}: a cached dispatch returns (recv_x, None, None, None, None, event)")
    recv_x = out[0]
    if ref["scales"] is None:
        check_bits(recv_x, ref["x"], f"{what}: recv_x")
    else:
        check(isinstance(recv_x, tuple), f"{what}: recv_x is not a (data, scales) tuple")
        check_bits(byte_rows(recv_x[0]), ref["x"], f"{what}: recv_x data")
        check_bits(byte_rows(recv_x[1]), ref["scales"], f"{what}: recv_x scales")


# ---- the operators (dispatch_v2 / combine_v2) ----------------------------------------------------------------

def v2_case(rng, world, max_tokens=6):
    Sr = 1 if world > 1 and rng.random() < 0.25 else 0
    L = rng.choice((1, 2, 3))
    E = L * (world - Sr)
    H = rng.choice((8, 16, 32))
    bs = rng.randint(0, max_tokens)
    global_bs = 0 if rng.random() < 0.5 else world * (bs + rng.randint(0, 2))
    return dict(
        seed=rng.getrandbits(31), Sr=Sr, S=1 if Sr else rng.choice((0, 1)), E=E, K=rng.randint(1, min(3, E)),
        H=H, dtype=rng.choice((torch.bfloat16, torch.float16)), global_bs=global_bs,
        T=[bs if global_bs == 0 else rng.randint(0, bs) for _ in range(world)],
        mask=rng.choice((None, None, 1, 2)), scales=rng.random() < 0.7, token_nums_type=rng.choice((0, 1)),
        quant_mode=rng.choice((0, 0, 0, 2, 3, 4)), comm_quant=2 if H % 8 == 0 and rng.random() < 0.3 else 0,
        shared_x=Sr == 0 and rng.random() < 0.3)


def v2_inputs(case, r):
    """Rank r's tokens (tagged (r, t) in columns 0 and 1), distinct ids per row, weights, mask, shared_x."""
    g = torch.Generator().manual_seed(case["seed"] * 3001 + r)
    T, E, K, H = case["T"][r], case["E"], case["K"], case["H"]
    x = torch.randint(-16, 17, (T, H), generator=g).float() / 8
    x[:, 0], x[:, 1] = r, torch.arange(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K)
    ids = ids.to(torch.int32).reshape(T, K)
    w = (torch.randint(1, 8, (T, K), generator=g).float() / 8).reshape(T, K)
    mask = None
    if case["mask"] == 1:
        mask = torch.arange(T) < int(torch.randint(0, T + 1, (1,), generator=g))
    elif case["mask"] == 2:
        mask = torch.rand(T, K, generator=g) < 0.7
        ids = torch.where(mask, ids, torch.full_like(ids, -1))  # inactive slots are never read
    sx = (torch.randint(-8, 9, (T, H), generator=g).float() / 4).to(case["dtype"]) if case["shared_x"] else None
    return dict(x=x.to(case["dtype"]), ids=ids, w=w, mask=mask, shared_x=sx)


def v2_layout(kw):
    return V2Layout(kw["ep_world_size"], kw["moe_expert_num"], kw["expert_ids"].shape[1],
                    kw.get("shared_expert_rank_num", 0), kw.get("shared_expert_num", 1), kw.get("global_bs", 0),
                    kw["x"].shape[0])


def v2_bounds_ok(got, x, mode, scales):
    """Dequantized rows of quant modes 2-4 within the format's error bound of docs/normal-mode.md (per element:
    int8 (0.5 + 2^-12) * scale; fp8 2^-3 |x| (e4m3 rounding plus MX saturation) + a subnormal step)."""
    keep = torch.isfinite(x.float()).all(dim=1)  # rows with NaN/Inf follow docs/quant.md's rules: not checked here
    got, x, scales = got.float()[keep], x[keep], scales[:x.shape[0]].view(torch.uint8 if scales.element_size() == 1 else scales.dtype)[keep]
    n, H = x.shape
    xf = x.float()
    if mode == 2:
        s = scales[:n].reshape(n, 1)
        return bool(((got.float() * s - xf).abs() <= (0.5 + 2 ** -12) * s + 1e-7).all())
    if mode == 3:
        s = scales[:n].repeat_interleave(128, dim=1)[:, :H]
    else:
        e = scales[:n].view(torch.uint8).to(torch.int32)[:, :(H + 31) // 32]
        s = torch.pow(2.0, (e - 127).float()).repeat_interleave(32, dim=1)[:, :H]
    deq = got.float() * s
    return bool(((deq - xf).abs() <= 2 ** -3 * xf.abs() + 2 ** -9 * s).all())


class V2Call:
    """dispatch_v2 of `case` on `world` ranks (group: the process group), then combine_v2 with identity
    experts (every rank returns its expand_x)."""

    def __init__(self, case, world, group):
        self.case, self.world, self.group = case, world, group
        self.inputs = [v2_inputs(case, r) for r in range(world)]

    def dispatch_kwargs(self, r):
        c, i = self.case, self.inputs[r]
        return dict(x=i["x"], expert_ids=i["ids"], group_ep=self.group, ep_world_size=self.world, ep_rank_id=r,
                    moe_expert_num=c["E"], expert_scales=i["w"] if c["scales"] else None, x_active_mask=i["mask"],
                    shared_expert_num=c["S"], shared_expert_rank_num=c["Sr"], global_bs=c["global_bs"],
                    expert_token_nums_type=c["token_nums_type"], quant_mode=c["quant_mode"])

    def combine_kwargs(self, r):
        """Rank r's combine_v2 arguments: its (mode-0) dispatch outputs fed back unchanged."""
        kws = [dict(self.dispatch_kwargs(s), quant_mode=0) for s in range(self.world)]
        ref = expected_v2_dispatch(kws, r)
        c, i = self.case, self.inputs[r]
        return dict(expand_x=ref[0], expert_ids=i["ids"], assist_info_for_combine=ref[2], ep_send_counts=ref[4],
                    expert_scales=i["w"], group_ep=self.group, ep_world_size=self.world, ep_rank_id=r,
                    moe_expert_num=c["E"], x_active_mask=i["mask"], shared_expert_num=c["S"],
                    shared_expert_rank_num=c["Sr"], global_bs=c["global_bs"], comm_quant_mode=c["comm_quant"],
                    shared_expert_x=i["shared_x"])


def expected_v2_dispatch(kws, p):
    """Rank p's dispatch_v2 outputs in mode 0 (quant modes: the mode-0 rows, see check_v2_dispatch)."""
    lay = v2_layout(kws[p])
    return v2_dispatch(lay, [k["x"] for k in kws], [k["expert_ids"] for k in kws],
                       [k.get("x_active_mask") for k in kws], [k.get("expert_scales") for k in kws], p,
                       kws[p].get("expert_token_nums_type", 1))


def check_v2_dispatch(out, kws, p, what):
    ref = expected_v2_dispatch(kws, p)
    mode = kws[p].get("quant_mode", 0)
    names = ("expand_x", "dynamic_scales", "assist_info_for_combine", "expert_token_nums", "ep_recv_counts",
             "tp_recv_counts", "expand_scales")
    check(len(out) == 7, f"{what}: {len(out)} outputs")
    for i, name in enumerate(names):
        if mode and i in (0, 1):
            continue
        check_bits(out[i], ref[i], f"{what}: {name}")
    if mode:
        n = int(ref[4][-1]) if ref[4].numel() else 0
        A, H = ref[0].shape
        ex, sc = out[0], out[1]
        want = {2: torch.int8, 3: torch.float8_e4m3fn, 4: torch.float8_e4m3fn}[mode]
        check(ex.dtype == want and list(ex.shape) == [A, H], f"{what}: expand_x {ex.dtype} {list(ex.shape)}")
        check(v2_bounds_ok(ex[:n], ref[0][:n], mode, sc), f"{what}: quantized rows outside the error bound")
        check(not byte_rows(ex[n:]).any() and not byte_rows(sc[n:]).any(), f"{what}: non-zero tail rows")


def expected_v2_combine(ckws, r):
    kw = ckws[r]
    lay = v2_layout(dict(kw, x=torch.empty(kw["expert_ids"].shape[0], 0)))
    holders = []
    for d, k in enumerate(ckws):
        n_own = int(k["ep_send_counts"][lay.W * lay.local_experts(d) - 1])
        holders.append((k["expand_x"], k["assist_info_for_combine"], n_own))
    return v2_combine(lay, r, kw["expert_ids"], kw.get("x_active_mask"), kw["expert_scales"], holders,
                      kw.get("comm_quant_mode", 0), kw.get("shared_expert_x"))


def same_values(a, b):
    """Bitwise equal, except that any two NaNs match (the operators' spec defines no NaN payload)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = torch.isnan(a.float())
    return torch.equal(nan, torch.isnan(b.float())) and same_bits(torch.where(nan, 0, a), torch.where(nan, 0, b))


def check_v2_combine(out, ckws, r, what):
    ref = expected_v2_combine(ckws, r)
    check(isinstance(out, torch.Tensor) and same_values(out, ref), f"{what}: x: got {show(out)}, expected {show(ref)}")


def run_v2_dispatch(kw):
    return ops.npu_moe_distribute_dispatch_v2(**kw)


def run_v2_combine(kw):
    return ops.npu_moe_distribute_combine_v2(**kw)


__all__ = ["ORDERS", "QUANT_MODES", "NormalCall", "V2Call", "WrongResult", "check", "check_cached",
           "check_combine", "check_dispatch", "check_v2_combine", "check_v2_dispatch",
           "expected_v2_dispatch", "normal_case", "run_v2_combine", "run_v2_dispatch", "v2_case"]
