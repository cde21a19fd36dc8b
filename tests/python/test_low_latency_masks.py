"""Rank masks and shrink of low-latency mode (docs/low-latency.md, "Masks and shrink"; spec low-latency.md
§5), flavor "deepep" against the reference of test_low_latency_deepep and flavor "ascend" against that of
test_low_latency_ascend, with the masked ranks' experts absent: a masked rank sends nothing and receives nothing, pairs to its experts are dropped (recv_count counts
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
    buf = epcomm.Buffer(None, low_latency_mode=True, flavor="deepep", timeout_s=1.0)
    if rank == 1:
        return
    with pytest.raises(epcomm.TimeoutError, match=r"rank 1\b"):
        buf.low_latency_dispatch(x, idx, t_max, E, use_fp8=False)


def test_without_shrink_a_missing_rank_is_a_timeout_naming_it():
    spawn(body_no_shrink, 2, 7, 4, 128, 4, 2)


# ---- flavor ascend ---------------------------------------------------------------------------------------

ASC = dict(E=6, K=2, H=128, T_max=4)


def without(ids, gone, L):
    """ids with the pairs to experts of the ranks in `gone` absent, and every slot of a rank in `gone`."""
    return [torch.full_like(i, -1) if s in gone else
            torch.where((i >= 0) & torch.isin(i.clamp(min=0) // L, torch.tensor(sorted(gone))), torch.full_like(i, -1), i)
            for s, i in enumerate(ids)]


def ascend_expert_outputs(rank, R, problem, eff, shape=ASC):
    """The expert outputs (combine's x) this rank holds after a dispatch routed by `eff`, in its row order."""
    import ll_reference as ref
    import test_low_latency_ascend as asc
    E, K, H, T_max = shape["E"], shape["K"], shape["H"], shape["T_max"]
    rows, _, _ = ref.rows_of(rank, eff, E, R)
    return asc.combine_input(rows, problem[3], ref.capacity(R, T_max, K, E // R), H)


def ascend_masked_before_combine(buf, rank, R, problem, gone, late, shape=ASC):
    """A dispatch with `gone` masked, then `late` masked too before its combine: that combine leaves `late`
    out (its pairs absent, its own tokens +0), checked bitwise."""
    import test_low_latency_ascend as asc
    E, T_max = shape["E"], shape["T_max"]
    L = E // R
    xs, ids, ws, ys = problem
    y_in = ascend_expert_outputs(rank, R, problem, without(ids, gone, L), shape)
    out = buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, topk_weights=ws[rank], use_fp8=False)
    buf.low_latency_update_mask_buffer(late, True)
    y, _, _ = buf.low_latency_combine(y_in, ids[rank], ws[rank], out[2])
    assert same_bits(y, asc.expect_combine(rank, without(ids, gone | {late}, L), ws, ys, shape["H"])), \
        f"rank {rank}: combine with rank {late} masked after its dispatch"


def ascend_round_trip(buf, rank, R, problem, gone, shape=ASC):
    """A bf16 dispatch (checked: rows, counts, handle) and its combine (bitwise) with `gone` masked."""
    import test_low_latency_ascend as asc
    E, K, H, T_max = shape["E"], shape["K"], shape["H"], shape["T_max"]
    L = E // R
    xs, ids, ws, ys = problem
    eff = without(ids, gone, L)
    out = buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, topk_weights=ws[rank], use_fp8=False)
    asc.check_dispatch(out, "bf16", rank, R, E, K, H, T_max, xs, eff, ws, {})
    if rank in gone:
        assert out[1].tolist() == [0] * L
    y_in = ascend_expert_outputs(rank, R, problem, eff, shape)
    y, _, _ = buf.low_latency_combine(y_in, ids[rank], ws[rank], out[2])
    assert same_bits(y, asc.expect_combine(rank, eff, ws, ys, H)), f"rank {rank}: combine with {gone} masked"
    if rank in gone:
        assert same_bits(y, torch.zeros_like(y))
    return out, y_in


def body_ascend_masks(rank, R):
    """Flavor ascend, one node: the operators run among the unmasked ranks. Rank 2, masked on every rank,
    calls too (it runs alone: receives nothing, combines to +0), then falls behind by more than the deadline
    (nothing is awaited from it); a rank masked between a dispatch and its combine is left out of that
    combine (its pairs absent, its own tokens +0); the cleaned mask brings everyone back."""
    import time
    import torch.distributed as dist
    import test_low_latency_ascend as asc
    E, K, H, T_max = ASC["E"], ASC["K"], ASC["H"], ASC["T_max"]
    L = E // R
    problem = asc.make_problem(R, E, K, H, [T_max, 3, T_max], 11)
    xs, ids, ws, ys = problem
    buf = asc.new_buffer(timeout_s=1.0)
    # Rank 0 masked: the call runs among ranks 1 and 2, and a failure there names the real rank.
    buf.low_latency_update_mask_buffer(0, True)
    if rank == 2:
        with pytest.raises(epcomm.InvalidUsageError, match="num_max_dispatch_tokens_per_rank"):
            buf.low_latency_dispatch(torch.cat([xs[2]] * 2), torch.cat([ids[2]] * 2), T_max, E, use_fp8=False)
    elif rank == 1:
        with pytest.raises(epcomm.AbortedError, match=r"rank 2\b"):
            buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, use_fp8=False)
    else:  # masked itself: runs alone
        assert buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, use_fp8=False)[1].tolist() == [0] * L
    buf.low_latency_update_mask_buffer(0, False)
    buf.low_latency_update_mask_buffer(2, True)
    assert mask_of(buf, R) == {2}
    cache = {}
    out = buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, quant_mode="int8")
    asc.check_dispatch(out, "int8", rank, R, E, K, H, T_max, xs, without(ids, {2}, L), None, cache)
    ascend_round_trip(buf, rank, R, problem, {2})
    # Two micro-batches in flight with hooks (combines queued on the worker), hooks called in reverse order.
    eff = without(ids, {2}, L)
    y_in = ascend_expert_outputs(rank, R, problem, eff)
    outs = [buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, topk_weights=ws[rank], use_fp8=False,
                                     return_recv_hook=True) for _ in range(2)]
    for out in reversed(outs):
        out[4]()
        asc.check_dispatch(out, "bf16", rank, R, E, K, H, T_max, xs, eff, ws, cache)
    combined = [buf.low_latency_combine(y_in, ids[rank], ws[rank], out[2], return_recv_hook=True) for out in outs]
    for y, _, hook in reversed(combined):
        hook()
        assert same_bits(y, asc.expect_combine(rank, eff, ws, ys, H)), f"rank {rank}: hooked combine, 2 masked"
    if rank == 2:
        time.sleep(1.5)  # past the others' deadline: they must not wait for it
    ascend_round_trip(buf, rank, R, problem, {2})
    ascend_masked_before_combine(buf, rank, R, problem, {2}, 0)
    assert mask_of(buf, R) == {0, 2}
    dist.barrier()  # rank 2 catches up before every rank is needed again
    buf.low_latency_clean_mask_buffer()
    assert mask_of(buf, R) == set()
    ascend_round_trip(buf, rank, R, problem, set())
    buf.destroy()


def test_ascend_masks_among_the_live_ranks():
    spawn(body_ascend_masks, 3)


def body_ascend_shrink(rank, R, stopped):
    """Flavor ascend with enable_shrink: rank `stopped` takes part in one round trip, then stops calling; the
    others mask it at the next dispatch's deadline, agree, and complete; clean_low_latency_buffer keeps the
    mask."""
    import test_low_latency_ascend as asc
    E, K, H, T_max = ASC["E"], ASC["K"], ASC["H"], ASC["T_max"]
    problem = asc.make_problem(R, E, K, H, [T_max, 2, T_max], 5)
    buf = asc.new_buffer(timeout_s=1.0, enable_shrink=True)
    ascend_round_trip(buf, rank, R, problem, set())
    if rank == stopped:
        return
    ascend_round_trip(buf, rank, R, problem, {stopped})
    assert mask_of(buf, R) == {stopped}
    buf.clean_low_latency_buffer(T_max, H, E)
    assert mask_of(buf, R) == {stopped}
    ascend_round_trip(buf, rank, R, problem, {stopped})
    # Hooked calls: their agreement rounds run on the worker, in call order.
    xs, ids, ws, ys = problem
    eff = without(ids, {stopped}, E // R)
    out = buf.low_latency_dispatch(xs[rank], ids[rank], T_max, E, topk_weights=ws[rank], use_fp8=False,
                                   return_recv_hook=True)
    y_in = ascend_expert_outputs(rank, R, problem, eff)
    y, _, hook = buf.low_latency_combine(y_in, ids[rank], ws[rank], out[2], return_recv_hook=True)
    hook()
    out[4]()
    asc.check_dispatch(out, "bf16", rank, R, E, K, H, T_max, xs, eff, ws, {})
    assert same_bits(y, asc.expect_combine(rank, eff, ws, ys, H)), f"rank {rank}: hooked combine after shrink"


def test_ascend_shrink_masks_a_rank_that_stops_calling():
    spawn(body_ascend_shrink, 3, 1)


def body_ascend_shrink_refusals(rank, R):
    """enable_shrink with shared-expert ranks raises in flavor ascend, naming the variable."""
    import os
    import test_low_latency_ascend as asc
    os.environ["MOE_SHARED_EXPERT_RANK_NUM"] = "1"
    buf = asc.new_buffer(enable_shrink=True)
    x = torch.randn(2, 128).bfloat16()
    idx = torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(epcomm.InvalidUsageError, match="MOE_SHARED_EXPERT_RANK_NUM"):
        buf.low_latency_dispatch(x, idx, 4, 2, use_fp8=False)


def body_ascend_masks_across_nodes(rank, R):
    """Flavor ascend over two virtual nodes: every rank keeps calling; rank 3 masked sends and receives
    nothing, rank 0 masked between a dispatch and its combine is left out of that combine; shrink raises."""
    import test_low_latency_ascend as asc
    shape = dict(E=8, K=3, H=128, T_max=4)
    E, K, H, T_max = shape["E"], shape["K"], shape["H"], shape["T_max"]
    problem = asc.make_problem(R, E, K, H, [T_max, 3, 0, T_max], 21)
    xs, ids = problem[0], problem[1]
    buf = asc.new_buffer()
    assert buf.num_nodes == 2
    buf.low_latency_update_mask_buffer(3, True)
    ascend_round_trip(buf, rank, R, problem, {3}, shape)
    ascend_masked_before_combine(buf, rank, R, problem, {3}, 0, shape)
    for r in (0, 3):
        buf.low_latency_update_mask_buffer(r, False)
    ascend_round_trip(buf, rank, R, problem, set(), shape)
    shrink = asc.new_buffer(enable_shrink=True)
    with pytest.raises(epcomm.InvalidUsageError, match="enable_shrink=True works on one node only"):
        shrink.low_latency_dispatch(xs[rank], ids[rank], T_max, E, use_fp8=False)
    buf.destroy()


def test_ascend_masks_across_nodes():
    spawn(body_ascend_masks_across_nodes, 4, env={"EPCOMM_RANKS_PER_NODE": "2"})


def test_ascend_shrink_refuses_shared_expert_ranks():
    spawn(body_ascend_shrink_refusals, 3)
