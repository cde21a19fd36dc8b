"""A plain-torch reference of normal mode (spec normal-mode.md §3-§5), written for obviousness, not speed:
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
        """(rows, cnt, list) on receiving rank d: rows are (s, t, k) triples or None for PAD (spec §4.3/§4.4)."""
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
        """Combined rows of origin r (spec §5). y_of(d, s, t, k) is the expert output row for source (s, t)
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
