"""Soak: thousands of random valid calls on 4 forked ranks, every result checked bit for bit against the
plain-torch reference (calls.py / reference.py), with the resident set and the open file descriptors of every
rank sampled and required flat.

Each step draws one of: get_dispatch_layout + fresh dispatch (random shapes, 0-token ranks, -1 slots and
repeated experts, both receive orders, every quantization mode and pre-quantized tuples, num_worst_tokens,
async calls) followed by a combine (explicit weights, biases, other widths and dtypes) and a cached dispatch
on its handle; or epcomm.ops dispatch_v2 (shared-expert ranks, masks, global_bs, quant modes 2-4) followed by
combine_v2 (identity experts, comm_quant_mode 2, shared_expert_x). One Buffer and one operator group per rank
serve every step.

Leak criterion: RSS and the fd count are sampled every SAMPLE_EVERY steps. The first quarter of the run is
warm-up (caching allocators grow to the largest shapes seen). Afterwards the fd count must never change, and
RSS must stay within RSS_SLACK_MB of the warm-up's peak.

EPCOMM_SOAK_CALLS=N: API calls (default 400, under a minute on 2 cores); EPCOMM_SOAK_SEED."""
import os
import random
import time

import torch
import torch.distributed as dist

import epcomm
from calls import (NormalCall, V2Call, check_cached, check_combine, check_dispatch, check_v2_combine,
                   check_v2_dispatch, normal_case, run_v2_combine, run_v2_dispatch, v2_case)
from harness import gather, spawn
from reference import layout, same_bits

WORLD = 4
CALLS = int(os.environ.get("EPCOMM_SOAK_CALLS", "400"))
SEED = int(os.environ.get("EPCOMM_SOAK_SEED", "7"))
SAMPLE_EVERY = 5  # steps
RSS_SLACK_MB = 16


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def finished(r):
    r[-1].wait()
    return r


def normal_step(buf, rank, rng, counts):
    """Layout, fresh dispatch, combine and cached dispatch of one random problem, each checked."""
    call = NormalCall(normal_case(rng, WORLD, max_tokens=rng.choice((4, 16))), WORLD)
    kw = call.dispatch_kwargs(rank)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(kw["topk_idx"], call.case["E"])
    ref_rank, ref_expert, ref_in = layout(kw["topk_idx"].long(), call.case["E"], WORLD)
    assert same_bits(per_rank, ref_rank) and same_bits(per_expert, ref_expert), "layout"
    assert same_bits(in_rank, ref_in.to(torch.int32)), "layout is_token_in_rank"
    x = kw.pop("x")
    out = finished(buf.dispatch(x, **kw))
    check_dispatch(out, call.expected(rank), "dispatch")
    handle = out[4]
    ckw = call.combine_kwargs(rank)
    cout = finished(buf.combine(ckw.pop("x"), handle, **ckw))
    check_combine(cout, call.expected_combine([call.combine_kwargs(s) for s in range(WORLD)], rank), "combine")
    xkw = call.cached_kwargs(rank)
    r = finished(buf.dispatch(xkw.pop("x"), handle=handle, **xkw))
    check_cached(r, call.expected_cached([call.cached_kwargs(s) for s in range(WORLD)], rank), "cached dispatch")
    counts["normal"] += 4


def v2_step(pg, rank, rng, counts):
    """dispatch_v2 (any quant mode) then, in mode 0, combine_v2 of the rows fed back; each checked."""
    call = V2Call(v2_case(rng, WORLD, max_tokens=rng.choice((3, 12))), WORLD, pg)
    kws = [call.dispatch_kwargs(s) for s in range(WORLD)]
    check_v2_dispatch(run_v2_dispatch(kws[rank]), kws, rank, "dispatch_v2")
    counts["ops"] += 1
    if call.case["quant_mode"] == 0:
        ckws = [call.combine_kwargs(s) for s in range(WORLD)]
        check_v2_combine(run_v2_combine(ckws[rank]), ckws, rank, "combine_v2")
        counts["ops"] += 1


def soak_job(rank, world):
    torch.manual_seed(0)
    pg = dist.group.WORLD
    buf = epcomm.Buffer(pg, num_nvl_bytes=8 << 20)
    epcomm.ops.init_group_context(pg, segment_bytes=8 << 20)
    rng = random.Random(SEED)  # the same stream on every rank: every rank makes the same calls
    counts = {"normal": 0, "ops": 0}
    samples = []  # (calls so far, rss, fds)
    t0, step = time.monotonic(), 0
    while counts["normal"] + counts["ops"] < CALLS:
        what = f"soak seed {SEED} step {step} (calls so far {counts}), rank {rank}"
        try:
            if rng.random() < 0.6:
                normal_step(buf, rank, rng, counts)
            else:
                v2_step(pg, rank, rng, counts)
        except Exception as e:
            raise AssertionError(f"{what}: {type(e).__name__}: {e}") from e
        step += 1
        if step % SAMPLE_EVERY == 0:
            samples.append((counts["normal"] + counts["ops"], rss_bytes(), open_fds()))
    elapsed = time.monotonic() - t0
    warm = samples[: max(len(samples) // 4, 1)]
    rest = samples[len(warm):]
    peak = max(s[1] for s in warm)
    fds = warm[-1][2]
    growth = max((s[1] for s in rest), default=peak) - peak
    fd_changes = [s for s in rest if s[2] != fds]
    every = gather(dict(rank=rank, growth=growth, peak=peak, fds=fds, fd_changes=fd_changes, counts=counts,
                        first=samples[0], last=samples[-1]))
    if rank == 0:
        print(f"\nsoak: seed {SEED}, {WORLD} ranks, {sum(counts.values())} calls per rank ({counts}) in {elapsed:.1f} s, "
              f"every result correct; after warm-up (first {warm[-1][0]} calls): "
              + "; ".join(f"rank {e['rank']} RSS {e['peak'] / 2**20:.1f} MiB, growth {e['growth'] / 2**20:+.2f} MiB, "
                          f"fds {e['fds']} (changed {len(e['fd_changes'])} times)" for e in every), flush=True)
    assert growth <= RSS_SLACK_MB << 20, (
        f"rank {rank}: RSS grew {growth / 2**20:.1f} MiB after warm-up (peak {peak / 2**20:.1f} MiB; samples "
        f"{[(c, round(r / 2**20, 1)) for c, r, _ in samples]})")
    assert not fd_changes, f"rank {rank}: open file descriptors changed after warm-up: {fds} -> {fd_changes}"
    buf.destroy()


def test_soak():
    spawn(soak_job, WORLD)
