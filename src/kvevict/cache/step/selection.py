"""Selection: which slots survive, from the policies' scores. Plain tensors in, slot indices out.

Scores follow the policy convention (higher keeps, ties keep the later token). Two
shapes of eviction: one entry too many (a decode step) has a single victim per
(row, KV head); anything more keeps the `budget` best slots, in positional order.
"""

from __future__ import annotations

import torch

LATEST_LAST = torch.iinfo(torch.long).max


def victim(scores: torch.Tensor, pos: torch.Tensor, ordered: bool) -> torch.Tensor:
    """`[B, H]` slot of the entry to evict when one must go; among equal scores the earlier token.

    scores, pos `[B, H, n]`. argmin takes the first of equal minima, which is the
    earliest token while slots are in positional order (`ordered`); otherwise ties are
    broken by position explicitly.
    """
    if ordered:
        return scores.argmin(dim=-1)
    # the earliest position among the slots holding the lowest score: three ops per layer and step
    return torch.where(scores == scores.amin(dim=-1, keepdim=True), pos, LATEST_LAST).argmin(dim=-1)


def keep_slots(scores: torch.Tensor, pos: torch.Tensor, budget: int, ordered: bool) -> torch.Tensor:
    """`[B, H, budget]` slots to keep, in positional order. Ties go to the later token.

    scores, pos `[B, H, n]` with n > budget. A stable sort over slots visited from the
    latest position to the earliest keeps the later of equal scores.
    """
    total = scores.shape[-1]
    if ordered:  # slots already run by position: no sorting by position
        if total == budget + 1:
            gone = victim(scores, pos, ordered)[..., None]
            slots = torch.arange(budget, device=scores.device)
            return slots + (slots >= gone).long()
        order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :budget]
        return (total - 1 - order).sort(dim=-1).values
    latest_first = pos.argsort(dim=-1, descending=True, stable=True)
    ranked = torch.sort(scores.gather(-1, latest_first), dim=-1, descending=True, stable=True).indices
    keep = latest_first.gather(-1, ranked[..., :budget])
    return keep.gather(-1, pos.gather(-1, keep).argsort(dim=-1))
