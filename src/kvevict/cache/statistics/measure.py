"""Attention statistics: what a layer's policies asked for, measured once, handed back.

Before attention runs, each policy says what it needs (`AttentionRequest`): the
attention of this forward's queries ("new", H2O), of its last query only ("last",
TOVA: on a decode step the same measurement as "new") or of the last `size` queries
even from earlier forwards ("window", SnapKV); or the queries themselves before the rotary
embedding ("queries", Expected Attention: `query_batch`). After attention, `feed` measures it and lets
each policy fold it into its per-slot statistic. The attention of the new queries is
measured once for every row that wants it, not once per policy: H2O and sink4+H2O in
one batch share it. A decode step whose policies all want it gets the probabilities
attention already computed (`probs`), so nothing is computed twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ...attention_stats import Workspace, query_probs
from ...errors import KvevictError
from ...policies import AttentionRequest, Policy, QueryBatch, SlotView
from ..positions.rotary import Rotary
from ..rows import RowLayout
from ..step import stages as step
from ..storage.slots import SlotStorage
from .probabilities import attention_mass
from .query_window import QueryWindow


class PositionView(Protocol):
    """What the statistics read of the layer's position mode (`modes.PositionMode`): its rotary module, the
    sequence length a forward sees, and how queries move to the positions they would hold now. Typed by what is
    used, so that the statistics need not import the modes, which import the replay that measures them."""

    rotary: Rotary

    def seq_length(self, n: int, seen: int) -> int: ...

    def move(self, x: torch.Tensor, used: torch.Tensor, target: torch.Tensor) -> torch.Tensor: ...

    def now(self, stream: torch.Tensor, seen: int, total: int) -> torch.Tensor: ...

#: what a policy may ask for (`AttentionRequest.kind`)
REQUEST_KINDS = ("new", "last", "window", "queries", "reconstruction")


def measure(
    request: AttentionRequest,
    new: Callable[[], torch.Tensor],
    window: Callable[[int], torch.Tensor],
    last: Callable[[], torch.Tensor] | None = None,
    queries: Callable[[int], QueryBatch] | None = None,
    reconstruction: Callable[[int], torch.Tensor | None] | None = None,
) -> torch.Tensor | QueryBatch | None:
    """The attention mass `request` asked for, from the measurement of its kind: the one place a
    request's kind is read (`feed`, the chunk replay and the ragged layer all come here).

    `new`: every query of the forward; `last`: its last query (defaults to `new`: one query
    in flight); `window(size)`: the last `size` queries across forwards; `queries(size)`: the
    pre-rotary queries (`Statistics.query_batch`); `reconstruction(sinks)`: a KVzip repeat forward's
    window attention (`per_head/reconstruction.py`, the ragged layer alone measures it; None outside a
    repeat forward). A kind no measurement exists for is a policy bug,
    refused rather than read as another kind.
    """
    if request.kind == "new":
        return new()
    if request.kind == "last":
        return (last or new)()
    if request.kind == "window":
        return window(request.size)
    if request.kind == "queries" and queries is not None:
        return queries(request.size)
    if request.kind == "reconstruction" and reconstruction is not None:
        return reconstruction(request.size)  # None outside a repeat forward: nothing to absorb
    if request.kind == "queries":
        raise KvevictError(
            "a policy that reads the queries themselves (expected-attention) cannot run in a chunk replayed token "
            "by token: evaluate it with one-token steps (--chunk 1) or compress a prompt"
        )
    raise KvevictError(
        f"a policy asked for attention of kind {request.kind!r}: AttentionRequest.kind must be one of "
        f"{', '.join(REQUEST_KINDS)}"
    )


class Statistics:
    """One layer's pending requests and its window of recent queries, measured within the layer's
    `workspace` (`LayerSettings.workspace`; None: the default bound)."""

    def __init__(self, query_window: int, workspace: Workspace | None = None) -> None:
        self.window_size = query_window
        self.workspace = workspace
        self.recent = QueryWindow(query_window)
        self.views: list[SlotView] | None = None
        self.requests: list[AttentionRequest | None] | None = None
        # the last forward's queries `[B, H_q, m, D]`, the positions they were rotated at `[m]` and
        # the tokens seen after it, for a "queries" request (`query_batch`)
        self.last_forward: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def reset(self) -> None:
        self.recent = QueryWindow(self.window_size)
        self.views = self.requests = None
        self.last_forward = None

    def plan(self, views: list[SlotView], layout: RowLayout, will_evict: bool) -> bool:
        """Ask each row group's policy what it needs; True if every row wants this forward's attention."""
        self.views = views
        self.requests = [group.policy.request(view, will_evict) for group, view in zip(layout.groups, views)]
        return all(r is not None and r.kind in ("new", "last") for r in self.requests)

    def skip(self) -> None:
        """Drop what `plan` asked for, unmeasured: the forward's eviction took a path that measures nothing
        (`step/paths.py`'s ring, whose policies ask for nothing), so no view is held past the forward."""
        self.views = self.requests = None

    def remember(self, query: torch.Tensor, used: torch.Tensor, seen: int) -> None:
        self.last_forward = (query, used, seen)
        if self.window_size:
            self.recent.remember(query, used, seen)

    def query_batch(
        self, mode: PositionView, size: int, next_position: int, take: Callable[[torch.Tensor], torch.Tensor]
    ) -> QueryBatch:
        # `next_position` is where the next query sits if nothing were evicted (`seq_length` of what is held):
        # the keys are scored as they sit now, and the score must not depend on the budget the entries are
        # later cut to (a held-back eviction, `EvictingCache.defer`, cuts at any budget)
        """A "queries" request's measurement: the last forward's queries when it brought at least
        `size` (a prompt: all of them), else the last `size` remembered; un-rotated with the model's
        rotary module from the positions attention rotated them at, so they are what the model
        projected (after a query norm, Gemma 3's), as kvpress's `get_prerope_query_states` gives them
        (NVIDIA/kvpress, `kvpress/utils.py`). `take` keeps the requesting rows."""
        if self.last_forward is None:
            raise KvevictError("a policy asked for the queries before any forward remembered them (a cache bug)")
        query, used, seen = self.last_forward
        stream = torch.arange(seen - query.shape[2], seen, device=query.device)
        if query.shape[2] < size and self.window_size:
            query, used, stream = self.recent.last(size, seen)
        rotary = mode.rotary
        raw = rotary.unrotate(take(query).float(), *(t.float() for t in rotary.at(used)))
        return QueryBatch(raw, stream, rotary.at, next_position)

    def feed(
        self,
        layout: RowLayout,
        storage: SlotStorage,
        mode: PositionView,
        query: torch.Tensor,
        scaling: float,
        seen: int,
        new: int,
        total: int,
        probs: torch.Tensor | None,
    ) -> list[SlotView]:
        """Measure what was asked and update the statistics; returns the views (fresh stats).

        query `[B, H_q, new, D]` as attention used it; probs `[B, H_kv, group, total]`
        when attention kept a decode query's probabilities.
        """
        views, requests = self.views, self.requests
        self.views = self.requests = None
        try:
            return self._feed(views, requests, layout, storage, mode, query, scaling, seen, new, total, probs)
        finally:
            self.last_forward = None  # served: a prefill's queries are not held past their forward

    def _feed(self, views, requests, layout, storage, mode, query, scaling, seen, new, total, probs) -> list[SlotView]:
        if all(r is None for r in requests):
            return views
        if probs is not None and len(requests) == 1:
            self._feed_decode(layout, storage, probs, views[0], requests[0])
            return views
        shared = self._shared_new(requests, layout, storage, query, scaling, seen, new, total, probs)

        def measured(i: int, request: AttentionRequest) -> torch.Tensor | QueryBatch:
            group, view = layout.groups[i], views[i]

            def keys() -> torch.Tensor:
                return group.take(storage.keys[:, :, :total])

            def last_of_many() -> torch.Tensor:  # the last query of a prefill, every key
                last = torch.tensor([seen - 1], device=query.device)
                return attention_mass(group.take(query[:, :, -1:]), last, keys(), view.positions, scaling,
                                      self.workspace)

            def window(size: int) -> torch.Tensor:
                queries, q_pos = self.window_queries(mode, size, seen, total)
                return attention_mass(group.take(queries), q_pos, keys(), view.positions, scaling, self.workspace)

            def queries(size: int) -> QueryBatch:
                return self.query_batch(mode, size, mode.seq_length(total, seen), group.take)

            # "new" (and "last" when one query is in flight) was measured once for every row that asked
            return measure(request, new=lambda: shared[i], last=(lambda: shared[i]) if i in shared else last_of_many,
                           window=window, queries=queries)

        def write(i: int, request: AttentionRequest, updated: torch.Tensor) -> torch.Tensor:
            stat = storage.stats[request.stat]
            updated = updated.to(stat.dtype)
            layout.groups[i].put(stat[:, :, :total], updated)
            return updated

        step.absorb(layout.groups, views, requests, measured, write)
        return views

    def _shared_new(self, requests, layout, storage, query, scaling, seen, new, total,
                    probs) -> dict[int, torch.Tensor]:
        """The attention of this forward's queries `[b_g, H_kv, total]` for each group `i` whose request reads it
        ("new"; "last" too when one query is in flight), measured once for all of them (from `probs` where
        attention kept a decode query's)."""
        shared_kinds = ("new", "last") if new == 1 else ("new",)
        asking = [i for i, r in enumerate(requests) if r is not None and r.kind in shared_kinds]
        if not asking:
            return {}
        subset, parts = layout.shared_rows(tuple(asking))
        if probs is not None:
            mass = subset.take(probs.sum(dim=2))
        else:
            keys = subset.take(storage.keys[:, :, :total])
            if new == 1:  # the newest token sees every key: no mask, no blocks
                mass = query_probs(subset.take(query), keys, scaling).sum(dim=2)
            else:
                q_pos = torch.arange(seen - new, seen, device=query.device)
                key_pos = subset.take(storage.pos[:, :, :total])
                mass = attention_mass(subset.take(query), q_pos, keys, key_pos, scaling, self.workspace)
        return {i: part.take(mass) for i, part in zip(asking, parts)}

    @staticmethod
    def _feed_decode(
        layout: RowLayout, storage: SlotStorage, probs: torch.Tensor, view: SlotView, request: AttentionRequest
    ) -> None:
        """`feed` for a decode step of one policy whose query's probabilities `[B, H_kv, group, n]`
        attention kept: the statistic is updated where it lies, in place (what `Policy.absorb`
        would return, written in one op instead of a new tensor and a copy)."""
        group = layout.groups[0]
        mass = probs.sum(dim=2)  # [B, H_kv, n]
        policy = group.policy
        stat = view.stats[request.stat]  # the storage's own slots: one group holds every row
        if type(policy).absorb is not Policy.absorb or stat.dtype != mass.dtype:
            updated = policy.absorb(view, request, mass).to(stat.dtype)
            stat.copy_(updated)
        elif request.accumulate:
            stat.add_(mass)
        else:
            stat.copy_(mass)

    def window_queries(self, mode: PositionView, size: int, seen: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The last `size` queries `[B, H_q, m, D]` (in any order), rotated to where their
        tokens sit now, and their stream positions `[m]`."""
        queries, used, stream = self.recent.last(size, seen)
        return mode.move(queries, used, mode.now(stream, seen, total)), stream
