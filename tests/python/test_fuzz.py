"""A seeded fuzz of the argument checks of the Python API on 2 forked ranks (docs/errors.md: every argument
error is collective). Each trial makes a valid call of one kind (get_dispatch_layout, fresh dispatch in both
receive orders with and without quantization, combine, cached dispatch, epcomm.ops dispatch_v2 and
combine_v2) with ONE argument changed, on one rank or on every rank, and demands one of two endings:

- a clean error on every rank: the changed ranks raise InvalidUsageError naming the argument, the others
  AbortedError naming a changed rank and quoting its message (or InvalidUsageError "mismatch"/"capacity"
  when the ranks disagree or a receiver overflows), within SLOW_ERROR_S; then the unchanged call on the same
  Buffer (or group) must return correct data, i.e. the next call pairs with the peers' next call;
- a correct result: every output equal, bit for bit, to the plain-torch reference (reference.py) computed
  from every rank's arguments as they were passed.

Which ending a change must give is stated with it (`one`: one rank changed, `all`: every rank), from the
specs; `either` where the specs allow both. Anything else fails: an exception that is not an epcomm.Error, an
ending that differs between ranks, a wrong result, a crash, or a hang (EPCOMM_TIMEOUT_S=5 and a watchdog of
WATCHDOG_S per trial). A failure names the seed, the trial, the change and the command that reruns it.

Every rank draws every rank's arguments from one seed (calls.py), so no trial communicates except the calls
themselves and one all-gather of the endings. One Buffer (and one operator group) per rank serves all
trials. EPCOMM_FUZZ_TRIALS (default 400), EPCOMM_FUZZ_SEED (default 1), EPCOMM_FUZZ_TRIAL=i (only trial i),
EPCOMM_FUZZ_KEEP_GOING=1 (count failures and go on, for long runs)."""
import faulthandler
import os
import random
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist

import epcomm
from calls import (ORDERS, NormalCall, V2Call, WrongResult, check_cached, check_combine, check_dispatch,
                   check_v2_combine, check_v2_dispatch, normal_case, run_v2_combine,
                   run_v2_dispatch, v2_case)
from calls import expected_dispatch as expected_fresh
from harness import gather, spawn
from reference import layout, same_bits

WORLD = 2
SEED = int(os.environ.get("EPCOMM_FUZZ_SEED", "1"))
TRIALS = int(os.environ.get("EPCOMM_FUZZ_TRIALS", "400"))
ONLY = os.environ.get("EPCOMM_FUZZ_TRIAL")
KEEP_GOING = os.environ.get("EPCOMM_FUZZ_KEEP_GOING") == "1"
TIMEOUT_S = 5
WATCHDOG_S = 40
SLOW_ERROR_S = 3.0
BIG = (2 ** 31, 2 ** 40, 2 ** 62, 2 ** 63 - 1)  # fit int64, beyond every count epcomm accepts
HUGE = (2 ** 63, 2 ** 64, -(2 ** 63) - 1)  # do not fit int64
JUNK = (None, "7", 1.5, [1, 2])  # where an int or a tensor goes


def reproduce(trial):
    return (f"EPCOMM_FUZZ_SEED={SEED} EPCOMM_FUZZ_TRIAL={trial} PYTHONPATH=<build>/python "
            f".venv/bin/python -m pytest -q tests/python/test_fuzz.py")


class Failure(AssertionError):
    pass


class Mut:
    """One argument of a call changed: `key` (a keyword of the call) becomes value(kw, rank). `one` / `all`:
    the ending the specs demand when one rank / every rank makes the change ("error", "capacity", "ok",
    "either"); `names`: words the error must contain (one of them); `only_one`: never made on every rank."""

    def __init__(self, label, key, value, one="error", all=None, names=None, only_one=False, needs=None,
                 decide=None):
        self.label, self.key, self.value = label, key, value
        self.one, self.all = one, all or one
        self.names = tuple(names or (key,))
        self.only_one, self.needs = only_one, needs
        self.decide = decide  # targets -> ending, where it depends on which ranks made the change

    def expect(self, targets):
        if self.decide is not None:
            return self.decide(targets)
        return self.all if len(targets) == WORLD else self.one

    def apply(self, kw, rank):
        kw = dict(kw)
        v = self.value(kw, rank) if callable(self.value) else self.value
        if v is _DROP:
            kw.pop(self.key, None)
        else:
            kw[self.key] = v
        return kw

    def changes(self, kw, rank):
        """Whether the change does anything to this rank's arguments (it may not: an empty tensor made
        non-contiguous, a row added to the scales of zero tokens, ...)."""
        new = self.apply(kw, rank)
        return not same_arg(new.get(self.key, _DROP), kw.get(self.key, _DROP))


_DROP = object()


def same_arg(a, b):
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and (a.numel() == 0 or same_bits(a, b)))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same_arg(u, v) for u, v in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return type(a) is type(b) and a == b


def noncontiguous(t):
    """The same values in a tensor whose last dimension has stride 2 (non-contiguous unless empty)."""
    if t.dim() == 0 or t.numel() == 0:
        return t
    wide = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def with_nans(t):
    t = t.clone()
    if t.numel():
        f = t.view(-1)
        f[0] = float("nan")
        f[-1] = float("inf")
        if f.numel() > 2:
            f[f.numel() // 2] = float("-inf")
    return t


def int_junk(key, names=None, valid_types_ok=False):
    """An int argument given as junk, too large for epcomm, or too large for int64."""
    muts = [Mut(f"{key}={v!r}", key, v, names=names) for v in JUNK]
    muts += [Mut(f"{key}=2^{v.bit_length() - 1}", key, v, names=names) for v in BIG + HUGE if v > 0]
    muts += [Mut(f"{key}=-2^63-1", key, -(2 ** 63) - 1, names=names)]
    return muts


def tensor_junk(key, names=None):
    return [Mut(f"{key}={v!r}", key, v, names=names) for v in ("tokens", 1.5, [[1, 2]])]


# ---- normal-mode mutations ------------------------------------------------------------------------------------

def dispatch_mutations(call, rng, ctx):
    c, R = call.case, WORLD
    E, K, H = c["E"], c["K"], c["H"]
    plain = c["quant"] is None
    u = rng.random()
    other = rng.choice([d for d in (torch.bfloat16, torch.float16, torch.float32) if d != c["dtype"]])
    L = E // R

    def slot(kw, pick_valid):
        ids = kw["topk_idx"]
        cand = (ids >= 0).nonzero() if pick_valid else (ids < 0).nonzero()
        return None if len(cand) == 0 else tuple(cand[int(u * len(cand))].tolist())

    def set_id(value, pick_valid=True):
        def f(kw, r):
            ids, at = kw["topk_idx"].clone(), slot(kw, pick_valid)
            if at is not None:
                ids[at] = value if value is not None else -7
            return ids
        return f

    def has_slot(pick_valid):
        return all(slot(call.dispatch_kwargs(s), pick_valid) is not None for s in range(R))

    def bump(key, delta, index_from_u=True):
        def f(kw, r):
            t = kw[key].clone()
            if t.numel():
                t.view(-1)[int(u * t.numel())] += delta
            return t
        return f

    m = []
    # x
    m += [Mut("x f64", "x", lambda kw, r: kw["x"].double(), names=("x", "float64"))] if plain else []
    m += [Mut("x int32", "x", lambda kw, r: torch.zeros(c["T"][r], H, dtype=torch.int32), names=("x", "int32", "i32"))]
    m += [Mut("x 1-D", "x", lambda kw, r: torch.zeros(5 * H, dtype=c["dtype"]), names=("x",))]
    m += [Mut("x 3-D", "x", lambda kw, r: torch.zeros(1, max(c["T"][r], 1), H, dtype=c["dtype"]), names=("x",))]
    m += [Mut("x one row more", "x", lambda kw, r: torch.zeros(c["T"][r] + 1, H, dtype=c["dtype"]),
              names=("x", "topk_idx", "topk_weights", "num_tokens"))]
    m += [Mut("x no columns", "x", lambda kw, r: torch.zeros(c["T"][r], 0, dtype=c["dtype"]),
              names=("x", "hidden"))]
    m += [Mut("x None", "x", None, names=("x",))] + tensor_junk("x")
    if plain:
        m += [Mut(f"x {other}", "x", lambda kw, r: kw["x"].to(other), one="error", all="ok",
                  names=("payload dtype", "dtype"))]
        m += [Mut("x wider", "x", lambda kw, r: torch.cat([kw["x"], kw["x"][:, :8]], 1), one="error", all="ok",
                  names=("hidden",))]
        m += [Mut("x NaN/Inf", "x", lambda kw, r: with_nans(kw["x"]), one="ok")]
        m += [Mut("x non-contiguous", "x", lambda kw, r: noncontiguous(kw["x"]), one="either",
                  names=("x", "contiguous"))]
    if c["quant"] and c["tuple"]:
        m += [Mut("x tuple scales f64", "x", lambda kw, r: (kw["x"][0], kw["x"][1].double()), names=("x", "scales", "tuple"))]
        m += [Mut("x tuple of 3", "x", lambda kw, r: kw["x"] + (kw["x"][1],), names=("x",))]
        m += [Mut("x tuple (data, None)", "x", lambda kw, r: (kw["x"][0], None), names=("x",))]
        m += [Mut("x tuple scales one row more", "x",
                  lambda kw, r: (kw["x"][0], torch.cat([kw["x"][1], kw["x"][1][:1]])), names=("x", "scales", "tuple"))]
    if c["quant"] and not c["tuple"]:
        m += [Mut("x NaN/Inf (quantized)", "x", lambda kw, r: with_nans(kw["x"]), one="ok")]
    # topk_idx
    if has_slot(True):
        m += [Mut("topk_idx = E", "topk_idx", set_id(E), names=("topk_idx",))]
        m += [Mut("topk_idx = E + 1000", "topk_idx", set_id(E + 1000), names=("topk_idx",))]
        m += [Mut("topk_idx = 2^40", "topk_idx", lambda kw, r: set_id(2 ** 40)(dict(kw, topk_idx=kw["topk_idx"].long()), r),
                  names=("topk_idx",))]
        m += [Mut("topk_idx valid slot -> -3", "topk_idx", set_id(-3),
                  names=("num_tokens_per_expert", "num_tokens_per_rank", "is_token_in_rank"))]
    if has_slot(False):
        m += [Mut("topk_idx -1 -> -7", "topk_idx", set_id(None, pick_valid=False), one="ok")]
    m += [Mut("topk_idx f32", "topk_idx", lambda kw, r: kw["topk_idx"].float(), names=("topk_idx",))]
    m += [Mut("topk_idx int16", "topk_idx", lambda kw, r: kw["topk_idx"].short(), names=("topk_idx", "int16"))]
    m += [Mut("topk_idx int32<->int64", "topk_idx",
              lambda kw, r: kw["topk_idx"].long() if kw["topk_idx"].dtype == torch.int32 else kw["topk_idx"].int(),
              one="ok")]
    m += [Mut("topk_idx 1-D", "topk_idx", lambda kw, r: kw["topk_idx"].reshape(-1), names=("topk_idx",))]
    m += [Mut("topk_idx one column more", "topk_idx",
              lambda kw, r: torch.cat([kw["topk_idx"], torch.full((c["T"][r], 1), -1, dtype=kw["topk_idx"].dtype)], 1),
              names=("topk_weights", "topk_idx"))]
    m += [Mut("topk_idx non-contiguous", "topk_idx", lambda kw, r: noncontiguous(kw["topk_idx"]), one="either",
              names=("topk_idx", "contiguous"))]
    m += [Mut("topk_idx None", "topk_idx", None, names=("topk_idx", "topk_weights"))] + tensor_junk("topk_idx")
    # topk_weights
    m += [Mut("topk_weights f64", "topk_weights", lambda kw, r: kw["topk_weights"].double(), names=("topk_weights",))]
    m += [Mut("topk_weights f16", "topk_weights", lambda kw, r: kw["topk_weights"].half(), names=("topk_weights",))]
    m += [Mut("topk_weights shape", "topk_weights", lambda kw, r: torch.rand(c["T"][r], K + 1),
              names=("topk_weights",))]
    m += [Mut("topk_weights NaN/Inf", "topk_weights", lambda kw, r: with_nans(kw["topk_weights"]), one="ok")]
    m += [Mut("topk_weights None", "topk_weights", None, names=("topk_weights", "topk_idx"))]
    m += tensor_junk("topk_weights")
    # num_tokens_per_expert
    m += [Mut("num_tokens_per_expert +1", "num_tokens_per_expert", bump("num_tokens_per_expert", 1),
              names=("num_tokens_per_expert",))]
    m += [Mut("num_tokens_per_expert -5", "num_tokens_per_expert", bump("num_tokens_per_expert", -5),
              names=("num_tokens_per_expert",))]
    m += [Mut("num_tokens_per_expert +2^40", "num_tokens_per_expert",
              lambda kw, r: bump("num_tokens_per_expert", 2 ** 40)(dict(kw, num_tokens_per_expert=kw["num_tokens_per_expert"].long()), r),
              names=("num_tokens_per_expert",))]
    m += [Mut("num_experts + R (from num_tokens_per_expert)", "num_tokens_per_expert",
              lambda kw, r: torch.cat([kw["num_tokens_per_expert"], torch.zeros(R, dtype=torch.int32)]),
              one="error", all="either", names=("num_experts", "num_tokens_per_expert", "num_tokens_per_rank",
                                               "is_token_in_rank", "num_worst_tokens"))]
    m += [Mut("num_experts + 1 (not a multiple of R)", "num_tokens_per_expert",
              lambda kw, r: torch.cat([kw["num_tokens_per_expert"], torch.zeros(1, dtype=torch.int32)]),
              names=("num_experts", "num_tokens_per_expert"))]
    m += [Mut("num_experts 2^20", "num_tokens_per_expert", lambda kw, r: torch.zeros(2 ** 20, dtype=torch.int32),
              names=("num_experts", "num_tokens_per_expert"))]
    m += [Mut("num_tokens_per_expert f32", "num_tokens_per_expert", lambda kw, r: kw["num_tokens_per_expert"].float(),
              names=("num_tokens_per_expert",))]
    m += [Mut("num_tokens_per_expert i64", "num_tokens_per_expert", lambda kw, r: kw["num_tokens_per_expert"].long(),
              one="ok")]
    m += [Mut("num_tokens_per_expert 2-D", "num_tokens_per_expert",
              lambda kw, r: kw["num_tokens_per_expert"].reshape(1, -1), names=("num_tokens_per_expert",))]
    m += [Mut("num_tokens_per_expert non-contiguous", "num_tokens_per_expert",
              lambda kw, r: noncontiguous(kw["num_tokens_per_expert"]), one="either",
              names=("num_tokens_per_expert", "contiguous"))]
    m += [Mut("num_tokens_per_expert empty", "num_tokens_per_expert", torch.zeros(0, dtype=torch.int32),
              names=("num_experts", "num_tokens_per_expert"))]
    m += [Mut("num_tokens_per_expert None", "num_tokens_per_expert", None, names=("num_tokens_per_expert",))]
    m += tensor_junk("num_tokens_per_expert")
    # the optional layout tensors (passed or not in the valid call)
    per_rank = lambda kw, r: layout(kw["topk_idx"].long(), E, R)[0]
    in_rank = lambda kw, r: layout(kw["topk_idx"].long(), E, R)[2]
    m += [Mut("num_tokens_per_rank +1", "num_tokens_per_rank", lambda kw, r: per_rank(kw, r) + torch.eye(R, dtype=torch.int32)[int(u * R)],
              names=("num_tokens_per_rank",))]
    m += [Mut("num_tokens_per_rank shape", "num_tokens_per_rank", lambda kw, r: torch.zeros(R + 1, dtype=torch.int32),
              names=("num_tokens_per_rank",))]
    m += [Mut("num_tokens_per_rank f32", "num_tokens_per_rank", lambda kw, r: per_rank(kw, r).float(),
              names=("num_tokens_per_rank",))]
    m += [Mut("num_tokens_per_rank strided", "num_tokens_per_rank", lambda kw, r: noncontiguous(per_rank(kw, r)),
              one="either", names=("num_tokens_per_rank", "contiguous"))]
    m += [Mut("num_tokens_per_rank None", "num_tokens_per_rank", None, one="ok")]
    m += tensor_junk("num_tokens_per_rank")
    if any(c["T"]):
        m += [Mut("is_token_in_rank flipped", "is_token_in_rank",
                  lambda kw, r: in_rank(kw, r) ^ (torch.arange(c["T"][r] * R).reshape(-1, R) == int(u * c["T"][r] * R)),
                  names=("is_token_in_rank",), decide=lambda ts: "error" if any(c["T"][t] for t in ts) else "ok")]
    m += [Mut("is_token_in_rank f32", "is_token_in_rank", lambda kw, r: in_rank(kw, r).float(),
              names=("is_token_in_rank",))]
    m += [Mut("is_token_in_rank shape", "is_token_in_rank", lambda kw, r: torch.zeros(c["T"][r] + 1, R, dtype=torch.bool),
              names=("is_token_in_rank",))]
    m += tensor_junk("is_token_in_rank")
    # ints
    a2 = c["align"] + 1
    m += [Mut("expert_alignment 0", "expert_alignment", 0), Mut("expert_alignment -1", "expert_alignment", -1)]
    # every rank: more PAD rows may overflow num_worst_tokens
    over_a2 = call.worst > 0 and max(len(call.reference().rows(d, c["order"], a2)[0]) for d in range(R)) > call.worst
    m += [Mut(f"expert_alignment {a2}", "expert_alignment", a2, names=("expert_alignment", "num_worst_tokens"),
              decide=lambda ts: "error" if len(ts) < R else "capacity" if over_a2 else "ok")]
    if c["order"] == "rank_major":
        m += [Mut("expert_alignment 2^20 (rank_major: the list only)", "expert_alignment", 2 ** 20, one="error",
                  all="ok")]
    m += int_junk("expert_alignment")
    n = [call.expected(d)["N"] for d in range(R)]
    if max(n) >= 2:  # a receiver overflows iff a changed rank receives more rows than it allows
        m += [Mut("num_worst_tokens too small", "num_worst_tokens", max(n) - 1, names=("num_worst_tokens",),
                  decide=lambda targets: "capacity" if any(n[t] > max(n) - 1 for t in targets) else "ok")]
    m += [Mut("num_worst_tokens -1", "num_worst_tokens", -1)]
    m += [Mut("num_worst_tokens large", "num_worst_tokens", max(n) + 100, one="ok")]
    m += int_junk("num_worst_tokens")
    # the rest
    flip = [o for o in ORDERS if o != c["order"]][0]
    # every rank flipped: the rows of the other order may not fit num_worst_tokens (then every rank raises)
    n_flip = [len(call.reference().rows(d, flip, c["align"])[0]) for d in range(R)]
    over = call.worst > 0 and max(n_flip) > call.worst
    m += [Mut("receive_order other", "receive_order", flip, names=("receive_order", "num_worst_tokens"),
              decide=lambda ts: "error" if len(ts) < R else "capacity" if over else "ok")]
    m += [Mut("receive_order 'diagonal'", "receive_order", "diagonal"), Mut("receive_order 5", "receive_order", 5)]
    m += [Mut("quant_mode 'int7'", "quant_mode", "int7"), Mut("quant_mode 3", "quant_mode", 3)]
    if not c["tuple"]:
        q = "int8" if c["quant"] != "int8" else "pertoken_fp8_e4m3"
        m += [Mut(f"quant_mode {q}", "quant_mode", q, one="error", all="ok", names=("quant_mode", "payload dtype"))]
        if c["dtype"] != torch.bfloat16:
            m += [Mut("quant_mode bf16 with non-bf16 x", "quant_mode", "bf16", names=("quant_mode", "bf16"))]
    m += [Mut("config {}", "config", {}), Mut("config 'c'", "config", "c")]
    m += [Mut("config other chunks", "config", lambda kw, r: epcomm.Config(0, 16, 128, 16, 128), one="error", all="ok",
              names=("config",))]
    m += [Mut("config valid", "config", lambda kw, r: epcomm.Buffer.get_dispatch_config(R), one="ok")]
    m += [Mut("stats shape", "dispatch_wait_recv_cost_stats", torch.zeros(R + 1, dtype=torch.int64))]
    m += [Mut("stats f32", "dispatch_wait_recv_cost_stats", torch.zeros(R, dtype=torch.float32))]
    m += [Mut("stats i64", "dispatch_wait_recv_cost_stats", lambda kw, r: torch.zeros(R, dtype=torch.int64), one="ok")]
    m += [Mut("stats non-contiguous", "dispatch_wait_recv_cost_stats", lambda kw, r: noncontiguous(torch.zeros(R, dtype=torch.int64)),
              one="either", names=("dispatch_wait_recv_cost_stats",))]
    m += tensor_junk("dispatch_wait_recv_cost_stats")
    m += [Mut("previous_event 'e'", "previous_event", "e"), Mut("previous_event completed", "previous_event",
                                                               lambda kw, r: epcomm.EventOverlap(), one="ok")]
    m += [Mut("async_finish toggled", "async_finish", lambda kw, r: not kw.get("async_finish", False), one="ok")]
    if ctx.prev_handle is not None:
        m += [Mut("a handle with top-k (cached + fresh)", "handle", lambda kw, r: ctx.prev_handle,
                  names=("handle", "cached", "topk_idx", "None"))]
    return m


def cached_mutations(call, rng, ctx):
    c = call.case
    other = rng.choice([d for d in (torch.bfloat16, torch.float16, torch.float32) if d != c["dt3"]])
    m = [Mut("handle foreign (another Buffer)", "handle", lambda kw, r: ctx.foreign, needs="foreign",
             names=("handle", "another Buffer"))]
    m += [Mut("handle of the other strategy", "handle", lambda kw, r: ctx.foreign_a2a, needs="foreign_a2a",
              names=("handle", "another Buffer"))]
    m += [Mut("handle rebuilt as a tuple", "handle", lambda kw, r: tuple(kw["handle"]), names=("handle",))]
    m += [Mut("handle 'h'", "handle", "h", names=("handle",))]
    if ctx.prev_handle is not None:
        m += [Mut("handle of an earlier dispatch", "handle", lambda kw, r: ctx.prev_handle, only_one=True,
                  names=("handle", "x", "dispatch id"))]
    m += [Mut("x one row more", "x", lambda kw, r: torch.zeros(c["T"][r] + 1, c["H3"], dtype=c["dt3"]),
              names=("x", "num_tokens"))]
    m += [Mut("x int32", "x", lambda kw, r: kw["x"].int(), names=("x",))]
    m += [Mut("x no columns", "x", lambda kw, r: kw["x"][:, :0], names=("x", "hidden"))]
    m += [Mut("x None", "x", None, names=("x",))] + tensor_junk("x")
    if not c["quant3"]:
        m += [Mut(f"x {other}", "x", lambda kw, r: kw["x"].to(other), one="error", all="ok", names=("payload dtype",))]
        m += [Mut("x NaN/Inf", "x", lambda kw, r: with_nans(kw["x"]), one="ok")]
    m += [Mut("x wider", "x", lambda kw, r: torch.cat([kw["x"], kw["x"]], 1), one="error", all="ok",
              names=("hidden",))]
    m += [Mut("topk_idx given", "topk_idx", lambda kw, r: call.dispatch_kwargs(r)["topk_idx"], names=("topk_idx",))]
    m += [Mut("num_tokens_per_expert given", "num_tokens_per_expert",
              lambda kw, r: call.dispatch_kwargs(r)["num_tokens_per_expert"], names=("num_tokens_per_expert",))]
    m += [Mut("expert_alignment differs from the handle's", "expert_alignment", c["align"] + 1,
              names=("expert_alignment",))]
    m += [Mut("num_worst_tokens differs from the handle's", "num_worst_tokens", call.worst + 7,
              names=("num_worst_tokens",))]
    m += [Mut("receive_order other", "receive_order", [o for o in ORDERS if o != c["order"]][0],
              names=("receive_order",))]
    m += [Mut("quant_mode 'int7'", "quant_mode", "int7")]
    q = "int8" if c["quant3"] != "int8" else "pertoken_fp8_e4m3"
    m += [Mut(f"quant_mode {q}", "quant_mode", q, one="error", all="ok", names=("quant_mode", "payload dtype"))]
    m += int_junk("expert_alignment")[:4]
    return m


def combine_mutations(call, rng, ctx):
    c = call.case
    order = c["order"]
    other = rng.choice([d for d in (torch.bfloat16, torch.float16, torch.float32) if d != c["dt2"]])
    rows = [call.expected(d)["num_rows"] for d in range(WORLD)]
    m = [Mut("x one row more", "x", lambda kw, r: torch.cat([kw["x"], kw["x"][:1]]) if rows[r] else
             torch.zeros(1, c["H2"], dtype=c["dt2"]), names=("x",))]
    m += [Mut("x one row less", "x", lambda kw, r: kw["x"][:-1], names=("x",),
              decide=lambda ts: "error" if any(rows[t] for t in ts) else "ok")]
    m += [Mut("x int32", "x", lambda kw, r: torch.zeros(kw["x"].shape, dtype=torch.int32), names=("x",))]
    m += [Mut("x f64", "x", lambda kw, r: kw["x"].double(), names=("x", "float64"))]
    m += [Mut("x 1-D", "x", lambda kw, r: kw["x"].reshape(-1), names=("x",))]
    m += [Mut("x None", "x", None, names=("x",))] + tensor_junk("x")
    m += [Mut("x no columns", "x", lambda kw, r: kw["x"][:, :0], names=("x", "hidden"))]
    m += [Mut("x NaN/Inf in real rows", "x", lambda kw, r: with_nans(kw["x"]), one="ok")]
    m += [Mut("x non-contiguous", "x", lambda kw, r: noncontiguous(kw["x"]), one="either", names=("x", "contiguous"))]
    if c["bias"] is None:
        m += [Mut(f"x {other}", "x", lambda kw, r: kw["x"].to(other), one="error", all="ok",
                  names=("payload dtype", "dtype"))]
        m += [Mut("x wider", "x", lambda kw, r: torch.cat([kw["x"], kw["x"][:, :2]], 1), one="error", all="ok",
                  names=("hidden",))]
    m += [Mut("handle foreign (another Buffer)", "handle", lambda kw, r: ctx.foreign, needs="foreign",
              names=("handle", "another Buffer"))]
    m += [Mut("handle of the other strategy", "handle", lambda kw, r: ctx.foreign_a2a, needs="foreign_a2a",
              names=("handle", "another Buffer"))]
    m += [Mut("handle rebuilt as a tuple", "handle", lambda kw, r: tuple(kw["handle"]), names=("handle",))]
    m += [Mut("handle None", "handle", None, names=("handle",)), Mut("handle 3", "handle", 3, names=("handle",))]
    if ctx.prev_handle is not None:
        m += [Mut("handle of an earlier dispatch", "handle", lambda kw, r: ctx.prev_handle, only_one=True,
                  names=("handle", "x", "dispatch id"))]
    T = c["T"]
    if order == "expert_major":
        m += [Mut("topk_weights shape", "topk_weights", lambda kw, r: torch.rand(T[r], c["K"] + 1), names=("topk_weights",))]
        m += [Mut("topk_weights None", "topk_weights", _DROP, one="ok")]
    else:
        m += [Mut("topk_weights one row more", "topk_weights",
                  lambda kw, r: torch.rand(call.expected(r)["num_rows"] + 1, c["K"]), names=("topk_weights",))]
        m += [Mut("topk_weights None", "topk_weights", _DROP, one="either", all="ok",
                  names=("topk_weights", "weights"))]
    m += [Mut("topk_weights f64", "topk_weights", lambda kw, r: torch.rand(T[r] if order == "expert_major" else
                                                                            call.expected(r)["num_rows"], c["K"]).double(),
              names=("topk_weights",))]
    m += [Mut("topk_weights NaN", "topk_weights", lambda kw, r: with_nans(kw["topk_weights"]) if "topk_weights" in kw
              else _DROP, one="ok")]
    m += tensor_junk("topk_weights")
    m += [Mut("bias shape", "bias", lambda kw, r: torch.zeros(T[r] + 1, c["H2"], dtype=c["dt2"]), names=("bias",))]
    m += [Mut("bias dtype", "bias", lambda kw, r: torch.zeros(T[r], c["H2"], dtype=other), names=("bias",))]
    m += [Mut("bias 3-tuple", "bias", lambda kw, r: (torch.zeros(T[r], c["H2"], dtype=c["dt2"]),) * 3, names=("bias",))]
    m += [Mut("bias None", "bias", _DROP, one="ok")] + tensor_junk("bias")
    m += [Mut("stats shape", "combine_send_cost_stats", torch.zeros(WORLD + 1, dtype=torch.int64))]
    m += [Mut("stats i32", "combine_send_cost_stats", lambda kw, r: torch.zeros(WORLD, dtype=torch.int32), one="ok")]
    m += [Mut("config {}", "config", {}), Mut("previous_event 1", "previous_event", 1)]
    return m


def layout_mutations(call, rng, ctx):
    E = call.case["E"]
    ids = lambda kw, r: kw["topk_idx"]
    m = [Mut("topk_idx None", "topk_idx", None), Mut("topk_idx 'ids'", "topk_idx", "ids")]
    m += [Mut("topk_idx f32", "topk_idx", lambda kw, r: ids(kw, r).float()),
          Mut("topk_idx int16", "topk_idx", lambda kw, r: ids(kw, r).short()),
          Mut("topk_idx 1-D", "topk_idx", lambda kw, r: ids(kw, r).reshape(-1)),
          Mut("topk_idx 3-D", "topk_idx", lambda kw, r: ids(kw, r)[None]),
          Mut("topk_idx = E", "topk_idx", lambda kw, r: torch.full_like(ids(kw, r), E) if ids(kw, r).numel() else
              torch.full((1, 1), E)),
          Mut("topk_idx -7", "topk_idx", lambda kw, r: torch.full_like(ids(kw, r), -7), one="ok"),
          Mut("topk_idx int32", "topk_idx", lambda kw, r: ids(kw, r).int(), one="ok"),
          Mut("topk_idx non-contiguous", "topk_idx", lambda kw, r: noncontiguous(ids(kw, r)), one="either",
              names=("topk_idx", "contiguous"))]
    m += [Mut(f"num_experts {v!r}", "num_experts", v) for v in (0, -WORLD, E + 1, "8", 4.0 * WORLD, None)]
    m += [Mut(f"num_experts 2^{v.bit_length() - 1}", "num_experts", v) for v in (2 ** 31, 2 ** 63, 2 ** 64)]
    m += [Mut("num_experts 2E", "num_experts", 2 * E, one="ok")]
    return m


# ---- operator mutations ---------------------------------------------------------------------------------------

def v2_common_mutations(call, rng, kind):
    c = call.case
    E, W = c["E"], WORLD
    # combine: a larger E changes L_p, so ep_send_counts no longer has W·L_p elements on the MoE ranks
    m = [Mut("moe_expert_num + MoE ranks", "moe_expert_num", E + (W - c["Sr"]), one="error",
             all="ok" if kind == "dispatch" else "error", names=("moe_expert_num", "E", "ep_send_counts"))]
    m += [Mut(f"moe_expert_num {v}", "moe_expert_num", v, names=("moe_expert_num", "ep_send_counts"))
          for v in (0, -W, E + 1) if v <= 0 or v % (W - c["Sr"])]
    m += [Mut("moe_expert_num 2^27", "moe_expert_num", 2 ** 27, names=("moe_expert_num",))]
    m += int_junk("moe_expert_num")
    m += [Mut("ep_world_size + 1", "ep_world_size", W + 1, names=("ep_world_size",))]
    m += int_junk("ep_world_size")
    m += [Mut("ep_rank_id other", "ep_rank_id", lambda kw, r: (r + 1) % W, names=("ep_rank_id",))]
    m += [Mut("ep_rank_id -1", "ep_rank_id", -1, names=("ep_rank_id",))] + int_junk("ep_rank_id")
    m += [Mut("tp_world_size 3", "tp_world_size", 3, names=("tp_world_size",))]
    m += [Mut("tp_world_size 'two'", "tp_world_size", "two", names=("tp_world_size",))]
    m += [Mut("tp_rank_id 1", "tp_rank_id", 1, names=("tp_rank_id",))]
    m += [Mut("expert_shard_type 1", "expert_shard_type", 1, names=("expert_shard_type",))]
    m += [Mut("shared_expert_num 2", "shared_expert_num", 2, names=("shared_expert_num", "shared_expert_rank_num"))]
    m += [Mut("shared_expert_rank_num W", "shared_expert_rank_num", W, names=("shared_expert_rank_num",))]
    m += int_junk("shared_expert_rank_num")[:3]
    m += [Mut("global_bs not a multiple", "global_bs", W * 7 + 1, names=("global_bs",))]
    m += [Mut("global_bs 2^40", "global_bs", 2 ** 40, names=("global_bs",)), Mut("global_bs -W", "global_bs", -W)]
    m += int_junk("global_bs")[:4]
    bs = max(c["T"])
    m += [Mut("global_bs larger", "global_bs", W * (bs + 3), one="error", all="ok", names=("global_bs",))]
    if bs > 1:
        m += [Mut("global_bs too small", "global_bs", W * (bs - 1),
                  names=("global_bs", "assist_info_for_combine", "ep_send_counts"))]
    m += [Mut("x_active_mask int", "x_active_mask", lambda kw, r: torch.ones(kw["expert_ids"].shape[0], dtype=torch.int32),
              names=("x_active_mask",))]
    m += [Mut("x_active_mask shape", "x_active_mask", lambda kw, r: torch.ones(kw["expert_ids"].shape[0] + 1, dtype=torch.bool),
              names=("x_active_mask",))]
    if any(t > 1 for t in c["T"]):
        m += [Mut("x_active_mask not a prefix", "x_active_mask",
                  lambda kw, r: torch.arange(kw["expert_ids"].shape[0]) % 2 == 1 if kw["expert_ids"].shape[0] > 1 else None,
                  names=("x_active_mask",), decide=lambda ts: "error" if any(c["T"][t] > 1 for t in ts) else "ok")]
    m += [Mut("x_active_mask 'm'", "x_active_mask", "m", names=("x_active_mask",))]
    m += [Mut("strict_hardware_limits 'B7'", "strict_hardware_limits", "B7", names=("strict_hardware_limits",))]
    m += [Mut("timeout -1", "timeout", -1, names=("timeout",)), Mut("timeout 'soon'", "timeout", "soon", names=("timeout",))]
    m += [Mut("zero_expert_num 1", "zero_expert_num", 1, names=("zero_expert_num",))]
    m += [Mut("group_tp 'nope' with tp_world_size 0", "group_tp", "nope", one="ok")]
    return m


def v2_dispatch_mutations(call, rng, ctx):
    c = call.case
    H, K, E = c["H"], c["K"], c["E"]
    m = v2_common_mutations(call, rng, "dispatch")
    m += [Mut("x f32", "x", lambda kw, r: kw["x"].float(), names=("x",))]
    m += [Mut("x 1-D", "x", lambda kw, r: kw["x"].reshape(-1), names=("x",))]
    m += [Mut("x None", "x", None, names=("x",))] + tensor_junk("x")
    m += [Mut("x one row more", "x", lambda kw, r: torch.zeros(kw["x"].shape[0] + 1, H, dtype=c["dtype"]),
              names=("x", "expert_ids"))]
    m += [Mut("x wider", "x", lambda kw, r: torch.cat([kw["x"], kw["x"]], 1), one="error", all="ok", names=("H",))]
    m += [Mut("x NaN/Inf", "x", lambda kw, r: with_nans(kw["x"]), one="ok")]
    m += [Mut("x non-contiguous", "x", lambda kw, r: noncontiguous(kw["x"]), one="either", names=("x", "contiguous"))]
    other = torch.float16 if c["dtype"] == torch.bfloat16 else torch.bfloat16
    m += [Mut(f"x {other}", "x", lambda kw, r: kw["x"].to(other), one="error", all="ok", names=("dtype", "x"))]
    m += [Mut("expert_ids int64", "expert_ids", lambda kw, r: kw["expert_ids"].long(), names=("expert_ids",))]
    m += [Mut("expert_ids None", "expert_ids", None, names=("expert_ids",))] + tensor_junk("expert_ids")
    m += [Mut("expert_ids non-contiguous", "expert_ids", lambda kw, r: noncontiguous(kw["expert_ids"]), one="ok")]
    m += [Mut("expert_ids K > E", "expert_ids", lambda kw, r: torch.zeros(kw["x"].shape[0], E + 1, dtype=torch.int32),
              names=("expert_ids", "expert_scales", "x_active_mask"))]
    if any(c["T"]) and c["mask"] is None:
        def set_id(v):
            def f(kw, r):
                ids = kw["expert_ids"].clone()
                if ids.numel():
                    ids.view(-1)[0] = v
                return ids
            return f
        some = lambda ts: "error" if any(c["T"][t] for t in ts) else "ok"
        m += [Mut("expert_ids = E", "expert_ids", set_id(E), names=("expert_ids",), decide=some)]
        m += [Mut("expert_ids = -1 (active)", "expert_ids", set_id(-1), names=("expert_ids",), decide=some)]
        if K > 1:
            m += [Mut("expert_ids repeated in a row", "expert_ids",
                      lambda kw, r: torch.cat([kw["expert_ids"][:, :1], kw["expert_ids"][:, :K - 1]], 1),
                      names=("expert_ids",), decide=some)]
    m += [Mut("expert_scales shape", "expert_scales", lambda kw, r: torch.rand(kw["x"].shape[0], K + 1),
              names=("expert_scales",))]
    m += [Mut("expert_scales f64", "expert_scales", lambda kw, r: torch.rand(kw["x"].shape[0], K).double(),
              names=("expert_scales",))]
    m += [Mut("expert_scales toggled", "expert_scales",
              lambda kw, r: None if kw.get("expert_scales") is not None else call.inputs[r]["w"], one="ok")]
    m += tensor_junk("expert_scales")
    m += [Mut("quant_mode 5", "quant_mode", 5, names=("quant_mode",)), Mut("quant_mode '2'", "quant_mode", "2",
                                                                          names=("quant_mode",))]
    q = 2 if c["quant_mode"] != 2 else 3
    m += [Mut(f"quant_mode {q}", "quant_mode", q, one="error", all="ok", names=("quant_mode",))]
    m += [Mut("scales with mode 0", "scales", lambda kw, r: torch.ones(H), names=("scales",))] if c["quant_mode"] == 0 else []
    m += [Mut("y_dtype int8 in mode 0", "y_dtype", torch.int8, names=("y_dtype",))] if c["quant_mode"] == 0 else []
    m += [Mut("y_dtype 'bf16'", "y_dtype", "bf16", names=("y_dtype",))]
    m += [Mut("x_dtype bf16", "x_dtype", torch.bfloat16, names=("x_dtype",))]
    m += [Mut("expert_token_nums_type 2", "expert_token_nums_type", 2, names=("expert_token_nums_type",))]
    m += [Mut("expert_token_nums_type toggled", "expert_token_nums_type",
              lambda kw, r: 1 - kw["expert_token_nums_type"], one="ok")]
    m += [Mut("elastic_info given", "elastic_info", torch.zeros(4, dtype=torch.int32), names=("elastic_info",))]
    return m


def v2_combine_mutations(call, rng, ctx):
    c = call.case
    H, K = c["H"], c["K"]
    m = v2_common_mutations(call, rng, "combine")
    m += [Mut("expand_x f32", "expand_x", lambda kw, r: kw["expand_x"].float(), names=("expand_x",))]
    m += [Mut("expand_x too few rows", "expand_x", lambda kw, r: kw["expand_x"][:max(int(kw["ep_send_counts"][-1]) - 1, 0)]
              if int(kw["ep_send_counts"][-1]) else kw["expand_x"][:, :0], names=("expand_x",))]
    m += [Mut("expand_x None", "expand_x", None, names=("expand_x",))] + tensor_junk("expand_x")
    m += [Mut("expand_x NaN in the tail rows", "expand_x", lambda kw, r: torch.cat(
        [kw["expand_x"][:int(kw["ep_send_counts"][-1])],
         torch.full_like(kw["expand_x"][int(kw["ep_send_counts"][-1]):], float("nan"))]), one="ok")]
    m += [Mut("expand_x non-contiguous", "expand_x", lambda kw, r: noncontiguous(kw["expand_x"]), one="either",
              names=("expand_x", "contiguous"))]
    m += [Mut("expert_ids int64", "expert_ids", lambda kw, r: kw["expert_ids"].long(), names=("expert_ids",))]
    m += [Mut("assist_info None", "assist_info_for_combine", None, names=("assist_info_for_combine",))]
    m += [Mut("assist_info int64", "assist_info_for_combine", lambda kw, r: kw["assist_info_for_combine"].long(),
              names=("assist_info_for_combine",))]
    m += tensor_junk("assist_info_for_combine")
    def assist_at(i, v):
        def f(kw, r):
            a = kw["assist_info_for_combine"].clone()
            if int(kw["ep_send_counts"][-1]) > 0:
                a[i] = v
            return a
        return f
    if all(int(call.combine_kwargs(s)["ep_send_counts"][-1]) > 0 for s in range(WORLD)):
        m += [Mut("assist_info rank W", "assist_info_for_combine", assist_at(0, WORLD),
                  names=("assist_info_for_combine", "assist"))]
        m += [Mut("assist_info slot K + S", "assist_info_for_combine", assist_at(2, K + 1 + c["Sr"]),
                  names=("assist_info_for_combine", "assist", "slot"))]
    m += [Mut("ep_send_counts one more", "ep_send_counts", lambda kw, r: torch.cat([kw["ep_send_counts"], kw["ep_send_counts"][-1:]]),
              names=("ep_send_counts",))]
    m += [Mut("ep_send_counts i64", "ep_send_counts", lambda kw, r: kw["ep_send_counts"].long(), names=("ep_send_counts",))]
    m += [Mut("ep_send_counts None", "ep_send_counts", None, names=("ep_send_counts",))]
    m += [Mut("ep_send_counts beyond A", "ep_send_counts", lambda kw, r: kw["ep_send_counts"] + 2 ** 30,
              names=("ep_send_counts",))]
    m += [Mut("expert_scales None", "expert_scales", None, names=("expert_scales",))]
    m += [Mut("expert_scales shape", "expert_scales", lambda kw, r: torch.rand(kw["expert_ids"].shape[0], K + 1),
              names=("expert_scales",))]
    m += [Mut("expert_scales NaN", "expert_scales", lambda kw, r: with_nans(kw["expert_scales"]), one="ok")]
    m += [Mut("comm_quant_mode 1", "comm_quant_mode", 1, names=("comm_quant_mode",))]
    if H % 8 == 0:
        q = 2 - c["comm_quant"]
        m += [Mut(f"comm_quant_mode {q}", "comm_quant_mode", q, one="error", all="ok", names=("comm_quant_mode",))]
    m += [Mut("shared_expert_x shape", "shared_expert_x", lambda kw, r: torch.zeros(kw["expert_ids"].shape[0] + 1, H,
                                                                                      dtype=c["dtype"]),
              names=("shared_expert_x",))]
    m += [Mut("ori_x given", "ori_x", lambda kw, r: kw["expand_x"][:1], names=("ori_x",))]
    m += [Mut("expand_idx with assist_info", "expand_idx", lambda kw, r: kw["assist_info_for_combine"],
              names=("expand_idx",))]
    return m


# ---- running a trial ------------------------------------------------------------------------------------------

class Watchdog:
    """Ends the rank (exit 3) with every thread's stack when a trial runs past WATCHDOG_S: a hang."""

    def __init__(self, note):
        self.note, self.deadline, self.what = note, None, ""
        faulthandler.enable()
        threading.Thread(target=self._watch, daemon=True).start()

    def arm(self, what):
        self.what = what
        with open(self.note, "w") as f:
            f.write(what)
        self.deadline = time.monotonic() + WATCHDOG_S

    def _watch(self):
        while True:
            time.sleep(0.5)
            d = self.deadline
            if d is not None and time.monotonic() > d:
                sys.stderr.write(f"\nfuzz: HANG: {self.what} ran past {WATCHDOG_S} s\n")
                faulthandler.dump_traceback(all_threads=True)
                sys.stderr.flush()
                os._exit(3)


class Ctx:
    """One rank's state across trials: two Buffers per strategy (the second one makes foreign handles), the
    operator group, the handle of the last dispatch per strategy."""

    def __init__(self, rank, note):
        self.rank = rank
        self.pg = dist.group.WORLD
        self.bufs = {"shm": [epcomm.Buffer(self.pg, num_nvl_bytes=n, timeout_s=TIMEOUT_S) for n in (8 << 20, 4 << 20)],
                     "alltoall": [epcomm.Buffer(self.pg, normal_strategy="alltoall", timeout_s=TIMEOUT_S)
                                  for _ in range(2)]}
        epcomm.ops.init_group_context(self.pg, segment_bytes=8 << 20, timeout_s=TIMEOUT_S)
        self.mode = "shm"
        self.prev = {"shm": None, "alltoall": None}
        self.foreign = self.foreign_a2a = None
        self.watchdog = Watchdog(note)
        self.stats = dict(trials=0, clean_errors=0, correct=0, pairing_checks=0, failures=0)
        self.failures = []

    @property
    def buf(self):
        return self.bufs[self.mode][0]

    @property
    def prev_handle(self):
        return self.prev[self.mode]

    @prev_handle.setter
    def prev_handle(self, h):
        self.prev[self.mode] = h

    def destroy(self):
        for bufs in self.bufs.values():
            for b in bufs:
                b.destroy()


def outcome_of(fn):
    t0 = time.monotonic()
    try:
        result = fn()
        return dict(ok=True, result=result, secs=time.monotonic() - t0)
    except Exception as e:  # every exception is judged below
        return dict(ok=False, cls=type(e).__name__, epcomm=isinstance(e, epcomm.Error), msg=str(e),
                    tb="".join(traceback.format_exception(e))[-3000:], secs=time.monotonic() - t0,
                    timeout=isinstance(e, epcomm.TimeoutError))


def judge(ctx, out, expect, mut, targets, check_ok):
    """Fails unless every rank's ending is what `expect` allows; returns True when the call raised. An error
    ending: every rank raised within SLOW_ERROR_S, naming the argument (one of mut.names); a changed rank
    raised InvalidUsageError, or AbortedError quoting another changed rank (its own change may be legal
    alone: a larger moe_expert_num on a shared-expert rank); an unchanged rank raised AbortedError quoting a
    changed rank, or InvalidUsageError for a mismatch or a capacity problem; and some rank found the error
    (InvalidUsageError)."""
    mine = {k: v for k, v in out.items() if k != "result"}
    every = gather(mine)
    for r, o in enumerate(every):
        if not o["ok"] and not o["epcomm"]:
            raise Failure(f"rank {r} raised {o['cls']}, not an epcomm.Error: {o['msg']}\n{o['tb']}")
        if not o["ok"] and o["timeout"]:
            raise Failure(f"rank {r} timed out (a hang): {o['msg']}")
    oks = {o["ok"] for o in every}
    if len(oks) > 1:
        raise Failure("the ranks ended differently: " + "; ".join(
            f"rank {r}: {'a result' if o['ok'] else o['cls'] + ': ' + o['msg']}" for r, o in enumerate(every)))
    if oks == {True}:
        if expect in ("error", "capacity"):
            raise Failure(f"expected an error ({expect}), every rank returned a result")
        check_ok(out["result"])
        return False
    if expect == "ok":
        raise Failure("expected a result, got: " + "; ".join(f"rank {r}: {o['cls']}: {o['msg']}"
                                                           for r, o in enumerate(every)))
    for r, o in enumerate(every):
        named = any(n in o["msg"] for n in mut.names)
        if o["secs"] > SLOW_ERROR_S:
            raise Failure(f"rank {r} raised only after {o['secs']:.1f} s: {o['msg']}")
        collective = o["cls"] == "InvalidUsageError" and ("mismatch" in o["msg"] or "capacity" in o["msg"])
        quotes = o["cls"] == "AbortedError" and any(f"rank {t} " in o["msg"] for t in targets if t != r)
        if expect == "capacity":
            ok = o["cls"] == "InvalidUsageError" and "capacity" in o["msg"]
        elif r in targets:
            ok = o["cls"] == "InvalidUsageError" or quotes
        else:
            ok = quotes or collective
        if not (ok and named):
            raise Failure(f"rank {r}{' (changed)' if r in targets else ''}: {o['cls']}: {o['msg']!r} is not the "
                          f"clean error expected (names {mut.names})")
    if all(o["cls"] == "AbortedError" for o in every):
        raise Failure("every rank raised AbortedError: none found the error itself")
    return True


def finished(r):
    """Waits for an asynchronous call's event inside the judged call (its errors are the call's)."""
    r[-1].wait()
    return r


def dispatch(buf, kw):
    kw = dict(kw)
    x = kw.pop("x")
    return finished(buf.dispatch(x, **kw))


def combine(buf, kw):
    kw = dict(kw)
    return finished(buf.combine(kw.pop("x"), kw.pop("handle"), **kw))


def pick_targets(rng, mut):
    if mut.only_one or rng.random() < 0.7:
        return [rng.randrange(WORLD)]
    return list(range(WORLD))


def make_foreign(ctx, needs, kws):
    """A handle of the same dispatch made by another Buffer of the trial's strategy ("foreign") or by a Buffer
    of the other strategy ("foreign_a2a"); collective on every rank."""
    if needs == "foreign":
        ctx.foreign = dispatch(ctx.bufs[ctx.mode][1], kws[ctx.rank])[4]
    elif needs == "foreign_a2a":
        other = "shm" if ctx.mode == "alltoall" else "alltoall"
        ctx.foreign_a2a = dispatch(ctx.bufs[other][0], kws[ctx.rank])[4]


def run_trial(ctx, i):
    rng = random.Random(f"{SEED}:{i}")
    me = ctx.rank
    api = rng.choice(("layout", "dispatch", "dispatch", "dispatch", "cached", "combine", "combine", "v2_dispatch",
                      "v2_dispatch", "v2_combine", "v2_combine"))
    if api.startswith("v2"):
        call = V2Call(v2_case(rng, WORLD), WORLD, ctx.pg)
    else:
        call = NormalCall(normal_case(rng, WORLD), WORLD)
        ctx.mode = "alltoall" if rng.random() < 0.25 else "shm"  # the strategy of DEEP_USE_MODE=alltoall
        api_label = f"{api} ({ctx.mode})"
    muts = {"layout": layout_mutations, "dispatch": dispatch_mutations, "cached": cached_mutations,
            "combine": combine_mutations, "v2_dispatch": v2_dispatch_mutations,
            "v2_combine": v2_combine_mutations}[api](call, rng, ctx)
    mut = rng.choice(muts)
    targets = pick_targets(rng, mut)
    what = f"trial {i} [{api if api.startswith('v2') else api_label}: {mut.label}, on rank(s) {targets}]"
    ctx.watchdog.arm(f"seed {SEED} {what}")
    try:
        globals()["_trial_" + api](ctx, call, mut, targets)
    except (Failure, WrongResult) as e:
        ctx.stats["failures"] += 1
        message = f"fuzz seed {SEED} {what}, rank {me}: {e}\n  reproduce: {reproduce(i)}"
        if not KEEP_GOING or "timed out" in str(e):
            raise Failure(message) from None
        ctx.failures.append(message)
    ctx.watchdog.deadline = None
    ctx.stats["trials"] += 1


def _count(ctx, errored):
    ctx.stats["clean_errors" if errored else "correct"] += 1


def changed_args(mut, kws, targets):
    """(every rank's arguments with the change made on `targets`, the ranks it changed, the ending due)."""
    changed = [s for s in targets if mut.changes(kws[s], s)]
    eff = [mut.apply(kws[s], s) if s in changed else kws[s] for s in range(WORLD)]
    expect = mut.expect(changed) if changed else "ok"
    return eff, changed, expect


def judged(ctx, out, expect, mut, changed, check_ok):
    try:
        return judge(ctx, out, expect, mut, changed, check_ok)
    except (Failure, WrongResult) as e:
        raise type(e)(f"(changed ranks {changed}, expected {expect}) {e}") from None


def _trial_layout(ctx, call, mut, targets):
    """get_dispatch_layout is local: only the changed ranks may raise."""
    me, E = ctx.rank, call.case["E"]
    kws = [dict(topk_idx=call.dispatch_kwargs(s)["topk_idx"], num_experts=E) for s in range(WORLD)]
    eff, changed, expect = changed_args(mut, kws, targets)
    kw = eff[me]
    out = outcome_of(lambda: ctx.buf.get_dispatch_layout(kw["topk_idx"], kw["num_experts"]))
    mine_expect = mut.expect([me]) if me in changed else "ok"

    def ok(r):
        per_rank, per_rdma, per_expert, in_rank, event = r
        ref = layout(kw["topk_idx"].long(), kw["num_experts"], WORLD)
        for got, want, name in ((per_rank, ref[0], "num_tokens_per_rank"), (per_expert, ref[1], "num_tokens_per_expert"),
                                (in_rank, ref[2].to(torch.int32), "is_token_in_rank")):
            if not same_bits(got, want):
                raise WrongResult(f"{name}: got {got.tolist()}, expected {want.tolist()}")
        if per_rdma is not None:
            raise WrongResult("num_tokens_per_rdma_rank should be None on one node")

    if not out["ok"]:
        if not out["epcomm"]:
            raise Failure(f"raised {out['cls']}, not an epcomm.Error: {out['msg']}\n{out['tb']}")
        if mine_expect == "ok" or out["cls"] != "InvalidUsageError" or not any(n in out["msg"] for n in mut.names):
            raise Failure(f"{out['cls']}: {out['msg']!r} (expected {mine_expect}, naming {mut.names})")
        _count(ctx, True)
    else:
        if mine_expect == "error":
            raise Failure("expected InvalidUsageError, got a result")
        ok(out["result"])
        _count(ctx, False)


def _normal_call(ctx, call, mut, targets, kws, run, expected, check):
    """A collective normal-mode call of every rank's arguments kws (changed on targets); after an error the
    unchanged call must pair correctly."""
    me = ctx.rank
    if mut.needs:
        make_foreign(ctx, mut.needs, [call.dispatch_kwargs(s) for s in range(WORLD)])
    eff, changed, expect = changed_args(mut, kws, targets)
    out = outcome_of(lambda: run(eff[me]))
    errored = judged(ctx, out, expect, mut, changed, lambda r: check(r, expected(eff), "changed call"))
    _count(ctx, errored)
    if errored:
        check(run(kws[me]), expected(kws), "the unchanged call after the error (pairing)")
        ctx.stats["pairing_checks"] += 1


def _trial_dispatch(ctx, call, mut, targets):
    kws = [call.dispatch_kwargs(s) for s in range(WORLD)]
    _normal_call(ctx, call, mut, targets, kws, lambda kw: dispatch(ctx.buf, kw),
                 lambda eff: expected_fresh(eff, ctx.rank, WORLD), lambda r, ref, w: keep(ctx, r, ref, w))


def keep(ctx, r, ref, what):
    check_dispatch(r, ref, what)
    ctx.prev_handle = r[4]


def _fresh(ctx, call):
    """The valid dispatch a combine or cached-dispatch trial starts from (checked)."""
    r = dispatch(ctx.buf, call.dispatch_kwargs(ctx.rank))
    keep(ctx, r, call.expected(ctx.rank), "the dispatch before")
    return r[4]


def _on_handle(ctx, call, mut, targets, kwargs_of, run, expected, check):
    """A call on the handle of a fresh (checked) dispatch: cached dispatch or combine. The handle of the
    dispatch before that stays available to the "handle of an earlier dispatch" change."""
    prev = ctx.prev_handle
    handle = _fresh(ctx, call)
    ctx.prev_handle = prev
    kws = [dict(kwargs_of(s), handle=handle) for s in range(WORLD)]
    _normal_call(ctx, call, mut, targets, kws, run, lambda eff: expected(eff, ctx.rank), check)
    ctx.prev_handle = handle


def _trial_cached(ctx, call, mut, targets):
    _on_handle(ctx, call, mut, targets, call.cached_kwargs, lambda kw: dispatch(ctx.buf, kw), call.expected_cached,
               check_cached)


def _trial_combine(ctx, call, mut, targets):
    _on_handle(ctx, call, mut, targets, call.combine_kwargs, lambda kw: combine(ctx.buf, kw),
               call.expected_combine, check_combine)


def _v2_call(ctx, call, mut, targets, kws, run, check):
    me = ctx.rank
    eff, changed, expect = changed_args(mut, kws, targets)
    out = outcome_of(lambda: run(eff[me]))
    errored = judged(ctx, out, expect, mut, changed, lambda r: check(r, eff, me, "changed call"))
    _count(ctx, errored)
    if errored:
        check(run(kws[me]), kws, me, "the unchanged call after the error (pairing)")
        ctx.stats["pairing_checks"] += 1


def _trial_v2_dispatch(ctx, call, mut, targets):
    kws = [call.dispatch_kwargs(s) for s in range(WORLD)]
    _v2_call(ctx, call, mut, targets, kws, run_v2_dispatch, check_v2_dispatch)


def _trial_v2_combine(ctx, call, mut, targets):
    me = ctx.rank
    d = [dict(call.dispatch_kwargs(s), quant_mode=0) for s in range(WORLD)]
    check_v2_dispatch(run_v2_dispatch(d[me]), d, me, "the dispatch_v2 before")
    kws = [call.combine_kwargs(s) for s in range(WORLD)]
    _v2_call(ctx, call, mut, targets, kws, run_v2_combine, check_v2_combine)


def fuzz_job(rank, world, notes):
    torch.manual_seed(0)
    ctx = Ctx(rank, os.path.join(notes, f"rank{rank}"))
    trials = [int(ONLY)] if ONLY is not None else range(TRIALS)
    t0 = time.monotonic()
    for i in trials:
        run_trial(ctx, i)
    if rank == 0:  # as rank 0 saw them (a local layout error counts on the changed rank only)
        total = ctx.stats
        print(f"\nfuzz: seed {SEED}: {total['trials']} trials in {time.monotonic() - t0:.1f} s: "
              f"{total['clean_errors']} clean errors, {total['correct']} correct results, "
              f"{total['pairing_checks']} pairing checks, {total['failures']} failures (wrong result, "
              f"non-Error exception or inconsistent ending), 0 crashes, 0 hangs", flush=True)
    for f in ctx.failures:
        print(f, file=sys.stderr)
    assert not ctx.failures, f"{len(ctx.failures)} failing trials (first: {ctx.failures[0]})"
    if ONLY is None and TRIALS >= 50:
        assert ctx.stats["clean_errors"] > 0 and ctx.stats["correct"] > 0, ctx.stats
    ctx.destroy()


def test_fuzz_arguments():
    with tempfile.TemporaryDirectory() as notes:
        try:
            spawn(fuzz_job, WORLD, notes, env={"EPCOMM_TIMEOUT_S": str(TIMEOUT_S)})
        except Exception:
            for r in range(WORLD):  # a crashed rank's last trial
                path = os.path.join(notes, f"rank{r}")
                if os.path.exists(path):
                    print(f"rank {r} was in: {open(path).read()}\n  reproduce: see EPCOMM_FUZZ_TRIAL above",
                          file=sys.stderr)
            raise


def local_calls(buf, a2a, handle, x):
    """(label, call, word the message must hold) for the local entry points, each given a bad argument."""
    big = 2 ** 64
    return [
        ("get_dispatch_input huge", lambda: buf.get_dispatch_input(2 ** 40, 2 ** 40), "capacity"),
        ("get_dispatch_input str", lambda: buf.get_dispatch_input("a", 16), "num_tokens"),
        ("get_dispatch_input 2^64", lambda: buf.get_dispatch_input(big, 16), "num_tokens"),
        ("alltoall get_dispatch_input -1", lambda: a2a.get_dispatch_input(-1, 16), "num_tokens"),
        ("get_combine_input hidden 2^62", lambda: buf.get_combine_input(handle, hidden=2 ** 62), "capacity"),
        ("get_combine_input dtype", lambda: buf.get_combine_input(handle, dtype="x"), "dtype"),
        ("alltoall get_combine_input None", lambda: a2a.get_combine_input(None), "handle"),
        ("node_of str", lambda: buf.node_of("a"), "rank"),
        ("node_of 2^64", lambda: a2a.node_of(big), "rank"),
        ("quantize str", lambda: epcomm.quantize("x", "int8"), "x"),
        ("quantize mode 3", lambda: epcomm.quantize(x, 3), "mode"),
        ("quantize num_threads 2^64", lambda: epcomm.quantize(x, "int8", num_threads=big), "num_threads"),
        ("dequantize out_dtype", lambda: epcomm.dequantize(*epcomm.quantize(x, "int8"), "int8", torch.int32),
         "out_dtype"),
        ("min_nvl_bytes str", lambda: epcomm.min_nvl_bytes("a", 2, 2), "row_bytes"),
        ("min_rdma_bytes 2^62", lambda: epcomm.min_rdma_bytes(2 ** 62, 2, 2), "row_bytes"),
        ("Config str", lambda: epcomm.Config("a"), "num_threads"),
        ("Config 2^40", lambda: epcomm.Config(0, 2 ** 40), "num_max_nvl_chunked_send_tokens"),
        ("size hint str", lambda: epcomm.Config().get_nvl_buffer_size_hint("a", 2), "hidden_bytes"),
        ("size hint 2^40 ranks", lambda: epcomm.Config().get_rdma_buffer_size_hint(64, 2 ** 40), "num_ranks"),
        ("EventOverlap str", lambda: epcomm.EventOverlap("e"), "event"),
        ("handle index", lambda: handle[100], "index"),
        ("handle key", lambda: handle["nope"], "nope"),
        ("handle item", lambda: handle.item("nope"), "nope"),
        ("set_num_threads str", lambda: epcomm.Buffer.set_num_threads("a"), "n"),
        ("get_dispatch_config 2^40", lambda: epcomm.Buffer.get_dispatch_config(2 ** 40), "num_ranks"),
        ("Buffer num_nvl_bytes str", lambda: epcomm.Buffer(num_nvl_bytes="a"), "num_nvl_bytes"),
        ("Buffer timeout_s str", lambda: epcomm.Buffer(timeout_s="a"), "timeout_s"),
        ("init_group_context segment_bytes str",
         lambda: epcomm.ops.init_group_context(dist.group.WORLD, segment_bytes="a"), "segment_bytes"),
    ]


def test_local_arguments(world1):
    """The local entry points (no peers to tell): a bad argument raises InvalidUsageError naming it, never
    pybind's TypeError, a ValueError from int(), a torch RuntimeError or a crash (get_combine_input with
    hidden = 2^62 used to abort the process in torch)."""
    buf = epcomm.Buffer(world1, num_nvl_bytes=8 << 20, num_combine_input_bytes=1 << 20,
                        num_dispatch_input_bytes=1 << 20)
    a2a = epcomm.Buffer(world1, normal_strategy="alltoall")
    ids = torch.tensor([[0, 1], [1, -1], [0, 0]])
    x = torch.randn(3, 16).to(torch.bfloat16)
    per_expert = buf.get_dispatch_layout(ids, 2)[2]
    handle = buf.dispatch(x, topk_idx=ids, topk_weights=torch.rand(3, 2), num_tokens_per_expert=per_expert)[4]
    failures = []
    for label, call, word in local_calls(buf, a2a, handle, x):
        try:
            call()
            failures.append(f"{label}: no error")
        except epcomm.InvalidUsageError as e:
            if word not in str(e):
                failures.append(f"{label}: {e!r} does not name {word!r}")
        except Exception as e:
            failures.append(f"{label}: {type(e).__name__} (not an epcomm.Error): {e}")
    buf.destroy()
    a2a.destroy()
    assert not failures, "\n".join(failures)
