"""The closed-form replay's shared plan against the plan made per row and head.

Where every row and KV head holds the same positions with the same scores (a uniform layer under a
position-decided policy: window, sinks + window), the plan of one (row, head) is computed and broadcast
(`replay.chunk.shared`). The reference is the plan made for each row and head, as before: the same
stream, the same logits bit for bit and the same kept positions per layer, row and head, on the
architecture matrix in both position modes, with a batch of two rows; and the shared plan must have run.
"""

from __future__ import annotations

import pytest
import torch

import kvevict.cache.replay.chunk as chunk
from architectures import ARCHS, VOCAB
from kvevict import EvictingCache
from test_architectures import CACHE_KWARG

BUDGET = 8
TOKENS = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(5))
CASES = [(arch, positions, spec) for arch in ARCHS for positions in arch.positions
         for spec in ("window", "sink2+window")]


def _stream(model, spec: str, positions: str) -> tuple[torch.Tensor, EvictingCache]:
    cache = EvictingCache(model, spec, budget=BUDGET, positions=positions, per_token=True)
    logits = []
    with torch.inference_mode():
        for start, stop in ((0, 12), (12, 19), (19, 26), (26, 30)):
            logits.append(model(TOKENS[:, start:stop], use_cache=True, **{CACHE_KWARG(model): cache}).logits)
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("arch,positions,spec", CASES, ids=[f"{a.name}-{p}-{s}" for a, p, s in CASES])
def test_the_shared_plan_replays_as_the_plan_per_row_and_head(arch, positions, spec, monkeypatch):
    model = arch.build(seed=4)
    seen = []

    def spying(pos, scores):
        seen.append(shared(pos, scores))
        return seen[-1]

    shared = chunk.shared
    monkeypatch.setattr(chunk, "shared", spying)
    fast, fast_cache = _stream(model, spec, positions)
    monkeypatch.setattr(chunk, "shared", lambda pos, scores: False)
    slow, slow_cache = _stream(model, spec, positions)
    assert any(seen)
    assert torch.equal(fast, slow)
    for a, b in zip(fast_cache.layers, slow_cache.layers):
        assert torch.equal(a.kept_positions(), b.kept_positions())
