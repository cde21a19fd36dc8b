"""deep_ep compatibility: `from deep_ep import Buffer, Config, EventOverlap` runs DeepEP-style code on epcomm.

Pass receive_order="rank_major" to Buffer for NVIDIA DeepEP's row contract (one row per token and
destination rank); the default "expert_major" is the Ascend port's (one row per token and expert)."""
import torch

from epcomm import Buffer, Config, EventOverlap

topk_idx_t = torch.int64

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
