"""Quantized KV storage (`qB+P`) against independent computations.

The reference is the architecture matrix's eager attention over a full `DynamicCache`, masked to
what the policy keeps, whose keys and values are replaced by their quantize -> dequantize images
computed here with HQQ's quantizer directly (no kvevict code): an entry is read at full precision
while it is among the `residual` most recent tokens at the end of its forward, as its image after.
In position-shift mode the image is of the un-rotated key, rotated to its place afterwards.
"""

from __future__ import annotations

import pytest
import torch
from hqq.core.quantize import Quantizer

from architectures import ARCHS
from kvevict import EvictingCache, compare
from kvevict.cache.storage import quant_backend
from kvevict.errors import KvevictError
from kvevict.policies import parse_policy
from test_architectures import BUDGET, TOKENS, Reference

from support import logits_one_by_one, reference_nll_with

GROUP = 8  # the tiny models' head_dim is 16


def image(x: torch.Tensor, bits: int, group: int = GROUP) -> torch.Tensor:
    """`x` `[..., D]` quantized per entry in groups of `group` channels and dequantized, by HQQ alone."""
    codes, meta = Quantizer.quantize(x.reshape(-1, x.shape[-1]), nbits=bits, group_size=group,
                                     optimize=False, axis=1, bitpack=False, device=x.device)
    meta.update(compute_dtype=x.dtype, scale=meta["scale"].to(x.dtype), zero=meta["zero"].to(x.dtype))
    return Quantizer.dequantize(codes, meta).reshape(x.shape)


class QuantReference(Reference):
    """The matrix reference reading images of every key and value older than the `residual` latest."""

    def __init__(self, model, rule, cache_mode: bool, bits: int, residual: int, *rest) -> None:
        super().__init__(model, rule, cache_mode, *rest)
        self.bits, self.residual = bits, residual

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        total = key.shape[2]
        old = slice(0, max(0, total - self.residual))  # read as images at this forward
        key, value = key.clone(), value.clone()
        value[:, :, old] = image(value[:, :, old], self.bits)
        if self.cache_mode:  # the held key is the un-rotated one
            cos, sin = self.cos_sin(self.kinds[module.layer_idx], torch.arange(total), key.shape[-1])
            scale = getattr(self.rotary, "attention_scaling", 1.0)
            raw = self.turn(key, cos[0], sin[0], -1.0) / scale**2
            key[:, :, old] = self.turn(image(raw, self.bits), cos[0], sin[0], 1.0)[:, :, old]
        else:
            key[:, :, old] = image(key[:, :, old], self.bits)
        return super().__call__(module, query, key, value, attention_mask, scaling, **kwargs)


def quant_reference_nll(model, rule, cache_mode: bool, bits: int, residual: int = 0) -> torch.Tensor:
    """With a residual, token by token from the first token: a forward of many tokens would read its own
    older tokens as images, where a decode step reads each recent one at full precision."""
    images = lambda m, r, c, *rest: QuantReference(m, r, c, bits, residual, *rest)  # noqa: E731
    return reference_nll_with(images, model, rule, cache_mode, prefill=1 if residual else None)


def exact_build(arch):
    """The tiny model in float64. Quantization rounds each entry to a grid, so an entry that sits on a
    rounding boundary takes one code or the next on float noise alone: in float32 the engine's keys and the
    reference's differ by ~1e-7 (another matmul order, another thread count), enough to flip a code and move
    the NLL ~1e-3. In float64 that noise is ~1e-16, and both sides quantize the same numbers."""
    return arch.build(seed=3, dtype=torch.float64)


RULES = {"sink4+window": ("band", 4), "h2o:recent=0.5": ("h2o", 0.5)}
CASES = [(a, p) for a in ARCHS for p in a.positions]


def matches_images(model, spec: str, positions: str, ref: torch.Tensor, tolerance: float = 1e-4) -> torch.Tensor:
    """Every storage form's exactness check: `spec` streamed by `compare` in chunks of 1 and of 7 gives the
    reference's NLL `ref` `[T-1]` within `tolerance` (relative). Returns the NLL of the same policy held
    unquantized (the spec after its storage prefix), so the caller can assert that the images moved it:
    the check is not the unquantized cache passing again."""
    for chunk in (1, 7):
        row = compare(model, TOKENS, [spec], BUDGET, positions, reference=False, progress=False, chunk=chunk)[0][0]
        err = ((row.nll - ref).abs() / ref.abs().clamp(min=1.0)).max()
        assert err < tolerance, f"{spec} {positions} chunk {chunk}: {err:.2e}"
    policy = spec.split("+", 1)[1]
    return compare(model, TOKENS, [policy], BUDGET, positions, reference=False, progress=False)[0][0].nll


def check(model, spec: str, rule, positions: str, bits: int, residual: int) -> None:
    ref = quant_reference_nll(model, rule, positions == "cache", bits, residual)
    plain = matches_images(model, spec, positions, ref)
    assert (plain - ref).abs().max() > 1e-3


@pytest.mark.parametrize("arch,positions", CASES, ids=[f"{a.name}-{p}" for a, p in CASES])
def test_quantized_matrix_matches_masked_reference_of_images(arch, positions):
    model = exact_build(arch)
    for spec, rule in RULES.items():
        check(model, f"q4:group={GROUP}+{spec}", rule, positions, bits=4, residual=0)


@pytest.mark.parametrize("bits", [8, 2])
def test_every_width_matches_its_images(bits):
    model = exact_build(ARCHS[0])
    check(model, f"q{bits}:group={GROUP}+sink4+window", RULES["sink4+window"], "original", bits, residual=0)


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_residual_reads_the_latest_tokens_at_full_precision(positions):
    model = exact_build(ARCHS[0])
    for spec, rule in RULES.items():
        check(model, f"q4:group={GROUP},residual=5+{spec}", rule, positions, 4, residual=5)


def test_held_bytes_are_codes_scales_zeros_and_residual(tiny):
    """memory() counts the tensors kept: per entry D*bits/8 code bytes and D/group scales and zeros, for the
    key and the value, plus the residual ring; bf16 counts those floats at 2 bytes."""
    tokens = TOKENS[:40]
    for bits, residual in ((4, 0), (2, 6), (8, 3)):
        cache = EvictingCache(tiny, f"q{bits}:group={GROUP},residual={residual}+sink4+window", budget=16,
                              per_token=True)
        with torch.inference_mode():
            tiny(tokens[None], cache=cache, use_cache=True)
        memory = cache.memory()
        layers, heads, dim = len(cache.layers), cache.layers[0].heads, cache.layers[0].head_dim
        groups = dim // GROUP
        held = {name: sum(b.numel() * b.element_size() for b in layer.storage.held.values())
                for name, layer in enumerate(cache.layers)}
        entries = layers * heads * 16
        per_entry = 2 * (dim * bits // 8 + 2 * groups * 4)  # float32 scales and zeros
        ring = layers * 2 * heads * residual * dim * 4
        assert memory.kv_bytes == entries * per_entry + ring
        assert memory.kv_bytes_bf16 == entries * 2 * (dim * bits // 8 + 2 * groups * 2) + ring // 2
        assert memory.kv_bytes < memory.full_kv_bytes * 16 / 40
        # what is allocated between forwards is the held form, and the one working buffer the layers take
        # turns decoding into (the largest layer's slots at float32), not a working copy per layer
        assert all(layer.storage._kv is None for layer in cache.layers)
        one_copy = max(2 * heads * layer.storage.capacity * dim * 4 for layer in cache.layers)
        assert memory.allocated_kv_bytes == sum(held.values()) + ring + one_copy


def test_codes_are_packed_per_entry():
    """Two 4-bit or four 2-bit codes per byte, and an entry's bytes are its own: quantizing one entry alone
    gives the bytes it has among others."""
    x = torch.randn(2, 3, 5, 16, generator=torch.Generator().manual_seed(0))
    for bits in (8, 4, 2):
        held = quant_backend.quantize(x, bits, GROUP)
        assert held.codes.dtype == torch.uint8 and held.codes.shape == (2, 3, 5, 16 * bits // 8)
        assert held.scale.shape == held.zero.shape == (2, 3, 5, 16 // GROUP)
        alone = quant_backend.quantize(x[:, 1:2, 3:4], bits, GROUP)
        assert torch.equal(alone.codes, held.codes[:, 1:2, 3:4])
        torch.testing.assert_close(quant_backend.dequantize(held, bits, GROUP, x.dtype), image(x, bits))


def test_rows_of_different_widths_are_refused_in_one_cache(tiny):
    with pytest.raises(KvevictError, match="storage form") as info:
        EvictingCache(tiny, [f"q4:group={GROUP}+window", "window"], budget=16)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("spec,needle", [
    ("q3+window", "q8, q4 or q2"),
    ("q4:group=0+window", "positive"),
    ("q4:keys=head+window", "keys=token"),
    ("q4+adakv:snapkv", "per-head layers"),
    ("q4", r"qB\+<policy>"),
])
def test_bad_quantization_specs_are_one_line(spec, needle):
    with pytest.raises(KvevictError, match=needle) as info:
        parse_policy(spec)
    assert "\n" not in str(info.value)


def test_group_must_divide_head_dim(tiny):
    with pytest.raises(KvevictError, match="does not divide this model's head_dim 16") as info:
        EvictingCache(tiny, "q4:group=32+window", budget=16)
    assert "group=16" in str(info.value)


# --- every policy: the quantized cache is the unquantized engine fed the images ------------------------------

def _stream(model, cache, tokens: torch.Tensor, chunk: int) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        out.append(model(tokens[None, :BUDGET], cache=cache, use_cache=True).logits[0])
        for start in range(BUDGET, tokens.numel(), chunk):
            out.append(model(tokens[None, start:start + chunk], cache=cache, use_cache=True).logits[0])
    return torch.cat(out)


def _fed_images(cache: EvictingCache, bits: int) -> EvictingCache:
    """An unquantized cache whose `update` receives the images of the keys and values instead (residual 0:
    an entry's image is fixed on arrival, so this is the quantized cache's whole schedule)."""
    cache.update = _images_into(cache.update, bits)
    return cache


def _images_into(update, bits: int, group: int = GROUP):
    """`update` handed the images of the keys and values it is given."""
    return lambda k, v, layer, *a, **kw: update(image(k, bits, group), image(v, bits, group), layer, *a, **kw)


def _composable() -> list[str]:
    from policy_matrix import base_specs

    specs = [s for s in base_specs() if not parse_policy(s).varies_by_head and parse_policy(s).position_mode is None]
    bounded = [s for s in specs if not parse_policy(s).unbounded]
    return specs + [f"sink2+{s}" for s in bounded if not parse_policy(s).preset]


@pytest.mark.parametrize("spec", _composable())
def test_every_policy_quantized_is_the_engine_fed_images(tiny, spec):
    """Logits and the kept entries of `q4+P` equal P's on the images (a chunk replayed token by token
    included): policies score what attention sees, the dequantized keys."""
    tokens = TOKENS[:40]
    for chunk in (1, 5):
        ours = EvictingCache(tiny, f"q4:group={GROUP}+{spec}", budget=BUDGET, per_token=True)
        ref = _fed_images(EvictingCache(tiny, spec, budget=BUDGET, per_token=True), 4)
        torch.testing.assert_close(_stream(tiny, ours, tokens, chunk), _stream(tiny, ref, tokens, chunk),
                                   rtol=1e-4, atol=1e-4)
        for a, b in zip(ours.kept_positions(), ref.kept_positions()):
            assert torch.equal(a, b), spec


# --- transformers' own QuantizedCache, same backend, bits, group and residual ---------------------------------

def test_matches_transformers_quantized_cache_token_by_token(tiny):
    """transformers' `QuantizedCache` (HQQ, axis 1: groups of one entry's channels) with residual_length=1
    re-quantizes everything at every step and attends the newest token at full precision: `residual=1`
    here is that schedule. HQQ's optimiser is left off on both sides (kvevict's quantizer never runs it:
    it would make an entry's codes depend on the entries quantized beside it)."""
    from transformers import QuantizedCache

    class PlainHQQ(Quantizer):
        @classmethod
        def quantize(cls, tensor, **options):
            return Quantizer.quantize(tensor, **{**options, "optimize": False})

    tokens = TOKENS[:30]
    for bits in (4, 2):
        theirs = QuantizedCache("hqq", tiny.config, nbits=bits, axis_key=1, axis_value=1, q_group_size=GROUP,
                                residual_length=1)
        for layer in theirs.layers:
            layer.quantizer = PlainHQQ
        ours = EvictingCache(tiny, f"q{bits}:group={GROUP},residual=1+full", budget=None)
        a, b = logits_one_by_one(tiny, tokens, ours), logits_one_by_one(tiny, tokens, theirs)
        c = logits_one_by_one(tiny, tokens, EvictingCache(tiny, "full", budget=None))
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert (a - c).abs().max() > 1e-2  # quantization changed the logits: the match is not two full caches


@pytest.mark.model
def test_embedded_model_matches_a_dynamic_cache_fed_images():
    """SmolLM2-135M (head_dim 64, default group 32): `qB+full` against transformers' own `DynamicCache` whose
    `update` receives the images, prompt then chunks."""
    from transformers import DynamicCache

    from kvevict import load_model, load_tokens

    model, tokenizer = load_model("smollm2-135m")
    tokens, _ = load_tokens("pg-essays", tokenizer, 72)
    for bits in (8, 4):
        ours = EvictingCache(model, f"q{bits}+full", budget=None)
        ref = DynamicCache(config=model.config)
        ref.update = _images_into(ref.update, bits, 32)
        with torch.inference_mode():
            a = torch.cat([model(tokens[None, s:s + 24], cache=ours, use_cache=True).logits[0] for s in (0, 24, 48)])
            b = torch.cat([model(tokens[None, s:s + 24], cache=ref, use_cache=True).logits[0] for s in (0, 24, 48)])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-4)
        assert ours.memory().kv_bytes < ours.memory().full_kv_bytes * (0.6 if bits == 8 else 0.35)


def test_shared_batches_put_each_width_in_a_batch_of_its_own():
    from kvevict.policies import shared_batches

    specs = ["window", "q4+window", "h2o", "q4+h2o", "q8+window", "adakv:snapkv"]
    assert shared_batches(specs) == [["window", "h2o"], ["q4+window", "q4+h2o"], ["q8+window"], ["adakv:snapkv"]]
