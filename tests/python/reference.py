"""A plain-torch reference of normal mode (docs/normal-mode.md), written for obviousness, not speed:
Python loops over ranks, tokens and slots, computed from every rank's inputs (all-gathered by the tests).
It shares nothing with epcomm."""
import torch

NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
INT_OF = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
          torch.int64: torch.int64, torch.int32: torch.int32, torch.int8: torch.int8, torch.uint8: torch.uint8,
          torch.bool: torch.bool}


def bits(t):
    """A tensor's bit pattern (so that NaN payloads, -0 and subnormals compare exactly); the one-byte formats
    (float8_*, float4_e2m1fn_x2) as their bytes."""
    if t.dtype not in INT_OF and t.element_size() == 1:
        return t.contiguous().view(torch.uint8)
    return t.contiguous().view(INT_OF[t.dtype])


def same_bits(a, b):
    return a.dtype == b.dtype and list(a.shape) == list(b.shape) and torch.equal(bits(a), bits(b))


def align_up(n, a):
    return (n + a - 1) // a * a


def layout(ids, E, R):
    """(num_tokens_per_rank i32 [R], num_tokens_per_expert i32 [E], is_token_in_rank bool [T, R])."""
    L = E // R
    T, K = ids.shape
    in_rank = torch.zeros(T, R, dtype=torch.bool)
    per_expert = torch.zeros(E, dtype=torch.int32)
    for t in range(T):
        for k in range(K):
            v = int(ids[t, k])
            if v >= 0:
                in_rank[t, v // L] = True
                per_expert[v] += 1
    return in_rank.sum(dim=0).to(torch.int32), per_expert, in_rank


class Problem:
    """Every rank's inputs: xs[s] [T_s, H], ids[s] [T_s, K] (negative = none), ws[s] [T_s, K] f32, or, without
    top-k, in_ranks[s] [T_s, R] and npes[s] [E]."""

    def __init__(self, R, E, xs, ids=None, ws=None, in_ranks=None, npes=None):
        self.R, self.E, self.L = R, E, E // R
        self.xs, self.ids, self.ws, self.in_ranks, self.npes = xs, ids, ws, in_ranks, npes
        self.has_topk = ids is not None

    def T(self, s):
        return int(self.xs[s].shape[0])

    def valid(self, s, t, k):
        return int(self.ids[s][t, k]) >= 0

    def dest_of(self, s, t):
        """Ranks token (s, t) goes to."""
        if not self.has_topk:
            return [d for d in range(self.R) if bool(self.in_ranks[s][t, d])]
        return sorted({int(v) // self.L for v in self.ids[s][t].tolist() if v >= 0})

    def rows(self, d, order, alignment):
        """(rows, cnt, list) on receiving rank d: rows are (s, t, k) triples or None for PAD (docs/normal-mode.md)."""
        R, L = self.R, self.L
        rows, cnt, lst = [], [], []
        if order == "expert_major":
            for j in range(L):
                c = 0
                for s in range(R):
                    for t in range(self.T(s)):
                        for k in range(self.ids[s].shape[1]):
                            if int(self.ids[s][t, k]) == d * L + j:
                                rows.append((s, t, k))
                                c += 1
                cnt.append(c)
                lst.append(align_up(c, alignment))
                rows += [None] * (lst[-1] - c)
        else:
            for s in range(R):
                for t in range(self.T(s)):
                    if d in self.dest_of(s, t):
                        rows.append((s, t, -1))
            for j in range(L):
                if self.has_topk:
                    c = sum(int((self.ids[s] == d * L + j).sum()) for s in range(R))
                else:
                    c = sum(int(self.npes[s][d * L + j]) for s in range(R))
                cnt.append(c)
                lst.append(align_up(c, alignment))
        return rows, cnt, lst

    def dispatch(self, d, order, alignment=1, num_worst_tokens=0, payload=None, idx_dtype=torch.int64):
        """Everything rank d receives. `payload(s)` gives source s's [T_s, ...] rows (default xs[s])."""
        rows, cnt, lst = self.rows(d, order, alignment)
        N = len(rows)
        n = num_worst_tokens if num_worst_tokens > 0 else N
        rows = rows + [None] * (n - N)
        src = torch.full((3, n), -1, dtype=torch.int32)
        K = self.ids[0].shape[1] if self.has_topk else 0
        idx = torch.full((n, K), -1, dtype=idx_dtype)
        w = torch.zeros(n, K, dtype=torch.float32)
        payload = payload or (lambda s: self.xs[s])
        proto = payload(0)
        x = torch.zeros((n,) + tuple(proto.shape[1:]), dtype=proto.dtype)
        per_source = [0] * self.R
        for i, r in enumerate(rows):
            if r is None:
                continue
            s, t, k = r
            per_source[s] += 1
            src[:, i] = torch.tensor([s, t, k], dtype=torch.int32)
            x[i] = payload(s)[t]
            if not self.has_topk:
                continue
            if order == "expert_major":
                idx[i, k] = int(self.ids[s][t, k]) - d * self.L
                w[i, k] = self.ws[s][t, k]
            else:
                for kk in range(K):
                    v = int(self.ids[s][t, kk])
                    if v >= 0 and v // self.L == d:
                        idx[i, kk] = v - d * self.L
                        w[i, kk] = self.ws[s][t, kk]
        return dict(rows=rows, x=x, idx=idx, w=w, list=lst, cnt=cnt, N=N, num_rows=n, src=src,
                    per_source=per_source)

    def combine(self, r, order, hidden, y_of, weights=None, biases=(), out_dtype=torch.bfloat16, g_of=None):
        """Combined rows of origin r (docs/normal-mode.md). y_of(d, s, t, k) is the expert output row for source (s, t)
        on rank d (k = slot in expert_major, -1 in rank_major) as a tensor of out_dtype. weights: [T, K] used
        instead of the dispatch's (expert_major). g_of(d, s, t) -> [K] f32 receiving-side weights
        (rank_major). Returns (combined_x, combined_weights or None)."""
        T, H = self.T(r), hidden
        out = []
        wout = []
        for t in range(T):
            acc = torch.zeros(H, dtype=torch.float32)
            if order == "expert_major":
                K = self.ids[r].shape[1]
                wt = weights[t] if weights is not None else self.ws[r][t]
                used = torch.zeros(K, dtype=torch.float32)
                for k in range(K):
                    v = int(self.ids[r][t, k])
                    if v < 0:
                        continue
                    used[k] = wt[k]
                    c = used[k] * y_of(v // self.L, r, t, k).to(torch.float32)
                    acc = acc + c
                wout.append(used)
            else:
                K = self.ids[r].shape[1] if self.has_topk else 0
                wsum = torch.zeros(K, dtype=torch.float32)
                for d in self.dest_of(r, t):
                    acc = acc + y_of(d, r, t, -1).to(torch.float32)
                    if g_of is not None:
                        wsum = wsum + g_of(d, r, t)
                wout.append(wsum)
            for b in biases:
                acc = acc + b[t].to(torch.float32)
            o = acc.to(out_dtype)
            if torch.isnan(o).any():
                nan = torch.tensor([NAN_BITS[out_dtype]], dtype=INT_OF[out_dtype]).view(out_dtype)
                o = torch.where(torch.isnan(o), nan, o)
            out.append(o)
        cx = torch.stack(out) if out else torch.zeros(0, H, dtype=out_dtype)
        K = self.ids[r].shape[1] if self.has_topk else 0
        cw = torch.stack(wout) if wout else torch.zeros(0, K, dtype=torch.float32)
        if order == "rank_major" and g_of is None:
            cw = None
        return cx, cw


# ---- the operator family (docs/distribute-v2.md), mode 0 and combine comm_quant_mode 0 / 2 -----

class V2Layout:
    """Rank layout of docs/normal-mode.md (expert_shard_type 0): W ranks, the first Sr of them shared-expert ranks serving S
    shared experts with R = Sr / S replicas each, E MoE experts in blocks of L on the others; top-K routing;
    bs = Bs when global_bs is 0."""

    def __init__(self, W, E, K, Sr=0, S=0, global_bs=0, bs=0):
        self.W, self.E, self.K, self.Sr = W, E, K, Sr
        self.S = S if Sr > 0 else 0
        self.R = Sr // self.S if self.S else 1
        self.L = E // (W - Sr)
        self.max_bs = global_bs // W if global_bs > 0 else bs
        self.G = global_bs if global_bs > 0 else bs * W

    def shared(self, p):
        return p < self.Sr

    def capacity(self, p):
        """A_p: the receive capacity of rank p (docs/normal-mode.md)."""
        if self.shared(p):
            return self.max_bs * -(-self.W // self.R)
        return self.G * min(self.L, self.K)

    def local_experts(self, p):
        return 1 if self.shared(p) else self.L


def v2_activity(ids, mask):
    """(active_tok [Bs] bool list, active_slot [Bs][K] bool lists) of docs/normal-mode.md."""
    Bs, K = ids.shape
    if mask is None:
        return [True] * Bs, [[True] * K for _ in range(Bs)]
    if mask.dim() == 1:
        n = int(mask.sum())
        return [t < n for t in range(Bs)], [[t < n] * K for t in range(Bs)]
    slots = [[bool(mask[t, k]) for k in range(K)] for t in range(Bs)]
    return [any(s) for s in slots], slots


def v2_dispatch_rows(lay, xs, idss, masks, p):
    """The rows rank p receives (docs/normal-mode.md): a list of (r, t, slot, row tensor), and cnt (the inclusive running
    totals of ep_recv_counts)."""
    rows, cnt = [], []
    W, K = lay.W, lay.K
    act = [v2_activity(idss[r], masks[r]) for r in range(W)]
    if not lay.shared(p):
        m = p - lay.Sr
        for el in range(lay.L):
            e = m * lay.L + el
            for r in range(W):
                tok, slot = act[r]
                for t in range(idss[r].shape[0]):
                    for k in range(K):
                        if slot[t][k] and int(idss[r][t, k]) == e:
                            rows.append((r, t, k, xs[r][t]))
                cnt.append(len(rows))
    else:
        s = p // lay.R
        for r in range(W):
            if r % lay.R == p % lay.R:
                tok, _ = act[r]
                for t in range(idss[r].shape[0]):
                    if tok[t]:
                        rows.append((r, t, K + s, xs[r][t]))
            cnt.append(len(rows))
    return rows, cnt


def v2_dispatch(lay, xs, idss, masks, scaless, p, token_nums_type=1):
    """Every output of dispatch_v2 on rank p in mode 0 (tp_world_size 0), full tensors with zero tails:
    (expand_x, dynamic_scales, assist_info_for_combine, expert_token_nums, ep_recv_counts, tp_recv_counts,
    expand_scales). scaless[r] is rank r's expert_scales or None (then expand_scales is (0,))."""
    rows, cnt = v2_dispatch_rows(lay, xs, idss, masks, p)
    A, H = lay.capacity(p), xs[p].shape[1]
    expand_x = torch.zeros(A, H, dtype=xs[p].dtype)
    assist = torch.zeros(A * 128, dtype=torch.int32)
    with_scales = scaless[p] is not None
    expand_scales = torch.zeros(A if with_scales else 0, dtype=torch.float32)
    for i, (r, t, slot, row) in enumerate(rows):
        expand_x[i] = row
        assist[3 * i:3 * i + 3] = torch.tensor([r, t, slot], dtype=torch.int32)
        if with_scales:  # a sender without expert_scales sends 0.0 (the spec leaves it open)
            expand_scales[i] = 1.0 if slot >= lay.K else scaless[r][t, slot] if scaless[r] is not None else 0.0
    W = lay.W
    if lay.shared(p):
        nums = [len(rows)]
    else:
        ends = [cnt[el * W + W - 1] for el in range(lay.L)]
        nums = ends if token_nums_type == 0 else [e - (ends[el - 1] if el else 0) for el, e in enumerate(ends)]
    return (expand_x, torch.zeros(A, dtype=torch.float32), assist, torch.tensor(nums, dtype=torch.int64),
            torch.tensor(cnt, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), expand_scales)


def comm_quant_int8_g8(y):
    """combine_v2's comm_quant_mode 2 (docs/normal-mode.md, docs/quant.md "int8 group-8"): what the receiver decodes from rows y
    [n, H] (bf16/f16, H % 8 == 0), in y's dtype."""
    n, H = y.shape
    f = y.float().reshape(n, H // 8, 8)
    a = f.abs().amax(dim=2, keepdim=True)
    s32 = a * torch.tensor(1.0 / 127, dtype=torch.float32)
    sigma = s32.to(y.dtype).float()
    q = torch.where(a > 0, torch.round(f / torch.where(a > 0, s32, torch.ones_like(s32))), torch.zeros_like(f))
    return (q * sigma).to(y.dtype).reshape(n, H)


def v2_combine(lay, r, ids, mask, expert_scales, holders, comm_quant=0, shared_x=None):
    """combine_v2's x on origin r (docs/normal-mode.md): holders[d] = (expand_x, assist_info, n_own) of every rank d, the rows
    it returns. ids, mask, expert_scales and shared_x are rank r's. Each product rounds to fp32, then adds;
    one rounding at the end; inactive tokens give zero rows."""
    Bs, K = ids.shape
    dt = holders[r][0].dtype
    H = holders[r][0].shape[1]
    recv = {}
    for d, (ex, assist, n_own) in enumerate(holders):
        rows = ex[:n_own]
        if comm_quant == 2 and n_own:
            rows = comm_quant_int8_g8(rows)
        for i in range(n_own):
            src, t, slot = (int(v) for v in assist[3 * i:3 * i + 3])
            if src == r:
                recv[(t, slot)] = rows[i]
    tok, slot = v2_activity(ids, mask)
    out = torch.zeros(Bs, H, dtype=dt)
    for t in range(Bs):
        if not tok[t]:
            continue
        acc = torch.zeros(H, dtype=torch.float32)
        for k in range(K):
            if slot[t][k]:
                acc = acc + recv[(t, k)].float() * expert_scales[t, k]
        for s in range(lay.S):
            acc = acc + recv[(t, K + s)].float()
        if shared_x is not None:
            acc = acc + shared_x.reshape(Bs, H)[t].float()
        out[t] = acc.to(dt)
    return out
