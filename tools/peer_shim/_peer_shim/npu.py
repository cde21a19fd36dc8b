"""Ascend stand-ins: `import torch_npu` gives a module (unless a real torch_npu is importable), torch.npu gets
the same CPU namespace as torch.cuda (cuda.py), device="npu..." maps to CPU (device.py); with
PEER_SHIM_NPU_DEVICE=1 "npu" also becomes a torch device type name (the PrivateUse1 backend renamed). torch_npu's operators (npu_moe_distribute_*)
are taken from epcomm.ops when it has them; any other torch_npu attribute raises, naming it."""
import importlib.util
import os
import sys
import types

import torch

from . import cuda, log


class _TorchNpu(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            import epcomm.ops as ops
            if hasattr(ops, name):
                return getattr(ops, name)
        except ImportError:
            pass
        raise AttributeError(f"torch_npu.{name}: not provided by the peer_shim CPU stand-in")


def install():
    ns = types.SimpleNamespace(**cuda.make_namespace("npu"))
    if not hasattr(torch, "npu"):
        npu_mod = types.ModuleType("torch.npu")
        npu_mod.__dict__.update(vars(ns))
        torch.npu = npu_mod
        sys.modules["torch.npu"] = npu_mod
    if os.environ.get("PEER_SHIM_NPU_DEVICE", "0") == "1":
        # makes torch.device("npu:0") constructible, but torch then expects a PrivateUse1 backend
        # (dist.barrier() fails asking for RegisterPrivateUse1HooksInterface): opt-in only
        try:
            torch.utils.rename_privateuse1_backend("npu")
        except Exception as e:  # already renamed, or not allowed in this torch
            log(f"rename_privateuse1_backend('npu'): {e}")
    if importlib.util.find_spec("torch_npu") is None:
        mod = _TorchNpu("torch_npu")
        mod.npu = torch.npu
        mod.__path__ = []  # so `import torch_npu.x` fails with a clear ModuleNotFoundError
        sys.modules["torch_npu"] = mod
