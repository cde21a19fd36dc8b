"""Single-process checks of the Python front: Config, size functions, exception mapping, dtype mapping,
quantizers, the deep_ep module, a one-rank distribute-v2 round trip, and a one-rank Buffer in both strategies."""
import pickle

import pytest
import torch

import epcomm
from epcomm import _C


def test_config_forms_and_validation():
    c = epcomm.Config()
    assert (c.num_threads, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (0, 32, 256, 32, 256)
    d = epcomm.Config(24, 6, 256, 6, 128)  # DeepEP's positional form: the first is num_sms -> num_threads
    assert d.num_threads == 24 and d.num_sms == 24 and d.num_max_rdma_chunked_recv_tokens == 128
    k = epcomm.Config(num_threads=2, num_max_nvl_chunked_send_tokens=8)
    assert k.num_max_nvl_chunked_send_tokens == 8 and k.num_max_nvl_chunked_recv_tokens == 256
    assert pickle.loads(pickle.dumps(d)) == d
    with pytest.raises(epcomm.InvalidUsageError, match="num_max_nvl_chunked_send_tokens"):
        epcomm.Config(0, 300, 256, 6, 128)
    with pytest.raises(ValueError, match="num_max_rdma_chunked_recv_tokens: expected >= 1"):
        epcomm.Config(0, 1, 1, 1, 0)


def test_static_configs_and_size_hints():
    for n in (1, 2, 3, 7, 64, 1000):
        assert epcomm.Buffer.get_dispatch_config(n) == epcomm.Buffer.get_combine_config(n)
    epcomm.Buffer.set_num_threads(3)
    try:
        assert epcomm.Buffer.num_threads == 3 and epcomm.Buffer.get_dispatch_config(8).num_threads == 3
    finally:
        epcomm.Buffer.set_num_threads(0)
    cfg = epcomm.Buffer.get_dispatch_config(8)
    hidden_bytes = 7168 * 2
    hint = cfg.get_nvl_buffer_size_hint(hidden_bytes, 8)
    assert hint >= epcomm.min_nvl_bytes(hidden_bytes, 32, 8) > 0
    assert cfg.get_rdma_buffer_size_hint(hidden_bytes, 8) == 0 and epcomm.min_rdma_bytes(hidden_bytes, 8, 8) == 0
    assert cfg.get_nvl_buffer_size_hint(hidden_bytes, 8, ranks_per_node=None) == hint


@pytest.mark.parametrize("code, cls, builtin", [
    ("InvalidUsage", epcomm.InvalidUsageError, ValueError),
    ("Timeout", epcomm.TimeoutError, TimeoutError),
    ("Aborted", epcomm.AbortedError, RuntimeError),
    ("SystemError", epcomm.SystemError, RuntimeError),
    ("Internal", epcomm.InternalError, RuntimeError),
])
def test_cpp_errors_arrive_with_their_class_and_message(code, cls, builtin):
    message = f"epcomm[rank 3] dispatch#7: a {code} message, verbatim"
    with pytest.raises(cls) as info:
        _C._raise(code, message)
    assert isinstance(info.value, builtin) and isinstance(info.value, epcomm.Error)
    assert str(info.value) == message


def test_dtype_mapping_and_quantizers():
    x = torch.randn(4, 64).to(torch.bfloat16)
    data, scales = epcomm.quantize(x, "mx_fp4_e2m1")
    real = getattr(torch, "float4_e2m1fn_x2", torch.uint8)
    assert data.dtype == real and list(data.shape) == [4, 32]
    assert scales.dtype == getattr(torch, "float8_e8m0fnu", torch.uint8) and list(scales.shape) == [4, 2]
    d8, s8 = epcomm.quantize(x, "int8")
    assert d8.dtype == torch.int8 and s8.dtype == torch.float32 and list(s8.shape) == [4]
    back = epcomm.dequantize(d8, s8, "int8")
    assert back.dtype == torch.float32 and (back - x.float()).abs().max() < 0.05
    f8, f8s = epcomm.quantize(x, "pergroup_fp8_e4m3")
    assert list(f8s.shape) == [4, 1] and f8.dtype == getattr(torch, "float8_e4m3fn", torch.uint8)
    assert (epcomm.dequantize(f8, f8s, "pergroup_fp8_e4m3", torch.bfloat16).float() - x.float()).abs().max() < 0.3
    with pytest.raises(epcomm.InvalidUsageError):
        epcomm.quantize(torch.randn(2, 33), "mx_fp8_e4m3")  # MX modes need H % 32 == 0


def test_deep_ep_module_reexports():
    import deep_ep

    assert deep_ep.Buffer is epcomm.Buffer and deep_ep.Config is epcomm.Config
    assert deep_ep.EventOverlap is epcomm.EventOverlap and deep_ep.topk_idx_t is torch.int64


def test_num_threads_class_default():
    epcomm.Buffer.num_threads = 2  # assigned directly, as DeepEP code does with num_sms
    try:
        assert epcomm.Buffer.get_combine_config(4).num_threads == 2
    finally:
        epcomm.Buffer.set_num_threads(0)
    assert epcomm.Buffer.get_dispatch_config(4).num_threads == 0


def test_event_overlap():
    e = epcomm.EventOverlap()
    assert e.is_complete()
    e.current_stream_wait()
    with e as inner:
        assert inner is e
    assert epcomm.Buffer.capture().is_complete()


def test_distribute_ops_one_rank(world1):
    ops = epcomm.ops
    with pytest.raises(epcomm.InvalidUsageError, match="no group registered under the name 'ep0'"):
        ops.npu_moe_distribute_dispatch_v2(torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int32), "ep0", 1, 0, 1)
    ops.register_group("ep0", world1)
    x = torch.arange(16, dtype=torch.float32).reshape(2, 8).bfloat16()
    ids, w = torch.zeros(2, 1, dtype=torch.int32), torch.tensor([[0.5], [2.0]])
    expand_x, dyn, assist, nums, ep_counts, tp_counts, expand_scales = ops.npu_moe_distribute_dispatch_v2(
        x, ids, "ep0", 1, 0, 1, expert_scales=w, quant_mode=0, global_bs=0)
    assert torch.equal(expand_x, x) and assist[:6].tolist() == [0, 0, 0, 0, 1, 0]
    assert nums.tolist() == [2] and ep_counts.tolist() == [2] and tp_counts.numel() == 0
    assert torch.equal(expand_scales, w.reshape(2))
    y = ops.npu_moe_distribute_combine_v2(expand_x, ids, assist, ep_counts, w, "ep0", 1, 0, 1)
    assert torch.equal(y, (x.float() * w).bfloat16())
    yn, rstd, xn = ops.npu_moe_distribute_combine_add_rms_norm(
        expand_x, ids, residual_x=x.reshape(2, 1, 8), gamma=torch.ones(8).bfloat16(), group_ep=world1,
        ep_world_size=1, ep_rank_id=0, moe_expert_num=1, norm_eps=1e-5, expand_idx=assist, ep_send_counts=ep_counts,
        expert_scales=w)
    assert yn.shape == (2, 1, 8) and rstd.shape == (2, 1, 1) and rstd.dtype == torch.float32
    assert torch.equal(xn, (x.float() * (w + 1)).bfloat16().reshape(2, 1, 8))
    # An epcomm.Group gets its operator context on its first call (created inside the GIL-free call).
    out = ops.npu_moe_distribute_dispatch_v2(x, ids, None, 1, 0, 1, ep_group=epcomm.Group(world1), timeout=5,
                                             strict_hardware_limits="")
    assert torch.equal(out[0], x)
    # Errors name the parameter.
    with pytest.raises(epcomm.InvalidUsageError, match="expand_idx"):
        ops.npu_moe_distribute_combine_v2(expand_x, ids, assist, ep_counts, w, "ep0", 1, 0, 1, expand_idx=assist)
    with pytest.raises(epcomm.InvalidUsageError, match="moe_expert_num"):
        ops.npu_moe_distribute_dispatch_v2(x, ids, "ep0", 1, 0, 0)
    with pytest.raises(epcomm.InvalidUsageError, match="x_dtype"):
        ops.npu_moe_distribute_dispatch_v2(x, ids, "ep0", 1, 0, 1, x_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="group_ep"):
        ops.npu_moe_distribute_dispatch_v2(x, ids, 42, 1, 0, 1)
    with pytest.raises(epcomm.InvalidUsageError):
        ops.register_group("bad", object())
    ops.unregister_group("ep0")


@pytest.mark.parametrize("mode", ["shm", "alltoall"])
def test_one_rank_buffer(world1, mode, monkeypatch):
    if mode == "alltoall":
        monkeypatch.setenv("DEEP_USE_MODE", "alltoall")
    else:
        monkeypatch.delenv("DEEP_USE_MODE", raising=False)
    buf = epcomm.Buffer(world1, num_nvl_bytes=1 << 22, num_qps_per_rank=12, explicitly_destroy=True)
    assert (buf.rank, buf.num_ranks, buf.group_size, buf.num_nodes, buf.node_of(0)) == (0, 1, 1, 1, 0)
    assert buf.mode == mode and buf.receive_order == "expert_major" and buf.timeout_s > 0
    idx = torch.tensor([[0, 1], [2, -1], [3, 3], [-1, -1], [1, 0]])
    w = torch.rand(5, 2)
    x = torch.randn(5, 8).to(torch.bfloat16)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, 4)
    assert per_rank.tolist() == [4] and per_rdma is None and per_expert.tolist() == [2, 2, 1, 2]
    recv_x, recv_idx, recv_w, lst, handle, ev = buf.dispatch(x, topk_idx=idx, topk_weights=w,
                                                              num_tokens_per_expert=per_expert, expert_alignment=2)
    assert lst == [2, 2, 2, 2] and handle.num_recv_pairs_per_expert == [2, 2, 1, 2] and recv_x.shape == (8, 8)
    assert handle.recv_src_token.tolist() == [0, 4, 0, 4, 1, -1, 2, 2]
    assert handle.recv_src_slot.tolist() == [0, 1, 1, 0, 0, -1, 0, 1]
    assert handle.receive_order == "expert_major" and handle.num_rows == handle.num_recv_rows == 8
    assert (handle.num_tokens, handle.num_topk, handle.num_experts) == (5, 2, 4)
    assert torch.equal(recv_x[5], torch.zeros(8, dtype=torch.bfloat16))  # the PAD row
    out, cw, _ = buf.combine(recv_x, handle)
    expected = (x.float() * torch.where(idx >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)).to(torch.bfloat16)
    assert (out.float() - expected.float()).abs().max() <= 0.02
    with pytest.raises(epcomm.InvalidUsageError, match="handle: expected the Handle returned by dispatch"):
        buf.combine(recv_x, tuple(handle))
    with pytest.raises(epcomm.InvalidUsageError, match=r"topk_idx\[0, 1\] = 9 is out of range \[0, 4\)"):
        buf.get_dispatch_layout(torch.tensor([[0, 9]]), 4)
    with pytest.raises(ValueError, match="topk_weights: shape"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w[:, :1], num_tokens_per_expert=per_expert)
    buf.destroy()
    with pytest.raises(epcomm.InvalidUsageError, match="destroyed"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)


def test_low_latency_calls_need_low_latency_mode(world1):
    buf = epcomm.Buffer(world1, flavor="deepep")
    x = torch.zeros(1, 128, dtype=torch.bfloat16)
    with pytest.raises(epcomm.InvalidUsageError, match="low_latency_mode"):
        buf.low_latency_dispatch(x, torch.zeros(1, 1, dtype=torch.int64), 1, 1)


def _rss_shmem_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    return 0


def test_large_segment_costs_memory_only_where_used(world1):
    # DeepEP's scripts ask for num_nvl_bytes=int(2e9) per rank: only the first 256 MiB are reserved and
    # written through at creation; the rest gets pages where rows are written.
    before = _rss_shmem_kb()
    buf = epcomm.Buffer(world1, num_nvl_bytes=int(2e9))
    grown = _rss_shmem_kb() - before
    assert grown < 400 * 1024, f"a 2e9-byte segment made RssShmem grow by {grown} kB"
    x = torch.randn(64, 256).to(torch.bfloat16)
    idx = torch.stack([torch.arange(64) % 4, (torch.arange(64) + 1) % 4], dim=1)
    w = torch.full((64, 2), 0.5)
    _, _, per_expert, _, _ = buf.get_dispatch_layout(idx, 4)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_expert=per_expert)
    y, _, _ = buf.combine(recv_x, handle)
    assert torch.equal(y, x)
    buf.destroy()
