"""`SlidingLayer`: a sliding-window attention layer (Gemma 3's local layers, Qwen2's upper ones).

The model itself lets query `i` see keys `j` with `i - W < j <= i` (transformers'
`sliding_window_overlay`), so such a layer never needs more than its window: it keeps
the last `W - 1` entries between forwards and the policy does not run in it. The
cache's budget bounds the full-attention layers, which are the ones that grow.

A decode step evicts like a first-in-first-out policy in a full-attention layer: in
original positions the newest entry takes the oldest one's slot (`SlotLayer.turn_ring`,
one slot moved instead of the window compacted), so the slots turn like a ring and leave
positional order. It needs no mask either: the `W - 1` entries held and the query itself
are all inside the query's window.

Within a forward of many tokens (a prefill, a chunk) each query sees only its own
window: `window_mask` gives the band from the stored positions (slot order does not
matter), so a chunk is exact without the token-by-token replay (the band is what
one-token forwards would have seen); its `finish` keeps the latest `W - 1` in positional
order again. In position-shift mode nothing turns (a key's rotation is its slot, so an
eviction renumbers every entry and compacts); the kept entries are contiguous stream
tokens, so renumbering them `0..L-1` changes no relative distance: RoPE logits are the same.

An engine whose budget holds every layer (`Policy.bounds_every_layer`: llama.cpp's `n_ctx`
cells hold its sliding layers too, which it shifts only when they are full size) runs its
policy in its sliding layers like in a full-attention one, at the cache's budget, while
each query still sees only the band of its window over the entries held (llama.cpp masks
by the renumbered positions, which are exactly the held entries' order): the cache gives
such a layer the uniform `uniform.EvictingLayer`, which masks `band`.
"""

from __future__ import annotations

import torch

from ..storage.slots import SlotStorage
from .slots import SlotLayer


class SlidingLayer(SlotLayer):
    """Keeps the last `window - 1` entries (the model's own window); no policy, no statistics."""

    @property
    def budget(self) -> int | None:
        """The model's window less one, whatever the cache's budget (which bounds the full-attention layers)."""
        return self.window - 1

    def _new_storage(self) -> SlotStorage:
        return self._slot_storage(())  # no policy runs here: no per-slot statistics

    def replays(self, q: int) -> bool:
        return False  # the band mask already shows each query its own window

    def plan(self) -> bool:
        return False  # no policy runs here: nothing to measure

    def evict_deferred(self) -> None:
        self.deferred = False  # its `finish` kept its window already: nothing was held back

    def ring_start(self) -> int | None:
        return 0  # the model's window pins nothing: the oldest held entry goes, from slot 0 on

    def window_mask(self, q: int) -> torch.Tensor | None:
        """`[q, n + q]` bool: which held or new entries each of the `q` new queries sees, or None: all.

        One query sees everything held (at most `W - 1` entries, all newer than its window's
        start, in any slot order). Many queries see the band `i - W < j <= i` of their stream
        positions, taken from the stored positions, since a turned ring holds them out of order.
        """
        if q == 1:
            return None
        positions = self.storage.pos[0, 0, : self.n + q]  # every row and head holds the same slots
        return visible(positions[self.n :], positions, self.window)

    def finish(self, query, query_positions, scaling, probs=None) -> None:
        """Drop what fell out of the window: the oldest entry's slot takes the newest (a decode step in
        original positions), else the latest `W - 1` are compacted to the front in positional order."""
        self.pending = False
        total = self.n + self.new
        self.new = 0
        keep = min(total, self.budget)
        slot = self.fifo_victim(total, keep) if keep < total else None
        if slot is not None:
            self.turn_ring(slot, keep)  # nothing is reported: the model's own window is no eviction to observe
        elif keep < total:
            self._compact_latest(total, keep)
        self.n = keep
        self.fit_storage()

    def _compact_latest(self, total: int, keep: int) -> None:
        """Move the `keep` latest of the `total` held slots to the front, oldest first."""
        if self.ordered:
            slots = torch.arange(total - keep, total, device=self.device)
        else:  # a turned ring: order the slots by their stored positions (the same in every row and head)
            slots = self.storage.pos[0, 0, :total].argsort()[total - keep :]
        self.settings.mode.compact(self.storage, slots.expand(self.batch_size, self.heads, -1), keep)
        self.ordered = True
        self._ring = None


def band(q: int, kv: int, window: int, device: torch.device) -> torch.Tensor:
    """`[q, kv]` bool: the last `q` of `kv` contiguous positions each see themselves and the `window - 1` before."""
    positions = torch.arange(kv, device=device)
    return visible(positions[kv - q :], positions, window)


def visible(queries: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    """`[q, kv]` bool: a query at position `queries` `[q]` sees a key at `keys` `[kv]` when the key is
    not after it and less than `window` before it (the model's own `i - window < j <= i`)."""
    distance = queries[:, None] - keys[None, :]
    return (distance >= 0) & (distance < window)
