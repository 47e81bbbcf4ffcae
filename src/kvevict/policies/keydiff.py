"""`keydiff`: keep the most distinctive keys (Park et al., 2025, "KeyDiff: Key Similarity-Based
KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained Environments").

Per (row, KV head), the anchor is the mean of the cached keys after each is scaled to
unit length; a key's score is minus its cosine similarity to that anchor, so keys that
point away from the crowd stay. No attention is needed. The anchor moves with what the
cache holds, so scores change at every step (chunked evaluation steps through them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, SlotView


@dataclass(eq=False)
class KeyDiff(Policy):
    reads_keys = True

    def spec(self) -> str:
        return "keydiff"

    def scores(self, view: SlotView) -> torch.Tensor:
        """`[b, H_kv, n]`: minus each key's `[b, H_kv, n, D]` cosine to the mean unit key, scaled
        by n times that mean's length (one positive number per head, so the order within a head
        is the cosine's, and a decode step pays a few small ops per layer)."""
        keys = view.keys().float()
        unit = keys * torch.rsqrt((keys * keys).sum(dim=-1, keepdim=True).clamp(min=1e-24))
        anchor = unit.sum(dim=2, keepdim=True)  # [b, H_kv, 1, D]: n times the mean unit key
        return -(unit @ anchor.transpose(-1, -2))[..., 0]
