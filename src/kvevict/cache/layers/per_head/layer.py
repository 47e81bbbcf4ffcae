"""`RaggedLayer`: a layer whose KV heads hold different numbers of entries (Ada-KV, `adakv:P`).

The layer's allowance is `KV heads x budget` entries per row, shared by its heads
(`allocation.allocate`), and stored for real in ragged per-head segments
(`RaggedStorage`): a head holds exactly its share, no head is padded to the longest.
SDPA wants one length for every head, so this layer attends by hand (`attention.ragged_attention`), but
all rows and heads in one computation: each query group reads its row's whole buffer
`[capacity, D]` as it lies (no gather, no copy) with a mask that shows it its own
head's held entries (`RaggedStorage.members`); the padding is in the compute, never in
the storage. Where every head owns an equal run of slots (`RaggedStorage.segment`: a
prefill, a held-back one, KVzip's repeat forwards) a query group reads its own run alone,
by a view, with no other head's entries to mask, and SDPA attends where no policy wants the
probabilities (`attention.ragged_attention`). The same probabilities give the
attention that attention-driven policies (h2o, tova) fold into their statistics, at no
extra pass, and since every entry belongs to one head they go back to the per-entry
statistics with one gather.

Policies score through the same masked view: per head the whole row, the other heads'
entries and the holes as pads at position -1 with zero keys and statistics, scored
`-inf` after the policy scored them, so the policies run unchanged (a pad draws no
attention, adds nothing to keydiff's mean, and sits before every token in SnapKV's
pooling, where a zero next to non-negative masses changes neither max- nor average
pooling with zero padding). Eviction leaves holes (`RaggedStorage.evict`): a decode
step moves no keys, and a row is re-packed only when a head's segment is full.

It implements `CacheLayer` directly, a peer of the slot layers (`slots.SlotLayer`):
no slots in positional order, no ring, no SDPA hooks. Every forward goes through
`replay` (`replays` is always True: the attention function hands it the whole call).
A forward of many tokens under `per_token=True` that would evict steps through its
queries one at a time, doing exactly what one-token forwards do, so chunked
evaluation is exact. Original positions only: in position-shift mode each head would
need its own positions (`EvictingCache` refuses it).
"""

from __future__ import annotations

import torch

from ....attention_stats import Workspace
from ....errors import KvevictError
from ....policies import AttentionRequest, Policy, QueryBatch, SlotView
from ...rows import RowGroup
from ...statistics.measure import Statistics, measure
from ...statistics.probabilities import BLOCK_ELEMENTS, attention_mass, bound
from ...step import stages as step
from ...step.outputs import StepOutputs
from ...step.selection import LATEST_LAST
from ...step.states import PolicyStates
from ...step.views import view_of
from ..interface import CacheLayer
from ..settings import LayerSettings
from .allocation import allocate
from .attention import ragged_attention
from .reconstruction import by_position, fits, put_back, ranked_keys, window_mass
from .storage import RaggedStorage


class RaggedLayer(CacheLayer):
    """Per-head budgets: one allowance per layer and row, ragged storage, attention by hand."""

    heads_differ = True
    measures = frozenset({"new", "last", "window", "queries", "reconstruction"})  # `_absorb`

    def __init__(self, index: int, settings: LayerSettings) -> None:
        super().__init__(index, settings)
        self.storage: RaggedStorage | None = None
        self.statistics = Statistics(settings.query_window, settings.workspace)
        self.states = PolicyStates(index)
        self._incoming: tuple[torch.Tensor, torch.Tensor] | None = None  # the forward's keys and values
        self._floor_cache: tuple[int | None, torch.Tensor] | None = None  # (budget, floors) of the bound rows

    def state_of(self, policy: Policy) -> object | None:
        """`policy`'s state in this layer (`Policy.new_state`), made on first use; handed to it as `SlotView.state`."""
        return self.states.of(policy)

    def _new_storage(self) -> RaggedStorage:
        s = self.settings
        return RaggedStorage(
            self.batch_size, self.heads, self.head_dim, self.dtype, self.device, s.stat_names, self.budget or 0, s.slack
        )

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor, used: torch.Tensor | None):
        # written into the segments by `replay`, one step at a time when the chunk evicts
        rows = self.batch_size
        self._incoming = (key_states.expand(rows, -1, -1, -1), value_states.expand(rows, -1, -1, -1))
        return key_states, value_states

    def reset(self) -> None:
        super().reset()
        self.statistics.reset()
        self.states.clear()
        if self.storage is not None:
            self.storage.reset()  # its statistics zeroed too

    def batch_select_indices(self, index: torch.Tensor) -> None:
        """Sealed only (`EvictingCache.batch_select_indices`): the statistics are dropped, the floors found again."""
        if not self.is_initialized:
            return
        self.storage.keep_rows(index)
        self.batch_size = index.numel()
        self.statistics.reset()
        self._floor_cache = None  # per row

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' `crop` with a negative count, on ragged segments: the latest `-tokens_to_remove`
        tokens leave every head (each must hold them all), which keeps its share of the rest; their slots are
        the next ones written, so a KVzip repeat forward taken back out leaves the segments as it found them."""
        count = -tokens_to_remove
        if count <= 0 or not self.is_initialized:
            return
        storage = self.storage
        latest = storage.members() & (storage.pos >= self.seen - count)[:, None, :]  # [B, H, capacity]
        self._check_holds_latest(latest, count)
        storage.drop_latest(count)  # every head holds them, so they are the last slots it wrote
        self.n, self.seen = int(storage.held.max()), self.seen - count

    def replays(self, q: int) -> bool:
        """Always: this layer computes its own attention (`attention.ragged_attention`)."""
        return True

    def replay(self, query: torch.Tensor, kwargs: dict, scaling: float) -> torch.Tensor:
        """Attention and eviction of a forward. query `[B or 1, H_q, q, D]` -> output `[B or 1, H_q, q, D]`."""
        self.pending = False
        rows = query.shape[0]
        query = query.expand(self.batch_size, -1, -1, -1)
        keys, values = self._incoming
        self._incoming = None
        q = query.shape[2]
        used = self._query_positions(query, kwargs)
        first = self.seen - q
        stepping = self.settings.per_token and q > 1 and self._overflows(q)
        spans = [(i, i + 1) for i in range(q)] if stepping else [(0, q)]
        outs = StepOutputs(q)  # one tensor for every step's output (`step/outputs.py`: the heap's sake)
        for a, b in spans:
            outs.put(a, self._forward(query[:, :, a:b], keys[:, :, a:b], values[:, :, a:b], used[a:b], first + b,
                                      scaling))
        self.new = 0
        for observer in self.settings.observers:
            observer.on_forward(self.index, self.n)
        return outs.out[:rows]

    def _workspace(self) -> Workspace:
        """The bound on the logits a block of queries holds: the cache's, else `BLOCK_ELEMENTS` as read here."""
        return bound(self.settings.workspace, BLOCK_ELEMENTS)

    def _overflows(self, q: int) -> bool:
        """Whether `q` more tokens per head would take some row past its allowance `H x budget`."""
        budget = self.budget
        return budget is not None and self.storage.most_held + self.heads * q > self.heads * budget

    def _forward(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        used: torch.Tensor,
        seen: int,
        scaling: float,
    ) -> torch.Tensor:
        """One forward of `m` tokens (`seen` counts them): store, attend, feed statistics, allocate.

        query `[B, H_q, m, D]`, keys/values `[B, H_kv, m, D]`, used `[m]` their positions.
        Every step works on all rows and heads at once, each head seeing the whole row
        buffer through `members` `[B, H_kv, capacity]` (its own held entries).
        """
        s, storage = self.settings, self.storage
        m = query.shape[2]
        storage.append(keys, values, seen - m, self.reserved - self.n)  # room for a reserved context at once
        if self.sealed:  # no eviction will ever read a statistic: attention alone
            out, _, _ = ragged_attention(storage, query, scaling, ~storage.members(), seen - m, False, False,
                                         self._workspace())
            self.n = int(storage.held.max())
            return out
        self.statistics.remember(query, used, seen)
        # held back (`EvictingCache.defer`): measure as for an eviction, evict in `evict_deferred`
        deferring = self.deferred and self.budget is not None
        will_evict = deferring or self._overflows(0)
        members, hidden, positions, views = self._views(seen)
        requests = [g.policy.request(v, will_evict) for g, v in zip(s.layout.groups, views)]
        kinds = {r.kind for r in requests if r is not None}
        out, new_mass, last_mass = ragged_attention(storage, query, scaling, hidden, seen - m, "new" in kinds,
                                                     "last" in kinds, self._workspace())
        self._absorb(query, views, requests, members, seen, scaling, new_mass, last_mass)
        self.statistics.last_forward = None  # served: the queries are not held past their forward
        if will_evict and not deferring:
            self._refuse_reconstructing()
            self._evict(views, members, positions, seen, shrink=m > 1)
        self.n = int(storage.held.max())
        return out

    def _absorb(self, query: torch.Tensor, views: list[SlotView], requests: list, members: torch.Tensor, seen: int,
                scaling: float, new_mass: torch.Tensor | None, last_mass: torch.Tensor | None) -> None:
        """Measure what each row group's policy asked for (`requests`, one per group) and let it absorb it
        into its statistic: each entry keeps its own head's value, and the group's view sees the update.

        query `[B, H_q, m, D]` (the forward's `m` tokens, `seen` counting them); members
        `[B, H_kv, capacity]` the entries each head holds; `new_mass` / `last_mass` `[B, H_kv, capacity]`
        the attention of all `m` queries and of the last one, where attention measured it."""
        s, storage = self.settings, self.storage
        first, width, groups = seen - query.shape[2], storage.capacity, s.layout.groups

        def window(size: int) -> torch.Tensor:  # SnapKV's last queries, other heads' entries invisible
            queries, q_pos = self.statistics.window_queries(s.mode, size, seen, width)
            key_pos = storage.per_head(storage.pos, ~members, LATEST_LAST)
            keys_now = storage.keys[:, None].expand(-1, self.heads, -1, -1)
            return attention_mass(queries, q_pos, keys_now, key_pos, scaling, self._workspace()).nan_to_num(0.0)

        def reconstruction(sinks: int) -> torch.Tensor | None:  # KVzip's window, in a repeat forward only
            chunk = self.forward.reconstruct
            if chunk is None:
                return None
            return window_mass(query, storage.keys, storage.pos, members, first, chunk, sinks, scaling,
                               self._workspace())

        def measured(i: int, request: AttentionRequest) -> torch.Tensor | QueryBatch | None:
            g = groups[i]
            mass = measure(request, new=lambda: new_mass, last=lambda: last_mass, window=window,
                           queries=lambda size: self.statistics.query_batch(s.mode, size, seen, g.take),
                           reconstruction=reconstruction)
            return mass if mass is None or isinstance(mass, QueryBatch) else g.take(mass)

        def write(i: int, request: AttentionRequest, updated: torch.Tensor) -> torch.Tensor:
            g, stat = groups[i], storage.stats[request.stat]
            updated = updated.to(stat.dtype)
            g.put(stat, updated.gather(1, g.take(storage.owner)[:, None]).squeeze(1))  # its own head's value
            return updated  # the view reads it only where the head holds an entry

        step.absorb(groups, views, requests, measured, write)

    def _views(self, seen: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[SlotView]]:
        """What each row group's policy sees now (`_ragged_view`): the entries each head holds
        `[B, H_kv, capacity]`, their negation, the positions as each head sees them (-1 elsewhere),
        and one view per group."""
        storage = self.storage
        members = storage.members()
        hidden = ~members
        positions = storage.per_head(storage.pos, hidden, -1)
        budget = self.budget if self.budget is not None else storage.capacity
        return members, hidden, positions, [self._ragged_view(g, positions, hidden, seen, budget)
                                            for g in self.settings.layout.groups]

    def _refuse_reconstructing(self) -> None:
        """A policy scored by reconstruction (`Policy.reconstructs`) has no scores before its repeat
        forwards: it evicts only at a held-back eviction, never inside a forward."""
        for g in self.settings.layout.groups:
            if g.policy.reconstructs:
                raise KvevictError(
                    f"'{g.policy.spec()}' scores a context by reconstructing it after the prefill, so it cannot "
                    "evict as a stream is read: compress a context once (kvevict.compress(..., tokenizer=...), "
                    "kvevict ruler) instead of a perplexity stream, needle or generation run"
                )

    def _scores(self, views: list[SlotView], members: torch.Tensor) -> torch.Tensor:
        """`[B, H, capacity]` every row's policy scores, -inf where a head holds nothing."""
        s = self.settings
        scores = step.scores(s.layout, views, *members.shape)
        return scores.masked_fill(~members, float("-inf"))

    def reconstruction_scores(self) -> dict[str, torch.Tensor]:
        """Per statistic of the rows scored by reconstruction, `[B, H_kv, T]` by head and position (`by_position`)."""
        return {name: by_position(self.storage, name, self.seen) for name in self.settings.layout.reconstructed}

    def reconstruction_fits(self, scores: dict[str, torch.Tensor]) -> bool:
        """Whether `reconstruction_scores` of a prefill fit this state (`reconstruction.fits`)."""
        return set(scores) == set(self.settings.layout.reconstructed) and fits(self.storage, scores, self.seen)

    def restore_reconstruction(self, scores: dict[str, torch.Tensor]) -> None:
        """Put back `reconstruction_scores` that fit this state (`reconstruction_fits`)."""
        put_back(self.storage, scores, self.seen)

    def ranked(self) -> torch.Tensor:
        """`[B, H x capacity]` this layer's held entries as keys of a ranking across layers
        (`reconstruction.ranked_keys`), scored as `_evict` scores them."""
        members, _, positions, views = self._views(self.seen)
        return ranked_keys(self._scores(views, members), positions, members)

    def _evict(self, views: list[SlotView], members: torch.Tensor, positions: torch.Tensor, seen: int,
               shrink: bool, total: torch.Tensor | None = None) -> None:
        """Keep each row's allowance `H x budget` (or `total` `[B]`, a share of a ranking across layers)
        by the scores of `views` (jointly over its heads).

        members `[B, H, capacity]` the entries each head holds, positions `[B, H, capacity]`
        theirs as each head sees them (-1 elsewhere). `shrink`: a long forward grew the
        buffer, so give it back.
        """
        s, storage = self.settings, self.storage
        scores = self._scores(views, members)
        allowance = self.heads * self.budget if total is None else total
        keep = allocate(scores, positions, members, allowance, self._floors(), storage.owner)  # a slot is one head's
        # a row keeps its allowance, or all it held (each head's floor is within its budget)
        most = min(storage.most_held, self.heads * self.budget) if total is None else int(keep.sum(dim=(1, 2)).max())
        storage.evict(keep, most)
        if shrink and storage.capacity > storage.base:
            storage.repack(0)
        self.identical = False
        if s.observers:  # they read whether token 0 leads each head's kept positions: `kept` [B, H, 1]
            self.report_eviction(seen, storage.first_slots(), None)

    def evict_deferred(self, total: torch.Tensor | None = None) -> None:
        """Evict what the held-back forward would have evicted at the budget this layer has now.

        That forward stored every entry's statistics (its own head's value, as `_forward`
        does after an eviction), so the views rebuilt from the storage score what it would
        have scored. The buffer is laid out for this budget (`RaggedStorage.rebase`), as a
        forward at this budget leaves it. `total` `[B]`: the entries each row keeps, where a
        ranking across layers decided it (`EvictingCache.evict_deferred`), instead of `H x budget`.
        """
        self.deferred = False
        storage = self.storage
        if self.budget is not None:
            storage.rebase(self.budget)
            if total is not None or self._overflows(0):
                members, _, positions, views = self._views(self.seen)
                self._evict(views, members, positions, self.seen, shrink=True, total=total)
            elif storage.capacity > storage.base:
                storage.repack(0)
        self.n = int(storage.held.max())
        for observer in self.settings.observers:
            observer.on_forward(self.index, self.n)

    def _floors(self) -> torch.Tensor:
        """`[B]` the fewest entries each head of a row keeps (its policy's `head_floor`)."""
        if self._floor_cache is None or self._floor_cache[0] != self.budget:
            floors = [p.head_floor(self.budget) for p in self.settings.layout.row_policies()]
            self._floor_cache = (self.budget, torch.tensor(floors, device=self.device))
        return self._floor_cache[1]

    def _ragged_view(
        self, group: RowGroup, positions: torch.Tensor, hidden: torch.Tensor, seen: int, budget: int
    ) -> SlotView:
        """What `group`'s policy sees: per head the whole row, the other heads' entries and the
        holes as pads (position -1, zero keys and statistics)."""
        storage = self.storage
        mask = group.take(hidden)

        def keys() -> torch.Tensor:
            head_keys = group.take(storage.keys)[:, None].expand(-1, self.heads, -1, -1)
            return head_keys.masked_fill(mask[..., None], 0.0)

        def values() -> torch.Tensor:
            head_values = group.take(storage.values)[:, None].expand(-1, self.heads, -1, -1)
            return head_values.masked_fill(mask[..., None], 0.0)

        return view_of(
            self, group, group.take(positions), seen, budget,
            stats={name: storage.per_head(group.take(storage.stats[name]), mask, 0.0) for name in group.policy.stats},
            keys=keys, values=values,
        )

    # --- inspection ------------------------------------------------------------------
    def kept_positions(self) -> torch.Tensor:
        """`[B, H_kv, L]` original positions each head holds, ascending, padded with -1 at the
        end to the longest head (`L`); `head_lengths` says how many are real."""
        storage = self.storage
        pos = storage.per_head(storage.pos, ~storage.members(), LATEST_LAST).sort(dim=-1).values
        pos = pos[..., : max(1, int(storage.held.max()))]
        return pos.masked_fill(pos == LATEST_LAST, -1)

    def head_lengths(self) -> torch.Tensor:
        return self.storage.held.clone().cpu()
