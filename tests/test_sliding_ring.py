"""A sliding-window layer's ring: decode steps turn it, a chunk after them still sees its own band.

Gemma 3's local layers hold their last `W - 1` entries. A decode step lets the newest
entry take the oldest one's slot, so after a few steps past the window the slots are out
of positional order; a chunk fed then must still show each query exactly its window.
The reference knows nothing of kvevict: the model's own forward over the whole stream
with SDPA and transformers' sliding-window mask. The full-attention layers hold every
token here (the budget covers the stream), so only the sliding layers bound the cache.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from architectures import GEMMA_WINDOW, VOCAB, Arch
from kvevict import EvictingCache

from support import attn

TOKENS = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(11))
# prefill 3, then decode steps until the ring has turned 17 times (its oldest slot is 17 % 6 = 5, not 0:
# the slots are out of order), a chunk inside the window, 9 steps, a chunk wider than the window, the rest
PIECES = [3] + [1] * 20 + [5] + [1] * 9 + [10] + [1] * 4 + [2] + [1] * 7
assert sum(PIECES) == TOKENS.numel()


def stream_logits(model, policy: str, positions: str) -> tuple[torch.Tensor, bool]:
    """Logits `[T, vocab]` of `TOKENS` fed in `PIECES` through an EvictingCache, and whether the first
    sliding layer's slots were out of positional order right before some chunk after the prefill."""
    cache = EvictingCache(model, policy, budget=TOKENS.numel(), positions=positions)
    # transformers 5.x renamed `past_key_values` to `cache` (5.24 warns on the old name)
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    logits, turned, start = [], False, 0
    with torch.inference_mode():
        for i, size in enumerate(PIECES):
            if i and size > 1 and not turned:
                held = cache.layers[0].storage.pos[0, 0, : cache.layers[0].n]  # layer 0 slides (GEMMA layer_types)
                turned = not torch.equal(held, held.sort().values)
            piece = TOKENS[start : start + size]
            logits.append(model(piece[None], use_cache=True, **{name: cache}).logits[0])
            start += size
    return torch.cat(logits), turned


@pytest.mark.parametrize("positions", ["original", "cache"])
@pytest.mark.parametrize("policy", ["window", "streamingllm"])
def test_chunk_after_turned_ring_matches_the_models_own_window(policy, positions):
    model = Arch("gemma3", ("original", "cache")).build(seed=7)
    assert model.config.layer_types[0] == "sliding_attention"
    with attn(model, "sdpa"), torch.inference_mode():
        expected = model(TOKENS[None]).logits[0]
    got, turned = stream_logits(model, policy, positions)
    assert model.config.sliding_window == GEMMA_WINDOW
    # original positions turn the ring in place; position shift renumbers, so it compacts and stays in order
    assert turned == (positions == "original")
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
