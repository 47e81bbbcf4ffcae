"""Reading a prompt into a cache whose rows are policies: one prefill, compressed at a budget, copied, left whole.

What every protocol is built from (`protocol_kinds/`): `prefill` reads ids into one cache
for a batch of policy rows (the shared prefix fed once), `compress_at` compresses a state
whose eviction was held back, `snapshot` copies a state so that several questions start
from the same one, and `whole` turns a held-back state into the full cache.

The engine (`cache/cache.py`, which imports transformers' cache machinery and, with HQQ installed, HQQ
and torch's compiler stack: seconds) is imported where the cache is built, not at the top: `kvevict ruler`
checks its grid before its model load through the protocols, which import this module, and without the engine.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ...defaults import DEFAULT_CHUNK
from ...errors import KvevictError
from ..compress import Compressed
from ..forward import body
from ..reconstruction import KeptScores, reconstruct, reconstructing_policy


def prefill(model, ids: torch.Tensor, specs: list[str], entries: int | None, positions: str,
            stream: bool = False, chunk: int = DEFAULT_CHUNK, defer: bool = False, tokenizer=None,
            kept: KeptScores | None = None) -> Compressed:
    """Read `ids` `[T]` into one cache whose rows are `specs`, the shared prefix fed once.

    Without `stream`, one forward reads all of it and each row's policy then compresses
    to `entries` (the SnapKV/kvpress protocol). With `stream`, the cache is exact per
    token: the first `entries` tokens go in one forward (nothing is evicted before the
    cache is full), the rest in chunks of `chunk` tokens, every row fed its own copy.
    With `defer` (where the cache can, `EvictingCache.can_defer`), the forward measures
    what the policies need and evicts nothing: `compress_at` then compresses copies of
    the state at any budget (`state.cache.deferred` says whether it did). A policy scored by
    reconstruction (`kvzip`) always holds its prefill back, and the context is reconstructed
    (`tokenizer`: the model's) before any budget compresses it, or scored from `kept` where it holds this
    context's scores (`reconstruction.KeptScores`).
    """
    from ...cache.cache import EvictingCache  # here, not at the top (module docstring)

    rows = len(specs)
    with torch.inference_mode():
        cache = EvictingCache(model, specs, budget=entries, positions=positions, per_token=stream)
        scored = entries is not None and reconstructing_policy(cache) is not None
        if scored and (stream or not cache.can_defer):
            raise KvevictError(
                f"'{specs[0]}' scores a context by reconstructing it once it is read, and this protocol evicts as it "
                "reads: run it under agnostic, aware or multi --form requests"
            )
        if (defer or scored) and not stream and entries is not None and cache.can_defer:
            cache.defer()
        head = ids.numel() if not stream or entries is None else min(entries, ids.numel())
        hidden = body(model, ids[None, :head].long(), cache)[:, -1]
        if scored:
            reconstruct(model, cache, ids, tokenizer, kept)
            if not defer:
                cache.evict_deferred()
        for start in range(head, ids.numel(), chunk):
            piece = ids[start : start + chunk].long()
            hidden = body(model, piece[None].expand(rows, -1), cache)[:, -1]
    return Compressed(cache, hidden.expand(rows, -1).clone(), ids.numel(), cache.budget,
                      [p.spec() for p in cache.policies]).measure()


def compress_at(state: Compressed, entries: int) -> Compressed:
    """Compress a state `prefill(..., defer=True)` held back to `entries` (in place; returns it)."""
    with torch.inference_mode():
        state.cache.budget = entries
        state.cache.evict_deferred()
    state.budget = state.cache.budget
    return state.measure()


def snapshot(state: Compressed) -> Compressed:
    """An independent copy of a compressed state: its cache copied (`EvictingCache.copy`, which shares
    what is the model's), its hidden state cloned."""
    return replace(state, cache=state.cache.copy(), hidden=state.hidden.clone(), policies=list(state.policies))


def whole(state: Compressed) -> Compressed:
    """A state `prefill(..., defer=True)` held back, left whole: the full cache, one row (in place).

    Nothing was evicted, and every row holds the same entries, so row 0 is the full
    cache's state: the same keys and values, the same next hidden state.
    """
    with torch.inference_mode():
        state.cache.budget = None
        state.cache.evict_deferred()  # at no budget: nothing goes, the layers stop holding back
        state.cache.freeze(final=True)
        state.keep_rows([0])
    state.policies, state.budget = ["full"], None
    return state.measure()
