"""Stepping through a chunk's queries as token-by-token feeding would: the parts every stepping
algorithm shares.

A forward of many tokens that evicts inside it (`replay/chunk.py`; the position-shift mode's own
stepping in `positions/modes.py`) keeps a *virtual* slot layout, `vslot` `[B, H, budget + 1]`
(storage slot of each slot a token-by-token run would use), so policies see the same views,
random draws land on the same slots, and the final gather leaves the storage exactly as
token-by-token feeding would have. `Stepper` holds it, with the step's statistics and
eviction; the algorithms differ only in how a step attends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...attention_stats import Workspace
from ...policies import AttentionRequest, QueryBatch, SlotView
from ..observers import Observer
from ..rows import RowGroup, RowLayout
from ..statistics.measure import PositionView, Statistics, measure
from ..statistics.probabilities import attention_mass
from ..step import selection
from ..step import stages as step
from ..step.views import view_of
from ..storage.slots import SlotStorage


@dataclass(frozen=True)
class Replayed:
    """What a replayed chunk leaves: its attention output `[B, H_q, q, D]`, the entries the layer holds after
    it (`held`, the layer's new `n`) and whether its slots are in positional order (`ordered`). A replay
    returns it and the layer takes it; no replay writes the layer's state from outside."""

    out: torch.Tensor
    held: int
    ordered: bool


class ReplayMode(PositionView, Protocol):
    """What a replay calls on the layer's position mode (`modes.PositionMode`). Typed by what is used, so
    that stepping need not import the modes, which step through it. `plan` is a `chunk.StaticPlan`."""

    def compact(self, storage: SlotStorage, keep: torch.Tensor, count: int) -> None: ...

    def static_attention(self, layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float,
                         plan: Any) -> torch.Tensor | None: ...

    def replay_steps(self, layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor,
                     scaling: float) -> Replayed: ...


class ReplaySettings(Protocol):
    """What a replay reads of the layer's fixed settings (`settings.LayerSettings`)."""

    @property
    def mode(self) -> ReplayMode: ...

    @property
    def layout(self) -> RowLayout: ...

    @property
    def observers(self) -> tuple[Observer, ...]: ...

    @property
    def workspace(self) -> Workspace | None: ...


class ReplayForward(Protocol):
    """What a replay reads of the forward in flight (`settings.Forward`): the plan the layer before
    left for the same chunk (a `chunk.StaticPlan`), or None."""

    @property
    def static_plan(self) -> Any: ...


class ReplayingLayer(Protocol):
    """What a replay reads and sets on the layer it runs in (an `EvictingLayer`)."""

    index: int
    n: int
    seen: int
    new: int
    ordered: bool
    batch_size: int
    heads: int
    device: torch.device
    budget: int | None
    storage: SlotStorage
    settings: ReplaySettings
    forward: ReplayForward
    statistics: Statistics

    def report_eviction(self, seen: int, kept: torch.Tensor | None, victims: torch.Tensor | None) -> None: ...

    def report_evictions(self, seen: torch.Tensor, victims: torch.Tensor) -> None: ...

    def window_size(self) -> int | None: ...

    def state_of(self, policy) -> object | None: ...


class Stepper:
    """What both stepping algorithms share: the virtual slots, the policies' statistics at each
    step, and the step's eviction. The algorithms differ only in how a step attends."""

    def __init__(self, layer: ReplayingLayer, scaling: float) -> None:
        self.layer, self.scaling = layer, scaling
        storage, groups = layer.storage, layer.settings.layout.groups
        n0, q = layer.n, layer.new
        self.first_seen = layer.seen - q
        self.vslot = torch.empty(layer.batch_size, layer.heads, layer.budget + 1, dtype=torch.long, device=layer.device)
        self.vslot[:, :, :n0] = torch.arange(n0, device=layer.device)
        self.k = n0  # entries a token-by-token run holds before the step
        self.evicted = False
        # Rows of static policies need no statistics and no calls per step: their scores
        # over every slot of the chunk are computed once and read through the virtual slots.
        self.stepping = [g for g in groups if not g.policy.static_scores]
        self.fixed = None
        if len(self.stepping) < len(groups):
            total = n0 + q
            self.fixed = static_scores(layer, storage.pos[:, :, :total], self.first_seen + q, total, static_only=True)
        self.wants_probs = any(g.policy.needs_attention for g in self.stepping)

    def begin(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Step `i` arrives: its token takes the next virtual slot. Returns the slots alive `[B, H, total]`,
        their positions, and the tokens seen after the step."""
        layer = self.layer
        self.vslot[:, :, self.k] = layer.n + i
        slots = self.vslot[:, :, : self.k + 1]
        return slots, layer.storage.pos.gather(-1, slots), self.first_seen + i + 1

    def end(
        self,
        slots: torch.Tensor,
        positions: torch.Tensor,
        seen: int,
        keys: torch.Tensor | None,
        probs: torch.Tensor | None,
        query: torch.Tensor,
        query_positions: torch.Tensor,
    ) -> torch.Tensor | None:
        """The policies' statistics of the step, then its eviction. keys `[B, H, total, D]` as the step
        sees them (None: the stored ones), probs `[B, H, g, total]` the step query's attention.
        Returns the victim slot index `[B, H]` (into `slots`) when the step evicts one entry, else None:
        a step that evicts several (the rows' schedule, `Policy.evict_to`: an engine's burst, whole
        pages) compacts the virtual slots in positional order here, as a compaction does."""
        layer, storage, budget = self.layer, self.layer.storage, self.layer.budget
        total = slots.shape[-1]
        layer.statistics.remember(query, query_positions, seen)
        target = layer.settings.layout.evict_to(budget, total)
        will_evict = target is not None
        groups = layer.settings.layout.groups  # a static row's scores are `fixed`: no view, no request
        views = [None if g.policy.static_scores else step_view(layer, g, positions, slots, seen, budget, storage, keys)
                 for g in groups]
        requests = [None if view is None else g.policy.request(view, will_evict) for g, view in zip(groups, views)]

        def measured(i: int, request: AttentionRequest) -> torch.Tensor | QueryBatch:
            g, view = groups[i], views[i]
            return measure(
                request,
                new=lambda: g.take(probs.sum(dim=2)),  # one query per step: its attention is "new" and "last"
                window=lambda size: window_mass(layer, g, view, size, seen, total, self.scaling),
                queries=lambda size: layer.statistics.query_batch(  # the step's query remembered above
                    layer.settings.mode, size, layer.settings.mode.seq_length(total, seen), g.take
                ),
            )

        def write(i: int, request: AttentionRequest, updated: torch.Tensor) -> torch.Tensor:
            g, stat = groups[i], storage.stats[request.stat]
            updated = updated.to(stat.dtype)
            g.put(stat, g.take(stat).scatter(-1, g.take(slots), updated))
            return updated

        step.absorb(groups, views, requests, measured, write)
        layer.statistics.last_forward = None  # served: the step's query is not held past it
        if not will_evict:
            self.k += 1
            return None
        self.evicted = True
        b, hkv = slots.shape[:2]
        scores = step.scores(layer.settings.layout, views, b, hkv, total,
                             None if self.fixed is None else self.fixed.gather(-1, slots))
        self.k = target
        if target < total - 1:
            keep = selection.keep_slots(scores, positions, target, ordered=False)
            self.vslot[:, :, :target] = slots.gather(-1, keep)
            layer.report_eviction(seen, positions.gather(-1, keep), None)
            return None
        victim = selection.victim(scores, positions, ordered=False)
        layer.report_eviction(seen, None, positions.gather(-1, victim[..., None])[..., 0])
        return victim


def step_view(
    layer: ReplayingLayer,
    group: RowGroup,
    positions: torch.Tensor,
    slots: torch.Tensor,
    seen: int,
    budget: int,
    storage,
    keys: torch.Tensor | None,
) -> SlotView:
    """What `group`'s policy sees at one step: the virtual slots, in token-by-token order."""
    if keys is None:
        def keys_now() -> torch.Tensor:
            return group.take(take_slots(storage.keys, slots))
    else:
        def keys_now() -> torch.Tensor:
            return group.take(keys)
    return view_of(
        layer, group, group.take(positions), seen, budget,
        stats={name: group.take(storage.stats[name]).gather(-1, group.take(slots)) for name in group.policy.stats},
        keys=keys_now,
        values=lambda: group.take(take_slots(storage.values, slots)),
    )


def take_slots(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`buffer` `[B, H, capacity, D]` at `slots` `[B, H, m]` -> `[B, H, m, D]`."""
    return buffer.gather(2, slots[..., None].expand(-1, -1, -1, buffer.shape[-1]))


def window_mass(
    layer: ReplayingLayer, group: RowGroup, view: SlotView, size: int, seen: int, total: int, scaling: float
) -> torch.Tensor:
    """The last `size` queries, rotated to where their tokens sit now (`window_queries`: in original positions
    where they were rotated), over `view`'s keys. Both stepping algorithms and `by_slot.steps_by_slot` measure here."""
    queries, q_pos = layer.statistics.window_queries(layer.settings.mode, size, seen, total)
    return attention_mass(group.take(queries), q_pos, view.keys(), view.positions, scaling, layer.settings.workspace)


def remember_queries(statistics: Statistics, query: torch.Tensor, used: torch.Tensor, start: int, stop: int,
              first_seen: int) -> int:
    """Write the chunk's queries `start..stop-1` into the query window, in pieces no longer than the
    window (so each lands in the slot a one-query step would write). Returns `stop`."""
    size = statistics.window_size
    if size:
        for lo in range(start, stop, size):
            hi = min(lo + size, stop)
            statistics.remember(query[:, :, lo:hi], used[lo:hi], first_seen + hi)
    return stop


def static_scores(
    layer: ReplayingLayer, pos: torch.Tensor, seen: int, total: int, static_only: bool = False
) -> torch.Tensor:
    """Scores of every group's rows over all `total` slots (static policies: the position or
    the key of a token decides its score).

    `static_only`: score the static groups only; the other rows hold zeros.
    """
    views = [
        None if static_only and not group.policy.static_scores
        else view_of(
            layer, group, group.take(pos), seen, layer.budget,
            keys=lambda group=group: group.take(layer.storage.keys[:, :, :total]),  # `knorm`: fixed per key
        )
        for group in layer.settings.layout.groups
    ]
    return step.scores(layer.settings.layout, views, layer.batch_size, layer.heads, total)
