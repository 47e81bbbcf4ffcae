"""KIVI's per-channel keys (`qB:keys=channel+P`) against independent computations.

The reference is the architecture matrix's eager attention over a full `DynamicCache`, masked to what
the policy keeps, reading images computed here: at a forward that ends with `T` tokens seen, the keys of
every block of `G` positions wholly older than the `residual` (blocks `0 .. (T - residual) // G - 1`)
are each channel's min/max affine codes over the block's `G` keys (evicted ones included), dequantized;
later keys are read at full precision. Values are HQQ's per-token images except the `residual` latest.
In position-shift mode the images are of the un-rotated keys.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from architectures import ARCHS
from kvevict import EvictingCache
from test_architectures import TOKENS, Reference
from test_quantized import GROUP, exact_build, image, matches_images

from support import logits_one_by_one, reference_nll_with


def channel_images(keys: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Keys `[B, H, blocks * group, D]`, each channel quantized over each block of `group` positions."""
    blocks = keys.unflatten(2, (-1, group))  # [B, H, blocks, group, D]
    low, high = blocks.amin(3, keepdim=True), blocks.amax(3, keepdim=True)
    inverse = ((2**bits - 1) / (high - low)).clamp(max=2e4)
    zero = -low * inverse
    codes = (blocks * inverse + zero).round().clamp(0, 2**bits - 1)
    return ((codes - zero) / inverse).flatten(2, 3)


class ChannelReference(Reference):
    def __init__(self, model, rule, cache_mode: bool, bits: int, residual: int, *rest) -> None:
        super().__init__(model, rule, cache_mode, *rest)
        self.bits, self.residual = bits, residual

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        total = key.shape[2]
        done = max(0, total - self.residual) // GROUP * GROUP  # keys in blocks taken by this forward
        key, value = key.clone(), value.clone()
        old = slice(0, max(0, total - self.residual))
        value[:, :, old] = image(value[:, :, old], self.bits)
        if self.cache_mode:
            cos, sin = self.cos_sin(self.kinds[module.layer_idx], torch.arange(total), key.shape[-1])
            factor = getattr(self.rotary, "attention_scaling", 1.0)
            raw = self.turn(key, cos[0], sin[0], -1.0) / factor**2
            raw[:, :, :done] = channel_images(raw[:, :, :done], self.bits, GROUP)
            key[:, :, :done] = self.turn(raw, cos[0], sin[0], 1.0)[:, :, :done]
        else:
            key[:, :, :done] = channel_images(key[:, :, :done], self.bits, GROUP)
        return super().__call__(module, query, key, value, attention_mask, scaling, **kwargs)


def channel_reference_nll(model, rule, cache_mode: bool, bits: int, residual: int) -> torch.Tensor:
    images = lambda m, r, c, *rest: ChannelReference(m, r, c, bits, residual, *rest)  # noqa: E731
    return reference_nll_with(images, model, rule, cache_mode, prefill=1)  # blocks taken token by token


RULES = {"sink4+window": ("band", 4), "h2o:recent=0.5": ("h2o", 0.5)}
CASES = [(a, p) for a in ARCHS for p in a.positions]


def check(model, spec: str, rule, positions: str, bits: int, residual: int) -> None:
    """Token by token from the first token, whatever chunk is asked for: a block is taken at the end of the
    forward that makes it old, so a longer forward would read a block its later tokens complete."""
    ref = channel_reference_nll(model, rule, positions == "cache", bits, residual)
    plain = matches_images(model, spec, positions, ref)
    assert (plain - ref).abs().max() > 1e-3  # the images differ from the entries


@pytest.mark.parametrize("arch,positions", CASES, ids=[f"{a.name}-{p}" for a, p in CASES])
def test_channel_keys_match_masked_reference_of_block_images(arch, positions):
    model = exact_build(arch)
    for spec, rule in RULES.items():
        check(model, f"q4:group={GROUP},keys=channel+{spec}", rule, positions, bits=4, residual=0)


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_channel_keys_with_a_residual(positions):
    model = exact_build(ARCHS[0])
    for spec, rule in RULES.items():
        check(model, f"q4:group={GROUP},residual=5,keys=channel+{spec}", rule, positions, 4, residual=5)


def test_channel_keys_hold_codes_per_entry_and_scales_per_block(tiny):
    """Per entry: the key's codes and the value's codes, scales and zeros; per block still held (one with an
    entry kept in it) a scale and a zero per channel; and the ring of `residual + group - 1` tokens."""
    tokens = TOKENS[:40]
    residual, bits = 3, 4
    cache = EvictingCache(tiny, f"q{bits}:group={GROUP},residual={residual},keys=channel+sink4+window", budget=16,
                          per_token=True)
    with torch.inference_mode():
        tiny(tokens[None, :39], cache=cache, use_cache=True)
        before = cache.kept_positions()[0][0, 0]  # row 0, head 0 (sink4+window: every head keeps the same)
        tiny(tokens[None, 39:], cache=cache, use_cache=True)  # a block emptied before this forward is dropped
    layer = cache.layers[0]
    heads, dim, layers = layer.heads, layer.head_dim, len(cache.layers)
    done = (40 - residual) // GROUP * GROUP
    kept = before
    blocks = torch.unique(kept[kept < done] // GROUP).numel()
    entry = dim * bits // 8 + dim * bits // 8 + 2 * (dim // GROUP) * 4
    ring = 2 * heads * (residual + GROUP - 1) * dim * 4
    table = 2 * heads * blocks * dim * 4
    assert cache.memory().kv_bytes == layers * (heads * 16 * entry + ring + table)


def test_keys_per_channel_read_outlier_channels_better_than_per_token():
    """KIVI's reason, on keys with one outlier channel: per-channel scales keep the other channels."""
    from kvevict.storage_forms import KvQuant

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 64, 16, generator=g)
    keys[..., 3] = keys[..., 3] * 30 + 40
    form = KvQuant(4, 16, keys="channel")
    scale, zero = form.block_scales(keys.unflatten(2, (-1, 16)))
    rows = torch.arange(64) // 16
    s, z = scale[:, :, rows], zero[:, :, rows]
    by_channel = form.decode_keys(form.encode_keys(keys, s, z), s, z, keys.dtype)
    by_token = image(keys, 4, 16)
    torch.testing.assert_close(by_channel, channel_images(keys, 4, 16))
    assert (by_channel - keys).abs().mean() < (by_token - keys).abs().mean() / 3


def test_per_token_keys_match_transformers_quantized_cache_with_quanto(tiny):
    """transformers' `QuantizedCache(backend="quanto")` at its defaults groups keys and values per token
    (axis 0: `group` consecutive channels of one entry), the grouping of kvevict's `keys=token`; quanto's
    MaxOptimizer is the same min/max affine rounding as HQQ with its optimiser off. With residual_length=1
    it re-quantizes everything at every step and reads the newest token at full precision: `residual=1`.
    (Per-channel keys have no schedule in common with it: its axis -1 groups the flattened heads and
    positions, which needs the cache length to be a multiple of the group at every flush.)"""
    pytest.importorskip("optimum.quanto")
    from optimum.quanto.library.extensions.cpp import ext
    from transformers import QuantizedCache

    if not list((Path(ext.build_directory)).glob("*.so")):
        pytest.skip("quanto's CPU kernels compile on first use (a C++ build): build them once with "
                    "python -c 'from optimum.quanto.library.extensions.cpp import ext; ext.lib'")

    model = exact_build(ARCHS[0])
    tokens = TOKENS[:30]
    for bits in (4, 2):
        theirs = QuantizedCache("quanto", model.config, nbits=bits, q_group_size=GROUP, residual_length=1)
        ours = EvictingCache(model, f"q{bits}:group={GROUP},residual=1+full", budget=None)
        plain = EvictingCache(model, "full", budget=None)
        a, b, c = (logits_one_by_one(model, tokens, cache) for cache in (ours, theirs, plain))
        # quanto's images differ from the min/max affine ones by float32 rounding (<= 5e-7 per entry on
        # this float64 model, from a float32 step inside quanto), ~1e-5 on the logits; one code taken
        # differently would move them by a grid step, ~1e-2 here
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert (a - c).abs().max() > 1e-2  # quantization changed the logits
