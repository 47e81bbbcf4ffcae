"""fp8 KV storage (`fp8+P`) against independent computations.

The reference is the architecture matrix's eager attention over a full `DynamicCache`, masked to what
the policy keeps, whose keys and values are replaced by their float8 e4m3 images computed here with
torch alone: `(x / scale)` cast to `torch.float8_e4m3fn` (saturating at ±448) and multiplied back, the
scale calibrated once per layer as amax / 448 over the first forward's entries (the prefill of the
budget), per tensor or per KV head, in float32 (float64 for the float64 models here). In
position-shift mode the image is of the un-rotated key.
"""

from __future__ import annotations

import pytest
import torch

from architectures import ARCHS
from kvevict import EvictingCache
from kvevict.errors import KvevictError
from kvevict.policies import parse_policy
from test_architectures import TOKENS, Reference
from test_quantized import exact_build, matches_images

from support import logits_one_by_one, reference_nll_with

E4M3 = torch.float8_e4m3fn
LIMIT = 448.0  # e4m3's largest finite value


def fp8_scale(x: torch.Tensor, per_head: bool) -> torch.Tensor:
    """amax / 448 of `x` `[B, H, T, D]`, over all of it or per KV head."""
    dims = (0, 2, 3) if per_head else (0, 1, 2, 3)
    return x.abs().amax(dim=dims, keepdim=True).to(torch.promote_types(x.dtype, torch.float32)) / LIMIT


def fp8_image(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 scales and arithmetic (float64 for a float64 model), as vLLM's and transformers' fp8 caches."""
    return ((x.to(scale.dtype) / scale).clamp(-LIMIT, LIMIT).to(E4M3).to(scale.dtype) * scale).to(x.dtype)


class Fp8Reference(Reference):
    """The matrix reference reading the fp8 images of every key and value, scales from the first forward."""

    def __init__(self, model, rule, cache_mode: bool, per_head: bool, *rest) -> None:
        super().__init__(model, rule, cache_mode, *rest)
        self.per_head = per_head
        self.scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        total, layer = key.shape[2], module.layer_idx
        held = key
        if self.cache_mode:  # the held key is the un-rotated one
            cos, sin = self.cos_sin(self.kinds[layer], torch.arange(total), key.shape[-1])
            factor = getattr(self.rotary, "attention_scaling", 1.0)
            held = self.turn(key, cos[0], sin[0], -1.0) / factor**2
        if layer not in self.scales:  # the first forward: the budget's prefill
            self.scales[layer] = (fp8_scale(held, self.per_head), fp8_scale(value, self.per_head))
        key_scale, value_scale = self.scales[layer]
        value = fp8_image(value, value_scale)
        key = fp8_image(held, key_scale)
        if self.cache_mode:
            key = self.turn(key, cos[0], sin[0], 1.0)
        return super().__call__(module, query, key, value, attention_mask, scaling, **kwargs)


def fp8_reference_nll(model, rule, cache_mode: bool, per_head: bool) -> torch.Tensor:
    return reference_nll_with(lambda m, r, c, *rest: Fp8Reference(m, r, c, per_head, *rest), model, rule, cache_mode)


RULES = {"sink4+window": ("band", 4), "h2o:recent=0.5": ("h2o", 0.5)}
CASES = [(a, p) for a in ARCHS for p in a.positions]


#: how far the NLL may lie from the reference's. In position-shift mode the engine re-rotates keys with its
#: rotary tables and the reference with its own arithmetic, ~1e-7 apart even in float64 (6e-7 on Gemma 3's
#: values after one layer): e4m3's 3-bit mantissa turns that into an occasional code one step off, which
#: moved Gemma 3's NLL by 6.5e-4. Original positions hold the keys as the model made them.
TOLERANCE = {"original": 1e-4, "cache": 2e-3}


def check(model, spec: str, rule, positions: str, per_head: bool) -> None:
    ref = fp8_reference_nll(model, rule, positions == "cache", per_head)
    plain = matches_images(model, spec, positions, ref, TOLERANCE[positions])
    gap = ((plain - ref).abs() / ref.abs().clamp(min=1.0)).max()
    assert gap > 2 * TOLERANCE[positions], f"{spec} {positions}: fp8 moved the NLL by only {gap:.2e}"


@pytest.mark.parametrize("arch,positions", CASES, ids=[f"{a.name}-{p}" for a, p in CASES])
def test_fp8_matrix_matches_masked_reference_of_images(arch, positions):
    model = exact_build(arch)
    for spec, rule in RULES.items():
        check(model, f"fp8+{spec}", rule, positions, per_head=False)


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_fp8_per_head_scales_match_their_images(positions):
    model = exact_build(ARCHS[0])
    check(model, "fp8:scale=head+sink4+window", RULES["sink4+window"], positions, per_head=True)


def test_fp8_matches_transformers_quantized_cache_token_by_token(tiny):
    """transformers' `QuantizedCache(backend="fp8")`: per-tensor e4m3, the scale set by the first update
    (amax / 448) and frozen. It reads its first update at full precision and every later one as images;
    kvevict reads every forward's entries as images, so the first update here returns its images too
    (the one schedule difference, made the same)."""
    from transformers import QuantizedCache
    from transformers.cache_utils import Fp8QuantizedLayer

    class ImagesFromTheStart(Fp8QuantizedLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            first = not self.is_initialized
            out = super().update(key_states, value_states, *args, **kwargs)
            if first:
                return self._dequantize(self._quantized_keys), self._dequantize(self._quantized_values)
            return out

    tokens = TOKENS[:30]
    theirs = QuantizedCache("fp8", tiny.config)
    theirs.layers = [ImagesFromTheStart() for _ in theirs.layers]
    ours = EvictingCache(tiny, "fp8+full", budget=None)
    plain = EvictingCache(tiny, "full", budget=None)
    a, b, c = (logits_one_by_one(tiny, tokens, cache) for cache in (ours, theirs, plain))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (a - c).abs().max() > 1e-3  # fp8 changed the logits: the match is not two full caches


def test_fp8_holds_one_byte_per_channel_and_its_scales(tiny):
    """memory() counts the float8 codes (one byte per channel of each key and value) and the float32
    scales per layer (2, or 2 per KV head); between forwards only these and the one working buffer the
    layers take turns decoding into (the largest layer's slots at float32)."""
    tokens = TOKENS[:40]
    for scale, per_layer in (("tensor", 2), ("head", None)):
        cache = EvictingCache(tiny, f"fp8:scale={scale}+sink4+window", budget=16, per_token=True)
        with torch.inference_mode():
            tiny(tokens[None], cache=cache, use_cache=True)
        memory = cache.memory()
        layers, heads, dim = len(cache.layers), cache.layers[0].heads, cache.layers[0].head_dim
        scales = layers * 4 * (per_layer or 2 * heads)
        assert memory.kv_bytes == layers * heads * 16 * 2 * dim + scales
        assert memory.kv_bytes_bf16 == memory.kv_bytes  # nothing is held at the model's dtype
        assert memory.kv_bytes < memory.full_kv_bytes * 16 / 40 / 2  # half of a float16 entry, float32 here
        held = sum(b.numel() * b.element_size() for layer in cache.layers for b in layer.storage.held.values())
        assert all(layer.storage._kv is None for layer in cache.layers)
        one_copy = max(2 * heads * layer.storage.capacity * dim * 4 for layer in cache.layers)
        assert memory.allocated_kv_bytes == held + scales + one_copy


def test_fp8_codes_are_e4m3_of_the_scaled_entries():
    from kvevict.storage_forms import Fp8

    x = torch.randn(2, 1, 3, 5, 16, generator=torch.Generator().manual_seed(0)) * 3
    for scale, per_head in (("tensor", False), ("head", True)):
        form, state = Fp8(8, scale), {}
        held = form.encode(x, state)
        assert held["codes"].dtype == torch.uint8 and held["codes"].shape == x.shape
        expect = [fp8_image(part, fp8_scale(part, per_head)) for part in x]
        torch.testing.assert_close(form.decode(held, x.dtype, state), torch.stack(expect), rtol=0, atol=0)
        later = form.encode(x * 10, state)  # frozen scales: beyond the calibrated range, saturated
        assert form.decode(later, x.dtype, state).abs().amax() <= x.abs().amax() * (1 + 1e-6)


@pytest.mark.parametrize("spec,needle", [
    ("fp16+window", "use fp8"),
    ("fp8:scale=row+window", "scale=tensor or scale=head"),
    ("fp8:bits=8+window", "sets bits twice"),
    ("fp8+q4+window", "quantizes twice"),
    ("fp8+adakv:snapkv", "per-head layers"),
])
def test_bad_fp8_specs_are_one_line(spec, needle):
    with pytest.raises(KvevictError, match=needle) as info:
        parse_policy(spec)
    assert "\n" not in str(info.value)


def test_fp8_rows_run_in_a_batch_of_their_own():
    from kvevict.policies import shared_batches

    specs = ["window", "fp8+window", "q8+window", "fp8+h2o", "fp8:scale=head+h2o"]
    assert shared_batches(specs) == [["window"], ["fp8+window", "fp8+h2o"], ["q8+window"], ["fp8:scale=head+h2o"]]
