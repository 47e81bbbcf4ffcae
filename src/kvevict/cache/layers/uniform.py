"""`EvictingLayer`: the uniform layer of an `EvictingCache`. A short coordinator over its parts.

Every row and KV head holds the same number of entries, in slots (`slots.SlotLayer`),
and the rows' policies pick what goes. Life of one forward:

1. `update` (`CacheLayer`) writes the new keys/values into the slots after the `n` kept
   ones (keys as the position mode wants them) and returns views of `[kept | new]`: no
   concatenation. It also leaves itself in the model's attention kwargs, which is how
   kvevict's attention function finds it (no global state).
2. The attention function calls `plan` (what do the policies need from this
   forward?), computes the output, then `finish` with the queries it used.
3. `finish` feeds the policies their statistics (`Statistics`) and, if more than the
   budget is held, evicts by the first of the layer's step paths that takes the step
   (`step/paths.py`, bound once per layer): the reference keeps the best-scoring entries
   (`selection`) gathered to the front in positional order; a decode step in
   original-position mode moves the newest slot into the victim's place instead (under a
   first-in-first-out policy the next slot of the ring, found without measuring or
   scoring). It then reports to the cache's observers what it holds and what it evicted.

A chunk that must evict token by token inside itself is `replay`ed instead (`replay/paths.py`: the
reference stepping and its registered fast paths).
A sliding-window layer whose engine bounds every layer (`Policy.bounds_every_layer`) is
this layer too, with its window's band masked (`window_mask`, `window_size`).

So between forwards every layer holds at most its budget, and during a forward the new
queries see the kept entries plus the tokens of that forward.
"""

from __future__ import annotations

import torch

from ...errors import KvevictError
from ...policies import Policy, SlotView
from ..replay.paths import replay_chunk
from ..rows import RowGroup
from ..statistics.measure import Statistics
from ..step import paths as step_paths
from ..step.paths import StepPath
from ..step.states import PolicyStates
from ..step.views import view_of
from ..storage.slots import SlotStorage
from .settings import LayerSettings
from .sliding import band
from .slots import SlotLayer

#: the per-slot statistic that holds `Policy.arrival` of each slot's key (`arrival_stat` policies)
ARRIVAL = "arrival"


class EvictingLayer(SlotLayer):
    """One layer's slots, its policies' statistics, and eviction down to its budget."""

    measures = frozenset({"new", "last", "window", "queries"})  # `Statistics.feed`

    def __init__(self, index: int, settings: LayerSettings) -> None:
        super().__init__(index, settings)
        self.statistics = Statistics(settings.query_window, settings.workspace)
        self.states = PolicyStates(index)
        # the row groups whose policy keeps a per-key number (`Policy.arrival_stat`), found at the first
        # `finish`; and whether every held slot's number is stored (see `_arrive`)
        self._arrival_groups: list[int] | None = None
        self._arrival_valid = False
        self.steps: tuple[StepPath, ...] = ()  # the step paths its evictions try, bound at its first forward

    def state_of(self, policy: Policy) -> object | None:
        """`policy`'s state in this layer (`Policy.new_state`), made on first use; handed to it as `SlotView.state`."""
        return self.states.of(policy)

    def _new_storage(self) -> SlotStorage:
        s = self.settings
        # the mode says whether a number a stored key alone decides stays true while the key is held
        arrival = s.mode.keeps_arrival(any(p.arrival_stat for p in s.layout.policies))
        storage = self._slot_storage((*s.stat_names, ARRIVAL) if arrival else s.stat_names)
        if arrival:  # `_arrive` writes it for every new slot before anything reads it
            storage.written_on_arrival = frozenset({ARRIVAL})
        return storage

    # --- transformers' layer API -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The storage, and the step paths (`step_paths.bind`): the rows are bound by now, and what the paths
        read of the layer never changes, so a step need not choose again."""
        super().lazy_initialization(key_states, value_states)
        self.steps = step_paths.bind(self)

    def reset(self) -> None:
        super().reset()
        self._arrival_valid = False
        self.statistics.reset()
        self.states.clear()

    # --- around attention ------------------------------------------------------------
    def window_mask(self, q: int) -> torch.Tensor | None:
        """None on a full-attention layer (every kept entry and the causal new tokens); on a sliding-window
        layer under an engine's schedule `[q, n + q]` bool, the band of its window (the held entries are in
        positional order there and may outnumber the window)."""
        return None if self.window is None else band(q, self.n + q, self.window, self.device)

    def window_size(self) -> int | None:
        """The band a replay must mask beyond the held entries (a sliding layer under an engine's
        schedule), or None: every held entry is visible."""
        return self.window

    def ring_start(self) -> int | None:
        """The ring's first slot: the rows' policies decide it (`LayerSettings.fifo_after`), None: no ring."""
        return self.settings.fifo_after

    def replays(self, q: int) -> bool:
        """Whether a forward of `q` tokens must replay token-by-token eviction inside itself (a schedule
        that does not evict at the end of the forward evicts at none of its steps: the count only grows)."""
        return self.settings.per_token and q > 1 and self._target(self.n + q) is not None

    def replay(self, query: torch.Tensor, kwargs: dict, scaling: float) -> torch.Tensor:
        """Attention and eviction of a chunk, exactly as `q` one-token forwards would do them.

        query `[B, H_q, q, D]` as the model rotated it. Returns the output `[B, H_q, q, D]`.
        """
        self.pending = False
        if query.shape[0] != self.batch_size:
            raise KvevictError(
                f"a chunk that evicts token by token must be fed for all {self.batch_size} rows: "
                f"its rows diverge inside it (input_ids.expand({self.batch_size}, -1))"
            )
        done = replay_chunk(self, query, self._query_positions(query, kwargs), scaling)
        self.n, self.ordered = done.held, done.ordered
        self.identical = False
        self.new = 0
        self._arrival_valid = False  # the replay moved slots without storing the new keys' numbers
        self.fit_storage()
        for observer in self.settings.observers:
            observer.on_forward(self.index, self.n)
        return done.out

    def plan(self) -> bool:
        """Ask each policy what it needs from the forward in flight (before attention runs).

        Returns whether every row's policy wants the attention of this forward's
        queries, so that a decode step can keep the probabilities attention computes
        anyway. (When only some rows want it, SDPA for all plus a pass over those rows
        is cheaper than attention by hand for all.)
        """
        if self.sealed:
            return False
        total = self.n + self.new
        views = [self._view(group, total) for group in self.settings.layout.groups]
        return self.statistics.plan(views, self.settings.layout, self._will_evict(total))

    def finish(
        self,
        query: torch.Tensor,
        query_positions: torch.Tensor | None,
        scaling: float,
        probs: torch.Tensor | None = None,
    ) -> None:
        """Feed policies their statistics and evict down to the budget.

        `query` is what attention used, `[B, H_q, q, D]` (rotated at `query_positions`,
        where the keys were rotated for). `probs`, `[B, H_kv, group, n]`, are the
        attention probabilities of a single query if attention kept them.
        """
        self.pending = False
        if query.shape[0] != self.batch_size:  # a shared forward: one row stands for all
            query = query.expand(self.batch_size, *query.shape[1:])
            if probs is not None:
                probs = probs.expand(self.batch_size, *probs.shape[1:])
        s = self.settings
        total = self.n + self.new
        if self.sealed:  # nothing to measure: no eviction will ever read it
            self.n, self.new = total, 0
            self.storage.release()
            for observer in s.observers:
                observer.on_forward(self.index, self.n)
            return
        target = self._target(total)
        if target is None or self.deferred:  # nothing leaves now, but the statistics accrue all the same
            self._measured(query, query_positions, scaling, probs, total)
            self.n, self.new = total, 0
            if target is not None:
                return  # everything held, every statistic measured: `evict_deferred` evicts
        else:  # the step path that takes it measures, unless it needs no scores (`step/paths.py`)
            self._evict_to(lambda: self._measured(query, query_positions, scaling, probs, total), total, target)
            self.new = 0
        self.fit_storage()
        for observer in s.observers:
            observer.on_forward(self.index, self.n)

    def _measured(self, query: torch.Tensor, query_positions: torch.Tensor | None, scaling: float,
                  probs: torch.Tensor | None, total: int) -> list[SlotView]:
        """The forward's requests measured and absorbed (`Statistics.feed`: what `plan` asked for) over the
        `total` held slots; returns the policies' views with the fresh statistics and the stored per-key
        numbers (`_arrive`). query `[B, H_q, new, D]` and probs `[B, H_kv, group, total]` (or None) as `finish`."""
        s = self.settings
        if query_positions is not None:
            self.statistics.remember(query, query_positions, self.seen)
        views = self.statistics.feed(s.layout, self.storage, s.mode, query, scaling, self.seen, self.new, total, probs)
        if self._arrival_groups is None:
            stored = ARRIVAL in self.storage.stats
            self._arrival_groups = [i for i, g in enumerate(s.layout.groups) if stored and g.policy.arrival_stat]
        if self._arrival_groups:
            self._arrive(views, total)
        return views

    def _evict_to(self, measured: step_paths.Measured, total: int, target: int) -> None:
        """Evict from `total` held entries down to `target` by the layer's step paths (`step_paths.take`);
        `measured()` gives the policies' views with this forward's statistics, to a path that scores."""
        self.identical = False
        self.ordered = step_paths.take(self, measured, total, target)
        self.n = target

    def evict_deferred(self) -> None:
        """Evict what the held-back forward would have evicted at the budget this layer has now.

        The statistics were measured in that forward (as for an eviction) and sit in the
        storage per slot, so the views built from it are the ones `finish` would have
        scored: the kept set is the one a forward at this budget keeps.
        """
        self.deferred = False
        total = self.n
        target = self._target(total)
        if target is not None:
            self._evict_to(lambda: self._held_views(total), total, target)
        self.fit_storage()
        for observer in self.settings.observers:
            observer.on_forward(self.index, self.n)

    def _held_views(self, total: int) -> list[SlotView]:
        """The policies' views of the `total` held slots with the statistics stored per slot (the held-back
        forward measured them) and the stored per-key numbers (`_arrive`)."""
        views = [self._view(group, total) for group in self.settings.layout.groups]
        if self._arrival_groups:
            self._arrive(views, total)
        return views

    def batch_select_indices(self, index: torch.Tensor) -> None:
        """Sealed only: a layer that may still evict would need its statistics and remembered
        queries to follow; a sealed one measures nothing, so they are dropped."""
        if not self.is_initialized:
            return
        super().batch_select_indices(index)
        self.statistics.reset()
        self._arrival_groups = None  # group indices: found again from the new groups
        self._arrival_valid = False

    def crop(self, tokens_to_remove: int) -> None:
        cropping = tokens_to_remove < 0 and self.is_initialized
        super().crop(tokens_to_remove)
        if cropping:
            self._arrival_valid = False

    def _arrive(self, views: list[SlotView], total: int) -> None:
        """Store `Policy.arrival` of the keys that came since the last forward (of every slot when the
        stored numbers are not all valid) and hand the stored `[b, H_kv, total]` to the views.

        Every slot move (`fill_hole`, `move_slot`, `gather`, a reallocation) carries the statistic with
        its slot, so after a forward all `n` held slots hold theirs; only a replay (which moves slots
        for keys it never scored this way) and a reset make them stale.
        """
        storage = self.storage
        stat = storage.stats[ARRIVAL]
        start = self.n if self._arrival_valid else 0
        groups = self.settings.layout.groups
        for i in self._arrival_groups:
            group = groups[i]
            group.put(stat[:, :, start:total], group.policy.arrival(group.take(storage.keys[:, :, start:total])))
            views[i].arrival = group.take(stat[:, :, :total])
        self._arrival_valid = True

    def _will_evict(self, total: int) -> bool:
        return self._target(total) is not None

    def _target(self, total: int) -> int | None:
        """Entries to keep when holding `total`, or None: the rows' schedule (`Policy.evict_to`), which for
        the papers' policies is "the budget, once exceeded" and for an engine may be a burst."""
        return None if self.budget is None else self.settings.layout.evict_to(self.budget, total)

    def _view(self, group: RowGroup, total: int) -> SlotView:
        storage = self.storage
        return view_of(
            self, group, group.take(storage.pos[:, :, :total]), self.seen,
            self.budget if self.budget is not None else total,
            stats={name: group.take(stat[:, :, :total]) for name, stat in storage.stats.items()},
            keys=lambda: group.take(storage.keys[:, :, :total]),
            values=lambda: group.take(storage.values[:, :, :total]),
        )

    def report_evictions(self, seen: torch.Tensor, victims: torch.Tensor) -> None:
        """Tell the observers of `k` one-entry evictions at once (a chunk replayed in closed form):
        `seen` `[k]` tokens seen after each, `victims` `[B, H_kv, k]` their positions."""
        for observer in self.settings.observers:
            observer.on_evict_steps(self.index, seen, victims)

    # --- inspection ------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, torch.Tensor]:
        """Per-slot statistics `[B, H_kv, capacity]` by name (valid up to `n`)."""
        return self.storage.stats if self.storage is not None else {}
