"""Ada-KV's allocation: which entries of a layer's KV heads survive when the heads share one allowance.

Plain tensors in, a keep mask out. Per row: every head first keeps its own best
`floor` entries (or all it holds, if fewer); the rest of the row's allowance goes to
the best remaining entries of all heads together. Ties keep the later token, as in
`step/selection.py`; a tie on the same token in two heads keeps the lower head.

That order is total, so each entry gets one int64 key that sorts the same way: the
score's float32 bits made monotone in the high half, `position x H + (H - 1 - head)` in
the low half (positions below `2^32 / H`). Then "the best `k`" is "the keys at or above
the `k`-th largest", found with `topk` rather than a full sort: a decode step evicts
only a few entries (about one per head), so it asks for the row's few worst and, unless
that would take a head below its floor, is done: those worst are not among any head's
best `floor`, so they are exactly the worst of the non-guaranteed entries. Where each slot
can belong to one head only (`owner`, the ragged layer's segments), that search runs over
the slots, one key each, instead of over every head's view of every slot: an H-th of the
keys (at Llama-3.1-8B's 8 KV heads and 4,096 entries each, 33K keys, not 263K).
"""

from __future__ import annotations

import torch

_LOWEST = torch.iinfo(torch.long).min
_HIGHEST = torch.iinfo(torch.long).max


def order_keys(scores: torch.Tensor, pos: torch.Tensor, head: torch.Tensor | None = None,
               heads: int | None = None) -> torch.Tensor:
    """`[B, H, L]` int64, distinct per (head, position), ordered as (score, position, -head).

    scores `[B, H, L]` float (at most float32 precision), pos `[B, H, L]` (distinct where they
    are >= 0; a pad's key means nothing). Or, given `head` (broadcast to `scores`: the head of each
    score) and the layer's `heads`, keys of any shape, e.g. one per slot `[B, L]`."""
    if head is None:
        heads = scores.shape[1]
        head = torch.arange(heads, device=scores.device).view(1, heads, 1)
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 and 0.0 are equal scores
    monotone = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # negative floats: reverse their order
    return (monotone << 32) + pos * heads + (heads - 1 - head)


def _at_least_kth(keys: torch.Tensor, k: torch.Tensor, largest: bool) -> torch.Tensor:
    """Whether each key of `keys` `[..., n]` is among the `k` `[...]` largest (or smallest) along the
    last axis; `k` may be 0. Pads must already hold the key that never qualifies."""
    n = keys.shape[-1]
    most = min(n, max(1, int(k.max())))
    ranked = keys.topk(most, dim=-1, largest=largest).values  # best first
    kth = ranked.gather(-1, (k - 1).clamp(0, most - 1).unsqueeze(-1))
    hit = keys >= kth if largest else keys <= kth
    return hit & (k > 0).unsqueeze(-1)


def allocate(
    scores: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, total: int, floor: torch.Tensor,
    owner: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[B, H, L]` bool: the entries to keep.

    scores `[B, H, L]` (higher keeps; values at invalid slots are ignored), pos `[B, H, L]`
    original positions, valid `[B, H, L]` which padded slots hold an entry, `total` the
    entries a row keeps (`H x budget`), floor `[B]` the fewest each head keeps. `owner` `[B, L]`,
    when given: the one head whose entry each slot can hold (`valid` is False for every other head).
    """
    if scores.dtype == torch.float64 and not torch.equal(scores.float().double(), scores):
        return _allocate_by_sorting(scores, pos, valid, total, floor)
    b, h, length = scores.shape
    held = valid.sum(dim=-1)  # [B, H]
    floors = torch.minimum(floor.view(b, 1), held)  # [B, H] what each head is sure to keep
    excess = (held.sum(dim=-1) - total).clamp(min=0)  # [B] entries a row must give up
    if int(excess.max()) <= h:  # a decode step: the row's few worst, if they leave every head its floor
        worst = _row_worst(scores, pos, valid, excess, owner)
        if not bool((held - worst.sum(dim=-1) < floors).any()):
            return valid & ~worst
    keys = order_keys(scores, pos).masked_fill(~valid, _LOWEST)  # pads' positions do not matter
    if bool((floors > 0).any()):
        guaranteed = valid & _at_least_kth(keys, floors, largest=True)
    else:
        guaranteed = torch.zeros_like(valid)
    # the rest of the allowance: the best remaining entries of the row, all heads together
    candidate = (valid & ~guaranteed).view(b, h * length)
    flat = keys.view(b, h * length)
    left = (total - guaranteed.sum(dim=(1, 2))).clamp(min=0)  # [B]
    count = candidate.sum(dim=-1)
    dropped = (count - left).clamp(min=0)  # [B]
    if int(dropped.max()) <= int(left.max()):  # few to drop (a decode step): find the worst
        worst = _at_least_kth(flat.masked_fill(~candidate, _HIGHEST), dropped, largest=False)
        chosen = candidate & ~worst
    else:
        chosen = candidate & _at_least_kth(flat.masked_fill(~candidate, _LOWEST), left, largest=True)
    return guaranteed | chosen.view(b, h, length)


def _row_worst(scores: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, excess: torch.Tensor,
               owner: torch.Tensor | None) -> torch.Tensor:
    """`[B, H, L]` bool: each row's `excess` `[B]` worst entries over all its heads. Over every head's
    view of every slot, or, given `owner` `[B, L]`, over the slots, each scored by its owner alone."""
    b, h, length = scores.shape
    if owner is None:
        keys = order_keys(scores, pos).view(b, h * length).masked_fill(~valid.view(b, -1), _HIGHEST)
        return _at_least_kth(keys, excess, False).view(b, h, length)
    mine = owner[:, None]  # [B, 1, L]
    held = valid.any(dim=1)  # [B, L]
    keys = order_keys(scores.gather(1, mine)[:, 0], pos.gather(1, mine)[:, 0], owner, h)
    worst = _at_least_kth(keys.masked_fill(~held, _HIGHEST), excess, False)  # [B, L]
    return valid & worst[:, None]


def _allocate_by_sorting(
    scores: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, total: int, floor: torch.Tensor
) -> torch.Tensor:
    """`allocate` by stable sorts, for scores finer than float32 (several policies' scores
    merged into float64, paged scores), which `order_keys` could not tell apart."""
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
