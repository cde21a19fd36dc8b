"""Accelerator devices -> CPU: a TorchFunctionMode (pushed on the importing thread, the script's main
thread) rewrites `device=` of every torch call, torch.device("cuda"/"npu"...) itself, the positional device of Tensor.to, and makes .cuda()/.npu()/
pin_memory()/record_stream() no-ops; torch.set_default_device("cuda") becomes "cpu"."""
import functools

import torch
from torch.overrides import TorchFunctionMode

ACCEL_TYPES = ("cuda", "npu", "privateuseone")


def is_accel(dev):
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):  # a bare ordinal means an accelerator
        return True
    if isinstance(dev, str):
        return dev.split(":")[0] in ACCEL_TYPES
    if isinstance(dev, torch.device):
        return dev.type in ACCEL_TYPES
    return False


def to_cpu(dev):
    return torch.device("cpu") if is_accel(dev) else dev


_SELF_METHODS = set()
_NONE_METHODS = set()
for _n in ("cuda", "npu", "pin_memory"):
    if hasattr(torch.Tensor, _n):
        _SELF_METHODS.add(getattr(torch.Tensor, _n))
for _n in ("record_stream",):
    if hasattr(torch.Tensor, _n):
        _NONE_METHODS.add(getattr(torch.Tensor, _n))
_TO = torch.Tensor.to


class CpuDeviceMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SELF_METHODS:
            return args[0]
        if func in _NONE_METHODS:
            return None
        if func is torch.device and args and isinstance(args[0], str) and is_accel(args[0]):
            return torch.device("cpu")  # torch.device("npu:0") would not even parse without torch_npu
        if "device" in kwargs and is_accel(kwargs["device"]):
            kwargs = dict(kwargs, device=torch.device("cpu"))
        if func is _TO and len(args) > 1:
            args = (args[0],) + tuple(to_cpu(a) for a in args[1:])
        return func(*args, **kwargs)


_mode = None


def install():
    global _mode
    orig_set_default_device = torch.set_default_device

    @functools.wraps(orig_set_default_device)
    def set_default_device(device):
        return orig_set_default_device(to_cpu(device))

    torch.set_default_device = set_default_device
    orig_is_pinned = torch.Tensor.is_pinned

    def is_pinned(self, *args, **kwargs):
        return False

    torch.Tensor.is_pinned = is_pinned
    _mode = CpuDeviceMode()
    _mode.__enter__()  # stays on the stack for the life of the thread
    del orig_is_pinned
    # torch function modes are per thread: threads started later get one too
    import threading
    inner = getattr(threading.Thread, "_bootstrap_inner", None)
    if inner is not None:
        def _bootstrap_inner(self):
            with CpuDeviceMode():
                inner(self)

        threading.Thread._bootstrap_inner = _bootstrap_inner
