"""An expert-parallel Mixture-of-Experts layer in torch over epcomm, checked against the same layer run densely.

    PYTHONPATH=build/python python3 examples/python/moe_layer.py            # 4 local processes
    PYTHONPATH=build/python torchrun --nproc-per-node 4 examples/python/moe_layer.py
    PYTHONPATH=build/python python3 examples/python/moe_layer.py --zero-copy

With --zero-copy the tokens are written into the Buffer's shared dispatch-input area and the experts write
their outputs straight into its shared combine-input area: on one host the peers then read both in place
(no staging copy in dispatch, no window copy in combine), with the same results.

Every rank holds `tokens` tokens and `experts / ranks` experts (SwiGLU MLPs). Forward: a softmax router picks
each token's top-k experts; dispatch sends every (token, expert) pair to the expert's rank, grouped by local
expert (expert_major), so each expert runs one matmul over a contiguous block; combine sends the outputs back
and sums them weighted by the router's weights. The dense reference evaluates every token's experts locally.
"""
import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import epcomm


class Experts(torch.nn.Module):
    """SwiGLU experts [first, first + count) of `total`; all ranks derive the same weights from one seed."""

    def __init__(self, total, first, count, hidden, ffn, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w1 = torch.randn(total, hidden, ffn, generator=g) / hidden**0.5
        w3 = torch.randn(total, hidden, ffn, generator=g) / hidden**0.5
        w2 = torch.randn(total, ffn, hidden, generator=g) / ffn**0.5
        self.first = first
        self.w1, self.w3, self.w2 = (torch.nn.Parameter(w[first:first + count]) for w in (w1, w3, w2))

    def expert(self, e, x):
        """Expert e (global id) on rows x [n, hidden] (float32)."""
        j = e - self.first
        return (torch.nn.functional.silu(x @ self.w1[j]) * (x @ self.w3[j])) @ self.w2[j]


class Router(torch.nn.Module):
    def __init__(self, hidden, experts, topk, seed=1):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(hidden, experts, generator=g) / hidden**0.5)
        self.topk = topk

    def forward(self, x):
        probs = torch.softmax(x.float() @ self.weight, dim=-1)
        weights, ids = torch.topk(probs, self.topk, dim=-1)
        return ids, weights / weights.sum(dim=-1, keepdim=True)


class MoELayer(torch.nn.Module):
    """The expert-parallel layer: router, dispatch, local experts, combine."""

    def __init__(self, buffer, hidden, ffn, experts, topk, zero_copy=False):
        super().__init__()
        self.buffer, self.num_experts, self.zero_copy = buffer, experts, zero_copy
        local = experts // buffer.num_ranks
        self.router = Router(hidden, experts, topk)
        self.experts = Experts(experts, buffer.rank * local, local, hidden, ffn)

    @torch.no_grad()
    def forward(self, x):
        ids, weights = self.router(x)
        _, _, per_expert, _, _ = self.buffer.get_dispatch_layout(ids, self.num_experts)
        if self.zero_copy:  # the layer before would write its output here directly
            shared_x = self.buffer.get_dispatch_input(x.shape[0], x.shape[1], x.dtype)
            shared_x.copy_(x)
            x = shared_x
        recv_x, _, _, counts, handle, _ = self.buffer.dispatch(
            x, topk_idx=ids, topk_weights=weights, num_tokens_per_expert=per_expert)
        # Rows arrive grouped by local expert; `counts` are the group sizes (a grouped GEMM's input).
        y = self.buffer.get_combine_input(handle, recv_x.dtype) if self.zero_copy else torch.empty_like(recv_x)
        begin = 0
        for j, n in enumerate(counts):
            rows = recv_x[begin:begin + n].float()
            y[begin:begin + n] = self.experts.expert(self.experts.first + j, rows).to(y.dtype)
            begin += n
        out, _, _ = self.buffer.combine(y, handle)  # sum over the top-k of weight * expert output
        return out, ids, weights


@torch.no_grad()
def dense_reference(x, ids, weights, experts, hidden, ffn):
    """The same layer without communication: every expert's weights, every token's experts evaluated here."""
    everything = Experts(experts, 0, experts, hidden, ffn)
    out = torch.zeros(x.shape[0], hidden)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            y = everything.expert(e, x[t:t + 1].float()).to(x.dtype).float()  # experts emit bf16 rows
            out[t] += weights[t, k] * y[0]
    return out.to(x.dtype)


def run(rank, world, args):
    torch.set_num_threads(1)
    if args.zero_copy:  # room for every rank's tokens (dispatch) and for all the rows a rank can receive
        row = args.hidden * 2
        buffer = epcomm.Buffer(dist.group.WORLD, num_dispatch_input_bytes=args.tokens * row,
                               num_combine_input_bytes=world * args.tokens * args.topk * row)
    else:
        buffer = epcomm.Buffer(dist.group.WORLD)
    layer = MoELayer(buffer, args.hidden, args.ffn, args.experts, args.topk, args.zero_copy)
    g = torch.Generator().manual_seed(100 + rank)
    tokens = args.tokens if rank % 3 else args.tokens // 2  # ranks may hold different token counts
    x = torch.randn(tokens, args.hidden, generator=g).to(torch.bfloat16)
    out, ids, weights = layer(x)
    ref = dense_reference(x, ids, weights, args.experts, args.hidden, args.ffn)
    err = (out.float() - ref.float()).abs().max().item() if tokens else 0.0
    scale = ref.float().abs().max().item() if tokens else 1.0
    ok = err <= 0.02 * max(scale, 1.0)
    if args.zero_copy and buffer.mode == "shm":  # the peers really read in place: nothing staged or copied
        c = buffer.copy_counters()
        if c["dispatch_staged_tokens"] or c["combine_copied_rows"]:
            print(f"rank {rank}: expected reads in place, copy counters say {c}")
            ok = False
    errors = [None] * world
    dist.all_gather_object(errors, (tokens, err, scale, ok))
    if rank == 0:
        for r, (n, e, s, good) in enumerate(errors):
            print(f"rank {r}: {n} tokens, max |epcomm - dense| = {e:.3g} (output scale {s:.3g}) "
                  f"{'ok' if good else 'TOO LARGE'}")
        print("PASS" if all(e[3] for e in errors) else "FAIL")
    buffer.destroy()
    return all(e[3] for e in errors)


def _spawned(rank, world, store, args):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        if not run(rank, world, args):
            sys.exit(1)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--zero-copy", action="store_true",
                   help="tokens and expert outputs in the Buffer's shared input areas (read in place by the peers)")
    args = p.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        ok = run(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        sys.exit(0 if ok else 1)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_spawned, args=(args.ranks, os.path.join(tmp, "store"), args), nprocs=args.ranks, join=True)
        except mp.ProcessExitedException:
            sys.exit(1)


if __name__ == "__main__":
    main()
