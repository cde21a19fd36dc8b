"""quantize / dequantize: the number formats dispatch puts on the wire (docs/quant.md), bit for bit."""
import torch

from . import _C
from ._dtypes import MODE_DATA, MODE_SCALES, as_format, byte_view
from ._errors import INT32, InvalidUsageError, int_arg

_OUT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def quantize(x, mode, num_threads=1):
    """Quantizes the rows of x ([T, H] bf16/f16/f32) as dispatch does in `mode` ("int8",
    "pertoken_fp8_e4m3", "pergroup_fp8_e4m3", "mx_fp8_e4m3", "mx_fp8_e5m2", "mx_fp4_e2m1"). Returns
    (data, scales): the tuple dispatch accepts as pre-quantized x (MX scales come as [T, H/32])."""
    _check(x, "x", mode, num_threads, "quantize")
    data, dn, scales, sn = _C.quantize(x, mode, int(num_threads))
    return as_format(data, dn), as_format(scales, sn)


def dequantize(data, scales, mode, out_dtype=None, num_threads=1):
    """Inverse of quantize: a [T, H] tensor of out_dtype (torch.float32 by default, or bf16/f16)."""
    _check(data, "data", mode, num_threads, "dequantize")
    out = _OUT.get(str(out_dtype or torch.float32).replace("torch.", ""))
    if out is None:
        raise InvalidUsageError(f"dequantize: argument: out_dtype: expected torch.float32, torch.bfloat16 or "
                                f"torch.float16, got {out_dtype!r}")
    if scales is not None and not isinstance(scales, torch.Tensor):
        raise InvalidUsageError(f"dequantize: argument: scales: expected a torch.Tensor, got {type(scales).__name__}")
    d, dn = byte_view(data)
    dn = dn or (MODE_DATA.get(mode) if d.dtype == torch.uint8 else None)
    s, sn = (None, None) if scales is None else byte_view(scales)
    if s is not None and sn is None and s.dtype == torch.uint8:
        sn = MODE_SCALES.get(mode)
    return _C.dequantize(d, s, mode, out, dn, sn, int(num_threads))


def _check(t, name, mode, num_threads, op):
    if not isinstance(t, torch.Tensor):
        raise InvalidUsageError(f"{op}: argument: {name}: expected a torch.Tensor, got {type(t).__name__}")
    if not isinstance(mode, str):
        raise InvalidUsageError(f"{op}: argument: mode: expected a quant_mode name, got {mode!r}")
    int_arg(num_threads, "num_threads", (0, INT32[1]), f"{op}: ")
