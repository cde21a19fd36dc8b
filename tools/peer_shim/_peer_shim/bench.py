"""bench_kineto without kineto: there are no CUDA kernels on a CPU, so the "kernel" time of `name` is the
wall time of the Buffer methods whose name ends in `_<name>` or is `<name>` (low_latency_dispatch for
"dispatch", ...; Ascend kernel names such as "MoeLowLatencyDispatchV2" map to low_latency_dispatch), measured around each call; with return_recv_hook the hook's call is timed too and, with
num_kernels_per_period > 1, reported as the second part ([send, recv] per name), like DeepEP's.

PEER_SHIM_KINETO_TESTS (default 1) sets how many times fn runs (DeepEP's num_tests is capped by it):
the peer scripts' hooked runs include an 8192^3 GEMM that takes tens of seconds on a CPU."""
import os
import time

from . import log

_told = set()


class _Recorder:
    def __init__(self, names):
        self.names = names
        self.calls = {n: [] for n in names}
        self.patched = []

    def _classes(self):
        import sys
        out = []
        for modname in ("deep_ep", "epcomm", "sgl_kernel_npu.deepep", "deep_ep.buffer"):
            mod = sys.modules.get(modname)
            cls = getattr(mod, "Buffer", None) if mod is not None else None
            if isinstance(cls, type) and cls not in out:
                out.append(cls)
        return out

    @staticmethod
    def _matches(attr, name):
        """DeepEP's names ("dispatch") match Buffer.dispatch and Buffer.*_dispatch; kernel names such as
        sgl-kernel-npu's "MoeLowLatencyDispatchV2" match *_dispatch (low_latency_* only, if "LowLatency")."""
        if attr == name or attr.endswith("_" + name):
            return True
        low = name.lower()
        for op in ("dispatch", "combine"):
            if op in low and op != low and (attr == op or attr.endswith("_" + op)):
                return "lowlatency" not in low.replace("_", "") or attr.startswith("low_latency_")
        return False

    def __enter__(self):
        for cls in self._classes():
            for attr in dir(cls):
                if attr.startswith("_"):
                    continue
                for n in self.names:
                    if self._matches(attr, n):
                        fn = cls.__dict__.get(attr)
                        if callable(fn):
                            self.patched.append((cls, attr, fn))
                            setattr(cls, attr, self._wrap(fn, n))
                        break
        return self

    def __exit__(self, *exc):
        for cls, attr, fn in reversed(self.patched):
            setattr(cls, attr, fn)
        self.patched.clear()
        return False

    def _wrap(self, fn, name):
        calls = self.calls[name]

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            entry = [time.perf_counter() - t0]
            calls.append(entry)
            if kwargs.get("return_recv_hook") and type(result) is tuple and result and callable(result[-1]):
                hook = result[-1]

                def timed_hook(*a, **k):
                    t1 = time.perf_counter()
                    try:
                        return hook(*a, **k)
                    finally:
                        entry.append(time.perf_counter() - t1)

                result = result[:-1] + (timed_hook,)
            return result

        return timed


def bench_kineto(fn, kernel_names, num_tests=30, suppress_kineto_output=False, trace_path=None, flush_l2=True,
                 barrier_comm_profiling=False, num_kernels_per_period=1, barrier=None, **_ignored):
    is_tuple = isinstance(kernel_names, tuple)
    names = tuple(kernel_names) if is_tuple else (kernel_names,)
    n = max(0, min(int(num_tests), int(os.environ.get("PEER_SHIM_KINETO_TESTS", "1"))))
    key = (names, num_kernels_per_period)
    if key not in _told:
        _told.add(key)
        log(f"bench_kineto{names}: wall time of the Buffer calls over {n} run(s) of fn (no kineto on CPU)")
    total = 0.0
    with _Recorder(names) as rec:
        for _ in range(n):
            if barrier_comm_profiling:
                if barrier is not None:
                    barrier()
                else:
                    import torch
                    import torch.distributed as dist
                    if dist.is_initialized():
                        dist.all_reduce(torch.ones(1, dtype=torch.float))
            t0 = time.perf_counter()
            fn()
            total += time.perf_counter() - t0
    if trace_path is not None:
        with open(trace_path, "w") as f:
            f.write('{"traceEvents": []}\n')
    fallback = max(total / max(n, 1) / len(names), 1e-9)
    out = []
    for name in names:
        entries = rec.calls[name]
        if num_kernels_per_period > 1:
            parts = []
            for j in range(num_kernels_per_period):
                vals = [e[j] for e in entries if len(e) > j]
                parts.append(max(sum(vals) / len(vals), 1e-9) if vals else fallback / num_kernels_per_period)
            out.append(parts)
        else:
            out.append(max(sum(sum(e) for e in entries) / len(entries), 1e-9) if entries else fallback)
    return tuple(out) if is_tuple else out[0]
