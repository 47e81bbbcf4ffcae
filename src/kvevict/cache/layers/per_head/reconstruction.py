"""What KVzip measures in a repeat forward, and how it ranks every layer's entries together.

`window_mass`: the repeat forward's queries (already rotated, as attention used them) over a window
of the row buffer: per KV head, its held entries before `min(sinks, start)`, those of the chunk
`start .. end` being repeated, and the forward's own tokens (causally). Soft-maxed over that window
alone, not over the whole cache: kvpress's `KVzipPress._compute_cross_attention`
(NVIDIA/kvpress 0.5.5, `kvpress/presses/kvzip_press.py`) concatenates exactly those keys. Each chunk
entry's score is the largest probability over the forward's queries of its head's group.

`layer_totals`: kvpress's `compress_post` with `layerwise=False` ranks the scores of every layer and
head together and counts, per layer, how many of the model's best it holds; each layer then keeps
that many of its own best, jointly over its heads (`allocation.allocate`, no floor).

`by_position` / `fits` / `put_back`: a pass's scores by head and position, to be kept and put back after the same
context is read again at another budget, whose slots lie elsewhere (`RaggedStorage.rebase`).
"""

from __future__ import annotations

import torch

from ....attention_stats import Mask, Workspace, attend
from .allocation import order_keys
from .storage import RaggedStorage

_LOWEST = torch.iinfo(torch.long).min


def window_mass(query: torch.Tensor, keys: torch.Tensor, key_pos: torch.Tensor, members: torch.Tensor,
                first: int, chunk: tuple[int, int], sinks: int, scaling: float, workspace: Workspace) -> torch.Tensor:
    """`[B, H_kv, capacity]` float32: each chunk entry's largest window probability, NaN elsewhere.

    query `[B, H_q, m, D]` rotated at positions `first .. first + m - 1`; keys `[B, capacity, D]` the
    row buffers; key_pos `[B, capacity]` their positions (-1: a hole); members `[B, H_kv, capacity]`
    the entries each head holds. Each head's window is gathered out of the row buffer first
    (`[B, H_kv, W, D]`, padded to the widest head's), so a query group reads its own head's window
    only; the kernel takes the largest probability over the queries and the group
    (`attention_stats.attend(maxima=True)`), a block of queries within the `workspace` at a time.
    """
    b, _, m, d = query.shape
    heads = members.shape[1]
    start, end = chunk
    pos = key_pos[:, None, :]
    window = members & ((pos < min(sinks, start)) | ((pos >= start) & (pos < end)) | (pos >= first))
    counts = window.sum(dim=-1)  # [B, H_kv]
    width = max(1, int(counts.max()))
    cols = window.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :width]  # [B, H_kv, W]
    valid = torch.arange(width, device=query.device) < counts[..., None]
    flat = cols.reshape(b, heads * width)
    win_keys = keys.gather(1, flat[..., None].expand(-1, -1, d)).view(b, heads, width, d)
    win_pos = key_pos.gather(1, flat).view(b, heads, width)
    at = torch.arange(first, first + m, device=query.device)
    best = attend(query, win_keys, scaling, workspace, Mask(~valid, win_pos, at), maxima=True).maxima
    in_chunk = valid & (win_pos >= start) & (win_pos < end)
    out = torch.full(members.shape, float("nan"), device=query.device)
    return out.scatter_(-1, cols, best.masked_fill(~in_chunk, float("nan")))


def ranked_keys(scores: torch.Tensor, positions: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """`[B, H_kv x capacity]` int64 keys ordered as `allocate` orders one layer's entries (score, then the
    later token, then the lower head); entries not held get the lowest key."""
    keys = order_keys(scores, positions).masked_fill(~members, _LOWEST)
    return keys.reshape(keys.shape[0], -1)


def layer_totals(keys: list[torch.Tensor], total: int) -> list[torch.Tensor]:
    """Per layer, `[B]` how many of each row's `total` best entries of all layers (`keys`: per layer
    `ranked_keys`) it holds. Ties across layers at the cut go where `topk` puts them."""
    flat = torch.cat(keys, dim=1)  # [B, all entries]
    top = flat.topk(min(total, flat.shape[1]), dim=1)
    real = top.values != _LOWEST
    bounds = torch.tensor([k.shape[1] for k in keys], device=flat.device).cumsum(0)
    layer = torch.bucketize(top.indices, bounds, right=True)  # [B, total] the layer each best entry sits in
    return [((layer == i) & real).sum(dim=1) for i in range(len(keys))]


def _slot_index(storage: RaggedStorage, seen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[B, capacity]` each slot's place in a `[H_kv x seen]` head-by-position layout (0 for a hole), and
    which slots hold an entry."""
    live = storage.pos >= 0
    return (storage.owner * seen + storage.pos).masked_fill(~live, 0), live


def by_position(storage: RaggedStorage, name: str, seen: int) -> torch.Tensor:
    """`[B, H_kv, seen]` the statistic `name` of each head's entry at each position, from a state where every
    head still holds every token read (a held-back prefill); 0 where none is held."""
    index, live = _slot_index(storage, seen)
    out = torch.zeros(storage.batch, storage.heads * seen, device=storage.device)
    out.scatter_(1, index, storage.stats[name].masked_fill(~live, 0.0))
    return out.view(storage.batch, storage.heads, seen)


def fits(storage: RaggedStorage, scores: dict[str, torch.Tensor], seen: int) -> bool:
    """Whether `by_position`'s `scores` fit this state: the same shape, and every head holding every token."""
    shape = (storage.batch, storage.heads, seen)
    held_all = int(storage.held.min()) == seen and int(storage.held.max()) == seen
    return held_all and all(t.shape == shape for t in scores.values())


def put_back(storage: RaggedStorage, scores: dict[str, torch.Tensor], seen: int) -> None:
    """Write `by_position`'s `scores` into the slots of this state, where they `fit`."""
    index, live = _slot_index(storage, seen)
    for name, saved in scores.items():
        values = saved.to(storage.device).reshape(storage.batch, -1).gather(1, index)
        storage.stats[name] = torch.where(live, values, storage.stats[name])
