"""Reading a quantized storage's ring of full-precision tokens back into the slots that stand for them.

The ring holds the latest tokens' keys and values at full precision (`QuantizedStorage.ring`, token `p` in
row `p % L`). Only the few slots whose positions are still in it read from it: they are found first and
copied alone, so a step costs the ring's length, not the held slots' count (a gather over every held slot
was most of a decode step through a residual).
"""

from __future__ import annotations

import torch


def read_ring(x: torch.Tensor, pos: torch.Tensor, ring: torch.Tensor, since: int) -> None:
    """Overwrite `x` `[B, H, n, D]` in place, where its slot's position `pos` `[B, H, n]` is `since` or later,
    with that position's row of `ring` `[B, H, L, D]` (row `pos % L`)."""
    b, h, s = (pos >= since).nonzero(as_tuple=True)
    if b.numel():
        x[b, h, s] = ring[b, h, pos[b, h, s] % ring.shape[2]]
