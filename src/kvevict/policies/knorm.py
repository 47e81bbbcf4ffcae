"""`knorm`: keep the keys with the lowest L2 norm (Devoto et al., 2024, "A Simple and
Effective L2 Norm-Based Strategy for KV Cache Compression").

The paper observes that keys with a low norm draw high attention (the attention sinks
among them), so the norm of a key predicts its importance without computing any
attention. A key's norm is fixed when it arrives (rotary position embeddings rotate a
key, which keeps its norm), so the kept set after any step is the lowest-norm
`budget` of all tokens seen: chunked evaluation uses the closed form.

Norms are compared at half precision (11 significant bits). A token that repeats has
the same key in the first layer up to the rotation, and the rotation's rounding makes
the two norms differ in the last bits, differently in a one-token forward and in a
chunk: ranking those bits would let chunked and token-by-token evaluation keep
different copies. Rounded, the copies tie exactly and the later one stays.

The norm is computed once per key when it arrives (`arrival`); a decode step then reads the
stored norms instead of taking the norm of every held key again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, SlotView


@dataclass(eq=False)
class KNorm(Policy):
    static_scores = True  # its key's norm, fixed on arrival
    reads_keys = True
    arrival_stat = True  # the score itself

    def spec(self) -> str:
        return "knorm"

    def arrival(self, keys: torch.Tensor) -> torch.Tensor:
        """`[b, H_kv, q]`: minus the L2 norm of each key `[b, H_kv, q, D]`, rounded to half precision
        (a row-wise reduction: one key alone or many give the same bits)."""
        return -torch.linalg.vector_norm(keys, dim=-1, dtype=torch.float32).half()

    def scores(self, view: SlotView) -> torch.Tensor:
        """`[b, H_kv, n]`: the stored arrival scores, or `arrival` of every slot's key."""
        return view.arrival if view.arrival is not None else self.arrival(view.keys())
