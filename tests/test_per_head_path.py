"""The per-head layer against the reference eviction step, on the architecture matrix.

The per-head layer (`cache/layers/per_head/`) is the layer kind registered for a policy whose heads may hold different
numbers of entries (`Policy.varies_by_head`: `adakv:P`; `layer_setup.layer_classes`). It does every stage of a
step its own way: ragged storage with holes, attention by hand, the statistics summed back per entry, scores
through a masked view, and Ada-KV's selection over a row's whole allowance. Where that selection is the uniform
one, `adakv:alpha=1:P` (every head keeps at least its whole budget, so exactly its own best `budget`), it must
keep what the reference step keeps for `P` in a uniform layer, and compute the same logits.

The same stream goes through both caches: a prefill within the budget, one-token forwards past it, a chunk
(replayed token by token in both), then one-token forwards again. The uniform cache runs the references alone:
its layers bind no step path but the reference (`step_paths.PATHS` empty) and replay a chunk by stepping
(`replay_paths.PATHS` empty).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvevict.cache.replay.paths as replay_paths
import kvevict.cache.step.paths as step_paths
from architectures import ARCHS, VOCAB
from kvevict import EvictingCache
from kvevict.cache.layers.per_head.layer import RaggedLayer
from test_architectures import CACHE_KWARG

BUDGET = 8
TOKENS = torch.randint(0, VOCAB, (34,), generator=torch.Generator().manual_seed(29))
PIECES = [6] + [1] * 12 + [5] + [1] * 11
assert sum(PIECES) == TOKENS.numel()
#: every kind of score Ada-KV may share across heads: attention sums, the last query, a query window, keys,
#: positions; and sinks pinned outside the allocation
SPECS = ["h2o", "tova", "snapkv:window=4", "knorm", "window", "sink2+h2o"]
CASES = [(arch, spec) for arch in ARCHS if "original" in arch.positions for spec in SPECS]


def _per_head(spec: str) -> str:
    """`spec` with its scoring policy allocated by Ada-KV at alpha=1 (sinks stay outside)."""
    sinks, plus, inner = spec.rpartition("+")
    return f"{sinks}{plus}adakv:alpha=1:{inner}"


def _stream(model, spec: str) -> tuple[torch.Tensor, EvictingCache]:
    """Logits `[1, T, vocab]` of `TOKENS` fed in `PIECES` through a cache running `spec` alone."""
    cache = EvictingCache(model, [spec], budget=BUDGET, positions="original")
    logits, start = [], 0
    saved = step_paths.PATHS, replay_paths.PATHS
    step_paths.PATHS = replay_paths.PATHS = ()  # the references alone (a layer binds its step paths at its first
    try:                                        # forward; a chunk's replay path is chosen as it comes)
        with torch.inference_mode():
            for size in PIECES:
                logits.append(model(TOKENS[None, start:start + size], use_cache=True,
                                    **{CACHE_KWARG(model): cache}).logits)
                start += size
    finally:
        step_paths.PATHS, replay_paths.PATHS = saved
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("arch,spec", CASES, ids=[f"{a.name}-{s}" for a, s in CASES])
def test_the_per_head_layer_keeps_what_the_reference_step_keeps_where_its_allocation_is_uniform(arch, spec):
    model = arch.build(seed=3)
    ragged, ragged_cache = _stream(model, _per_head(spec))
    uniform, uniform_cache = _stream(model, spec)
    per_head = [layer for layer in ragged_cache.layers if isinstance(layer, RaggedLayer)]
    assert per_head and not any(isinstance(layer, RaggedLayer) for layer in uniform_cache.layers)
    # attention by hand against SDPA, over slots in another order: rounding alone
    assert (ragged - uniform).abs().max() <= 1e-5 * uniform.abs().max()
    nll = [F.cross_entropy(x[0, :-1], TOKENS[1:], reduction="none") for x in (ragged, uniform)]
    assert ((nll[0] - nll[1]).abs() <= 1e-5 * nll[1].abs().clamp(min=1.0)).all()
    for a, b in zip(ragged_cache.layers, uniform_cache.layers):
        assert torch.equal(a.head_lengths(), b.head_lengths())
        assert torch.equal(a.kept_positions(), b.kept_positions())
