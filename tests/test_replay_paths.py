"""Each registered fast path of the chunk replay against the reference stepping, on the architecture matrix.

The same stream goes through two caches, one chunk that evicts token by token inside it after a
prefill: one cache replays it by the registered paths (`replay_paths.PATHS`), the other by the reference
alone (no fast path registered). The logits, the positions each layer holds and every per-slot statistic
must agree, and the fast path must have been the one that ran.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

import kvevict.cache.replay.paths as replay_paths
from architectures import ARCHS, VOCAB
from kvevict import EvictingCache
from kvevict.cache.replay.paths import PATHS, REFERENCE
from kvevict.errors import KvevictError
from kvevict.policies import AttentionRequest, Policy, SlotView
from test_architectures import CACHE_KWARG

from support import counting

BUDGET = 8
TOKENS = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(11))
#: per fast path, policies it applies to (all static, or static and slot-local, scores)
POLICIES = {"closed form": ["window", "sink2+window", "knorm"], "by slot": ["h2o", "snapkv:window=4", "sink2+h2o"]}
CASES = [(arch, positions, path, spec) for arch in ARCHS for positions in arch.positions for path in PATHS
         for spec in POLICIES[path.name] if path.name != "by slot" or positions == "original"]


def _stream(model, spec: str, positions: str, paths, ran: list[str]) -> tuple[torch.Tensor, EvictingCache]:
    """Logits of a 12-token prefill then chunks of 7 under `paths` (the ones the replay may take)."""
    counted = tuple(dataclasses.replace(p, run=counting(p, ran)) for p in paths)
    cache = EvictingCache(model, spec, budget=BUDGET, positions=positions, per_token=True)
    logits = []
    saved = replay_paths.PATHS
    replay_paths.PATHS = counted
    try:
        with torch.inference_mode():
            for start, stop in ((0, 12), (12, 19), (19, 26), (26, 30)):
                logits.append(model(TOKENS[None, start:stop], use_cache=True, **{CACHE_KWARG(model): cache}).logits[0])
    finally:
        replay_paths.PATHS = saved
    return torch.cat(logits), cache


@pytest.mark.parametrize("arch,positions,path,spec", CASES,
                         ids=[f"{a.name}-{p}-{f.name}-{s}" for a, p, f, s in CASES])
def test_a_fast_path_replays_a_chunk_as_the_reference_does(arch, positions, path, spec):
    model = arch.build(seed=2)
    fast_ran, reference_ran = [], []
    fast, fast_cache = _stream(model, spec, positions, (path,), fast_ran)
    slow, slow_cache = _stream(model, spec, positions, (), reference_ran)
    assert set(fast_ran) <= {path.name} and not reference_ran
    # the shift's shortcut declines a chunk whose victims are not the oldest (knorm's may or may not be):
    # the reference replays that one
    assert fast_ran or (positions == "cache" and spec == "knorm")
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-4)
    for a, b in zip(fast_cache.layers, slow_cache.layers):
        assert a.n == b.n
        pos_a, pos_b = a.storage.pos[:, :, : a.n], b.storage.pos[:, :, : b.n]
        order_a, order_b = pos_a.argsort(-1), pos_b.argsort(-1)
        assert torch.equal(pos_a.gather(-1, order_a), pos_b.gather(-1, order_b))
        for name in a.storage.stats:
            if name in b.storage.stats and name != "arrival":  # the arrival statistic is stale after any replay
                torch.testing.assert_close(a.storage.stats[name][:, :, : a.n].gather(-1, order_a),
                                           b.storage.stats[name][:, :, : b.n].gather(-1, order_b))


def test_the_reference_measures_what_a_one_token_forward_measures_and_each_path_declares_its_own():
    assert REFERENCE.measures == {"new", "last", "window", "queries"}
    assert all(path.measures <= REFERENCE.measures for path in PATHS)
    assert [p.name for p in PATHS] == ["closed form", "by slot"]


@dataclass(eq=False)
class _SlotLocalQueries(Policy):
    """A slot-local policy that reads the queries themselves: the by-slot replay path cannot measure them."""

    stats = ("seen_queries",)
    slot_local = True
    needs_attention = True
    requests = ("queries",)

    def spec(self) -> str:
        return "slot-local-queries"

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest:
        return AttentionRequest(kind="queries", stat="seen_queries", size=2, accumulate=False)

    def scores(self, view: SlotView) -> torch.Tensor:
        return view.stats["seen_queries"]


@dataclass(eq=False)
class _Reconstructs(_SlotLocalQueries):
    """A uniform policy asking for a KVzip repeat forward's measurement, which only per-head layers make."""

    slot_local = False
    requests = ("reconstruction",)

    def spec(self) -> str:
        return "uniform-reconstruction"


def test_a_request_no_layer_or_replay_path_can_measure_is_refused_when_the_cache_is_built(tiny):
    with pytest.raises(KvevictError, match="'slot-local-queries' asks for 'queries' measurements, which the chunk "
                                           "replay's by slot path cannot make"):
        EvictingCache(tiny, _SlotLocalQueries(), budget=8, per_token=True)
    EvictingCache(tiny, _SlotLocalQueries(), budget=8)  # one-token forwards measure the queries
    with pytest.raises(KvevictError, match="'uniform-reconstruction' asks for 'reconstruction' measurements, "
                                           "which the EvictingLayer cannot make"):
        EvictingCache(tiny, _Reconstructs(), budget=8)
    for spec in ("h2o", "tova", "snapkv", "expected-attention", "sinkauto4+h2o", "adakv:snapkv", "kvzip"):
        EvictingCache(tiny, spec, budget=64, per_token=True)  # every registered policy's requests are measured
