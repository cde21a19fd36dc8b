"""A Buffer's flavor and the Ascend port's environment switches (docs/python.md, "Flavors"
and "Porting"). Switches are read when a call is made, not at import."""
import math
import os

import torch

from ._errors import InvalidUsageError

FLAVORS = ("ascend", "deepep")


def resolve_flavor(flavor):
    """The Buffer's flavor: the argument, else EPCOMM_FLAVOR, else "ascend" (the seed's contract)."""
    if flavor is None:
        env = os.environ.get("EPCOMM_FLAVOR", "").strip()
        if not env:
            return "ascend"
        if env.lower() not in FLAVORS:
            raise InvalidUsageError(f"Buffer: EPCOMM_FLAVOR: expected ascend or deepep, got {env!r}")
        return env.lower()
    if not isinstance(flavor, str) or flavor not in FLAVORS:
        raise InvalidUsageError(f"Buffer: argument: flavor: expected 'ascend', 'deepep' or None, got {flavor!r}")
    return flavor


def default_receive_order(flavor):
    """The normal-mode receive order a flavor gives when receive_order is not passed."""
    return "rank_major" if flavor == "deepep" else "expert_major"


def _int_env(name, default, low, high):
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        v = int(raw)
    except ValueError:
        v = None
    if v is None or not low <= v <= high:
        raise InvalidUsageError(f"{name}: expected an integer in [{low}, {high}], got {raw!r}")
    return v


def expert_token_nums_prefix_sums():
    """MOE_EXPERT_TOKEN_NUMS_TYPE: 1 (default) per-expert counts, 0 inclusive prefix sums."""
    return _int_env("MOE_EXPERT_TOKEN_NUMS_TYPE", 1, 0, 1) == 0


def apply_token_nums_type(counts):
    """The per-expert list as the Ascend port returns it under MOE_EXPERT_TOKEN_NUMS_TYPE."""
    if counts is None or not expert_token_nums_prefix_sums():
        return counts
    out, total = [], 0
    for c in counts:
        total += int(c)
        out.append(total)
    return out


def long_seq_rounds(num_tokens):
    """(n, P) from DEEPEP_NORMAL_LONG_SEQ_ROUND (default 1) and DEEPEP_NORMAL_LONG_SEQ_PER_ROUND_TOKENS
    (default ceil(T / n)). Raises when the rounds cannot hold the tokens (n * P < T)."""
    n = _int_env("DEEPEP_NORMAL_LONG_SEQ_ROUND", 1, 1, 256)
    if n == 1:
        return 1, max(num_tokens, 1)
    P = _int_env("DEEPEP_NORMAL_LONG_SEQ_PER_ROUND_TOKENS", max(math.ceil(num_tokens / n), 1), 1, 1 << 20)
    if n * P < num_tokens:
        raise InvalidUsageError(
            f"get_dispatch_layout: DEEPEP_NORMAL_LONG_SEQ_ROUND x DEEPEP_NORMAL_LONG_SEQ_PER_ROUND_TOKENS = {n} x "
            f"{P} = {n * P} tokens, fewer than num_tokens = {num_tokens}")
    return n, P


def per_round_expert_counts(topk_idx, num_experts, n, P):
    """[n * E] int32: block i counts the (token, slot) pairs of tokens [i * P, (i + 1) * P) per expert. The
    tensor remembers n, so that dispatch can sum it back to [E] (fold_expert_counts)."""
    ids = topk_idx.to(torch.int64)
    T = ids.shape[0]
    out = torch.zeros(n, num_experts, dtype=torch.int64)
    for i in range(n):
        block = ids[i * P: min((i + 1) * P, T)]
        valid = block[(block >= 0) & (block < num_experts)]
        out[i] = torch.bincount(valid, minlength=num_experts)[:num_experts]
    t = out.reshape(-1).to(torch.int32)
    t._epcomm_rounds = n
    return t


def fold_expert_counts(num_tokens_per_expert):
    """Dispatch takes [E], or the per-round [n * E] that get_dispatch_layout returned: summed to [E]."""
    t = num_tokens_per_expert
    rounds = getattr(t, "_epcomm_rounds", 1)
    if rounds <= 1:
        return t
    return t.reshape(rounds, -1).sum(0).to(t.dtype)
