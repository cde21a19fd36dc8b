"""torch.distributed: the accelerator backends (nccl, hccl, "cpu:gloo,cuda:nccl", ...) become gloo and
device_id / NCCL-only options are dropped, so init_process_group(backend='nccl', ...) works on CPU;
all_gather_into_tensor / reduce_scatter_tensor also take NCCL's stacked [world, ...] layout (gloo takes only
the concatenated one)."""
import functools

import torch.distributed as dist

from . import log
from .device import is_accel

_ACCEL_BACKENDS = ("nccl", "hccl", "xccl", "mpi")


def _map_backend(backend):
    if backend is None:
        return None
    b = str(backend).lower()
    if any(a in b for a in _ACCEL_BACKENDS) or "cuda" in b or "npu" in b:
        return "gloo"
    return backend


def install():
    orig_init = dist.init_process_group

    @functools.wraps(orig_init)
    def init_process_group(*args, **kwargs):
        args = list(args)
        if args:
            old = args[0]
            args[0] = _map_backend(args[0])
        else:
            old = kwargs.get("backend")
            kwargs["backend"] = _map_backend(old) or "gloo"
        dev = kwargs.pop("device_id", None)
        if old != (args[0] if args else kwargs["backend"]) or dev is not None:
            log(f"init_process_group: backend {old!r} -> gloo" + (f", device_id {dev} dropped" if dev is not None
                                                                 else ""))
        kwargs.pop("pg_options", None)
        return orig_init(*args, **kwargs)

    orig_new_group = dist.new_group

    @functools.wraps(orig_new_group)
    def new_group(*args, **kwargs):
        args = list(args)
        if len(args) >= 3:  # new_group(ranks, timeout, backend, pg_options, ...)
            args[2] = _map_backend(args[2])
            if len(args) >= 4:
                args[3] = None
        if "backend" in kwargs:
            kwargs["backend"] = _map_backend(kwargs["backend"])
        kwargs.pop("pg_options", None)
        if is_accel(kwargs.get("device_id")):
            kwargs.pop("device_id")
        return orig_new_group(*args, **kwargs)

    orig_agit = dist.all_gather_into_tensor

    @functools.wraps(orig_agit)
    def all_gather_into_tensor(output_tensor, input_tensor, *args, **kwargs):
        # NCCL takes a stacked [world, *in] output; gloo only the concatenated [world * in0, *in[1:]]
        if (output_tensor.dim() == input_tensor.dim() + 1 and output_tensor.is_contiguous()
                and tuple(output_tensor.shape[1:]) == tuple(input_tensor.shape)):
            output_tensor = output_tensor.view(-1, *input_tensor.shape[1:])
        return orig_agit(output_tensor, input_tensor, *args, **kwargs)

    orig_rst = dist.reduce_scatter_tensor

    @functools.wraps(orig_rst)
    def reduce_scatter_tensor(output, input, *args, **kwargs):  # noqa: A002 - torch's names
        if (input.dim() == output.dim() + 1 and input.is_contiguous()
                and tuple(input.shape[1:]) == tuple(output.shape)):
            input = input.view(-1, *output.shape[1:])  # noqa: A001
        return orig_rst(output, input, *args, **kwargs)

    dist.init_process_group = init_process_group
    dist.new_group = new_group
    dist.all_gather_into_tensor = all_gather_into_tensor
    dist.reduce_scatter_tensor = reduce_scatter_tensor
    try:
        import torch.distributed.distributed_c10d as c10d
        c10d.init_process_group = init_process_group
        c10d.new_group = new_group
    except ImportError:
        pass
