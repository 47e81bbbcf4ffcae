"""A chunk read after held entries attends with its causal mask made a block of queries at a time.

`statistics.probabilities.causal_sdpa` keeps the float32 mask SDPA makes of a `[q, n]` bool mask within the
layer's workspace. The references are independent of it: one SDPA call with the whole mask written here
(`tril` shifted by the entries before the chunk), and a model's own forward over the whole stream with no
cache; a tiny workspace forces blocks of a few queries, and the blocks must have been used.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvevict.cache.statistics.probabilities as probabilities
from architectures import ARCHS, VOCAB
from kvevict import EvictingCache
from kvevict.attention_stats import Workspace
from test_architectures import CACHE_KWARG

TOKENS = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(8))


@pytest.mark.parametrize("q,n", [(7, 7), (5, 23), (16, 50), (1, 9)])
def test_blocks_of_queries_give_the_whole_masks_attention(q, n):
    g = torch.Generator().manual_seed(q * n)
    query, key, value = (torch.randn(2, 6, q, 16, generator=g), torch.randn(2, 3, n, 16, generator=g),
                         torch.randn(2, 3, n, 16, generator=g))
    whole = torch.ones(q, n, dtype=torch.bool).tril(diagonal=n - q)  # query i sees keys 0 .. n - q + i
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=whole, scale=0.25, enable_gqa=True)
    blocked = probabilities.causal_sdpa(query, key, value, 0.25, Workspace(4 * 2 * n))  # two queries a block
    torch.testing.assert_close(blocked, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a.name in ("llama3", "qwen3")], ids=lambda a: a.name)
def test_a_chunk_after_held_entries_matches_the_uncached_forward_in_blocks(arch, monkeypatch):
    model = arch.build(seed=3)
    calls = []
    real = probabilities.sdpa

    def counted(query, *args):
        calls.append(query.shape[2])
        return real(query, *args)

    monkeypatch.setattr(probabilities, "sdpa", counted)
    cache = EvictingCache(model, "h2o", budget=100, workspace=Workspace(4 * 3 * 40))  # 3 queries of 40 keys
    kwarg = {CACHE_KWARG(model): cache}
    with torch.inference_mode():
        first = model(TOKENS[:, :12], use_cache=True, **kwarg).logits  # no entries before it: SDPA's own causal
        calls.clear()
        logits = torch.cat([first, model(TOKENS[:, 12:], use_cache=True, **kwarg).logits], dim=1)
        reference = model(TOKENS, use_cache=False).logits
    assert calls and max(calls) <= 3  # the 28-token chunk went in blocks of at most three queries
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
