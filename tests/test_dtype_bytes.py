"""Bytes in the dtype the model was loaded in: the envelope search's probes and capacity arithmetic, and the
quantized storage's codes, scales and zero points.

Each count is checked against a hand count from the tiny model's shape (2 layers x 2 KV heads x head_dim 16),
at 4 bytes a number in float32 and 2 in bf16, never against the code's own arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from kvevict import EvictingCache
from kvevict.ab.envelope import EnvelopeConfig, run_envelope
from kvevict.capacity import KvShape

from conftest import make_tiny, random_tokens

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
TOKENS, FLOOR = 64, 8


class CharTokenizer:
    """Characters mod the tiny vocabulary."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return {"input_ids": torch.tensor([[ord(c) % 101 for c in text]])}


def _in(dtype: torch.dtype):
    model = make_tiny(seed=3)
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


@pytest.mark.parametrize("dtype, number", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_envelope_counts_bytes_in_the_loaded_dtype(tmp_path, dtype, number):
    """A probe holds its budget's entries at `number` bytes a number, against the full cache's every token;
    the KV shape the capacity arithmetic reads says `number` bytes an element, and the weights count
    `number` bytes a parameter."""
    text = tmp_path / "text.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 4)
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    config = EnvelopeConfig(text=str(text), tokens=TOKENS, policies=["window"], floor=FLOOR, resolution=1.5,
                            max_ppl_ratio=1.2, out=str(tmp_path / "runs"), name="e", dtype=name)
    model = _in(dtype)
    _, records = run_envelope(config, model=model, tokenizer=CharTokenizer(), progress=False)
    assert {r.dtype for r in records} == {name}
    full = next(r for r in records if r.kind == "full")
    per_token = LAYERS * KV_HEADS * 2 * HEAD_DIM * number  # keys and values of every layer and KV head
    shape = KvShape(**full.extra["kv_shape"])
    assert shape.element_bytes == number
    assert shape.sequence_bytes(TOKENS) == TOKENS * per_token
    parameters = sum(p.numel() for p in model.parameters())
    assert full.extra["weight_bytes"] == parameters * number
    probes = [r for r in records if r.kind == "policy"]
    assert probes
    for probe in probes:
        assert probe.kv_bytes == min(probe.budget, TOKENS) * per_token
        assert probe.full_kv_bytes == TOKENS * per_token


def test_quantized_storage_holds_its_floats_in_the_loaded_dtype():
    """In a bf16 model the quantized form keeps its scales and zero points (and the residual ring) in bf16:
    the tensors held say so, and `kv_bytes` counts them at 2 bytes, the same as `kv_bytes_bf16`."""
    bits, group, residual, budget = 4, 8, 3, 16
    model = _in(torch.bfloat16)
    cache = EvictingCache(model, f"q{bits}:group={group},residual={residual}+sink4+window", budget=budget,
                          per_token=True)
    with torch.inference_mode():
        model(random_tokens(40)[None], past_key_values=cache, use_cache=True)
    floats = {b.dtype for layer in cache.layers for b in layer.storage.held.values() if b.is_floating_point()}
    assert floats == {torch.bfloat16}
    assert all(layer.storage.ring.dtype == torch.bfloat16 for layer in cache.layers)
    groups = HEAD_DIM // group
    per_entry = 2 * (HEAD_DIM * bits // 8 + 2 * groups * 2)  # key and value: codes, then scale and zero at 2 bytes
    ring = LAYERS * 2 * KV_HEADS * residual * HEAD_DIM * 2
    memory = cache.memory()
    assert memory.kv_bytes == LAYERS * KV_HEADS * budget * per_entry + ring
    assert memory.kv_bytes_bf16 == memory.kv_bytes


def test_a_model_in_another_dtype_than_the_search_says_is_refused(tmp_path):
    """Records name the dtype that ran: a bf16 model handed to a search that says float32 is one line."""
    from kvevict.errors import KvevictError

    config = EnvelopeConfig(tokens=TOKENS, policies=["window"], floor=FLOOR, out=str(tmp_path / "runs"))
    with pytest.raises(KvevictError, match="pass EnvelopeConfig\\(dtype='bfloat16'\\)"):
        run_envelope(config, model=_in(torch.bfloat16), tokenizer=CharTokenizer(), progress=False)
