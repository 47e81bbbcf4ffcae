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
        """`[b, H_kv, n]`: minus the cosine of each key `[b, H_kv, n, D]` to the mean unit key."""
        keys = view.keys().float()
        unit = keys / torch.linalg.vector_norm(keys, dim=-1, keepdim=True).clamp(min=1e-12)
        anchor = unit.mean(dim=2, keepdim=True)  # [b, H_kv, 1, D]
        anchor = anchor / torch.linalg.vector_norm(anchor, dim=-1, keepdim=True).clamp(min=1e-12)
        return -(unit * anchor).sum(dim=-1)
