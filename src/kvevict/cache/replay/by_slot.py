"""Stepping a chunk over all its slots at once: the replay for static and slot-local policies.

A slot-local policy (`Policy.slot_local`) scores a slot from that slot alone, so scoring every
slot of the chunk (`[B, H, n0 + q]`, the not-yet-arrived and the evicted masked `+inf`) picks the
victim a token-by-token step picks from its `budget + 1` entries; in position order `argmin`
takes the earliest of equal minima, the cache's tie rule, with no second pass. A step costs a
softmax of one query over the chunk's logits (for rows that ask for "new" attention), the
policies' scores and one argmin for every row together; a "window" request (SnapKV's
re-selection, every `interval` tokens) is measured and absorbed on the exact alive slots, as a
decode step would. The chunk ends with one masked SDPA and one compaction, in positional order.

Original positions only (a stored key keeps its rotation): a fast path of the replay (`replay_paths.PATHS`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...attention_stats import QueryRows, products, softmax
from ...policies import AttentionRequest, SlotView
from ..rows import RowGroup
from ..statistics.measure import measure
from ..statistics.probabilities import bound
from ..step import stages as step
from ..step.views import view_of
from .stepping import Replayed, ReplayingLayer, remember_queries, static_scores, take_slots, window_mass


def applies(layer: ReplayingLayer) -> bool:
    """Whether this chunk can be stepped by slot: every row's policy is static or slot-local, and
    each step that evicts evicts exactly one entry."""
    layout = layer.settings.layout
    if not all(g.policy.static_scores or g.policy.slot_local for g in layout.groups):
        return False
    k = layer.n
    for _ in range(layer.new):
        target = layout.evict_to(layer.budget, k + 1)
        if target is not None and target != k:
            return False
        k = k + 1 if target is None else target
    return True


def steps_by_slot(layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> Replayed:
    """Replay the chunk's `q` steps (module docstring) and return its attention output `[B, H_q, q, D]` with
    the layer's new state; the storage ends as token-by-token feeding leaves it."""
    run = _Chunk(layer, query, used, scaling)
    layout, budget = layer.settings.layout, layer.budget
    for i in range(layer.new):
        seen = run.arrive(i)
        target = layout.evict_to(budget, run.k + 1)
        run.absorb(i, seen, target is not None)
        if target is None:
            run.k += 1
        else:
            run.evict(i, seen)
            run.k = target
    return run.finish()


class _Chunk:
    """One chunk's stepping state, in position order: `order` `[B, H, total]` (storage slot of each
    position-order index: the held slots sorted by position, then the chunk's), the positions and
    statistics in that order, `gone` (not alive: yet to arrive, or evicted) and, with a query
    window (SnapKV), the slot layout a token-by-token run would use (`vslot`, `where`)."""

    def __init__(self, layer: ReplayingLayer, query: torch.Tensor, used: torch.Tensor, scaling: float) -> None:
        storage = layer.storage
        self.layer, self.query, self.used, self.scaling = layer, query, used, scaling
        n0, q = layer.n, layer.new
        self.n0, self.total, self.k = n0, n0 + q, n0
        b = query.shape[0]
        hkv = layer.heads
        device = layer.device
        self.first_seen = layer.seen - q
        held_order = storage.pos[:, :, :n0].argsort(dim=-1)
        self.order = torch.cat([held_order, torch.arange(n0, self.total, device=device).expand(b, hkv, q)], dim=-1)
        self.positions = storage.pos[:, :, :self.total].gather(-1, self.order)  # [B, H, total], increasing
        self.stats = {name: stat[:, :, :self.total].gather(-1, self.order) for name, stat in storage.stats.items()}
        self._keys: torch.Tensor | None = None  # [B, H, total, D] in position order, made on first use
        groups = layer.settings.layout.groups
        self.stepping = [g for g in groups if not g.policy.static_scores]
        self.fixed = None  # [B, H, total] the static rows' scores, in position order
        if len(self.stepping) < len(groups):
            fixed = static_scores(layer, storage.pos[:, :, :self.total], self.first_seen + q, self.total,
                                  static_only=True)
            self.fixed = fixed.gather(-1, self.order)
        # group -> its rows' logits `[b_g, H, g, total]` one query at a time, a block of queries at a time, on first use
        self.logits: dict[int, QueryRows] = {}
        self.gone = torch.zeros(b, hkv, self.total, dtype=torch.bool, device=device)
        self.gone[:, :, n0:] = True
        self.remembered = 0
        self.victims: list[torch.Tensor] = []
        self.evicting: list[int] = []
        # With a query window, the slots a token-by-token run would use are kept too (the newest fills
        # the victim's place, as a decode step does), so a re-selection measures and pools the same keys
        # in the same order as that run, and the chunk ends in that layout.
        self.layered = bool(layer.statistics.window_size)
        if self.layered:
            span = torch.arange(self.total, device=device).expand(b, hkv, -1)
            self.vslot = torch.empty(b, hkv, layer.budget + 1, dtype=torch.long, device=device)
            self.vslot[:, :, :n0] = torch.empty_like(self.order).scatter_(-1, self.order, span)[:, :, :n0]
            self.where = torch.empty(b, hkv, self.total, dtype=torch.long, device=device)  # slot of each index
            self.where.scatter_(-1, self.vslot[:, :, :n0], torch.arange(n0, device=device).expand(b, hkv, -1))

    def sorted_keys(self) -> torch.Tensor:
        if self._keys is None:
            self._keys = take_slots(self.layer.storage.keys, self.order)
        return self._keys

    def view(self, group: RowGroup, seen: int, alive: torch.Tensor | None = None) -> SlotView:
        """`group`'s view of every slot of the chunk (slot-local scoring), or of its alive slots
        `alive` `[b_g, H, k]` (indices in position order)."""
        layer = self.layer
        pick = (lambda x: x) if alive is None else (lambda x: x.gather(-1, alive))
        keys = (lambda: group.take(self.sorted_keys())) if alive is None else (
            lambda: take_slots(group.take(self.sorted_keys()), alive))
        return view_of(
            layer, group, pick(group.take(self.positions)), seen, layer.budget,
            stats={name: pick(group.take(self.stats[name])) for name in group.policy.stats}, keys=keys,
        )

    def new_mass(self, index: int, group: RowGroup, i: int) -> torch.Tensor:
        """Query `i`'s attention `[b_g, H, total]` over the alive slots (summed over its group)."""
        if index not in self.logits:
            query, keys = group.take(self.query), group.take(self.sorted_keys())
            self.logits[index] = QueryRows(
                lambda start, stop: products(query[:, :, start:stop], keys), self.layer.new,
                query.shape[0] * query.shape[1] * self.total, self.scaling, bound(self.layer.settings.workspace),
            )
        alive_probs = softmax(self.logits[index].row(i).clone(), group.take(self.gone)[:, :, None])
        return alive_probs.sum(dim=2)  # one query: its attention is "new" and "last"

    def arrive(self, i: int) -> int:
        """Token `i` of the chunk arrives in slot `k`; returns the tokens seen after it."""
        self.gone[:, :, self.n0 + i] = False
        if self.layered:
            self.vslot[:, :, self.k] = self.n0 + i
            self.where[:, :, self.n0 + i] = self.k
        return self.first_seen + i + 1

    def absorb(self, i: int, seen: int, will_evict: bool) -> None:
        """Each stepping row's request at step `i`: measured and absorbed into its statistics (`step.absorb`)."""
        layer, groups = self.layer, self.layer.settings.layout.groups
        views = [None if g.policy.static_scores else self.view(g, seen) for g in groups]
        requests = [None if view is None else g.policy.request(view, will_evict) for g, view in zip(groups, views)]
        alive: dict[int, torch.Tensor] = {}  # group -> the alive slots a "window" request is measured on
        for index, request in enumerate(requests):
            if request is not None and request.kind == "window":
                self.remembered = remember_queries(layer.statistics, self.query, self.used, self.remembered,
                                                   i + 1, self.first_seen)
                alive[index] = groups[index].take(self.vslot[:, :, : self.k + 1])
                views[index] = self.view(groups[index], seen, alive[index])

        def measured(index: int, request: AttentionRequest) -> torch.Tensor:
            g, view = groups[index], views[index]
            return measure(request, new=lambda: self.new_mass(index, g, i),
                           window=lambda size: window_mass(layer, g, view, size, seen, self.k + 1, self.scaling))

        def write(index: int, request: AttentionRequest, updated: torch.Tensor) -> torch.Tensor:
            g, stat = groups[index], self.stats[request.stat]
            updated = updated.to(stat.dtype)
            g.put(stat, g.take(stat).scatter(-1, alive[index], updated) if index in alive else updated)
            return updated

        step.absorb(groups, views, requests, measured, write)

    def evict(self, i: int, seen: int) -> None:
        """Step `i` evicts one entry per row and head: the lowest score among the alive."""
        b, hkv, total = self.gone.shape
        layout = self.layer.settings.layout
        # scores of its own to mask, never a policy's tensor: the static rows' copied, or zeros
        own = (torch.zeros(b, hkv, total, dtype=torch.float64, device=self.layer.device) if self.fixed is None
               else self.fixed.clone())
        views = [None if g.policy.static_scores else self.view(g, seen) for g in layout.groups]
        scores = step.scores(layout, views, b, hkv, total, own)
        victim = scores.masked_fill_(self.gone, float("inf")).argmin(dim=-1)  # [B, H] earliest of the lowest
        self.gone.scatter_(-1, victim[..., None], True)
        if self.layered:  # the newest entry (slot k) moves into the victim's slot
            hole = self.where.gather(-1, victim[..., None])
            self.vslot.scatter_(-1, hole, self.vslot[:, :, self.k : self.k + 1].clone())  # a slice of itself
            self.where[:, :, self.n0 + i] = hole[..., 0]
        self.victims.append(victim)
        self.evicting.append(i)

    def finish(self) -> Replayed:
        """The chunk's attention (query `i` sees the slots that arrived by step `i` and were not
        evicted before it: one masked SDPA) and the storage compacted to the kept slots."""
        layer, storage, query = self.layer, self.layer.storage, self.query
        remember_queries(layer.statistics, query, self.used, self.remembered, layer.new, self.first_seen)
        b, hkv, total = self.gone.shape
        q, group_size, device = layer.new, query.shape[1] // hkv, layer.device
        arrive = (torch.arange(total, device=device) - self.n0).clamp(min=-1)
        leave = torch.full((b, hkv, total), q, dtype=torch.long, device=device)
        if self.victims:
            victim_slots = torch.stack(self.victims, dim=-1)  # [B, H, E] in position order
            steps = torch.tensor(self.evicting, device=device)
            leave.scatter_(-1, victim_slots, steps.expand(b, hkv, -1))
            if layer.settings.observers:
                layer.report_evictions(self.first_seen + 1 + steps, self.positions.gather(-1, victim_slots))
        step_ids = torch.arange(q, device=device)[:, None]
        alive = (arrive <= step_ids) & (step_ids <= leave[:, :, None, :])  # [B, H, q, total] in position order
        mask = torch.empty_like(alive).scatter_(-1, self.order[:, :, None, :].expand(-1, -1, q, -1), alive)
        if group_size > 1:
            mask = mask.repeat_interleave(group_size, dim=1)
        out = F.scaled_dot_product_attention(
            query, storage.keys[:, :, :total], storage.values[:, :, :total], attn_mask=mask, scale=self.scaling,
            enable_gqa=group_size > 1,
        )
        for name, stat in self.stats.items():
            storage.stats[name][:, :, :total].scatter_(-1, self.order, stat)
        if self.layered:  # storage slots in the token-by-token layout
            keep = self.order.gather(-1, self.vslot[:, :, : self.k])
        else:  # storage slots in positional order
            keep = self.order.gather(-1, (~self.gone).nonzero()[:, -1].view(b, hkv, self.k))
        layer.settings.mode.compact(storage, keep, self.k)
        return Replayed(out, self.k, not self.layered)
