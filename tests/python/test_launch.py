"""Launchers: the documented torchrun command (env:// rendezvous) starting examples/python/moe_layer.py on 2
ranks, with EPCOMM_LOG=info showing each rank's set-up line; and processes whose Buffer construction raised
leaving cleanly at exit (gloo must not free tensors that need the interpreter after it is gone)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun():
    """The torchrun beside this interpreter (the venv's), as the docs call it."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "torch.distributed.run"]


def test_moe_layer_under_torchrun_with_info_log():
    env = dict(os.environ, EPCOMM_LOG="info", OMP_NUM_THREADS="1")
    cmd = torchrun() + ["--standalone", "--nproc_per_node", "2",
                        os.path.join(ROOT, "examples/python/moe_layer.py"), "--tokens", "12"]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    assert p.returncode == 0, f"torchrun exited with {p.returncode}:\n{p.stdout}"
    assert "PASS" in p.stdout, p.stdout
    for rank in (0, 1):
        line = f"epcomm[rank {rank}] info: Buffer: 2 ranks, 1 node; shm ("
        assert line in p.stdout, f"no set-up line '{line}...' in:\n{p.stdout}"


FAILING_BUFFER = r"""
import os, sys, tempfile
import torch.distributed as dist
import epcomm
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(sys.argv[2]), world_size=2)
try:
    epcomm.Buffer(dist.group.WORLD, num_nvl_bytes=1024)   # below the segment's control part: raises
except epcomm.InvalidUsageError as e:
    assert "num_nvl_bytes" in str(e), e
    print("raised as expected")
else:
    raise SystemExit("Buffer(num_nvl_bytes=1024) did not raise")
"""


def test_failed_buffer_construction_exits_cleanly(tmp_path):
    # The abort (terminate called without an active exception) came in 3 to 4 of 6 runs: run it 6 times.
    for attempt in range(6):
        store = tmp_path / f"store{attempt}"
        procs = [subprocess.Popen([sys.executable, "-c", FAILING_BUFFER, str(store), str(r)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        for r, p in enumerate(procs):
            out = p.communicate(timeout=120)[0]
            assert p.returncode == 0, f"run {attempt}, rank {r} exited with {p.returncode}:\n{out}"
            assert "raised as expected" in out and "terminate called" not in out, out
