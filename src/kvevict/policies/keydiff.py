"""`keydiff`: keep the most distinctive keys (Park et al., 2025, "KeyDiff: Key Similarity-Based
KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained Environments").

Per (row, KV head), the anchor is the mean of the cached keys after each is scaled to
unit length; a key's score is minus its cosine similarity to that anchor, so keys that
point away from the crowd stay. No attention is needed. The anchor moves with what the
cache holds, so scores change at every step (chunked evaluation steps through them); what
does not change is each key's length, so its inverse is computed once per key on arrival
(`arrival`) and a decode step reads it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, SlotView


@dataclass(eq=False)
class KeyDiff(Policy):
    reads_keys = True
    arrival_stat = True  # each key's inverse length

    def spec(self) -> str:
        return "keydiff"

    def arrival(self, keys: torch.Tensor) -> torch.Tensor:
        """`[b, H_kv, q]`: one over the length of each key `[b, H_kv, q, D]` (float32)."""
        keys = keys.float()
        return torch.rsqrt((keys * keys).sum(dim=-1).clamp(min=1e-24))

    def scores(self, view: SlotView) -> torch.Tensor:
        """`[b, H_kv, n]`: minus each key's `[b, H_kv, n, D]` cosine to the mean unit key, scaled
        by n times that mean's length (one positive number per head, so the order within a head
        is the cosine's). With the inverse lengths `inv` stored, that is two matrix products:
        the anchor `inv @ keys` (n times the mean unit key) and `-(keys @ anchor) * inv`."""
        keys = view.keys().float()
        inv = view.arrival if view.arrival is not None else self.arrival(keys)
        anchor = inv[:, :, None, :] @ keys  # [b, H_kv, 1, D]: the sum of the unit keys
        return (keys @ anchor.transpose(-1, -2))[..., 0].mul_(inv).neg_()
