"""`EvictingLayer`: one layer of an `EvictingCache`. A short coordinator over its parts.

Life of one forward, per layer:

1. `update` writes the new keys/values into the slots after the `n` kept ones
   (`SlotStorage`, keys as the position mode wants them) and returns views of
   `[kept | new]`: no concatenation. It also leaves itself in the model's attention
   kwargs, which is how kvevict's attention function finds it (no global state).
2. The attention function calls `plan` (what do the policies need from this
   forward?), computes the output, then `finish` with the queries it used.
3. `finish` feeds the policies their statistics (`Statistics`) and, if more than the
   budget is held, keeps the best-scoring entries (`selection`): a decode step in
   original-position mode moves the newest slot into the victim's place; anything
   else gathers the survivors to the front in positional order. It then reports to
   the cache's observers what it holds and what it evicted.

So between forwards every layer holds at most its budget, and during a forward the new
queries see the kept entries plus the tokens of that forward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import CacheLayerMixin

from ..errors import KvevictError
from ..policies import Policy, SlotView
from .inputs import attach_error, model_positions
from .layer_settings import Forward, LayerSettings
from .observers import Eviction
from .replay import replay_static, replay_steps
from .rows import RowGroup
from .statistics import Statistics
from .storage import SlotStorage

#: the name kvevict's attention function is registered under in transformers
NAME = "kvevict"
#: where `update` leaves the layer in the model's attention kwargs for the attention function
LAYER_KEY = "kvevict_layer"
#: the per-slot statistic that holds `Policy.arrival` of each slot's key (`arrival_stat` policies)
ARRIVAL = "arrival"


@dataclass(frozen=True)
class LayerMemory:
    """What one layer holds, as the layer itself counts it (`EvictingLayer.memory`).

    `per_head` `[B][H_kv]` entries each (row, KV head) holds; bytes count keys and values
    as the storage holds them (a quantized form: codes, scales, zero points and its residual):
    `kv_bytes` the entries held, `full_kv_bytes` a full cache of
    the tokens seen, `allocated_kv_bytes` the buffers. `heads_differ`: the heads may hold
    different numbers of entries (per-head budgets).
    """

    per_head: list[list[int]]
    kv_bytes: int
    full_kv_bytes: int
    allocated_kv_bytes: int
    heads_differ: bool
    kv_bytes_bf16: int = 0  # `kv_bytes` with every floating-point number counted at 2 bytes (the deployment dtype)


class EvictingLayer(CacheLayerMixin):
    """One layer's slots, its policies' statistics, and eviction down to its budget."""

    is_compileable = False
    is_sliding = False
    #: the KV heads may hold different numbers of entries (per-head budgets: `per_head.RaggedLayer`)
    heads_differ = False
    #: can hold a forward's eviction back until `evict_deferred` (see `EvictingCache.defer`)
    can_defer = True

    def __init__(self, index: int, settings: LayerSettings) -> None:
        super().__init__()
        self.index = index
        self.settings = settings
        self.n = 0  # entries kept (valid slots are 0..n-1)
        self.seen = 0  # tokens that have gone through this layer
        self.new = 0  # tokens of the forward in flight
        self.pending = False  # updated, waiting for kvevict's attention to finish
        self.storage: SlotStorage | None = None
        self.statistics = Statistics(settings.query_window)
        # Rows hold the same tokens so far (no eviction, no per-row forward): a one-row
        # forward may stand for all of them.
        self.identical = True
        self.ordered = True  # slots sit in positional order (until a hole is filled in place)
        self._budget: int | None = None
        # (slot of the oldest unpinned entry, tokens seen when it was found): valid for the next
        # decode step only, see `_fifo_victim`
        self._ring: tuple[int, int] | None = None
        # the row groups whose policy keeps a per-key number (`Policy.arrival_stat`), found at the first
        # `finish`; and whether every held slot's number is stored (see `_arrive`)
        self._arrival_groups: list[int] | None = None
        self._arrival_valid = False
        self.forward = Forward()  # the forward in flight, handed over by the cache at `update`
        # the next eviction is held back: statistics measured, nothing evicted (`EvictingCache.defer`)
        self.deferred = False
        # never evicts again (`EvictingCache.freeze(final=True)`): the policies' statistics are no longer measured
        self.sealed = False
        # what each policy carries from one step of this layer to the next (`Policy.new_state`): (policy, state)
        # pairs, matched by identity (a copy of the cache copies both sides of each pair together)
        self._states: list[tuple[Policy, object]] = []

    def state_of(self, policy: Policy) -> object | None:
        """`policy`'s state in this layer (`Policy.new_state`), made on first use; handed to it as `SlotView.state`."""
        for owner, state in self._states:
            if owner is policy:
                return state
        state = policy.new_state(self.index)
        self._states.append((policy, state))
        return state

    @property
    def budget(self) -> int | None:
        """Entries this layer keeps between forwards (None: never evict)."""
        return self._budget

    def set_budget(self, budget: int | None) -> None:
        """Called by the cache alone (`EvictingCache.budget`, `freeze`): lowering it evicts at the next forward."""
        self._budget = budget

    # --- transformers' layer API -------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _, heads, _, dim = key_states.shape
        s = self.settings
        batch = s.layout.rows_for(key_states.shape[0])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.heads, self.head_dim = batch, heads, dim
        self.storage = self._new_storage()
        self.is_initialized = True

    def _new_storage(self) -> SlotStorage:
        s = self.settings
        capacity = (self.budget or 0) + s.slack
        names = s.stat_names
        # the mode says whether a number a stored key alone decides stays true while the key is held
        arrival = s.mode.keeps_arrival(any(p.arrival_stat for p in s.layout.policies))
        if arrival:
            names = (*names, ARRIVAL)
        storage = s.mode.new_storage(
            self.batch_size, self.heads, self.head_dim, self.dtype, self.device, names, capacity, s.storage_form
        )
        if arrival:  # `_arrive` writes it for every new slot before anything reads it
            storage.written_on_arrival = frozenset({ARRIVAL})
        return storage

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, forward: Forward | None = None, **kwargs
    ):
        """Store the forward's keys and values; `forward` is the cache's record of the forward in flight."""
        self.forward = forward if forward is not None else Forward()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        model_kwargs = kwargs.get("kwargs")
        handoff = None
        if not isinstance(model_kwargs, dict):  # GPT-NeoX: the layer goes through its attention module instead
            handoff = self.settings.handoff
            if handoff is None:
                raise KvevictError(
                    "this model does not hand its attention arguments to the cache (cache.update(..., kwargs=...)) "
                    "and kvevict found no attention module with this layer's index: use a model from the "
                    "architecture matrix (Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, GPT-NeoX, GPT-2, OPT)"
                )
            model_kwargs = {}
        if self.pending or (self.index == 0 and getattr(self.settings.config, "_attn_implementation", None) != NAME):
            self.pending = False
            raise attach_error()
        self._check_rows(key_states.shape[0])
        self._check_finite(key_states, value_states)
        q = key_states.shape[2]
        mode = self.settings.mode
        used = None
        if self.index == 0 or mode.keys_need_positions(self.index):
            # Positions are the same for every layer of a forward: check them once, at layer 0.
            start = mode.seq_length(self.n, self.seen)
            used = self._positions(model_kwargs, q, start, check_rows=self.index == 0)
            if self.index == 0:
                self.forward = replace(self.forward, positions=used)
            if self.index == 0 and self.seen and not mode.continues(int(used[0]), self.n, self.seen):
                raise KvevictError(
                    f"this cache already holds {self.seen} tokens of a sequence, but the new tokens start at position "
                    f"{int(used[0])}: call cache.reset() (or make a new EvictingCache) before reusing it for another "
                    "sequence"
                )
        out = self._store(key_states, value_states, used)
        model_kwargs[LAYER_KEY] = self
        if handoff is not None:
            handoff.layer = self
        self.new = q
        self.seen += q
        self.pending = True
        return out

    def _store(
        self, key_states: torch.Tensor, value_states: torch.Tensor, used: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's new entries after the kept ones; return `[kept | new]` keys and values."""
        storage = self.storage
        end = self.n + key_states.shape[2]
        if end > storage.capacity:
            # Only a prefill longer than the slack, or a frozen (growing) cache, gets here. A frozen
            # cache grows by a quarter (amortized: each entry is copied ~4 times), not by doubling: a
            # compressed prompt's decode should not allocate twice what it holds.
            grow = storage.capacity + storage.capacity // 4 if self.budget is None else 0
            storage.ensure(end, self.n, max(end + self.settings.slack, grow))
        storage.begin(self.n, key_states.shape[2], self.seen + key_states.shape[2])  # a storage form's working copy
        storage.open(self.n, value_states, self.seen)
        self.settings.mode.store_keys(storage, key_states, used, self.n)
        if storage.written(self.n, end):  # a storage form changed the held keys: rotate them to their slots again
            self.settings.mode.after_compaction(storage, end)
        # A shared forward (one row standing for all) attends with row 0; writes above broadcast.
        rows = key_states.shape[0]
        return storage.keys[:rows, :, :end], storage.values[:rows, :, :end]

    def _check_rows(self, rows: int) -> None:
        if rows == 1 and self.batch_size > 1 and not self.identical:
            raise KvevictError(
                f"this cache holds {self.batch_size} rows (one per policy) and they diverged at the first eviction: "
                f"a one-row forward can only stand for all rows before that; feed {self.batch_size} rows "
                f"(input_ids.expand({self.batch_size}, -1))"
            )
        if rows not in (1, self.batch_size):
            raise KvevictError(
                f"this cache holds {self.batch_size} sequences but got a batch of {rows}: "
                "use a new EvictingCache for each batch (cache.reset() to reuse it)"
            )
        if rows == self.batch_size and rows > 1:
            self.identical = False

    def _check_finite(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # NaN/inf reaching any layer reaches the last one: checking the first (bad inputs)
        # and the last (bad weights anywhere) catches both without a sync per layer.
        if self.index in (0, self.settings.last_layer) and not bool(
            torch.isfinite(key_states).all() and torch.isfinite(value_states).all()
        ):
            raise KvevictError(
                f"layer {self.index} produced NaN/inf keys or values: check the inputs (inputs_embeds) and the "
                "model weights; the cache refuses to rank entries by NaN scores"
            )

    def get_seq_length(self) -> int:
        return self.settings.mode.seq_length(self.n, self.seen)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.n + query_length, 0

    def get_max_length(self) -> int:
        return -1 if self.budget is None else self.budget

    def reset(self) -> None:
        self.n = self.seen = self.new = 0
        self.sealed = False
        self.identical = True
        self.ordered = True
        self._ring = None
        self._arrival_valid = False
        self.pending = False
        self.statistics.reset()
        self._states = []
        if self.storage is not None:
            for stat in self.storage.stats.values():
                stat.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KvevictError("EvictingCache does not support beam search: use greedy or sampling (num_beams=1)")

    # --- around attention ------------------------------------------------------------
    def align_query(self, query: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The queries `[B, H_q, q, D]` rotated where this layer's keys expect them, and
        those positions `[q]` (None when nobody needs them: original positions and no
        policy that remembers queries)."""
        return self.settings.mode.align_query(
            query, lambda: self._query_positions(query, kwargs), self.n, remember=bool(self.settings.query_window)
        )

    def _query_positions(self, query: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """`[q]` positions the model rotated this forward's queries at."""
        start = self.settings.mode.seq_length(self.n, self.seen - self.new)
        return self._positions(kwargs, query.shape[2], start, check_rows=False)

    def _positions(self, kwargs: dict, q: int, start: int, check_rows: bool) -> torch.Tensor:
        """`[q]` positions the model used: its `position_ids`, or else layer 0's (every layer of
        a forward shares them; a layer's own count can differ from layer 0's in position-shift mode)."""
        shared = self.forward.positions
        if "position_ids" not in kwargs and self.index and shared is not None and shared.numel() == q:
            return shared
        return model_positions(kwargs, q, start, self.device, check_rows=check_rows)

    def window_mask(self, q: int) -> torch.Tensor | None:
        """A mask narrower than "every kept entry and the causal new tokens", or None (a full-attention layer)."""
        return None

    def window_size(self) -> int | None:
        """The band a replay must mask beyond the held entries (a sliding layer under an engine's
        schedule), or None: every held entry is visible."""
        return None

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
        used = self._query_positions(query, kwargs)
        out = None
        if all(g.policy.static_scores for g in self.settings.layout.groups):
            out = replay_static(self, query, used, scaling)
        if out is None:
            out = replay_steps(self, query, used, scaling)
        self.identical = False
        self.new = 0
        self._arrival_valid = False  # the replay moved slots without storing the new keys' numbers
        self.fit_storage()
        for observer in self.settings.observers:
            observer.on_forward(self.index, self.n)
        return out

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
        if query_positions is not None:
            self.statistics.remember(query, query_positions, self.seen)
        views = self.statistics.feed(s.layout, self.storage, s.mode, query, scaling, self.seen, self.new, total, probs)
        if self._arrival_groups is None:
            stored = ARRIVAL in self.storage.stats
            self._arrival_groups = [i for i, g in enumerate(s.layout.groups) if stored and g.policy.arrival_stat]
        if self._arrival_groups:
            self._arrive(views, total)
        target = self._target(total)
        if target is not None and self.deferred:
            self.n, self.new = total, 0  # everything held, every statistic measured: `evict_deferred` evicts
            return
        if target is not None:
            self._evict_to(views, total, target)
        else:
            self.n = total
        self.new = 0
        self.fit_storage()
        for observer in s.observers:
            observer.on_forward(self.index, self.n)

    def _evict_to(self, views: list[SlotView], total: int, target: int) -> None:
        self.identical = False
        slot = self._fifo_victim(total, target)
        if slot is None:
            self._evict(views, total, target)
        else:
            self._evict_slot(slot, target)

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
            views = [self._view(group, total) for group in self.settings.layout.groups]
            if self._arrival_groups:
                self._arrive(views, total)
            self._evict_to(views, total, target)
        self.fit_storage()
        for observer in self.settings.observers:
            observer.on_forward(self.index, self.n)

    def crop(self, tokens_to_remove: int) -> None:
        """Take the `count = -tokens_to_remove` latest tokens back out (transformers' `crop` with a
        negative count), as if they had never been read: a request's question
        after a frozen prefix, so that the next request reads the prefix alone (`multi --form
        aware-requests`). Every row and KV head must hold all of them (a pinned span,
        `policies/span.py`), so each keeps the same number of entries: the others stay in positional
        order, and the next token takes the first dropped one's position."""
        count = -tokens_to_remove
        if count <= 0 or not self.is_initialized:
            return
        positions = self.storage.pos[:, :, : self.n]  # [B, H_kv, n]
        latest = positions >= self.seen - count
        self._check_holds_latest(latest, count)
        held = self.n - count
        keep = positions.masked_fill(latest, self.seen).argsort(dim=-1)[..., :held]  # [B, H_kv, held]
        self.settings.mode.compact(self.storage, keep, held)
        self.n, self.seen = held, self.seen - count
        self.ordered, self._ring, self._arrival_valid = True, None, False

    def _check_holds_latest(self, latest: torch.Tensor, count: int) -> None:
        """`crop`'s condition: `latest` `[B, H_kv, slots]` marks the latest tokens held, `count` per
        row and head."""
        if not bool((latest.sum(dim=-1) == count).all()):
            raise KvevictError(f"layer {self.index} does not hold all of the {count} latest tokens in every row "
                               "and head, so they cannot be taken back out: pin them while compressing")

    def batch_select_indices(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` `[b]` of a sealed layer (the cache re-numbered its row groups).

        Sealed only: a layer that may still evict would need its statistics and remembered
        queries to follow; a sealed one measures nothing, so they are dropped.
        """
        if not self.is_initialized:
            return
        self.storage.keep_rows(index)
        self.batch_size = index.numel()
        self.statistics.reset()
        self._arrival_groups = None  # group indices: found again from the new groups
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

    def fit_storage(self) -> None:
        """After a forward: give back buffers a long forward grew beyond twice the budget and its
        slack (a compressed prompt keeps `budget + slack` slots, not the prompt's length), and the working
        buffers of a storage form (`SlotStorage.release`)."""
        if self.budget is not None:
            self.storage.fit(self.budget + self.settings.slack, self.n)
        self.storage.release()

    def _will_evict(self, total: int) -> bool:
        return self._target(total) is not None

    def _target(self, total: int) -> int | None:
        """Entries to keep when holding `total`, or None: the rows' schedule (`Policy.evict_to`), which for
        the papers' policies is "the budget, once exceeded" and for an engine may be a burst."""
        return None if self.budget is None else self.settings.layout.evict_to(self.budget, total)

    def _view(self, group: RowGroup, total: int) -> SlotView:
        storage = self.storage
        return SlotView(
            positions=group.take(storage.pos[:, :, :total]),
            seen=self.seen,
            budget=self.budget if self.budget is not None else total,
            layer=self.index,
            stats={name: group.take(stat[:, :, :total]) for name, stat in storage.stats.items()},
            keys=lambda: group.take(storage.keys[:, :, :total]),
            values=lambda: group.take(storage.values[:, :, :total]),
            state=self.state_of(group.policy),
        )

    def _fifo_victim(self, total: int, keep_count: int) -> int | None:
        """The victim slot of a decode step under a first-in-first-out policy (`Policy.fifo_after`),
        found without scores, or None (score and select).

        Slots in positional order hold the pinned tokens `0..N-1` first, so the oldest unpinned
        entry sits in slot N. Each in-place eviction puts the newest entry into the victim's slot,
        so the unpinned slots `N..budget-1` turn like a ring: the next oldest is the next slot. The
        ring is trusted only right after its own eviction one token earlier; anything else
        (a chunk, a compaction, a budget change) starts again from positional order or scores.
        """
        fifo = self.settings.mode.ring(self.ring_start())
        if fifo is None or total != keep_count + 1:
            return None
        if self.ordered:
            return fifo
        if self._ring is not None and self._ring[1] == self.seen - 1:
            return self._ring[0]
        return None

    def ring_start(self) -> int | None:
        """The first slot of the first-in-first-out ring (the pinned tokens sit before it), or None: no ring.
        The rows' policies decide it (`LayerSettings.fifo_after`); a sliding-window layer has its own."""
        return self.settings.fifo_after

    def _evict_slot(self, slot: int, keep_count: int) -> None:
        """Evict slot `slot` (the newest entry, slot `keep_count`, takes its place) and report it."""
        gone = self._turn_ring(slot, keep_count)
        self.n = keep_count
        wanted = any(o.wants_victims for o in self.settings.observers)
        self.report_eviction(self.seen, self.storage.pos[:, :, :keep_count], gone if wanted else None)

    def _turn_ring(self, slot: int, keep_count: int) -> torch.Tensor:
        """Move the newest entry (slot `keep_count`) into the victim's slot `slot` and note the next victim,
        the slot after it (the ring wraps to `ring_start`). Returns the positions `[B, H_kv]` evicted."""
        gone = self.storage.move_slot(keep_count, slot)
        following = slot + 1 if slot + 1 < keep_count else self.ring_start()
        self._ring = (following, self.seen)
        self.ordered = False
        return gone

    def _evict(self, views: list[SlotView], total: int, keep_count: int) -> None:
        layout = self.settings.layout
        storage = self.storage
        parts = [group.policy.scores(view) for group, view in zip(layout.groups, views)]
        scores = layout.merge(parts, self.batch_size, self.heads, total)
        wanted = any(o.wants_victims for o in self.settings.observers)
        # the mode decides how: a decode step in original positions fills the victim's slot in place
        victims, self.ordered = self.settings.mode.evict(storage, scores, total, keep_count, self.ordered, wanted)
        self.n = keep_count
        self.report_eviction(self.seen, storage.pos[:, :, :keep_count], victims)

    def report_eviction(self, seen: int, kept: torch.Tensor | None, victims: torch.Tensor | None) -> None:
        """Tell the observers what this layer evicted when it had seen `seen` tokens (see `Eviction`)."""
        observers = self.settings.observers
        if observers:
            event = Eviction(self.index, seen, kept, victims)
            for observer in observers:
                observer.on_evict(event)

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

    def kept_positions(self) -> torch.Tensor:
        """`[B, H_kv, n]` original positions of the entries held, ascending."""
        return self.storage.pos[:, :, : self.n].sort(dim=-1).values

    def head_lengths(self) -> torch.Tensor:
        """`[B, H_kv]` entries each (row, KV head) holds: `n` everywhere (per-head budgets: `RaggedLayer`)."""
        return torch.full((self.batch_size, self.heads), self.n, dtype=torch.long)

    def full_length(self) -> int:
        """Entries a full cache holds here for the tokens seen: all of them, or on a sliding-window layer the
        model's window less one (what transformers' sliding layers keep, and what a full cache would hold)."""
        return min(self.seen, self.window - 1) if self.is_sliding else self.seen

    def memory(self) -> LayerMemory | None:
        """This layer's entries and KV bytes (None before its first forward); its storage's business alone."""
        if not self.is_initialized:
            return None
        storage = self.storage  # it counts what it holds: codes and scales for a quantized form
        entry = 2 * self.head_dim * torch.empty((), dtype=self.dtype).element_size()  # one key and its value
        lengths = self.head_lengths()  # [B, H_kv]
        held = int(lengths.sum())
        return LayerMemory(
            per_head=lengths.tolist(),
            kv_bytes=storage.held_bytes(held),
            full_kv_bytes=entry * self.batch_size * self.heads * self.full_length(),
            allocated_kv_bytes=storage.allocated_bytes(),
            heads_differ=self.heads_differ,
            kv_bytes_bf16=storage.held_bytes(held, full_bytes=2),
        )
