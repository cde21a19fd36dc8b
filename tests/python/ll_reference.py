"""A plain-torch reference of low-latency mode, flavor "ascend" (low-latency.md §4 on distribute-v2.md §3-§6)
and of the quantizers it names (quant.md §3.2, §3.3, §2.3), written from the spec only: Python loops over ranks,
tokens and slots, computed from every rank's inputs. It shares nothing with epcomm."""
import struct

import torch


def rows_of(p, ids, E, R, shared_ranks=0):
    """Receiving rank p: (rows, cnt, nums) with rows = [(s, t, k)] in dispatch_v2's EP receive order (local
    expert, then source rank, then the sender's order t*K + k), cnt = ep_recv_counts (the inclusive running
    total after each block j*R + s) and nums = per-local-expert counts. With shared_ranks = n > 0 the first n
    ranks hold n replicas of one shared expert (distribute-v2.md §3): shared rank p receives every active token
    (one with some id >= 0) of the sources s with s % n == p % n, as (s, t, K)."""
    if p < shared_ranks:
        rows, cnt = [], []
        for s in range(R):
            if s % shared_ranks == p % shared_ranks:
                for t in range(ids[s].shape[0]):
                    if bool((ids[s][t] >= 0).any()):
                        rows.append((s, t, ids[s].shape[1]))
            cnt.append(len(rows))
        return rows, cnt, [len(rows)]
    L = E // (R - shared_ranks)
    rows, cnt, nums = [], [], []
    for j in range(L):
        e = (p - shared_ranks) * L + j
        before = len(rows)
        for s in range(R):
            for t in range(ids[s].shape[0]):
                for k in range(ids[s].shape[1]):
                    if int(ids[s][t, k]) == e:
                        rows.append((s, t, k))
            cnt.append(len(rows))
        nums.append(len(rows) - before)
    return rows, cnt, nums


def prefix_sums(nums):
    out, total = [], 0
    for n in nums:
        total += n
        out.append(total)
    return out


def capacity(R, T_max, K, L, shared_rank=0):
    """Rows of recv_x: the A of distribute-v2.md §3 with global_bs = R * T_max, i.e. R*T_max*min(K, L); on a
    shared-expert rank (shared_rank = n replicas) T_max * ceil(R / n)."""
    if shared_rank:
        return T_max * -(-R // shared_rank)
    return R * T_max * min(K, L)


# ---- quantizers (quant.md), one row at a time, fp32 arithmetic by torch scalar ops -------------------------

def _f32(v):
    return torch.tensor(v, dtype=torch.float32)


def int8_per_token_a3(row):
    """quant.md int8_per_token_a3: s = 127 / amax, q = int8_sat(RNE(xf * s)), stored scale = 1 / s."""
    xf = row.float()
    amax = xf.abs().max()
    if float(amax) == 0:
        return torch.zeros_like(xf, dtype=torch.int8), _f32(0.0)
    s = _f32(127.0) / amax
    if torch.isinf(s):
        return torch.zeros_like(xf, dtype=torch.int8), _f32(0.0)
    q = torch.round(xf * s).clamp(-127, 127).to(torch.int8)
    return q, _f32(1.0) / s


FP8 = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_sat(v, dtype):
    """RNE with saturation: clamping to +-M first gives the same code (M is on the grid)."""
    M = FP8[dtype]
    return v.clamp(-M, M).to(dtype)


def fp8_per_token(row, dtype):
    """quant.md fp8_per_token: d = M / amax, c = fp8_sat(xf * d), stored scale = 1 / d."""
    xf = row.float()
    amax = xf.abs().max()
    d = _f32(FP8[dtype]) / amax if float(amax) else None
    if d is None or torch.isinf(d):
        return torch.zeros(xf.shape, dtype=dtype), _f32(0.0)
    return fp8_sat(xf * d, dtype), _f32(1.0) / d


def _biased_exponent(v):
    return (struct.unpack("<I", struct.pack("<f", float(v)))[0] >> 23) & 0xFF


def _mx_blocks(row, emax):
    """quant.md §3.3 FLOOR over blocks of 32 (finite inputs): (codes per element, scale bytes)."""
    xf = row.float()
    H = xf.numel()
    codes, scales = [], []
    for b in range(0, H, 32):
        blk = xf[b:b + 32]
        E = _biased_exponent(blk.abs().max())
        assert E != 255, "the tests use finite inputs"
        if E == 0:  # zero or subnormal block: scale 0, every code 0x00
            scales.append(0)
            codes.append(("zero", blk.numel()))
            continue
        s = max(E - emax, 0)
        scales.append(s)
        codes.append(("val", blk.double() * 2.0 ** (127 - s)))
    return codes, scales


def mxfp8(row, dtype):
    """quant.md mxfp8_e4m3 / mxfp8_e5m2 with the FLOOR rule: (codes [H] dtype, scale bytes [ceil(H/32)] u8)."""
    emax = 8 if dtype == torch.float8_e4m3fn else 15
    blocks, scales = _mx_blocks(row, emax)
    parts = []
    for kind, v in blocks:
        if kind == "zero":
            parts.append(torch.zeros(v, dtype=torch.uint8))
        else:
            parts.append(fp8_sat(v.float(), dtype).view(torch.uint8))
    return torch.cat(parts), torch.tensor(scales, dtype=torch.uint8)


def e2m1_code(v):
    """quant.md §2.3: RNE on the e2m1 grid with saturation, keeping the sign (finite v)."""
    a = abs(v)
    if a <= 0.25:
        c = 0
    elif a < 0.75:
        c = 1
    elif a <= 1.25:
        c = 2
    elif a < 1.75:
        c = 3
    elif a <= 2.5:
        c = 4
    elif a < 3.5:
        c = 5
    elif a <= 5:
        c = 6
    else:
        c = 7
    return c | (8 if v < 0 or (v == 0 and struct.pack("<d", v)[7] & 0x80) else 0)


def mxfp4(row):
    """quant.md mxfp4_e2m1 (FLOOR, emax 2): (packed bytes [H/2] u8, element 2j in the low nibble; scale bytes)."""
    blocks, scales = _mx_blocks(row, 2)
    nib = []
    for kind, v in blocks:
        if kind == "zero":
            nib += [0] * v
        else:
            nib += [e2m1_code(float(e)) for e in v.tolist()]
    packed = [nib[2 * j] | (nib[2 * j + 1] << 4) for j in range(len(nib) // 2)]
    return torch.tensor(packed, dtype=torch.uint8), torch.tensor(scales, dtype=torch.uint8)


def quantize_row(row, fmt):
    """(codes as u8/i8 bytes, scales) of one row in an LL format; scales f32 scalar or u8 bytes."""
    if fmt == "int8":
        q, s = int8_per_token_a3(row)
        return q, s
    if fmt == "pertoken_fp8_e4m3":
        c, s = fp8_per_token(row, torch.float8_e4m3fn)
        return c.view(torch.uint8), s
    if fmt == "mx_fp8_e4m3":
        return mxfp8(row, torch.float8_e4m3fn)
    if fmt == "mx_fp8_e5m2":
        return mxfp8(row, torch.float8_e5m2)
    if fmt == "mx_fp4_e2m1":
        return mxfp4(row)
    raise ValueError(fmt)


# ---- combine -------------------------------------------------------------------------------------------------

def combine(y_of, ids, w, H, shared_of=None):
    """combine_v2's weighted sum for one rank's tokens (distribute-v2.md §6, no shared experts):
    out[t] = bf16(sum over k ascending with ids[t,k] >= 0 of f32(w[t,k]) * f32(y_of(t, k))), start +0.0, each
    product rounded to fp32 and then added (no FMA), then the shared expert's row shared_of(t) unweighted, one
    final rounding. A token without pairs gives +0 (it is inactive: no shared row either)."""
    T, K = ids.shape
    out = []
    for t in range(T):
        acc = None
        for k in range(K):
            if int(ids[t, k]) >= 0:
                prod = w[t, k].float() * y_of(t, k).float()
                acc = prod + 0.0 if acc is None else acc + prod
        if acc is not None and shared_of is not None:
            acc = acc + shared_of(t).float()
        out.append((acc if acc is not None else torch.zeros(H)).to(torch.bfloat16))
    return torch.stack(out) if out else torch.zeros(0, H, dtype=torch.bfloat16)
