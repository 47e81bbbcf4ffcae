"""`view_of`: the one builder of what a row group's policy sees of a layer's slots (a `SlotView`).

Every place that asks policies for requests or scores builds its views here: a layer's held slots after a
forward (`EvictingLayer._view`), the virtual slots of a replayed step (`stepping.step_view`,
`stepping.static_scores`), a chunk's slots scored at once (`by_slot`), a per-head layer's padded heads
(`per_head.layer`). What differs between them is which slots the view shows, so the callers hand over the
group's positions, statistics, keys and values; what a view carries beside them (the layer's index, the
policy's state kept by the layer, whether its eviction is held back) is decided here once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...policies import SlotView
from ..rows import RowGroup


def view_of(
    layer,
    group: RowGroup,
    positions: torch.Tensor,
    seen: int,
    budget: int,
    stats: dict[str, torch.Tensor] | None = None,
    keys: Callable[[], torch.Tensor] | None = None,
    values: Callable[[], torch.Tensor] | None = None,
) -> SlotView:
    """`group`'s view in `layer` (any layer kind: it reads `index` and `state_of`): `positions` `[b, H_kv, n]`
    and `stats` `{name: [b, H_kv, n]}` already the group's rows, `keys` / `values` callables giving its
    `[b, H_kv, n, D]` on demand (a policy that never reads them costs nothing). `held_back`: the layer's
    eviction waits for a context read in several forwards (`EvictingCache.defer`)."""
    return SlotView(
        positions=positions, seen=seen, budget=budget, layer=layer.index, stats={} if stats is None else stats,
        keys=keys, values=values, state=layer.state_of(group.policy), held_back=layer.deferred,
    )
