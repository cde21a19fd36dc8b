"""Rank masks and shrink of low-latency mode, flavor "deepep" (docs/low-latency.md, "Masks and shrink";
spec low-latency.md §5), against the reference of test_low_latency_deepep with the masked ranks' experts
absent: a masked rank sends nothing and receives nothing, pairs to its experts are dropped (recv_count counts
only live sources' pairs, combine sums only live experts' outputs)."""
import pytest
import torch

import epcomm
from harness import spawn
from test_low_latency_deepep import check_dispatch, combine_ref, expert_outputs, inputs, same_bits


def effective(all_inputs, masked, E, R):
    """The inputs as the live ranks see them: masked sources send nothing, pairs to masked experts are -1."""
    L = E // R
    out = []
    for s, (x, idx) in enumerate(all_inputs):
        if s in masked:
            out.append((x[:0], idx[:0]))
            continue
        idx = idx.clone()
        for e in range(E):
            if e // L in masked:
                idx[idx == e] = -1
        out.append((x, idx))
    return out


def round_trip(buf, rank, R, all_inputs, masked, t_max, H, E, K, seed):
    """One dispatch (bf16) + combine checked against the reference with `masked` absent."""
    L = E // R
    x, idx = all_inputs[rank]
    eff = effective(all_inputs, masked, E, R)
    r = buf.low_latency_dispatch(x, idx, t_max, E, use_fp8=False)
    if rank in masked:  # a masked rank receives nothing
        assert r[1].tolist() == [0] * L
    else:
        check_dispatch(rank, R, eff, t_max, E, H, r, "bf16")
    recv_x, count, handle, _, _ = r
    w = torch.rand(x.shape[0], K, generator=torch.Generator().manual_seed(seed + rank))
    y = expert_outputs(recv_x, count, rank, L, None)
    out, _, hook = buf.low_latency_combine(y, idx, w, handle)
    hook()
    ref_idx = idx.clone().fill_(-1) if rank in masked else eff[rank][1]
    assert same_bits(out, combine_ref(x, ref_idx, w, E)), f"rank {rank}: combine with {masked} masked"


def mask_of(buf, R):
    st = torch.zeros(R, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(st)
    return {r for r in range(R) if st[r]}


def body_masks_by_hand(rank, R, seed, t_max, H, E, K):
    all_inputs = [inputs(seed, s, 5, H, E, K) for s in range(R)]
    buf = epcomm.Buffer(None, low_latency_mode=True, flavor="deepep")
    assert mask_of(buf, R) == set()
    buf.low_latency_update_mask_buffer(2, True)
    assert mask_of(buf, R) == {2}
    round_trip(buf, rank, R, all_inputs, {2}, t_max, H, E, K, seed)
    # An argument error on one live rank fails the call on the live ranks only; the Buffer stays usable.
    x, idx = all_inputs[rank]
    if rank == 0:
        with pytest.raises(epcomm.InvalidUsageError, match="num_max_dispatch_tokens_per_rank"):
            buf.low_latency_dispatch(torch.cat([x] * 2), torch.cat([idx] * 2), t_max, E, use_fp8=False)
    elif rank == 2:  # masked itself: runs alone
        buf.low_latency_dispatch(x, idx, t_max, E, use_fp8=False)
    else:
        with pytest.raises(epcomm.AbortedError, match="rank 0"):
            buf.low_latency_dispatch(x, idx, t_max, E, use_fp8=False)
    round_trip(buf, rank, R, all_inputs, {2}, t_max, H, E, K, seed)
    buf.low_latency_update_mask_buffer(0, True)
    round_trip(buf, rank, R, all_inputs, {0, 2}, t_max, H, E, K, seed + 1)
    assert mask_of(buf, R) == {0, 2}
    buf.low_latency_clean_mask_buffer()
    assert mask_of(buf, R) == set()
    round_trip(buf, rank, R, all_inputs, set(), t_max, H, E, K, seed + 2)
    with pytest.raises(epcomm.InvalidUsageError, match="rank"):
        buf.low_latency_update_mask_buffer(R, True)
    with pytest.raises(epcomm.InvalidUsageError, match="mask_status"):
        buf.low_latency_query_mask_buffer(torch.zeros(R + 1, dtype=torch.int32))


def test_masks_by_hand_four_ranks():
    spawn(body_masks_by_hand, 4, 3, 6, 256, 8, 3)


def body_shrink(rank, R, seed, t_max, H, E, K, stopped):
    """Rank `stopped` never calls; the others mask it during the dispatch, agree, and complete."""
    all_inputs = [inputs(seed, s, 4, H, E, K) for s in range(R)]
    buf = epcomm.Buffer(None, low_latency_mode=True, flavor="deepep", enable_shrink=True, timeout_s=1.0)
    if rank == stopped:
        return
    round_trip(buf, rank, R, all_inputs, {stopped}, t_max, H, E, K, seed)
    assert mask_of(buf, R) == {stopped}
    buf.clean_low_latency_buffer(t_max, H, E)  # collective among the survivors; the mask stays
    assert mask_of(buf, R) == {stopped}
    round_trip(buf, rank, R, all_inputs, {stopped}, t_max, H, E, K, seed + 1)


def test_shrink_masks_a_rank_that_never_calls():
    spawn(body_shrink, 3, 5, 4, 256, 6, 2, 1)


def body_no_shrink(rank, R, seed, t_max, H, E, K):
    x, idx = inputs(seed, rank, 3, H, E, K)
    # Flavor ascend: its operators span every rank, so shrink (leaving a stopped rank out) raises.
    asc = epcomm.Buffer(None, low_latency_mode=True, flavor="ascend", enable_shrink=True)
    with pytest.raises(epcomm.InvalidUsageError, match="enable_shrink=True is not available in flavor 'ascend'"):
        asc.low_latency_dispatch(x, idx, t_max, E, use_fp8=False)
    buf = epcomm.Buffer(None, low_latency_mode=True, flavor="deepep", timeout_s=1.0)
    if rank == 1:
        return
    with pytest.raises(epcomm.TimeoutError, match=r"rank 1\b"):
        buf.low_latency_dispatch(x, idx, t_max, E, use_fp8=False)


def test_without_shrink_a_missing_rank_is_a_timeout_naming_it_and_ascend_refuses_shrink():
    spawn(body_no_shrink, 2, 7, 4, 128, 4, 2)



def body_ascend_masks(rank, R):
    """Flavor ascend, every rank calling: rank 2 masked on every rank sends and receives nothing, pairs to its
    experts are absent (checked against the ascend reference with those slots -1), it combines to +0; a mask
    changed between a dispatch and its combine raises."""
    import ll_reference as ref
    import test_low_latency_ascend as asc
    E, K, H, T_max = 6, 2, 128, 4
    L = E // R
    xs, ids, ws, ys = asc.make_problem(R, E, K, H, [T_max, 3, T_max], 11)
    eff = [torch.full_like(i, -1) if s == 2 else torch.where((i >= 0) & (i // L == 2), torch.full_like(i, -1), i)
           for s, i in enumerate(ids)]
    buf = asc.new_buffer()
    buf.low_latency_update_mask_buffer(2, True)
    assert mask_of(buf, R) == {2}
    cache = {}
    for fmt in ("bf16", "int8"):
        w = ws[rank] if fmt != "int8" else None
        out = buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, topk_weights=w,
                                       quant_mode=None if fmt == "bf16" else fmt, use_fp8=fmt != "bf16")
        asc.check_dispatch(out, fmt, rank, R, E, K, H, T_max, xs, eff, ws if w is not None else None, cache)
        if rank == 2:
            assert out[1].tolist() == [0] * L
    out = buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, topk_weights=ws[rank], use_fp8=False)
    rows, _, _ = ref.rows_of(rank, eff, E, R)
    y_in = asc.combine_input(rows, ys, ref.capacity(R, T_max, K, L), H)
    y, _, _ = buf.low_latency_combine(y_in, ids[rank], ws[rank], out[2])
    assert same_bits(y, asc.expect_combine(rank, eff, ws, ys, H)), f"rank {rank}: combine with rank 2 masked"
    if rank == 2:
        assert same_bits(y, torch.zeros_like(y))
    buf.low_latency_update_mask_buffer(0, True)
    with pytest.raises((epcomm.InvalidUsageError, epcomm.AbortedError), match="rank mask changed"):
        buf.low_latency_combine(y_in, ids[rank], ws[rank], out[2])
    buf.low_latency_clean_mask_buffer()
    out = buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, topk_weights=ws[rank], use_fp8=False)
    asc.check_dispatch(out, "bf16", rank, R, E, K, H, T_max, xs, ids, ws, cache)
    buf.destroy()


def test_ascend_masks_with_every_rank_calling():
    spawn(body_ascend_masks, 3)
