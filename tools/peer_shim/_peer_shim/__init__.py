"""peer_shim: CPU stand-ins for the accelerator APIs that peer test scripts use (see ../README.md).

install() (called by ../sitecustomize.py) does, in this order:
  * torch.cuda.*  -> CPU stand-ins (devices, streams, events timed with perf_counter, memory queries, _sleep)
  * device="cuda"/"npu"/int, .cuda(), .npu(), .to("cuda"), set_default_device("cuda"), pin_memory,
    record_stream -> CPU (a TorchFunctionMode on the main thread plus a few wrappers)
  * torch.distributed.init_process_group / new_group: nccl/hccl -> gloo, device_id dropped
  * torch.compile -> the function itself (PEER_SHIM_TORCH_COMPILE=1 keeps the real one)
  * `deep_ep.utils.*` from a DeepEP source tree (PEER_SHIM_DEEPEP_SRC), with a stub `deep_ep._C`
  * bench_kineto of DeepEP-style test utils -> wall-time of the Buffer calls (no kineto on CPU)
  * torch_npu / torch.npu stand-ins (PEER_SHIM_NPU=1, the default), see npu.py
Nothing here changes epcomm or the peer scripts."""
import os
import sys

_installed = False


def log(msg):
    if os.environ.get("PEER_SHIM_QUIET", "0") != "1":
        print(f"[peer_shim pid {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def install():
    global _installed
    if _installed:
        return
    _installed = True
    import torch  # noqa: F401  (the shim is about torch; importing it here is the point)

    from . import cuda, device, distributed, imports
    cuda.install()
    device.install()
    distributed.install()
    if os.environ.get("PEER_SHIM_TORCH_COMPILE", "0") != "1":
        _no_compile()
    imports.install()
    if os.environ.get("PEER_SHIM_NPU", "1") == "1":  # torch_npu / torch.npu stand-ins
        from . import npu
        npu.install()


def _no_compile():
    import torch

    def compile(model=None, *args, **kwargs):  # noqa: A001 - replaces torch.compile
        if model is None:
            return lambda fn: fn
        return model

    compile._peer_shim = True
    torch.compile = compile
