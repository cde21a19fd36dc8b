"""Runs a test body on N local ranks: torch.multiprocessing.spawn plus a gloo group on a file:// store.
Bodies are module-level functions body(rank, world, *args); an exception in any rank fails the test with
that rank's traceback."""
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, store, env, body, args):
    os.environ.update(env)
    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        body(rank, world, *args)
        dist.barrier()  # only on success: a failed rank's peers are terminated by spawn
    finally:
        dist.destroy_process_group()


def spawn(body, world, *args, env=None):
    """Runs body(rank, world, *args) on `world` spawned processes; raises if any of them failed."""
    env = dict({"EPCOMM_POISON_OUTPUTS": "1", "EPCOMM_TIMEOUT_S": "60"}, **(env or {}))
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, os.path.join(tmp, "store"), env, body, args), nprocs=world, join=True)


def gather(obj):
    """Every rank's obj, in rank order (all_gather_object on the default group)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def use_mode(mode):
    """Selects the strategy of Buffers created afterwards (DEEP_USE_MODE)."""
    if mode == "alltoall":
        os.environ["DEEP_USE_MODE"] = "alltoall"
    else:
        os.environ.pop("DEEP_USE_MODE", None)
