"""The seed's real torch dtypes in and out (torch 2.x): float8_e4m3fn, float8_e5m2, float8_e8m0fnu and
float4_e2m1fn_x2 from epcomm.quantize, as every quantized recv_x of dispatch (both strategies), as a
pre-quantized tuple x (and back out of dispatch unchanged), in epcomm.dequantize, and as the operators'
y_dtype / expand_x; uint8 views of the same bytes are accepted as input and give the same bits.

The meaning of the bytes is checked independently of epcomm: torch's own decoding of the fp8 and e8m0 dtypes
(and a nibble table for e2m1, which torch cannot compute with) times the scale must equal epcomm.dequantize,
which docs/quant.md defines as decode(code) x scale in fp32."""

import pytest
import torch

import epcomm

F8E4M3, F8E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E8M0, F4X2 = torch.float8_e8m0fnu, torch.float4_e2m1fn_x2

# mode -> (data dtype, scales dtype, scale block: elements per scale, None = one per row)
MODES = {
    "int8": (torch.int8, torch.float32, None),
    "pertoken_fp8_e4m3": (F8E4M3, torch.float32, None),
    "pergroup_fp8_e4m3": (F8E4M3, torch.float32, 128),
    "mx_fp8_e4m3": (F8E4M3, E8M0, 32),
    "mx_fp8_e5m2": (F8E5M2, E8M0, 32),
    "mx_fp4_e2m1": (F4X2, E8M0, 32),
}
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP e2m1 magnitudes of codes 0-7


def rows(T=6, H=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * torch.logspace(-3, 3, T).unsqueeze(1)
    return x.to(torch.bfloat16)


def torch_decode(data, scales, mode):
    """fp32 values of (data, scales) decoded by torch's own dtypes, not by epcomm."""
    dtype, _, block = MODES[mode]
    if dtype == F4X2:
        b = data.view(torch.uint8).to(torch.int64)
        codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1)  # low nibble first
        mag = torch.tensor(E2M1)[codes & 7]
        values = torch.where(codes >= 8, -mag, mag)
    else:
        values = data.float()
    s = scales.float().reshape(values.shape[0], -1)
    if block is not None:
        s = s.repeat_interleave(block, dim=1)[:, : values.shape[1]]
    return values * s


@pytest.mark.parametrize("mode", list(MODES))
def test_quantize_gives_real_dtypes_that_torch_decodes(mode):
    x = rows()
    data, scales = epcomm.quantize(x, mode)
    dtype, sdtype, _ = MODES[mode]
    assert data.dtype == dtype and scales.dtype == sdtype
    assert list(data.shape) == [6, 128 if dtype == F4X2 else 256]
    back = epcomm.dequantize(data, scales, mode)
    assert back.dtype == torch.float32
    assert torch.equal(back, torch_decode(data, scales, mode)), f"{mode}: torch's decoding differs from epcomm's"
    # uint8 views of the same bytes: the mode names the formats, the result is the same.
    s_in = scales.view(torch.uint8) if sdtype == E8M0 else scales
    assert torch.equal(epcomm.dequantize(data.view(torch.uint8), s_in, mode), back)
    if mode == "int8":
        return
    err = (back - x.float()).abs().max().item()
    assert err <= x.float().abs().max().item() * (0.3 if dtype == F4X2 else 0.07), f"{mode}: error {err}"


def dispatch_one_rank(buf, x, quant_mode=None, num_experts=4):
    T = x[0].shape[0] if isinstance(x, tuple) else x.shape[0]
    idx = torch.stack([torch.arange(T) % num_experts, (torch.arange(T) + 1) % num_experts], dim=1)
    w = torch.full((T, 2), 0.5)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, num_experts)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert,
                                              quant_mode=quant_mode)
    return recv_x, handle


def u8(t):
    """The bytes of t (torch cannot index float4_e2m1fn_x2 tensors, so rows are picked from this view)."""
    return t.contiguous().view(torch.uint8)


def same_bytes(a, b):
    return torch.equal(u8(a), u8(b))


@pytest.mark.parametrize("strategy", ["shm", "alltoall"])
@pytest.mark.parametrize("mode", list(MODES))
def test_quantized_dispatch_returns_real_dtypes(world1, monkeypatch, strategy, mode):
    if strategy == "alltoall":
        monkeypatch.setenv("DEEP_USE_MODE", "alltoall")
    buf = epcomm.Buffer(world1)
    try:
        x = rows()
        (data, scales), handle = dispatch_one_rank(buf, x, quant_mode=mode)
        dtype, sdtype, _ = MODES[mode]
        assert data.dtype == dtype and scales.dtype == sdtype, (data.dtype, scales.dtype)
        qd, qs = epcomm.quantize(x, mode)
        src = handle.recv_src_token.long()
        assert (src >= 0).all()
        assert same_bytes(data, u8(qd)[src]), f"{mode}: recv_x data is not the quantized rows of its tokens"
        assert same_bytes(scales.reshape(len(src), -1), u8(qs).reshape(len(x), -1)[src])
    finally:
        buf.destroy()


@pytest.mark.parametrize("strategy", ["shm", "alltoall"])
@pytest.mark.parametrize("mode", [m for m in MODES if m != "int8"])
@pytest.mark.parametrize("view", ["real", "uint8"])
def test_prequantized_tuple_in_and_out(world1, monkeypatch, strategy, mode, view):
    if strategy == "alltoall":
        monkeypatch.setenv("DEEP_USE_MODE", "alltoall")
    buf = epcomm.Buffer(world1)
    try:
        qd, qs = epcomm.quantize(rows(seed=1), mode)
        dtype, sdtype, _ = MODES[mode]
        if view == "uint8":
            data_in = qd.view(torch.uint8)
            scales_in = qs.view(torch.uint8) if sdtype == E8M0 else qs
            hint = mode if dtype == F8E5M2 else None  # e5m2 cannot be told from e4m3 by its shapes
        else:
            data_in, scales_in, hint = qd, qs, None
        (data, scales), handle = dispatch_one_rank(buf, (data_in, scales_in), quant_mode=hint)
        assert data.dtype == dtype and scales.dtype == sdtype, (view, data.dtype, scales.dtype)
        src = handle.recv_src_token.long()
        assert same_bytes(data, u8(qd)[src])
        assert same_bytes(scales.reshape(len(src), -1), u8(qs).reshape(len(qd), -1)[src])
    finally:
        buf.destroy()


@pytest.mark.parametrize("quant_mode,y_dtype,scales_dtype", [
    (2, None, torch.float32), (2, torch.int8, torch.float32),
    (3, None, torch.float32), (3, F8E4M3, torch.float32), (3, F8E5M2, torch.float32),
    (4, None, torch.uint8), (4, F8E4M3, torch.uint8), (4, F8E5M2, torch.uint8)])
def test_operator_expand_x_dtypes(world1, quant_mode, y_dtype, scales_dtype):
    # Spec docs/distribute-v2.md: expand_x is y_dtype (default int8 in mode 2, e4m3 in modes 3 and 4);
    # dynamic_scales are fp32, and E8M0 bytes as uint8 in mode 4.
    x = rows(T=4, H=256, seed=2)
    ids = torch.tensor([[0], [1], [0], [1]], dtype=torch.int32)
    out = epcomm.ops.npu_moe_distribute_dispatch_v2(x, ids, world1, 1, 0, 2, quant_mode=quant_mode,
                                                    y_dtype=y_dtype)
    expand_x, dynamic_scales = out[0], out[1]
    want = y_dtype or (torch.int8 if quant_mode == 2 else F8E4M3)
    assert expand_x.dtype == want and dynamic_scales.dtype == scales_dtype
    if quant_mode == 3 and want == F8E4M3:  # per-128 groups: torch's decoding times the scales is x, roughly
        back = expand_x.float() * dynamic_scales.float().repeat_interleave(128, dim=1)
        order = torch.tensor([0, 2, 1, 3])  # rows by expert: tokens 0, 2 (expert 0), then 1, 3
        assert ((back[:4] - x.float()[order]).abs() <= x.float()[order].abs() * 0.07 + 1e-30).all()


def test_unknown_torch_dtype_is_named(world1):
    buf = epcomm.Buffer(world1)
    try:
        with pytest.raises(epcomm.InvalidUsageError, match="complex64"):
            dispatch_one_rank(buf, rows().to(torch.complex64))
    finally:
        buf.destroy()
