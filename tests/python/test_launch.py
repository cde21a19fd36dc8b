"""The torchrun way of starting ranks (env:// rendezvous from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
emulated with plain subprocesses because Debian's torchrun 1.13 fails under Python 3.11 before it starts
any worker. Runs examples/python/moe_layer.py on 2 ranks that way."""
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_moe_layer_under_torchrun_style_env():
    port, world = free_port(), 2
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "examples/python/moe_layer.py"),
                                       "--tokens", "12"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{out}"
    assert "PASS" in outputs[0], outputs[0]
