"""One-token low-latency round trip from Python: the median time of low_latency_dispatch + low_latency_combine
called back to back on every rank (spec low-latency.md section 7: <= 60 us at 2 ranks). The C++ figure is
`epcomm bench --api low-latency --tokens 1`; this one adds the Python front.

    PYTHONPATH=build/python .venv/bin/python tools/ll_python_latency.py --flavor ascend --ranks 2

Prints one JSON line per run from rank 0. Hidden 7168, top-8 of 256 experts, bf16, as the C++ bench."""
import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank, world, store, args):
    os.environ.setdefault("EPCOMM_POISON_OUTPUTS", "0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import epcomm

    E, K, H, T = args.experts, args.topk, args.hidden, 1
    hint = epcomm.Buffer.get_low_latency_rdma_size_hint(T, H, world, E)
    buf = epcomm.Buffer(dist.group.WORLD, low_latency_mode=True, flavor=args.flavor, num_rdma_bytes=hint)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.randperm(E, generator=g)[:K].view(1, K)
    w = torch.rand(1, K, generator=g)
    times = []
    for _ in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        r = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
        buf.low_latency_combine(r[0], idx, w, r[2])
        times.append(time.perf_counter() - t0)
    timed = sorted(times[args.warmup:])
    if rank == 0:
        print(json.dumps({"op": "round_trip", "api": "low-latency (Python)", "flavor": args.flavor, "ranks": world,
                          "tokens": T, "hidden": H, "topk": K, "experts": E, "iters": args.iters,
                          "time_us_median": round(statistics.median(timed) * 1e6, 1),
                          "time_us_p99": round(timed[int(0.99 * (len(timed) - 1))] * 1e6, 1),
                          "first_iter_ratio": round(times[0] / statistics.median(timed), 2)}), flush=True)
    buf.destroy()
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", choices=("deepep", "ascend"), default="deepep")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(args.ranks, os.path.join(tmp, "store"), args), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
