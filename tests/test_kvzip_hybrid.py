"""KVzip (`kvzip`) on a hybrid model (Gemma 3: sliding-window layers between full-attention ones), against
references computed per kind of layer on plain transformers.

kvpress refuses this model (NVIDIA/kvpress 0.5.5, `kvpress/presses/kvzip_press.py`, `KVzipPress.__call__`):
a sliding layer keeps only the model's last window, which the repeat forwards would push the context's end
out of. kvevict runs each repeat forward against a copy of the sliding layers and scores the full-attention
layers alone. The references: the repeat forwards run on a copy of a plain `DynamicCache` (whose sliding
layers keep their last `window - 1` entries, transformers' `DynamicSlidingWindowLayer`) with an eager
attention that records the full-attention layers' queries and keys and shows each sliding layer's query its
own band; the kept sets of the full-attention layers are kvpress's selection over those layers only; the
sliding layers after compression hold what a plain forward's cache holds; and the compressed cache decodes
as one forward masked per kind of layer.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from architectures import GEMMA_WINDOW, Arch
from kvevict.eval.compress import compress
from kvevict.eval.forward import logits
from test_kvzip import CHUNK, FRAMING, T, causal, causal_attention, keep_by_hand, kept_sets, scores_by_hand

from conftest import random_tokens
from support import attn


def band(m: int, n: int, sliding: bool) -> torch.Tensor:
    """`[1, m, n]` the last `m` of `n` contiguous tokens each seeing the tokens up to itself, and on a
    sliding layer only those less than the window before it (the model's `i - W < j <= i`)."""
    seen = causal(m, n)
    if not sliding:
        return seen
    distance = torch.arange(n - m, n)[:, None] - torch.arange(n)[None, :]
    return seen & (distance < GEMMA_WINDOW)[None]


class HybridRecorder:
    """Eager attention, banded on the sliding layers; per full-attention layer the last call's rotated
    queries `[1, H_q, m, D]`, keys `[1, H_kv, n, D]` and scaling."""

    def __init__(self) -> None:
        self.calls: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        if not module.is_sliding:
            self.calls[module.layer_idx] = (query.clone(), key.clone(), scaling)
        visible = band(query.shape[2], key.shape[2], module.is_sliding)
        return causal_attention(module, query, key, value, visible, scaling)


def full_layers(model) -> list[int]:
    return [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]


@pytest.fixture(scope="module")
def model():
    gemma = Arch("gemma3", ("original",)).build(seed=31).eval()
    assert gemma.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention",
                                        "full_attention"]
    return gemma


@pytest.fixture(scope="module")
def context(model):
    return random_tokens(T, seed=32) % model.config.vocab_size


@pytest.fixture(scope="module")
def by_hand(model, context):
    """`[full layers, H_kv, T]` KVzip's scores of the full-attention layers, the sinks +inf."""
    return scores_by_hand(model, context, HybridRecorder(), full_layers(model))


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("budget", [20, 9])
def test_the_full_attention_layers_keep_the_best_reconstruction_scores(model, context, by_hand, layerwise, budget):
    spec = f"kvzip:layerwise={str(layerwise).lower()},chunk_size={CHUNK}"
    state = compress(model, context, spec, budget, tokenizer=FRAMING)
    ours = kept_sets(state.cache)  # the full-attention layers: sliding ones keep their window, no budget
    expected = keep_by_hand(by_hand, budget, layerwise)  # ranked over the full-attention layers alone
    assert ours.shape == expected.shape == (2, 2, T)
    assert torch.equal(ours, expected), f"{(ours != expected).sum()} entries differ"
    assert int(ours.sum()) == 2 * 2 * budget


def test_the_sliding_layers_hold_what_a_plain_forward_leaves_them(model, context):
    state = compress(model, context, f"kvzip:chunk_size={CHUNK}", 9, tokenizer=FRAMING)
    plain = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(context[None], past_key_values=plain)
    for i, kind in enumerate(model.config.layer_types):
        if kind != "sliding_attention":
            continue
        layer = state.cache.layers[i]
        assert layer.n == layer.seen - (T - GEMMA_WINDOW + 1) == GEMMA_WINDOW - 1
        order = layer.storage.pos[0, 0, : layer.n].argsort()
        assert torch.equal(layer.storage.pos[0, :, : layer.n].gather(1, order.expand(2, -1)),
                           torch.arange(T - GEMMA_WINDOW + 1, T).expand(2, -1))
        torch.testing.assert_close(layer.storage.keys[0][:, order], plain.layers[i].keys[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer.storage.values[0][:, order], plain.layers[i].values[0], rtol=1e-5, atol=1e-5)


class HybridKeptMask:
    """Eager attention: a sliding layer's queries see their band; a full-attention layer's queries after the
    context see, per KV head, only the kept context entries (and the later tokens, causally)."""

    def __init__(self, keep: dict[int, torch.Tensor]) -> None:
        self.keep = keep  # full-attention layer -> [H_kv, T]

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        m, n = query.shape[2], key.shape[2]
        if module.is_sliding:
            return causal_attention(module, query, key, value, band(m, n, True), scaling)
        i = torch.arange(n - m, n)[:, None]
        keep = torch.ones(key.shape[1], n, dtype=torch.bool)
        keep[:, :T] = self.keep[module.layer_idx]
        visible = causal(m, n) & ((i < T)[None] | keep[:, None, :])
        return causal_attention(module, query, key, value, visible, scaling)


def test_the_compressed_cache_decodes_as_a_forward_masked_per_kind_of_layer(model, context, by_hand):
    budget, tail = 12, random_tokens(8, seed=33) % model.config.vocab_size
    state = compress(model, context, f"kvzip:chunk_size={CHUNK}", budget, tokenizer=FRAMING)
    with torch.inference_mode():
        ours = logits(model, state.feed(model, tail))[0]
    keep = dict(zip(full_layers(model), keep_by_hand(by_hand, budget, False)))
    AttentionInterface.register("kvzip_hybrid_kept", HybridKeptMask(keep))
    with attn(model, "kvzip_hybrid_kept"), torch.inference_mode():
        theirs = model(torch.cat([context, tail])[None]).logits[0, T:]
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-4, atol=1e-4)
