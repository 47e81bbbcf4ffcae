"""llama.cpp's KV types (`q8_0+P`, `q4_0+P`, `f16+P`) against independent computations.

The quantizers' reference is gguf-py's numpy port of ggml's (`gguf.quants.quantize` / `dequantize`,
"bit-exact same results as reference implementation in ggml-quants.c"), the rotation's scipy's Sylvester
Hadamard matrix over sqrt(n). No kvevict code computes an expected value: the streaming NLL is set against
the model's own forward with its attention written here, reading the images of every key (after RoPE, as
llama.cpp stores them) and value, made by gguf-py and scipy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES
from scipy.linalg import hadamard

from architectures import COMMON
from kvevict import EvictingCache, compare
from kvevict.errors import KvevictError
from kvevict.policies import parse_policy
from kvevict.storage_forms import GgmlBlocks, GgmlFloat
from test_architectures import BUDGET, TOKENS, Reference

from support import logits_through, nll_from_logits, reference_nll_with

TYPES = {8: GGMLQuantizationType.Q8_0, 4: GGMLQuantizationType.Q4_0}
#: llama.cpp's rotation blocks (keys, values) by head_dim, read in src/llama-kv-cache.cpp: keys 64 doubled while
#: head_dim is a multiple of twice it, values 64; no rotation unless head_dim is a multiple of 64
BLOCKS = {64: (64, 64), 128: (128, 64), 192: (64, 64), 256: (256, 64), 96: (0, 0), 32: (0, 0)}


def ggml_image(x: np.ndarray, bits: int) -> np.ndarray:
    """float32 `x` `[..., D]` through ggml's quantizer and back, by gguf-py."""
    kind = TYPES[bits]
    return quants.dequantize(quants.quantize(x.astype(np.float32), kind), kind).reshape(x.shape)


def spin(x: np.ndarray, block: int) -> np.ndarray:
    """`x` `[..., D]` (float64) times scipy's Hadamard matrix over sqrt(block), per run of `block` channels."""
    h = hadamard(block) / np.sqrt(block)
    return (x.reshape(*x.shape[:-1], -1, block) @ h).reshape(x.shape)


def rotated_image(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """What llama.cpp's cache gives attention for `x` `[..., D]`: rotated, rounded to float32, quantized,
    dequantized and rotated back (the query's and output's rotations moved onto the entry)."""
    a = x.double().numpy()
    if block:
        a = spin(a, block)
    out = ggml_image(a.astype(np.float32), bits).astype(np.float64)
    if block:
        out = spin(out, block)
    return torch.from_numpy(out).to(x.dtype)


def entries(head_dim: int = 128, outlier: float = 1.0) -> torch.Tensor:
    """Keys and values `[2, B=2, H=3, 40, D]`, a zero entry, a block of ties, one channel scaled by `outlier`."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2, 3, 40, head_dim, generator=g) * torch.rand(2, 2, 3, 40, 1, generator=g) * 4
    x[:, :, :, 5] = 0  # all-zero blocks: scale 0, codes 0 (q4_0: 8)
    x[:, :, :, 6, :32] = torch.cat([torch.tensor([127.0]), torch.arange(31) - 15.5])  # q8_0: d = 1, halves tie
    x[..., 7] *= outlier
    return x


# --- the codec ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
def test_held_bytes_are_ggml_blocks_bit_for_bit(bits):
    """Unrotated, each held block is gguf-py's block byte for byte: the fp16 scale then the codes (q4_0: code j
    low and j + 16 high in byte j), and the images are gguf-py's dequantized values exactly."""
    x = entries()
    form = GgmlBlocks(bits, rot="none")
    held = form.encode(x, {})
    per_block = GGML_QUANT_SIZES[TYPES[bits]][1] - 2
    codes = held["codes"].reshape(*x.shape[:-1], -1, per_block)
    scale = held["scale"].contiguous().view(torch.uint8).reshape(*x.shape[:-1], -1, 2)
    ours = torch.cat([scale, codes], -1).reshape(*x.shape[:-1], -1).numpy()
    theirs = quants.quantize(x.numpy(), TYPES[bits])
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(form.decode(held, torch.float32, {}).numpy(), ggml_image(x.numpy(), bits))


@pytest.mark.parametrize("head_dim", sorted(BLOCKS))
@pytest.mark.parametrize("bits", [8, 4])
def test_rotated_images_are_llamacpps(bits, head_dim):
    """With the rotation: keys over llama.cpp's key block, values over 64, images equal to scipy's Hadamard,
    gguf-py's quantizer and scipy's Hadamard back, exactly."""
    x = entries(head_dim)
    out = GgmlBlocks(bits).decode(GgmlBlocks(bits).encode(x, {}), torch.float32, {})
    keys, values = BLOCKS[head_dim]
    torch.testing.assert_close(out[0], rotated_image(x[0], bits, keys), rtol=0, atol=0)
    torch.testing.assert_close(out[1], rotated_image(x[1], bits, values), rtol=0, atol=0)


def test_the_rotation_spreads_an_outlier_channel():
    """One channel 30x the rest sets a whole block's scale unrotated; spread over 64 channels it costs
    q4_0 less: why llama.cpp rotates a quantized cache."""
    x = entries(64, outlier=30.0)
    err = {rot: (GgmlBlocks(4, rot).decode(GgmlBlocks(4, rot).encode(x, {}), torch.float32, {}) - x).pow(2).mean()
           for rot in ("hadamard", "none")}
    assert err["hadamard"] < 0.5 * err["none"]


def test_float_types_cast_to_nearest_even():
    x = entries(64).double() / 7
    for bits, dtype in ((16, np.float16), (32, np.float32)):
        form = GgmlFloat(bits)
        out = form.decode(form.encode(x, {}), torch.float64, {})
        np.testing.assert_array_equal(out.numpy(), x.numpy().astype(dtype).astype(np.float64))


# --- through the cache ----------------------------------------------------------------------------------------


def wide_llama() -> tf.LlamaForCausalLM:
    """The matrix's tiny Llama with head_dim 128 (ggml's blocks of 32 and llama.cpp's rotation need a multiple of
    64; keys rotate over 128, values over 64), in float64: the engine and the reference then quantize the same
    float32 numbers (the precision llama.cpp quantizes from) to codes."""
    torch.manual_seed(3)
    config = tf.LlamaConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=128,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return tf.LlamaForCausalLM(config).to(torch.float64).eval()


def image_of(spec: str, x: torch.Tensor, keys: bool) -> torch.Tensor:
    """The test's image of keys or values `[B, H, T, D]` under `spec`'s storage prefix."""
    prefix = spec.split("+")[0]
    if prefix == "f16":
        return x.to(torch.float16).to(x.dtype)
    bits = int(prefix[1])
    block = 0 if "rot=none" in prefix else BLOCKS[x.shape[-1]][0 if keys else 1]
    return rotated_image(x, bits, block)


def full_reference_nll(model, spec: str, tokens: torch.Tensor) -> torch.Tensor:
    """One causal forward of the whole stream, attention written here over the images of every key and value."""

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        b, hq, q, d = query.shape
        group = hq // key.shape[1]
        k = image_of(spec, key, True).repeat_interleave(group, 1)
        v = image_of(spec, value, False).repeat_interleave(group, 1)
        logits = (query @ k.transpose(-1, -2)) * scaling
        total = k.shape[2]
        causal = torch.arange(total)[None, :] <= torch.arange(total - q, total)[:, None]
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
        return (probs @ v).transpose(1, 2).contiguous(), probs

    return nll_from_logits(logits_through(model, "ggml_images", attention, [tokens]), tokens)


@pytest.mark.parametrize("spec", ["q8_0+full", "q4_0+full", "q4_0:rot=none+full", "f16+full"])
def test_a_stream_through_the_cache_reads_the_images(spec):
    model = wide_llama()
    ref = full_reference_nll(model, spec, TOKENS)
    for chunk in (1, 7):
        row = compare(model, TOKENS, [spec], BUDGET, reference=False, progress=False, chunk=chunk)[0][0]
        torch.testing.assert_close(row.nll, ref, rtol=1e-6, atol=1e-6)
    plain = compare(model, TOKENS, ["full"], BUDGET, reference=False, progress=False)[0][0].nll
    assert (plain - ref).abs().max() > 1e-3  # the images moved it: the match is not two full caches


class GgmlReference(Reference):
    """The matrix reference (what `sink4+window` keeps) over images; in position-shift mode the held key is the
    un-rotated one, its image rotated to where the query sees it."""

    def __init__(self, model, rule, cache_mode: bool, spec: str, *rest) -> None:
        super().__init__(model, rule, cache_mode, *rest)
        self.spec = spec

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        total = key.shape[2]
        value = image_of(self.spec, value, False)
        if self.cache_mode:
            cos, sin = self.cos_sin(self.kinds[module.layer_idx], torch.arange(total), key.shape[-1])
            raw = self.turn(key, cos[0], sin[0], -1.0)
            key = self.turn(image_of(self.spec, raw, True), cos[0], sin[0], 1.0)
        else:
            key = image_of(self.spec, key, True)
        return super().__call__(module, query, key, value, attention_mask, scaling, **kwargs)


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_an_evicting_policy_reads_the_images_of_what_it_keeps(positions):
    model, spec = wide_llama(), "q4_0+sink4+window"
    images = lambda m, r, c, *rest: GgmlReference(m, r, c, spec, *rest)  # noqa: E731
    ref = reference_nll_with(images, model, ("band", 4), positions == "cache")
    for chunk in (1, 7):
        row = compare(model, TOKENS, [spec], BUDGET, positions, reference=False, progress=False, chunk=chunk)[0][0]
        torch.testing.assert_close(row.nll, ref, rtol=1e-6, atol=1e-6)


def test_memory_counts_ggml_row_sizes():
    """KV bytes held are ggml's: per key and per value `D / 32` blocks of gguf's block size (q8_0 34 bytes, q4_0
    18), f16 two bytes a value, whatever the model's dtype."""
    model = wide_llama()
    layers, heads, d, n = 2, 2, 128, 30
    for spec, per_value in (("q8_0+full", GGML_QUANT_SIZES[TYPES[8]][1] / 32),
                            ("q4_0+full", GGML_QUANT_SIZES[TYPES[4]][1] / 32), ("f16+full", 2)):
        cache = EvictingCache(model, spec, budget=None)
        with torch.inference_mode():
            model(TOKENS[None, :n], cache=cache, use_cache=True)
        memory = cache.memory()
        assert memory.kv_bytes == layers * heads * n * 2 * d * per_value
        assert memory.kv_bytes_bf16 == memory.kv_bytes


@pytest.mark.parametrize("wrapper", ["q8_0", "q4_0:rot=none", "f16"])
def test_a_ggml_form_declares_and_answers_as_its_inner_policy(wrapper):
    """The wrapper matrix's declaration checks (`tests/test_wrapper_matrix.py`) for the ggml forms: every registered
    policy under them is its inner policy in every declaration and hook but `kv_storage`."""
    from test_wrapper_matrix import INNER, check_declarations, check_rewrapping, refusal

    for spec in INNER:
        if refusal(wrapper, parse_policy(spec)) is None:
            check_declarations(wrapper, spec)
            check_rewrapping(wrapper, spec)


@pytest.mark.parametrize("spec", ["q8_0+llamacpp:keep=4,bos=0", "q4_0+window", "f16+llamacpp:keep=0,bos=0"])
def test_a_ggml_form_keeps_what_a_position_rule_keeps(spec):
    """llama-server's rule with its KV type is one spec: under a form, a rule that scores by position alone keeps
    exactly the positions it keeps bare, at every forward, context shifts included."""
    from kvevict.policies.engine_defaults import run_positions

    model, bare = wide_llama(), spec.split("+", 1)[1]
    kept = {}
    for one in (spec, bare):
        cache = EvictingCache(model, one, budget=BUDGET, positions=run_positions([one], None), per_token=True)
        kept[one], seen = [], 0
        with torch.inference_mode():
            for q in (BUDGET, 1, 9, 1, 20):
                model(TOKENS[None, seen:seen + q], cache=cache, use_cache=True)
                seen += q
                kept[one].append([layer.kept_positions() for layer in cache.layers])
    assert all(torch.equal(a, b) for x, y in zip(kept[spec], kept[bare], strict=True) for a, b in zip(x, y,
                                                                                                        strict=True))
    assert cache.layers[0].kept_positions().shape[-1] < seen  # it evicted


# --- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,needle", [
    ("q4_1+full", "not a KV type kvevict holds"),
    ("q5_0+full", "use q8_0 or q4_0"),
    ("q8_0:rot=random+full", "rot=hadamard"),
    ("f8+full", "use f16"),
    ("q8_0:bits=4+full", "sets bits twice"),
    ("q8_0", "storage is written qB"),
    ("q8_0+fp8+full", "quantizes twice"),
])
def test_bad_ggml_specs_are_one_line(spec, needle):
    with pytest.raises(KvevictError, match=needle) as info:
        parse_policy(spec)
    assert "\n" not in str(info.value)


def test_a_head_dim_ggml_blocks_do_not_tile_is_refused(tiny):
    """The matrix's tiny Llama has head_dim 16: no 32-value block fits (llama.cpp refuses it too)."""
    with pytest.raises(KvevictError, match="do not divide this model's head_dim 16"):
        EvictingCache(tiny, "q8_0+full", budget=None)
