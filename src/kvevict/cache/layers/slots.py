"""`SlotLayer`: a layer whose rows and heads all hold the same number of entries, in slots that SDPA reads.

What the uniform layer (`uniform.EvictingLayer`) and the sliding-window layer
(`sliding.SlidingLayer`) share, and the per-head layer does not: slot storage
(`SlotStorage`, or a storage form) written after the `n` kept entries, so attention
reads `[kept | new]` views without a concatenation; the hooks kvevict's attention
function calls around SDPA (`align_query`, `window_mask`, `plan`, `finish`); the ring
of slots a first-in-first-out eviction turns; `crop`; and giving back what a long
forward grew (`fit_storage`).

The ring: slots in positional order hold the pinned tokens `0..N-1` first, so the
oldest unpinned entry sits in slot N (`ring_start`). An in-place eviction puts the
newest entry into the victim's slot, so the unpinned slots turn like a ring and the
next oldest is the next slot. The ring is trusted only right after its own eviction
one token earlier; anything else (a chunk, a compaction, a budget change) starts again
from positional order (`ordered`) or, in the uniform layer, from scores. The uniform
layer's steps take the ring through `step/paths.py` (its "ring" path); the sliding layer
turns it in its own `finish`, which runs no policy.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from ...attention_stats import query_attention
from ..statistics.probabilities import bound, causal_sdpa, sdpa
from ..storage.slots import SlotStorage
from .interface import CacheLayer
from .settings import LayerSettings


class SlotLayer(CacheLayer):
    """Slot storage shared by every row and head, attended by SDPA around the layer's hooks."""

    def __init__(self, index: int, settings: LayerSettings) -> None:
        super().__init__(index, settings)
        self.storage: SlotStorage | None = None
        self.ordered = True  # slots sit in positional order (until a hole is filled in place)
        # (slot of the oldest unpinned entry, tokens seen when it was found): valid for the next
        # decode step only, see `fifo_victim`
        self._ring: tuple[int, int] | None = None

    def _slot_storage(self, names: tuple[str, ...]) -> SlotStorage:
        """Buffers for `budget + slack` slots with the per-slot statistics `names`, in the storage form and
        with the keys the position mode wants (un-rotated copies or not)."""
        s = self.settings
        capacity = (self.budget or 0) + s.slack
        return s.mode.new_storage(
            self.batch_size, self.heads, self.head_dim, self.dtype, self.device, names, capacity, s.storage_form
        )

    def _store(
        self, key_states: torch.Tensor, value_states: torch.Tensor, used: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's new entries after the kept ones; return `[kept | new]` keys and values."""
        storage = self.storage
        end = self.n + key_states.shape[2]
        if max(end, self.reserved) > storage.capacity:
            # Only a prefill longer than the slack, or a frozen (growing) cache, gets here. A frozen
            # cache grows by a quarter (amortized: each entry is copied ~4 times), not by doubling: a
            # compressed prompt's decode should not allocate twice what it holds. A chunked prefill
            # reserves its whole context (`reserved`): one allocation, never the old buffers beside the new.
            grow = storage.capacity + storage.capacity // 4 if self.budget is None else 0
            storage.ensure(max(end, self.reserved), self.n, max(end + self.settings.slack, grow))
        storage.begin(self.n, key_states.shape[2], self.seen + key_states.shape[2])  # a storage form's working copy
        storage.open(self.n, value_states, self.seen)
        self.settings.mode.store_keys(storage, key_states, used, self.n)
        if storage.written(self.n, end):  # a storage form changed the held keys: rotate them to their slots again
            self.settings.mode.after_compaction(storage, end)
        # A shared forward (one row standing for all) attends with row 0; writes above broadcast.
        rows = key_states.shape[0]
        return storage.keys[:rows, :, :end], storage.values[:rows, :, :end]

    def reset(self) -> None:
        super().reset()
        self.ordered = True
        self._ring = None
        if self.storage is not None:
            for stat in self.storage.stats.values():
                stat.zero_()

    # --- around SDPA ----------------------------------------------------------------------
    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, kwargs: dict
    ) -> torch.Tensor:
        """kvevict's attention over `[kept | new]`: query `[B, H_q, q, D]` as the model rotated it, key/value
        `[B, H_kv, n + q, D]` (what `update` returned) -> output `[B, H_q, q, D]`.

        The mask is built here, not by transformers: the slots are not positions, and the right mask is
        "every kept entry is visible, the new tokens are causal among themselves" (or a sliding layer's
        band). The layer's policies are asked first (`plan`); a decode step whose every row wants that
        query's attention computes it by hand once and keeps the probabilities (SDPA cannot return them,
        and a second pass would cost as much again); then `finish` measures and evicts.
        """
        q_len = query.shape[2]
        query, query_positions = self.align_query(query, kwargs)
        mask = self.window_mask(q_len)
        probs = None
        if self.plan() and q_len == 1:
            out, probs = query_attention(query, key, value, scaling)  # the kernel's single-block path
        elif mask is not None:
            out = sdpa(query, key, value, mask, False, scaling)
        else:  # the mask in blocks of queries within the workspace: a chunk after a long context
            out = causal_sdpa(query, key, value, scaling, bound(self.settings.workspace))
        self.finish(query, query_positions, scaling, probs)
        return out

    def align_query(self, query: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The queries `[B, H_q, q, D]` rotated where this layer's keys expect them, and
        those positions `[q]` (None when nobody needs them: original positions and no
        policy that remembers queries)."""
        return self.settings.mode.align_query(
            query, lambda: self._query_positions(query, kwargs), self.n, remember=bool(self.settings.query_window)
        )

    @abstractmethod
    def window_mask(self, q: int) -> torch.Tensor | None:
        """`[q, n + q]` bool: a mask narrower than "every kept entry and the causal new tokens", or None."""

    @abstractmethod
    def plan(self) -> bool:
        """Before attention: whether every row wants the probabilities of this forward's single query."""

    @abstractmethod
    def finish(
        self, query: torch.Tensor, query_positions: torch.Tensor | None, scaling: float,
        probs: torch.Tensor | None = None,
    ) -> None:
        """After attention: the queries `[B, H_q, q, D]` it used (rotated at `query_positions`) and, for a
        decode step, its probabilities `[B, H_kv, group, n]`; the layer keeps what it keeps."""

    # --- the ring of slots ----------------------------------------------------------------
    @abstractmethod
    def ring_start(self) -> int | None:
        """The first slot of the first-in-first-out ring (the pinned tokens sit before it), or None: no ring."""

    def fifo_victim(self, total: int, keep_count: int) -> int | None:
        """The victim slot of a decode step (`total` held, `keep_count` kept) under a first-in-first-out
        eviction, found without scores, or None: the mode turns no ring, the step evicts more than one
        entry, or the slots left positional order other than by the ring's own step one token earlier."""
        fifo = self.settings.mode.ring(self.ring_start())
        if fifo is None or total != keep_count + 1:
            return None
        if self.ordered:
            return fifo
        if self._ring is not None and self._ring[1] == self.seen - 1:
            return self._ring[0]
        return None

    def turn_ring(self, slot: int, keep_count: int) -> torch.Tensor:
        """Move the newest entry (slot `keep_count`) into the victim's slot `slot` and note the next victim,
        the slot after it (the ring wraps to `ring_start`). Returns the positions `[B, H_kv]` evicted."""
        gone = self.storage.move_slot(keep_count, slot)
        following = slot + 1 if slot + 1 < keep_count else self.ring_start()
        self._ring = (following, self.seen)
        self.ordered = False
        return gone

    def fit_storage(self) -> None:
        """After a forward: give back buffers a long forward grew beyond twice the budget and its
        slack (a compressed prompt keeps `budget + slack` slots, not the prompt's length), and the working
        buffers of a storage form (`SlotStorage.release`)."""
        if self.budget is not None:
            self.storage.fit(self.budget + self.settings.slack, self.n)
        self.storage.release()

    # --- rows, crop, inspection -------------------------------------------------------------
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
        self.ordered, self._ring = True, None

    def batch_select_indices(self, index: torch.Tensor) -> None:
        """Keep only the rows `index` `[b]` of a sealed layer (the cache re-numbered its row groups)."""
        if not self.is_initialized:
            return
        self.storage.keep_rows(index)
        self.batch_size = index.numel()

    def kept_positions(self) -> torch.Tensor:
        """`[B, H_kv, n]` original positions of the entries held, ascending."""
        return self.storage.pos[:, :, : self.n].sort(dim=-1).values

    def head_lengths(self) -> torch.Tensor:
        """`[B, H_kv]` entries each (row, KV head) holds: `n` everywhere."""
        return torch.full((self.batch_size, self.heads), self.n, dtype=torch.long)
