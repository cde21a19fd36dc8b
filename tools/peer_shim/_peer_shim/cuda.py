"""torch.cuda stand-ins: one "device" per process, streams that are already done, events timed with
time.perf_counter, memory queries answered from the host. Also used for torch.npu (npu.py)."""
import contextlib
import os
import sys
import time
import types

import torch


def _env_int(name, default):
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


class _State:
    current_device = 0


class Stream:
    """A CPU stream: work is done when the call returns, so waits and queries are immediate."""

    def __init__(self, device=None, priority=0, **_):
        self.device = torch.device("cpu")
        self.priority = priority
        self.cuda_stream = 0
        self.npu_stream = 0

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return isinstance(other, Stream)

    def __hash__(self):
        return 0

    def __repr__(self):
        return "<peer_shim CPU Stream>"


_default_stream = Stream()


class Event:
    """record() takes time.perf_counter(); elapsed_time(end) is in milliseconds, like CUDA events."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False, **_):
        self.enable_timing = enable_timing
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def wait(self, stream=None):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end_event):
        if self._t is None or end_event._t is None:
            raise RuntimeError("peer_shim Event.elapsed_time: both events must be recorded first")
        return (end_event._t - self._t) * 1e3

    def __repr__(self):
        return f"<peer_shim CPU Event t={self._t}>"


def _host_memory():
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return free, total
    except (ValueError, OSError):
        return 64 << 30, 64 << 30


def _from_torch():
    """True when the caller of the shimmed function is torch's own code."""
    name = sys._getframe(2).f_globals.get("__name__", "")
    return name == "torch" or name.startswith("torch.")


def make_namespace(kind="cuda"):
    """The attributes that replace torch.cuda's (or form torch.npu)."""
    ns = {}

    # The script sees an accelerator; torch's own code (dynamo, inductor, distributed, profiler) does not,
    # so it keeps to its CPU paths instead of calling into the CUDA runtime it doesn't have.
    def is_available():
        if _from_torch():
            return False
        return os.environ.get("PEER_SHIM_CUDA_AVAILABLE", "1") == "1"

    def device_count():
        if _from_torch():
            return 0
        return _env_int("PEER_SHIM_DEVICE_COUNT", 8)

    def set_device(device):
        if isinstance(device, torch.device):
            device = device.index or 0
        elif isinstance(device, str):
            device = int(device.split(":")[1]) if ":" in device else 0
        _State.current_device = int(device)

    def current_device():
        return _State.current_device

    @contextlib.contextmanager
    def device_ctx(device=None):
        old = _State.current_device
        if device is not None:
            set_device(device)
        try:
            yield
        finally:
            _State.current_device = old

    def synchronize(device=None):
        pass

    def current_stream(device=None):
        return _default_stream

    def default_stream(device=None):
        return _default_stream

    def set_stream(stream):
        pass

    @contextlib.contextmanager
    def stream(s=None):
        yield s

    def _sleep(cycles):
        # CUDA's spin of `cycles` GPU clocks (~2 GHz): sleep as long, at most 1 s
        time.sleep(min(max(int(cycles), 0) / 2e9, 1.0))

    def get_device_name(device=None):
        return f"CPU (peer_shim {kind})"

    def get_device_capability(device=None):
        return (9, 0)

    def get_device_properties(device=None):
        if _from_torch():
            raise RuntimeError("peer_shim: no CUDA device for torch's own code")
        free, total = _host_memory()
        return types.SimpleNamespace(name=get_device_name(), total_memory=total, major=9, minor=0,
                                     multi_processor_count=os.cpu_count() or 1, is_integrated=False,
                                     is_multi_gpu_board=False)

    def mem_get_info(device=None):
        return _host_memory()

    def zero(*_, **__):
        return 0

    def noop(*_, **__):
        return None

    def memory_stats(*_, **__):
        return {}

    def is_initialized():
        return not _from_torch()

    def get_rng_state(device="cuda"):
        return torch.zeros(0, dtype=torch.uint8, device="cpu")

    def get_rng_state_all():
        return [get_rng_state() for _ in range(device_count())]

    def initial_seed():
        return torch.initial_seed()

    nvtx = types.SimpleNamespace(range_push=noop, range_pop=noop, mark=noop,
                                 range=lambda *a, **k: contextlib.nullcontext())
    ns.update(is_available=is_available, device_count=device_count, set_device=set_device,
              current_device=current_device, device=device_ctx, synchronize=synchronize,
              current_stream=current_stream, default_stream=default_stream, set_stream=set_stream,
              stream=stream, Stream=Stream, Event=Event, _sleep=_sleep, get_device_name=get_device_name,
              get_device_capability=get_device_capability, get_device_properties=get_device_properties,
              mem_get_info=mem_get_info, memory_allocated=zero, max_memory_allocated=zero,
              memory_reserved=zero, max_memory_reserved=zero, reset_peak_memory_stats=noop,
              reset_max_memory_allocated=noop, empty_cache=noop, memory_stats=memory_stats,
              is_initialized=is_initialized, init=noop, manual_seed=noop, manual_seed_all=noop,
              ipc_collect=noop, nvtx=nvtx,
              get_rng_state=get_rng_state, set_rng_state=noop, get_rng_state_all=get_rng_state_all,
              set_rng_state_all=noop, seed=noop, seed_all=noop, initial_seed=initial_seed, is_bf16_supported=lambda *a, **k: True)
    # one function object per name (torch._dynamo rejects one object registered under two torch names)
    for name, value in list(ns.items()):
        if isinstance(value, types.FunctionType):
            f = types.FunctionType(value.__code__, value.__globals__, name, value.__defaults__, value.__closure__)
            f.__qualname__ = f"peer_shim.{kind}.{name}"
            ns[name] = f
    return ns


def install():
    for name, value in make_namespace("cuda").items():
        setattr(torch.cuda, name, value)
