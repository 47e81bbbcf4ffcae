"""The storage forms' working buffer: decoding into it, lending it to one layer at a time, counting it.

A storage form decodes its held codes into a working copy for every forward (`cache/storage/quantized.py`).
The cache keeps one buffer for that and lends it to its layers in turn (`cache/storage/working.py`). These
tests hold the buffer to a fresh copy per layer, which is what every storage form's exactness test checks:
the same logits and kept sets bit for bit, on the paths where a layer keeps its copy past its attention (a
compression's held-back eviction) and in position-shift mode (un-rotated keys beside the rotated ones).
"""

from __future__ import annotations

import pytest
import torch

from kvevict import EvictingCache, compress
from kvevict.cache.storage.working import WorkingBuffer
from kvevict.policies import parse_policy
from test_architectures import TOKENS

#: every registered storage form, at the options deployments run and the ones that change the arithmetic
FORM_SPECS = ["q8", "q4", "q2", "q4:group=16,residual=4", "q4:group=16,keys=channel", "fp8", "fp8:scale=head",
              "q8_0", "q4_0", "f16", "f32", "vllmfp8", "vllmfp8:format=e5m2,kscale=0.02,vscale=0.5"]


def form_of(spec: str):
    return parse_policy(f"{spec}+window").kv_storage


@pytest.mark.parametrize("spec", FORM_SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_decode_into_equals_decode_for_every_form(spec, dtype):
    """`decode_into` a strided part of a larger buffer writes exactly the numbers `decode` returns."""
    form = form_of(spec)
    torch.manual_seed(0)
    x = (torch.randn(2, 1, 3, 9, 32) * 3).to(dtype)  # [2, B, H, n, D]
    state: dict = {}
    held = form.encode(x, state)
    expected = form.decode(held, dtype, state)
    buffer = torch.full((2, 1, 3, 16, 32), float("nan"), dtype=dtype)  # slots past n stay as they were
    form.decode_into(held, buffer[:, :, :, 2:11], state)
    assert torch.equal(buffer[:, :, :, 2:11], expected)
    assert buffer[:, :, :, :2].isnan().all() and buffer[:, :, :, 11:].isnan().all()


def test_a_lend_is_refused_while_another_holder_has_the_buffer():
    buffer, a, b = WorkingBuffer(), object(), object()
    (first,) = buffer.lend(a, [(2, 8)], torch.float32, torch.device("cpu"))
    assert buffer.lend(b, [(2, 8)], torch.float32, torch.device("cpu")) is None
    buffer.give_back(b)  # not b's to give back
    assert buffer.lend(b, [(2, 8)], torch.float32, torch.device("cpu")) is None
    buffer.give_back(a)
    (second,) = buffer.lend(b, [(2, 4)], torch.float32, torch.device("cpu"))
    assert second.data_ptr() == first.data_ptr()  # the same memory, lent in turn
    assert buffer.bytes() == 2 * 8 * 4


def test_the_buffer_shrinks_when_the_holder_it_was_sized_for_needs_less_than_half():
    buffer, big, small = WorkingBuffer(), object(), object()
    cpu = torch.device("cpu")
    buffer.lend(big, [(100,)], torch.float32, cpu)
    buffer.give_back(big)
    buffer.lend(small, [(10,)], torch.float32, cpu)  # another layer's smaller need reads a part of it
    buffer.give_back(small)
    assert buffer.bytes() == 400
    buffer.lend(big, [(40,)], torch.float32, cpu)  # its own need fell below half: given back
    assert buffer.bytes() == 160


def fresh_copies(monkeypatch) -> None:
    """Every layer decodes into a fresh copy of its own, as before the buffer was shared."""
    monkeypatch.setattr(WorkingBuffer, "lend", lambda self, *args: None)


def stream(model, spec: str, positions: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of TOKENS read in chunks of 5 through `spec` at budget 12, evicting token by token, and
    the positions each layer keeps at the end."""
    cache = EvictingCache(model, spec, budget=12, positions=positions, per_token=True)
    with torch.inference_mode():
        logits = [model(TOKENS[None, i:i + 5], cache=cache, use_cache=True).logits[0]
                  for i in range(0, TOKENS.numel(), 5)]
    return torch.cat(logits), cache.kept_positions()


def compressed(model, spec: str, positions: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of four tokens fed after TOKENS compressed in chunks of 8 to 12 entries (the eviction
    held back to the end: every layer keeps its working copy until then), and the positions kept."""
    state = compress(model, TOKENS, spec, 12, positions=positions, chunk=8)
    kept = state.cache.kept_positions()
    steps = [state.next_logits(model)]
    for token in TOKENS[:4]:
        state.feed(model, token[None])
        steps.append(state.next_logits(model))
    return torch.cat(steps), kept


#: a form and a policy per arm: keydiff reads the keys again when a held-back eviction runs, after later layers
ARMS = ["fp8+snapkv:window=4,kernel=3", "fp8:scale=head+keydiff", "q4:group=16,residual=4+h2o",
        "q4:group=16,keys=channel+knorm", "vllmfp8:format=e5m2+tova"]


#: compression in chunks: not with a residual or KIVI's key blocks, which read one token per forward
CASES = [(spec, stream) for spec in ARMS] + [(spec, compressed) for spec in ARMS[:2] + ARMS[-1:]]


@pytest.mark.parametrize("positions", ["original", "cache"])
@pytest.mark.parametrize(("spec", "run"), CASES, ids=[f"{spec}-{run.__name__}" for spec, run in CASES])
def test_the_shared_buffer_reads_what_a_fresh_copy_per_layer_reads(tiny, monkeypatch, spec, run, positions):
    shared = run(tiny, spec, positions)
    with monkeypatch.context() as patch:
        fresh_copies(patch)
        alone = run(tiny, spec, positions)
    assert torch.equal(shared[0], alone[0])
    assert all(torch.equal(a, b) for a, b in zip(shared[1], alone[1], strict=True))


def test_the_cache_counts_its_working_buffer_once(tiny):
    """Allocated bytes: every layer's held codes and scales, plus one layer's working copy (the largest
    layer's slots, keys and values at the model's dtype), not one per layer."""
    cache = EvictingCache(tiny, "fp8+h2o", budget=12, per_token=True)
    with torch.inference_mode():
        tiny(TOKENS[None, :30], cache=cache, use_cache=True)
    storages = [layer.storage for layer in cache.layers]
    held = sum(b.numel() * b.element_size() for s in storages for b in s.held.values())
    scales = sum(s.form.state_bytes(s.state) for s in storages)
    one_copy = max(2 * s.batch * s.heads * s.capacity * s.head_dim * 4 for s in storages)  # float32
    assert len(storages) > 1
    assert cache.memory().allocated_kv_bytes == held + scales + one_copy
