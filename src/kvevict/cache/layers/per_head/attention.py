"""Attention of a ragged layer (`RaggedLayer`): every row and KV head at once, each query group over its own
head's entries, with the attention mass the policies absorb from the same probabilities.

SDPA wants one length for every head, so the kernel attends (`attention_stats.attend`): each query group
reads its row's whole buffer `[capacity, D]` as it lies (no gather, no copy) with a mask that shows it its
own head's held entries (`RaggedStorage.members`). Where every head owns an equal run of slots
(`RaggedStorage.segment`) a query group reads its own run alone, by a view, with no other head's entries to
mask. Where, besides, every head holds the same number of entries with no hole among them
(`RaggedStorage.dense`: a prefill, a held-back one, KVzip's repeat forwards over it) and no policy wants the
probabilities, the forward is plain causal attention over `[B, H_kv, held, D]`, and SDPA computes it
(`causal_sdpa`): at the Llama-3.1-8B attention shape a KVzip compression of 32K tokens took 311 s against 386 s
by hand (docs/benchmarks.md), the same kept sets as the reference (tests/test_kvzip.py), the outputs within
float32's rounding of attention by hand (tests/test_ragged_dense.py).
"""

from __future__ import annotations

import torch

from ....attention_stats import Mask, Workspace, attend
from ...statistics.probabilities import causal_sdpa
from .storage import RaggedStorage


def ragged_attention(
    storage: RaggedStorage, query: torch.Tensor, scaling: float, hidden: torch.Tensor, first: int, want_new: bool,
    want_last: bool, workspace: Workspace,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Attention of all rows and heads at once, each query group over its own head's entries.

    query `[B, H_q, m, D]` at positions `first ..`; the keys are the row buffers
    `[B, capacity, D]` as they are (no gather, no copy), read by every query head of the row, and a
    query sees the entries of its KV head (all but `hidden` `[B, H_kv, capacity]`) at positions up to
    its own, so the new tokens are causal. Where every head owns an equal run of slots
    (`RaggedStorage.segment`: a prefill, a held-back one and its repeat forwards, until heads hold
    different numbers), a query group reads its own head's run alone, a view `[B, H_kv, segment, D]`:
    the same probabilities without the `H_kv - 1` other heads' entries, which it would only mask; with
    no hole in any run and no mass asked for, SDPA attends (the module's docstring).
    Queries go in blocks so that a long prefill never holds more than the `workspace`'s logits.
    Returns the output `[B, H_q, m, D]`, and, when asked, the attention every entry got
    `[B, H_kv, capacity]` (float32, summed over the query group) from all `m` queries and from
    the last one.
    """
    b, _, m, d = query.shape
    heads, segment = storage.heads, storage.segment
    if segment is None:  # every query group reads its whole row: one key head for all
        keys, values, pos = storage.keys[:, None], storage.values[:, None], storage.pos[:, None]
    else:  # each KV head's lane is its own segment
        keys, values = (t.view(b, heads, segment, d) for t in (storage.keys, storage.values))
        if m > 1 and not (want_new or want_last) and (held := storage.dense()) is not None:
            # a plain cache `[B, H_kv, held, D]`, the new tokens its last: SDPA, its mask a block at a time
            return causal_sdpa(query, keys[:, :, :held], values[:, :, :held], scaling, workspace), None, None
        pos, hidden = storage.pos.view(b, heads, segment), storage.own_segments(hidden)
    # one new token sees every entry its head holds; more are causal among themselves
    mask = Mask(hidden, pos, torch.arange(first, first + m, device=query.device)) if m > 1 else Mask(hidden)
    done = attend(query, keys, scaling, workspace, mask, values=values, sums=want_new, last=want_last, heads=heads)
    new_mass, last_mass = done.sums, done.last
    if segment is not None:
        new_mass, last_mass = (None if t is None else storage.spread(t) for t in (new_mass, last_mass))
    return done.out, new_mass, last_mass
