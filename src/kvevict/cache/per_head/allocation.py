"""Ada-KV's allocation: which entries of a layer's KV heads survive when the heads share one allowance.

Plain tensors in, a keep mask out. Per row: every head first keeps its own best
`floor` entries (or all it holds, if fewer); the rest of the row's allowance goes to
the best remaining entries of all heads together. Ties keep the later token, as in
`selection.py`; a tie on the same token in two heads keeps the lower head.
"""

from __future__ import annotations

import torch


def allocate(
    scores: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, total: int, floor: torch.Tensor
) -> torch.Tensor:
    """`[B, H, L]` bool: the entries to keep.

    scores `[B, H, L]` (higher keeps; values at invalid slots are ignored), pos `[B, H, L]`
    original positions, valid `[B, H, L]` which padded slots hold an entry, `total` the
    entries a row keeps (`H x budget`), floor `[B]` the fewest each head keeps.
    """
    b, h, length = scores.shape
    # rank inside each head: best score first, the later token first among equals
    latest_first = pos.masked_fill(~valid, -1).argsort(dim=-1, descending=True, stable=True)
    by_score = scores.gather(-1, latest_first).masked_fill(~valid.gather(-1, latest_first), float("-inf"))
    order = latest_first.gather(-1, torch.sort(by_score, dim=-1, descending=True, stable=True).indices)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(length, device=scores.device).expand_as(order))
    guaranteed = valid & (rank < floor.view(b, 1, 1))
    # the rest of the allowance: the best remaining entries of the row, all heads together
    left = (total - guaranteed.sum(dim=(1, 2))).clamp(min=0)  # [B]
    flat_scores = scores.reshape(b, h * length)
    flat_pos = pos.reshape(b, h * length)
    candidate = (valid & ~guaranteed).reshape(b, h * length)
    latest = flat_pos.argsort(dim=-1, descending=True, stable=True)  # equal positions: lower head first
    best = torch.sort(flat_scores.gather(-1, latest), dim=-1, descending=True, stable=True).indices
    joint = latest.gather(-1, best)
    first = torch.sort(candidate.gather(-1, joint).int(), dim=-1, descending=True, stable=True).indices
    joint = joint.gather(-1, first)  # candidates first, best first
    taken = torch.arange(h * length, device=scores.device)[None] < left[:, None]
    chosen = torch.zeros(b, h * length, dtype=torch.bool, device=scores.device)
    chosen.scatter_(-1, joint, taken & candidate.gather(-1, joint))
    return guaranteed | chosen.view(b, h, length)
