"""`attention_mass` against the attention computed the plain way: every query's masked softmax over every key, in
float64, summed over the queries and the query heads of each KV group. Blocks of a few queries, keys in any order
(as a cache holds them after eviction) and keys no query of a block can see: the keys the blocked path skips must
be exactly those that receive nothing."""

from __future__ import annotations

import pytest
import torch

from kvevict.cache.statistics import probabilities
from kvevict.cache.statistics.probabilities import attention_mass


def plain(query, query_pos, keys, key_pos, scaling):
    b, hq, m, d = query.shape
    hkv, n = keys.shape[1], keys.shape[2]
    q = query.double().reshape(b, hkv, hq // hkv, m, d)
    logits = torch.einsum("bhgmd,bhnd->bhgmn", q, keys.double()) * scaling
    visible = key_pos.expand(b, hkv, n)[:, :, None, None, :] <= query_pos[None, None, None, :, None]
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    return probs.sum(dim=(2, 3)).float()


@pytest.mark.parametrize("query_block", [1, 7, 256])
def test_causal_prefill_equals_the_plain_softmax(query_block, monkeypatch):
    monkeypatch.setattr(probabilities, "QUERY_BLOCK", query_block)
    g = torch.Generator().manual_seed(0)
    query, keys = torch.randn(2, 6, 45, 16, generator=g), torch.randn(2, 3, 45, 16, generator=g)
    positions = torch.arange(45)
    got = attention_mass(query, positions, keys, positions, 0.25)
    torch.testing.assert_close(got, plain(query, positions, keys, positions, 0.25), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_block", [1, 5, 64])
def test_keys_in_any_order_per_row_and_head(query_block, monkeypatch):
    """Each (row, KV head) holds another permutation of positions 0, 2, ..., 138; the queries sit at 60..109, so
    the keys after a block's last query are scattered, not a tail: nothing may be skipped that one of them sees."""
    monkeypatch.setattr(probabilities, "QUERY_BLOCK", query_block)
    g = torch.Generator().manual_seed(1)
    query, keys = torch.randn(2, 6, 50, 8, generator=g), torch.randn(2, 3, 70, 8, generator=g)
    key_pos = torch.stack([torch.randperm(70, generator=g) * 2 for _ in range(6)]).view(2, 3, 70)
    query_pos = torch.arange(60, 110)
    got = attention_mass(query, query_pos, keys, key_pos, 0.3)
    torch.testing.assert_close(got, plain(query, query_pos, keys, key_pos, 0.3), atol=1e-5, rtol=1e-5)


def test_keys_sorted_with_a_tail_no_block_sees(monkeypatch):
    """Keys at 0..79 in order, queries at 10..39: the keys past 39 receive exactly nothing."""
    monkeypatch.setattr(probabilities, "QUERY_BLOCK", 4)
    g = torch.Generator().manual_seed(2)
    query, keys = torch.randn(1, 4, 30, 8, generator=g), torch.randn(1, 2, 80, 8, generator=g)
    got = attention_mass(query, torch.arange(10, 40), keys, torch.arange(80), 0.5)
    torch.testing.assert_close(got, plain(query, torch.arange(10, 40), keys, torch.arange(80), 0.5),
                               atol=1e-5, rtol=1e-5)
    assert (got[:, :, 40:] == 0).all() and (got[:, :, :40] > 0).all()


def test_early_tokens_held_in_the_last_slots_are_not_skipped(monkeypatch):
    """A cache that wrote old tokens into its last slots (positions 0, 1, 2 after 5..79): every query sees them,
    so no block may stop at the first key past its last query."""
    monkeypatch.setattr(probabilities, "QUERY_BLOCK", 4)
    g = torch.Generator().manual_seed(3)
    query, keys = torch.randn(1, 4, 30, 8, generator=g), torch.randn(1, 2, 78, 8, generator=g)
    key_pos = torch.cat([torch.arange(5, 80), torch.arange(3)])
    got = attention_mass(query, torch.arange(10, 40), keys, key_pos, 0.5)
    torch.testing.assert_close(got, plain(query, torch.arange(10, 40), keys, key_pos, 0.5), atol=1e-5, rtol=1e-5)
    assert (got[:, :, -3:] > 0).all()
