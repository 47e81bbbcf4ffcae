"""`SlidingLayer`: a sliding-window attention layer (Gemma 3's local layers, Qwen2's upper ones).

The model itself lets query `i` see keys `j` with `i - W < j <= i` (transformers'
`sliding_window_overlay`), so such a layer never needs more than its window: it keeps
the last `W - 1` entries between forwards and the policy does not run in it. The
cache's budget bounds the full-attention layers, which are the ones that grow.

Within a forward of many tokens (a prefill, a chunk) each query sees only its own
window: `window_mask` gives the band (the held entries are the latest tokens), so a chunk is
exact without the token-by-token replay (the band is what one-token forwards would
have seen). In position-shift mode the kept entries are contiguous stream tokens, so
renumbering them `0..L-1` changes no relative distance: RoPE logits are the same.

An engine whose budget holds every layer (`Policy.bounds_every_layer`: llama.cpp's `n_ctx`
cells hold its sliding layers too, which it shifts only when they are full size) makes
this layer run the rows' policy like a full-attention one, at the cache's budget, while
each query still sees only the band of its window over the entries held: llama.cpp masks
by the renumbered positions, which are exactly the held entries' order.
"""

from __future__ import annotations

import torch

from .layer import EvictingLayer
from .layer_settings import LayerSettings


class SlidingLayer(EvictingLayer):
    """Keeps the last `window - 1` entries (the model's own window); no policy, no statistics
    (unless the policy bounds every layer, see the module)."""

    is_sliding = True

    def __init__(self, index: int, settings: LayerSettings) -> None:
        super().__init__(index, settings)
        self.window = int(settings.window)
        self.engine_bounded = any(p.bounds_every_layer for p in settings.layout.policies)

    @property
    def budget(self) -> int | None:
        return self._budget if self.engine_bounded else self.window - 1

    def window_size(self) -> int | None:
        return self.window if self.engine_bounded else None

    def replays(self, q: int) -> bool:
        # the band mask already shows each query its own window, unless the engine's schedule evicts mid-chunk
        return super().replays(q) if self.engine_bounded else False

    def plan(self) -> bool:
        return super().plan() if self.engine_bounded else False  # no policy runs here: nothing to measure

    def evict_deferred(self) -> None:
        if self.engine_bounded:
            super().evict_deferred()
        self.deferred = False  # else its `finish` kept its window already: nothing was held back

    def window_mask(self, q: int) -> torch.Tensor:
        """`[q, n + q]` bool: the held entries are always the latest stream tokens (contiguous), so
        the band of the new queries is the model's own `i - window < j <= i`."""
        return band(q, self.n + q, self.window, self.device)

    def finish(self, query, query_positions, scaling, probs=None) -> None:
        """Drop what fell out of the window: the oldest slots (kept in positional order)."""
        if self.engine_bounded:
            super().finish(query, query_positions, scaling, probs)
            return
        self.pending = False
        total = self.n + self.new
        self.new = 0
        keep = min(total, self.budget)
        if keep < total:
            slots = torch.arange(total - keep, total, device=self.device)
            self.settings.mode.compact(self.storage, slots.expand(self.batch_size, self.heads, -1), keep)
        self.n = keep
        self.fit_storage()


def band(q: int, kv: int, window: int, device: torch.device) -> torch.Tensor:
    """`[q, kv]` bool: the last `q` of `kv` contiguous positions each see themselves and the `window - 1` before."""
    distance = torch.arange(kv - q, kv, device=device)[:, None] - torch.arange(kv, device=device)[None, :]
    return (distance >= 0) & (distance < window)
