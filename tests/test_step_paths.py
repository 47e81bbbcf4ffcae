"""Each registered fast path of a uniform layer's eviction step against the reference step, on the architecture
matrix.

The same stream goes through two caches: a prefill, one-token forwards, a chunk (which compacts, so a ring must
start again from positional order), then one-token forwards again. One cache's layers bind the path under test
before the reference (`step_paths.PATHS` holds it alone), the other's bind the reference alone. The logits, the
positions each layer holds, every per-slot statistic and what the observers were told (when token 0 left each
layer and head) must agree, and the fast path must have taken steps.

A path's kept set is the reference's for every policy whose scores do not depend on which slot holds an entry.
`random` draws one number per slot, so after an in-place step it draws them over another layout than the
reference's compaction: as random, not equal; it is left out here (the chunk replay keeps the in-place layout,
`stepping.Stepper`, so its chunks agree with one-token forwards).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import kvevict.cache.step.paths as step_paths
from architectures import ARCHS, VOCAB
from kvevict import EvictingCache
from kvevict.cache.layers.uniform import EvictingLayer
from kvevict.cache.observers import SinkTracker
from kvevict.cache.step.paths import PATHS, REFERENCE
from kvevict.errors import KvevictError
from kvevict.policies import AttentionRequest, SlotView
from kvevict.policies.window import Window
from test_architectures import CACHE_KWARG

from support import counting

BUDGET = 8
TOKENS = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(13))
#: a prefill within the budget, one-token steps past it (token 0 leaves `window` at a step), a chunk, steps again
PIECES = [6] + [1] * 16 + [5] + [1] * 13
assert sum(PIECES) == TOKENS.numel()
#: per fast path, the policies (one per row) it takes: first-in-first-out ones for the ring; for in place,
#: every kind of score (attention sums, the last query, a query window, keys, positions) and rows mixed
POLICIES = {
    "ring": [["window"], ["sink2+window"], ["window", "window"]],
    "in place": [["h2o"], ["tova"], ["snapkv:window=4"], ["knorm"], ["keydiff"], ["sink2+h2o"], ["window"],
                 ["window", "h2o"]],
}
CASES = [(arch, path, specs) for arch in ARCHS for path in PATHS for specs in POLICIES[path.name]]


def _stream(model, specs: list[str], positions: str, paths, ran: list[str]) -> tuple[torch.Tensor, EvictingCache]:
    """Logits `[rows, T, vocab]` of `TOKENS` fed in `PIECES`, the layers binding `paths` before the reference."""
    counted = tuple(dataclasses.replace(p, run=counting(p, ran)) for p in paths)
    cache = EvictingCache(model, specs, budget=BUDGET, positions=positions)
    rows, logits, start = len(specs), [], 0
    saved = step_paths.PATHS
    step_paths.PATHS = counted  # read when each layer binds its paths, at its first forward
    try:
        with torch.inference_mode():
            for size in PIECES:
                piece = TOKENS[None, start : start + size].expand(rows, -1)
                logits.append(model(piece, use_cache=True, **{CACHE_KWARG(model): cache}).logits)
                start += size
    finally:
        step_paths.PATHS = saved
    return torch.cat(logits, dim=1), cache


def _by_position(layer, x: torch.Tensor) -> torch.Tensor:
    """`x` `[B, H_kv, capacity]` at the layer's held slots, in positional order."""
    pos = layer.storage.pos[:, :, : layer.n]
    return x[:, :, : layer.n].gather(-1, pos.argsort(dim=-1))


@pytest.mark.parametrize("arch,path,specs", CASES, ids=[f"{a.name}-{p.name}-{'|'.join(s)}" for a, p, s in CASES])
def test_a_fast_path_evicts_as_the_reference_step_does(arch, path, specs):
    model = arch.build(seed=3)
    fast_ran, reference_ran = [], []
    fast, fast_cache = _stream(model, specs, "original", (path,), fast_ran)
    slow, slow_cache = _stream(model, specs, "original", (), reference_ran)
    assert fast_ran and set(fast_ran) <= {path.name} and not reference_ran
    # the slots hold the same entries in another order, so attention sums in another order: rounding alone
    assert (fast - slow).abs().max() <= 1e-5 * slow.abs().max()
    nll = [F.cross_entropy(x[:, :-1].flatten(0, 1), TOKENS[1:].repeat(len(specs)), reduction="none")
           for x in (fast, slow)]
    assert ((nll[0] - nll[1]).abs() <= 1e-5 * nll[1].abs().clamp(min=1.0)).all()
    for a, b in zip(fast_cache.layers, slow_cache.layers):
        assert a.n == b.n
        assert not isinstance(a, EvictingLayer) or a.statistics.views is None  # no plan held past its forward
        assert torch.equal(_by_position(a, a.storage.pos), _by_position(b, b.storage.pos))
        for name in a.storage.stats:
            torch.testing.assert_close(_by_position(a, a.storage.stats[name]), _by_position(b, b.storage.stats[name]),
                                       rtol=1e-5, atol=1e-7)
    lost = [next(o for o in c.observers if isinstance(o, SinkTracker)).lost_at(len(c.layers), c.layers[0].heads)
            for c in (fast_cache, slow_cache)]
    assert torch.equal(lost[0], lost[1])  # a victim reported (ring, in place) or what stayed (the reference)


ROTARY = [arch for arch in ARCHS if "cache" in arch.positions]


@pytest.mark.parametrize("arch", ROTARY, ids=[a.name for a in ROTARY])
def test_no_fast_path_binds_where_an_eviction_renumbers_the_keys(arch):
    """In position-shift mode a key's rotation is its slot: an eviction compacts, so only the reference binds
    (the stream then is the reference's whatever `PATHS` holds)."""
    model = arch.build(seed=3)
    cache = EvictingCache(model, ["window", "h2o"], budget=BUDGET, positions="cache")
    with torch.inference_mode():
        model(TOKENS[None, :12].expand(2, -1), use_cache=True, **{CACHE_KWARG(model): cache})
    uniform = [layer for layer in cache.layers if isinstance(layer, EvictingLayer)]
    assert uniform and all(layer.steps == (REFERENCE,) for layer in uniform)


@pytest.mark.parametrize("specs,positions,bound", [
    (["window"], "original", ["ring", "in place", "reference"]),
    (["sink4+window"], "original", ["ring", "in place", "reference"]),
    (["window", "sink4+window"], "original", ["in place", "reference"]),  # two rings: none for the layer
    (["h2o"], "original", ["in place", "reference"]),
    (["window"], "cache", ["reference"]),
])
def test_each_layer_binds_the_paths_its_settings_allow_once(tiny, specs, positions, bound):
    cache = EvictingCache(tiny, specs, budget=BUDGET, positions=positions)
    with torch.inference_mode():
        for start, stop in ((0, 12), (12, 13), (13, 14)):
            tiny(TOKENS[None, start:stop].expand(len(specs), -1), use_cache=True, **{CACHE_KWARG(tiny): cache})
    assert all([p.name for p in layer.steps] == bound for layer in cache.layers)
    assert all(first is again for first, again in zip(cache.layers[0].steps, step_paths.bind(cache.layers[0])))


def test_the_reference_measures_what_a_layer_measures_and_each_path_declares_its_own():
    assert REFERENCE.measures == EvictingLayer.measures
    assert [p.name for p in PATHS] == ["ring", "in place"]
    assert {p.name: p.measures for p in PATHS} == {"ring": frozenset(), "in place": REFERENCE.measures}


@dataclass(eq=False)
class _FifoAttention(Window):
    """A first-in-first-out policy that asks for attention: the ring path that takes its rows measures nothing."""

    stats = ("mass",)
    requests = ("new",)

    def spec(self) -> str:
        return "fifo-attention"

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest:
        return AttentionRequest(kind="new", stat="mass")


def test_a_request_the_ring_cannot_measure_is_refused_when_the_cache_is_built(tiny):
    assert _FifoAttention().fifo_after == 0
    with pytest.raises(KvevictError, match="'fifo-attention' asks for 'new' measurements, which the eviction "
                                           "step's ring path cannot make: a first-in-first-out policy"):
        EvictingCache(tiny, _FifoAttention(), budget=BUDGET)
