"""Memory given back after compression: a uniform cache's buffers shrink to `budget + slack`
per layer once a long forward evicted, so compressing a prompt saves memory for real."""

from __future__ import annotations

import pytest
import torch

from kvevict import EvictingCache
from kvevict.eval.compress import compress
from kvevict.eval.forward import body

from conftest import make_tiny, random_tokens

MODEL = make_tiny(seed=3, layers=2)
CONFIG = MODEL.config


def room_bytes(rows: int, entries: int) -> int:
    """Bytes of keys and values for `entries` slots per (row, KV head) of one layer, from the config."""
    element = torch.tensor([], dtype=MODEL.dtype).element_size()
    return 2 * rows * CONFIG.num_key_value_heads * entries * CONFIG.head_dim * element


@pytest.mark.parametrize("spec", ["snapkv:window=8", "window", "h2o"])
@pytest.mark.parametrize("chunk", [None, 40])
def test_buffers_shrink_to_the_budget_after_a_long_prefill(spec, chunk):
    """A 200-token prefill (whole, or in chunks of 40 that evict token by token) to a budget of 24
    leaves every layer's buffers at most `budget + slack` slots per (row, KV head)."""
    budget, slack, length = 24, 8, 200
    cache = EvictingCache(MODEL, spec, budget=budget, slack=slack)
    tokens = random_tokens(length)
    step = chunk or length
    with torch.inference_mode():
        for start in range(0, length, step):
            body(MODEL, tokens[None, start : start + step], cache)
    memory = cache.memory()
    assert memory.kv_bytes == CONFIG.num_hidden_layers * room_bytes(1, budget)
    for layer in cache.layers:
        assert layer.memory().allocated_kv_bytes <= room_bytes(1, budget + slack)


def test_compress_gives_back_the_prefill_buffers():
    """`compress` of 300 tokens to 32 for two rows: the buffers hold `budget + slack` (slack 16, the
    cache's default) per layer, far below the full cache of the 300 tokens."""
    budget, rows = 32, 2
    state = compress(MODEL, random_tokens(300), ["snapkv:window=8", "knorm"], budget)
    memory = state.cache.memory()
    assert memory.allocated_kv_bytes <= CONFIG.num_hidden_layers * room_bytes(rows, budget + 16)
    assert memory.full_kv_bytes == CONFIG.num_hidden_layers * room_bytes(rows, 300)
