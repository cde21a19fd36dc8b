"""torch dtypes <-> epcomm format names. Outputs in the one-byte formats (fp8, e8m0, fp4x2) come back as the
real torch dtypes (float8_e8m0fnu needs torch 2.7, float4_e2m1fn_x2 torch 2.8; with an older torch such a
format stays torch.uint8); inputs are accepted in the real dtypes or as uint8 views of the same bytes."""
import torch

# epcomm name -> attribute of the torch module that names the real dtype, where one exists.
_REAL_NAMES = {
    "f8e4m3": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
    "e8m0": "float8_e8m0fnu",
    "f4x2": "float4_e2m1fn_x2",
}
REAL_DTYPES = {name: getattr(torch, attr) for name, attr in _REAL_NAMES.items() if hasattr(torch, attr)}
_NAME_OF_REAL = {dtype: name for name, dtype in REAL_DTYPES.items()}

PLAIN = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "bool",
}
TORCH_OF = {name: dtype for dtype, name in PLAIN.items()}

# The data and scale formats of each quant mode (docs/normal-mode.md).
MODE_DATA = {
    "int8": "i8",
    "pertoken_fp8_e4m3": "f8e4m3",
    "pergroup_fp8_e4m3": "f8e4m3",
    "mx_fp8_e4m3": "f8e4m3",
    "mx_fp8_e5m2": "f8e5m2",
    "mx_fp4_e2m1": "f4x2",
}
MODE_SCALES = {
    "int8": "f32",
    "pertoken_fp8_e4m3": "f32",
    "pergroup_fp8_e4m3": "f32",
    "mx_fp8_e4m3": "e8m0",
    "mx_fp8_e5m2": "e8m0",
    "mx_fp4_e2m1": "e8m0",
}


def torch_dtype(name):
    """The torch dtype an epcomm format comes back as: the real one if torch has it, else uint8."""
    if name in REAL_DTYPES:
        return REAL_DTYPES[name]
    return TORCH_OF.get(name, torch.uint8)


def as_format(t, name):
    """Views a tensor the C++ core returned (uint8 for one-byte formats) as the real torch dtype if any."""
    if t is None or name is None:
        return t
    real = REAL_DTYPES.get(name)
    if real is not None and t.dtype != real:
        return t.view(real)
    return t


def byte_view(t):
    """(tensor the C++ core can read, epcomm format name or None): real fp8/e8m0/fp4 torch tensors are passed
    as uint8 views plus their format name."""
    name = _NAME_OF_REAL.get(t.dtype)
    if name is None:
        return t, None
    return t.view(torch.uint8), name


def tuple_formats(data, scales, quant_mode):
    """epcomm format names for a pre-quantized (data, scales) tuple, whose one-byte tensors may be plain
    torch.uint8 views. quant_mode, when given, decides; otherwise the
    shapes do: f32 scales mean e4m3 data, e8m0 scales with H/32 per row mean e4m3 data (mx_fp8_e4m3; say
    quant_mode="mx_fp8_e5m2" for e5m2) and with 2*cols/32 per row fp4x2 data."""
    d, dn = byte_view(data)
    s, sn = byte_view(scales)
    if quant_mode in MODE_DATA:
        if dn is None and d.dtype == torch.uint8:
            dn = MODE_DATA[quant_mode]
        if sn is None and s.dtype == torch.uint8:
            sn = MODE_SCALES[quant_mode]
        return d, dn, s, sn
    if sn is None and s.dtype == torch.uint8:
        sn = "e8m0"
    if dn is None and d.dtype == torch.uint8:
        if s.dtype == torch.float32:
            dn = "f8e4m3"
        else:
            dn = "f8e4m3"
            rows = d.shape[0] if d.dim() >= 1 else 0
            cols = d.shape[1] if d.dim() == 2 else 0
            per_row = (s.shape[1] if s.dim() == 2 else (s.numel() // rows if rows else 0))
            if cols and per_row * 32 == 2 * cols and per_row * 32 != cols:
                dn = "f4x2"
    return d, dn, s, sn
