#!/usr/bin/env python3
"""Runs a peer project's low-latency test, unchanged, on CPU against epcomm (see README.md).

    tools/peer_shim/run.py deepep   [--ranks 2] [--ref HEAD] [--git DIR] [--timeout S] [-- extra test args]
    tools/peer_shim/run.py sgl-npu  [--ranks 2] ...

The test files are taken from the peer's git (`git --git-dir=DIR show REF:path`, DIR a bare repository or
a checkout's .git) into a fresh temp dir, and run there with tools/peer_shim first on PYTHONPATH (its
sitecustomize installs the CPU shim), then the built epcomm (build/python). Output goes to the terminal
and to <tmp>/test.log. Exit status: the test's (124 on timeout)."""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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
        args=lambda r: ["--num-processes", str(r), "--num-tokens", "32", "--hidden", "1024",
                        "--num-topk", "4", "--num-experts", str(4 * r)],
    ),
    "sgl-npu": dict(
        git="/work/.mirror/sgl-project+sgl-kernel-npu/repo", flavor="ascend",
        layouts=[dict(test="tests/python/deepep/test_low_latency.py", extra_dirs=[],
                      extra_files=["tests/python/deepep/utils.py"])],
        args=lambda r: ["--num-processes", str(r), "--num-tokens", "32", "--hidden", "1024",
                        "--num-topk", "4", "--num-experts", str(4 * r)],
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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("peer", choices=sorted(PEERS))
    ap.add_argument("--ranks", type=int, default=2)
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

    args = ([] if a.no_default_args else peer["args"](a.ranks)) + rest
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE, a.epcomm] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("EPCOMM_FLAVOR", peer["flavor"])
    env.setdefault("PEER_SHIM_DEEPEP_SRC", src_dir if layout["extra_dirs"] else "")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(free_port()))
    threads = max(1, (os.cpu_count() or 1) // max(a.ranks, 1))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [a.python, test] + args
    log_path = os.path.join(tmp, "test.log")
    print(f"[run.py] {a.peer} {layout['test']} @ {rev[:12]}  EPCOMM_FLAVOR={env['EPCOMM_FLAVOR']} "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}\n[run.py] cwd={test_dir}\n[run.py] {' '.join(cmd)}",
          flush=True)
    t0 = time.time()
    with open(log_path, "wb") as log:
        p = subprocess.Popen(cmd, cwd=test_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
        deadline = t0 + a.timeout
        rc = None
        try:
            for line in iter(p.stdout.readline, b""):
                sys.stdout.buffer.write(line)
                sys.stdout.flush()
                log.write(line)
                if time.time() > deadline:
                    break
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                rc = None
        finally:
            if rc is None or p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                time.sleep(2)
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = 124
    print(f"[run.py] exit {rc} after {time.time() - t0:.1f} s; log {log_path}", flush=True)
    if not a.keep and rc == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
