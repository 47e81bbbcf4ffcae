"""What `EvictingCache` does for a policy scored by reconstruction (KVzip, `Policy.reconstructs`): the repeat
forwards' window over a held-back prefill, and the scores they leave, handed out and taken back so that a context
read again at another budget skips them (`eval/reconstruction.py` runs the forwards and files the scores).

A mixin of `EvictingCache`, which holds the layers, the rows and the held-back state it reads
(`layers`, `deferred`, `tokens_seen`, `_model_memo`, `reconstructed`, `_repeating`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..errors import KvevictError
from .layers.interface import CacheLayer


class Reconstructing:
    """The reconstruction pass's side of the cache."""

    @contextmanager
    def reconstructing(self, start: int, end: int) -> Iterator[None]:
        """The forward inside is one of KVzip's repeat forwards over the context chunk `start .. end`: its
        `"reconstruction"` requests score that chunk's entries (`per_head/reconstruction.window_mass`).
        Only a held-back prefill (`defer`) is reconstructed, and the pass writes nothing: afterwards the
        full-attention layers take the forward's tokens back out (`crop`), and each sliding-window layer,
        which keeps only the model's last window (the repeat forward would push the context's end out of
        it), is its own state again: the forward ran against a copy of it (`_aside`), dropped here."""
        if not self.deferred:
            raise KvevictError("a context is reconstructed between a held-back prefill (cache.defer()) and its "
                               "eviction (evict_deferred): defer the prefill first")
        seen = self.tokens_seen
        aside = self._aside()
        self._repeating = (start, end)
        try:
            yield
            fed = self.tokens_seen - seen
        finally:
            self._repeating = None
            for i, layer in aside.items():
                self.layers[i] = layer
        with torch.inference_mode():
            for layer in self.layers:
                if not layer.is_sliding:
                    layer.crop(-fed)
        self.reconstructed = True

    def reconstruction_scores(self) -> list[dict[str, torch.Tensor]]:
        """Per layer, what the reconstruction pass scored (`RaggedLayer.reconstruction_scores`; `{}` for a layer
        it does not score), to be put back after the same prefill read again (`restore_reconstruction`): the
        repeat forwards cost several prefills, and a search compresses one context at several budgets."""
        if not (self.deferred and self.reconstructed):
            raise KvevictError("no reconstruction to keep: reconstruct a held-back prefill first")
        return [layer.reconstruction_scores() if layer.heads_differ else {} for layer in self.layers]

    def restore_reconstruction(self, scores: list[dict[str, torch.Tensor]]) -> bool:
        """Score a held-back prefill with what `reconstruction_scores` kept after the same prefill, instead of
        the repeat forwards. False, with nothing changed, where the scores do not fit this state."""
        layers = self.layers
        if (not self.deferred or len(scores) != len(layers) or not any(layer.heads_differ for layer in layers)
                or any(bool(kept) != layer.heads_differ for kept, layer in zip(scores, layers))):
            return False
        scored = [(layer, kept) for kept, layer in zip(scores, layers) if layer.heads_differ]
        if not all(layer.reconstruction_fits(kept) for layer, kept in scored):  # checked whole before any write
            return False
        for layer, kept in scored:
            layer.restore_reconstruction(kept)
        self.reconstructed = True
        return True

    def _aside(self) -> dict[int, CacheLayer]:
        """Each sliding-window layer, set aside: a copy takes its place (sharing what is the model's) until
        the caller puts the layer back. Its window is `window - 1` entries, so the copy is small."""
        aside = {i: layer for i, layer in enumerate(self.layers) if layer.is_sliding}
        memo = self._model_memo()
        for i, layer in aside.items():
            memo[id(layer.settings)] = layer.settings  # its fixed settings (rows, observers) stay the cache's
            self.layers[i] = copy.deepcopy(layer, memo)
        return aside
