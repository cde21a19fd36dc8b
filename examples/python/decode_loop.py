"""A decode loop over low-latency mode, driven the way an SGLang-style server does it: two micro-batches in
flight, each call returning with a receive hook. A dispatch returns once its rows are sent (on one node that
is written into the receivers' memory, the dispatch's whole work; across nodes the transfer goes on after it
returned), a combine returns at once and runs on the Buffer's communication thread while the next
micro-batch's experts run. Every step is checked against the same MoE layer run densely.

    PYTHONPATH=build/python python3 examples/python/decode_loop.py                  # 2 local processes
    PYTHONPATH=build/python torchrun --nproc-per-node 4 examples/python/decode_loop.py
    PYTHONPATH=build/python python3 examples/python/decode_loop.py --zero-copy      # experts write in place

Per step and micro-batch: low_latency_dispatch(return_recv_hook=True) for both micro-batches, then for each in
turn hook() (its rows have arrived), its local experts over the [L, R*T_max, H] blocks (recv_count rows each),
low_latency_combine(return_recv_hook=True); then the combines' hooks. With --zero-copy the experts write
straight into get_next_low_latency_combine_buffer(handle), which the peers read in place.
"""
import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import epcomm
from moe_layer import Experts, Router, dense_reference


def run_experts(experts, recv_x, recv_count, out):
    """The local experts on their blocks: expert j's first recv_count[j] rows of recv_x [L, R*T_max, H]."""
    for j, n in enumerate(recv_count.tolist()):
        if n:
            out[j, :n] = experts.expert(experts.first + j, recv_x[j, :n].float()).to(out.dtype)
    return out


def decode_step(buffer, router, experts, batches, t_max, num_experts, zero_copy):
    """One step for every micro-batch: dispatches issued together, each batch's experts, combines overlapped
    with the next batch's experts. Returns the outputs and the routing of each batch."""
    routed = [router(x) for x in batches]
    sent = [buffer.low_latency_dispatch(x, ids, t_max, num_experts, use_fp8=False, return_recv_hook=True)
            for x, (ids, _) in zip(batches, routed)]
    combines = []
    for (recv_x, recv_count, handle, _, hook), (ids, weights) in zip(sent, routed):
        hook()  # this micro-batch's rows are in (across nodes, the next one's may still be travelling)
        y = buffer.get_next_low_latency_combine_buffer(handle) if zero_copy else torch.empty_like(recv_x)
        run_experts(experts, recv_x, recv_count, y)
        combines.append(buffer.low_latency_combine(y, ids, weights, handle, zero_copy=zero_copy,
                                                   return_recv_hook=True))
    outs = []
    for out, _, hook in combines:
        hook()
        outs.append(out)
    return outs, routed


def run(rank, world, args):
    torch.set_num_threads(1)
    t_max = args.tokens
    buffer = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, flavor="deepep",
                           num_rdma_bytes=epcomm.Buffer.get_low_latency_rdma_size_hint(
                               t_max, args.hidden, world, args.experts))
    local = args.experts // world
    router = Router(args.hidden, args.experts, args.topk)
    experts = Experts(args.experts, rank * local, local, args.hidden, args.ffn)
    g = torch.Generator().manual_seed(200 + rank)
    ok, times = True, []
    for step in range(args.steps):
        # Decode batches shrink and grow as requests finish and arrive; a rank may have none.
        sizes = [max(0, t_max - (step + rank + b) % 3) for b in range(2)]
        batches = [torch.randn(n, args.hidden, generator=g).to(torch.bfloat16) for n in sizes]
        t0 = time.perf_counter()
        outs, routed = decode_step(buffer, router, experts, batches, t_max, args.experts, args.zero_copy)
        times.append((time.perf_counter() - t0) * 1e6)
        for x, out, (ids, weights) in zip(batches, outs, routed):
            if x.shape[0] == 0:
                continue
            ref = dense_reference(x, ids, weights, args.experts, args.hidden, args.ffn)
            err = (out.float() - ref.float()).abs().max().item()
            ok = ok and err <= 0.02 * max(ref.float().abs().max().item(), 1.0)
    report = [None] * world
    dist.all_gather_object(report, (ok, times))
    if rank == 0:
        for step in range(args.steps):
            slowest = max(r[1][step] for r in report)
            print(f"step {step}: {slowest:8.0f} us (two micro-batches, slowest rank)")
        print("PASS" if all(r[0] for r in report) else "FAIL: outputs differ from the dense layer")
    buffer.destroy()
    return all(r[0] for r in report)


def _spawned(rank, world, store, args):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        if not run(rank, world, args):
            sys.exit(1)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8, help="num_max_dispatch_tokens_per_rank (per micro-batch)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--zero-copy", action="store_true",
                   help="experts write into get_next_low_latency_combine_buffer (read in place by the peers)")
    args = p.parse_args()
    ranks = int(os.environ.get("WORLD_SIZE", args.ranks))
    if args.experts % ranks:
        p.error(f"--experts {args.experts} must be a multiple of the {ranks} ranks")
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
