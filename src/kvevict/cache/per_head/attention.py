"""Attention of a ragged layer (`RaggedLayer`): every row and KV head at once, each query group over its own
head's entries, with the attention mass the policies absorb from the same probabilities.

SDPA wants one length for every head, so this is by hand: each query group reads its row's whole buffer
`[capacity, D]` as it lies (no gather, no copy) with a mask that shows it its own head's held entries
(`RaggedStorage.members`). Where every head owns an equal run of slots (`RaggedStorage.segment`: a prefill, a
held-back one, KVzip's repeat forwards) a query group reads its own run alone, by a view, with no other head's
entries to mask.
"""

from __future__ import annotations

import torch

from ..probabilities import BLOCK_ELEMENTS
from .storage import RaggedStorage


def ragged_attention(
    storage: RaggedStorage, query: torch.Tensor, scaling: float, hidden: torch.Tensor, first: int, want_new: bool,
    want_last: bool, block_elements: int = BLOCK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Attention of all rows and heads at once, each query group over its own head's entries.

    query `[B, H_q, m, D]` at positions `first ..`; the keys are the row buffers
    `[B, capacity, D]` as they are (no gather, no copy), and a query sees the entries
    of its KV head (all but `hidden` `[B, H_kv, capacity]`) at positions up to its own, so the
    new tokens are causal. Where every head owns an equal run of slots (`RaggedStorage.segment`:
    a prefill, a held-back one and its repeat forwards, until heads hold different numbers), a
    query group reads its own head's run alone, a view `[B x H_kv, segment, D]`: the same
    probabilities without the `H_kv - 1` other heads' entries, which it would only mask.
    Queries go in blocks so that a long prefill never holds more than `block_elements` logits.
    Returns the output `[B, H_q, m, D]`, and, when asked, the attention every entry got
    `[B, H_kv, capacity]` (float32, summed over the query group) from all `m` queries and from
    the last one.
    """
    b, hq, m, d = query.shape
    heads, segment = storage.heads, storage.segment
    group = hq // heads
    if segment is None:  # every query group reads its whole row
        lanes, width = b, storage.capacity
        keys, values = storage.keys, storage.values
        pos, hidden = storage.pos[:, None], hidden
    else:  # each KV head's lane is its own segment
        lanes, width = b * heads, segment
        keys, values = (t.view(lanes, segment, d) for t in (storage.keys, storage.values))
        pos, hidden = storage.pos.view(b, heads, segment), storage.own_segments(hidden)
    pos, hidden = pos[:, :, None, None, :], hidden[:, :, None, None, :]  # [B, H_kv or 1, 1, 1, width]
    block = max(1, block_elements // max(1, b * hq * width))
    new_mass = torch.zeros(b, heads, width, device=query.device) if want_new and m > block else None
    outs, probs = [], None
    for a in range(0, m, block):
        q_blk = query[:, :, a : a + block]
        mb = q_blk.shape[2]
        logits = torch.bmm(q_blk.reshape(lanes, -1, d), keys.transpose(1, 2)).float().mul_(scaling)
        logits = logits.view(b, heads, group, mb, width)
        if m > 1:  # the new token at `first + i` sees the entries up to itself
            at = torch.arange(first + a, first + a + mb, device=query.device)
            logits.masked_fill_(hidden | (pos > at[:, None]), float("-inf"))
        else:
            logits.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out = torch.bmm(probs.view(lanes, -1, width).to(values.dtype), values)
        outs.append(out.view(b, hq, mb, d))
        if new_mass is not None:
            new_mass += probs.sum(dim=(2, 3))
    if want_new and new_mass is None:  # one block: no running sum
        new_mass = probs.sum(dim=(2, 3))
    last_mass = probs[:, :, :, -1].sum(dim=2) if want_last else None
    if segment is not None:
        new_mass, last_mass = (None if t is None else storage.spread(t) for t in (new_mass, last_mass))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out, new_mass, last_mass
