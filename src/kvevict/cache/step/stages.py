"""The one eviction step: what every layer kind and every replay does between a forward's attention and the
entries it keeps, written once.

A step, wherever it runs (a uniform layer after a forward, `step/paths.py`; a chunk's step replayed token by
token, `stepping.Stepper` and `by_slot`; the per-head layer):

1. **views**: each row group's policy sees the held slots (`views.view_of`, the one view builder);
2. **requests**: each policy says what it needs (`Policy.request`);
3. **measure and absorb** (`absorb`): each request measured by its kind (`measure.measure`, the one
   place a kind is read) and folded into the policy's statistic (`Policy.absorb`), which the view then reads;
4. **score** (`scores`): every row's policy scores its view, merged into one `[B, H_kv, n]`;
5. **select** (`selection.keep_slots` for a compaction, `selection.victim` for one entry).

What differs between the places a step runs is only where the views' slots come from (held slots, a
replay's virtual slots, a ragged buffer's segments), how a measurement is taken there (the probabilities
attention kept, a chunk's logits, the query window) and where the absorbed statistic is stored back: those
are the arguments here, not copies of the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...policies import AttentionRequest, QueryBatch, SlotView
from ..rows import RowGroup, RowLayout

#: the mass measured for the `i`-th row group's request (`measure.measure` with the place's measurements),
#: or None: nothing to absorb at this step (a reconstruction outside a repeat forward)
Measure = Callable[[int, AttentionRequest], "torch.Tensor | QueryBatch | None"]
#: store the `i`-th group's absorbed statistic `[b_g, H_kv, n]` (named `request.stat`) where its place keeps it;
#: returns what the group's view reads from now on
Write = Callable[[int, AttentionRequest, torch.Tensor], torch.Tensor]


def absorb(
    groups: Sequence[RowGroup],
    views: Sequence[SlotView],
    requests: Sequence[AttentionRequest | None],
    measured: Measure,
    write: Write,
) -> None:
    """Stage 3 for every row group that asked: measure its request, let its policy absorb the mass into its
    statistic, store that (`write`) and hand it to the group's view, so its scores read this step's statistic."""
    for i, (group, view, request) in enumerate(zip(groups, views, requests)):
        if request is None:
            continue
        mass = measured(i, request)
        if mass is None:
            continue
        view.stats[request.stat] = write(i, request, group.policy.absorb(view, request, mass))


def scores(
    layout: RowLayout,
    views: Sequence[SlotView | None],
    batch: int,
    heads: int,
    total: int,
    fixed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage 4: `[B, H_kv, total]` every row's scores of the `total` slots its view shows (higher keeps).

    `views[i]` is the `i`-th group's view, or None where its rows' scores are in `fixed` already (a replay's
    static rows, scored once per chunk). `fixed` `[B, H_kv, total]`, a tensor the caller owns, is written
    over in place by the scored groups and returned."""
    if fixed is None:
        parts = [None if view is None else group.policy.scores(view) for group, view in zip(layout.groups, views)]
        return layout.merge(parts, batch, heads, total)
    for group, view in zip(layout.groups, views):
        if view is not None:
            group.put(fixed, group.policy.scores(view))
    return fixed
