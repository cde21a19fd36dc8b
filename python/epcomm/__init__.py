"""epcomm: expert-parallel communication for Mixture-of-Experts models on CPUs.

    import epcomm
    buffer = epcomm.Buffer(group)            # group: a torch.distributed gloo ProcessGroup (collective)
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(x, topk_idx=..., ...)
    combined_x, combined_w, event = buffer.combine(expert_out, handle)

See docs/python.md. `deep_ep` re-exports Buffer, Config and EventOverlap for code written against DeepEP."""
import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C
from ._errors import AbortedError, Error, InternalError, InvalidUsageError, SystemError, TimeoutError
from ._errors import INT32, int_arg
from .buffer import Buffer, Config
from .event import EventOverlap
from .group import Group
from .handle import Handle
from .quant import dequantize, quantize
from . import ops

__version__ = _C.__version__


def min_nvl_bytes(row_bytes, num_topk, num_ranks, ranks_per_node=None):
    """Segment size (num_nvl_bytes) with which every call whose record has row_bytes of payload and num_topk
    slots succeeds (it may move in rounds)."""
    return _C.min_nvl_bytes(*_size_args("min_nvl_bytes", row_bytes, num_topk, num_ranks, ranks_per_node))


def min_rdma_bytes(row_bytes, num_topk, num_ranks, ranks_per_node=None):
    """Internode staging size with which every such call succeeds (0 on one node)."""
    return _C.min_rdma_bytes(*_size_args("min_rdma_bytes", row_bytes, num_topk, num_ranks, ranks_per_node))


def _size_args(op, row_bytes, num_topk, num_ranks, ranks_per_node):
    pre = f"{op}: "
    return (int_arg(row_bytes, "row_bytes", (0, 1 << 40), pre), int_arg(num_topk, "num_topk", INT32, pre),
            int_arg(num_ranks, "num_ranks", INT32, pre),
            None if ranks_per_node is None else int_arg(ranks_per_node, "ranks_per_node", INT32, pre))


__all__ = [
    "Buffer", "Config", "EventOverlap", "Group", "Handle", "ops", "quantize", "dequantize", "min_nvl_bytes",
    "min_rdma_bytes", "Error", "InvalidUsageError", "TimeoutError", "AbortedError", "SystemError",
    "InternalError",
]
