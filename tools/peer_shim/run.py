#!/usr/bin/env python3
"""Runs a peer project's test, unchanged, on CPU against epcomm (see README.md).

    tools/peer_shim/run.py deepep   [--ranks 2] [--ref HEAD] [--git DIR] [--timeout S] [-- extra test args]
    tools/peer_shim/run.py sgl-npu  [--ranks 2] ...
    tools/peer_shim/run.py deepep --test tests/legacy/test_intranode.py --ranks 4
    tools/peer_shim/run.py deepep --test tests/legacy/test_internode.py --ranks 8 --nodes 2

Without --test it runs the peer's low-latency test. The test files are taken from the peer's git
(`git --git-dir=DIR show REF:path`, DIR a bare repository or a checkout's .git) into a fresh temp dir, and run
there with tools/peer_shim first on PYTHONPATH (its sitecustomize installs the CPU shim), then the built epcomm
(build/python). With --test, the .py files beside the test in the peer's tree come along (its helpers).
--nodes N > 1 makes N virtual nodes: N launches of the script (WORLD_SIZE=N, RANK=i, as the peers' init_dist
reads them) of --ranks ranks each, with EPCOMM_RANKS_PER_NODE=ranks and UCX_TLS=tcp. Output goes to the
terminal and to <tmp>/test.log. Exit status: the test's (the first failing launch's; 124 on timeout)."""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

PEERS = {
    "deepep": dict(
        git="/work/.mirror/deepseek-ai+DeepEP/repo", flavor="deepep",
        # (file in the peer's tree, where it goes in the temp dir); the first existing test layout wins
        layouts=[
            dict(test="tests/legacy/test_low_latency.py", extra_dirs=["deep_ep/utils"], extra_files=[]),
            dict(test="tests/test_low_latency.py", extra_dirs=[], extra_files=["tests/utils.py"]),
        ],
        # a 2-core CPU: the defaults (128 tokens, hidden 7168, 288 experts, top-8, 8 processes) are GPU sizes
        args=lambda r, total: ["--num-processes", str(r), "--num-tokens", "32", "--hidden", "1024",
                               "--num-topk", "4", "--num-experts", str(4 * total)],
    ),
    "sgl-npu": dict(
        git="/work/.mirror/sgl-project+sgl-kernel-npu/repo", flavor="ascend",
        layouts=[dict(test="tests/python/deepep/test_low_latency.py", extra_dirs=[],
                      extra_files=["tests/python/deepep/utils.py"])],
        args=lambda r, total: ["--num-processes", str(r), "--num-tokens", "32", "--hidden", "1024",
                               "--num-topk", "4", "--num-experts", str(4 * total)],
        # Tests whose flags differ from the low-latency test's. test_normal_and_low_latency.py's defaults (16
        # processes, 4096 normal tokens, 1000 loops) exhaust 24 GiB; it has no --num-tokens.
        test_args={
            "tests/python/deepep/test_normal_and_low_latency.py": lambda r, total: [
                "--num-processes", str(r), "--normal-num-tokens", "512", "--low-latency-num-tokens", "32",
                "--test-loop", "20"],
        },
    ),
}


def git(gitdir, *args, check=True):
    return subprocess.run(["git", f"--git-dir={gitdir}", *args], check=check, capture_output=True)


def exists(gitdir, ref, path):
    return git(gitdir, "cat-file", "-e", f"{ref}:{path}", check=False).returncode == 0


def extract(gitdir, ref, path, dest):
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest, "wb") as f:
        f.write(git(gitdir, "show", f"{ref}:{path}").stdout)


def test_layout(gitdir, ref, peer, test):
    """The layout of --test: the file, the .py files beside it, the peer's helper package dirs."""
    if not exists(gitdir, ref, test):
        sys.exit(f"run.py: --test {test}: no such file at {ref} in {gitdir}")
    folder = os.path.dirname(test)
    siblings = git(gitdir, "ls-tree", "--name-only", f"{ref}:{folder}" if folder else ref).stdout.decode().split()
    extra_files = [os.path.join(folder, f) for f in siblings
                   if f.endswith(".py") and os.path.join(folder, f) != test]
    extra_dirs = [d for lay in peer["layouts"] for d in lay["extra_dirs"]]
    return dict(test=test, extra_dirs=sorted(set(extra_dirs)), extra_files=extra_files)


def run_launches(cmds, cwd, envs, log_path, timeout):
    """Runs the launches side by side, each line to the terminal and the log (prefixed [node i] when there are
    several); returns the first nonzero exit status, 124 when the deadline passed."""
    lock = threading.Lock()
    procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True) for cmd, env in zip(cmds, envs)]
    with open(log_path, "wb") as log:
        def pump(i, p):
            prefix = f"[node {i}] ".encode() if len(procs) > 1 else b""
            for line in iter(p.stdout.readline, b""):
                with lock:
                    sys.stdout.buffer.write(prefix + line)
                    sys.stdout.flush()
                    log.write(prefix + line)
        threads = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(procs)]
        for t in threads:
            t.start()
        deadline = time.time() + timeout
        rcs = []
        for p in procs:
            try:
                rcs.append(p.wait(timeout=max(1.0, deadline - time.time())))
            except subprocess.TimeoutExpired:
                rcs.append(124)
                break
        timed_out = len(rcs) < len(procs) or 124 in rcs
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        time.sleep(2 if any(p.poll() is None for p in procs) else 0)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for t in threads:
            t.join(timeout=5)
    if timed_out:
        return 124
    return next((rc for rc in rcs if rc != 0), 0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("peer", choices=sorted(PEERS))
    ap.add_argument("--ranks", type=int, default=2, help="ranks (per node with --nodes)")
    ap.add_argument("--test", default=None, help="a test file in the peer's tree (default: its low-latency test)")
    ap.add_argument("--nodes", type=int, default=1, help="virtual nodes: launches of --ranks ranks each")
    ap.add_argument("--ref", default="HEAD")
    ap.add_argument("--git", default=None, help="the peer's git dir (bare, or a checkout's .git)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    ap.add_argument("--epcomm", default=os.path.join(ROOT, "build", "python"), help="built epcomm package dir")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--no-default-args", action="store_true", help="pass only the args after --")
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    a = ap.parse_args(argv)
    peer = PEERS[a.peer]
    gitdir = a.git or peer["git"]
    if os.path.isdir(os.path.join(gitdir, ".git")):
        gitdir = os.path.join(gitdir, ".git")
    if a.test:
        layout = test_layout(gitdir, a.ref, peer, a.test)
    else:
        layout = next((lay for lay in peer["layouts"] if exists(gitdir, a.ref, lay["test"])), None)
    if layout is None:
        sys.exit(f"run.py: none of {[lay['test'] for lay in peer['layouts']]} at {a.ref} in {gitdir}")

    tmp = tempfile.mkdtemp(prefix=f"peer_shim_{a.peer}_")
    test_dir = os.path.join(tmp, "test")
    src_dir = os.path.join(tmp, "src")
    test = os.path.join(test_dir, os.path.basename(layout["test"]))
    extract(gitdir, a.ref, layout["test"], test)
    for f in layout["extra_files"]:
        extract(gitdir, a.ref, f, os.path.join(test_dir, os.path.basename(f)))
    for d in layout["extra_dirs"]:
        names = git(gitdir, "ls-tree", "-r", "--name-only", a.ref, d).stdout.decode().split()
        for f in names:
            if f.endswith(".py"):
                extract(gitdir, a.ref, f, os.path.join(src_dir, f))
    rev = git(gitdir, "rev-parse", a.ref).stdout.decode().strip()

    if a.nodes < 1:
        sys.exit(f"run.py: --nodes {a.nodes}: expected at least 1")
    default_args = peer.get("test_args", {}).get(a.test or layout["test"], peer["args"])
    args = ([] if a.no_default_args else default_args(a.ranks, a.ranks * a.nodes)) + rest
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE, a.epcomm] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("EPCOMM_FLAVOR", peer["flavor"])
    env.setdefault("PEER_SHIM_DEEPEP_SRC", src_dir if layout["extra_dirs"] else "")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))
    if a.nodes > 1:
        env.setdefault("EPCOMM_RANKS_PER_NODE", str(a.ranks))
        env.setdefault("UCX_TLS", "tcp")
    threads = max(1, (os.cpu_count() or 1) // max(a.ranks * a.nodes, 1))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [a.python, test] + args
    log_path = os.path.join(tmp, "test.log")
    nodes = f" x {a.nodes} nodes (EPCOMM_RANKS_PER_NODE={env['EPCOMM_RANKS_PER_NODE']})" if a.nodes > 1 else ""
    print(f"[run.py] {a.peer} {layout['test']} @ {rev[:12]}{nodes}  EPCOMM_FLAVOR={env['EPCOMM_FLAVOR']} "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}\n[run.py] cwd={test_dir}\n[run.py] {' '.join(cmd)}",
          flush=True)
    t0 = time.time()
    envs = [dict(env, WORLD_SIZE=str(a.nodes), RANK=str(i)) if a.nodes > 1 else env for i in range(a.nodes)]
    rc = run_launches([cmd] * a.nodes, test_dir, envs, log_path, a.timeout)
    print(f"[run.py] exit {rc} after {time.time() - t0:.1f} s; log {log_path}", flush=True)
    if not a.keep and rc == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
