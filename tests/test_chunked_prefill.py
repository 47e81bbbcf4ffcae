"""A context compressed after a prefill in chunks keeps what one forward over it keeps.

`kvevict.compress(..., chunk=N)` reads the context `N` tokens per forward into the full cache and
compresses once after the last (`eval/compress.prefill`), so a long prompt never holds every activation
of the whole context at once. The reference is the one-forward compression (`chunk=None`), which the
policies' own tests check against kvpress and eager attention: for every registered bounded policy (and
KVzip, Ada-KV and the sink wrappers), in both position modes, on a tiny Llama, Qwen 3 (its query and key
norms) and Gemma 3 (sliding-window layers beside full ones), the kept positions of every layer and KV head
must be equal, and the continuation read through the compressed cache must give the same logits.

Tolerance: the chunks' keys and queries come from projections of a chunk's rows instead of the whole
context's, which may round their last bits differently; H2O's sums add the chunks' columns in another
order; Expected Attention merges its chunks' query moments instead of taking them in one pass. The logits
are held to 1e-4 (float32), the kept sets exactly.
"""

from __future__ import annotations

import pytest
import torch

from architectures import Arch
from kvevict import KvevictError
from kvevict.eval.compress import compress, continuation_nll
from kvevict.eval.forward import body, logits
from kvevict.policies import parse_policy
from test_kvzip import FRAMING

from conftest import make_tiny, random_tokens
from policy_matrix import base_specs, position_modes

T, BUDGET, CHUNK = 70, 24, 16


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def model(request):
    if request.param == "llama":
        return make_tiny()
    return Arch(request.param, ("original",)).build().eval()


def _specs() -> list[str]:
    bounded = [s for s in base_specs() if not parse_policy(s).unbounded and not parse_policy(s).preset]
    # SnapKV re-selecting less often than a chunk comes: its window must still be the context's last
    return bounded + ["kvzip", "snapkv:window=4,interval=40", "sink2+snapkv:window=2,interval=3",
                      "sink2+expected-attention:n_sink=1,window=3"]


def _held(cache) -> list[list[list[int]]]:
    """Per layer the budget bounds, per (row, KV head): the original positions held, ascending."""
    out = []
    for pos in cache.kept_positions():
        out.append([sorted(p for p in head.tolist() if p >= 0) for row in pos for head in row])
    return out


def _continued(model, state) -> torch.Tensor:
    """`[rows, 4, vocab]` logits of four tokens read through the compressed cache after the context."""
    with torch.inference_mode():
        hidden = body(model, random_tokens(4, seed=9)[None].expand(state.rows, -1), state.cache)
        return logits(model, hidden).float()


@pytest.mark.parametrize("spec", _specs())
def test_a_context_read_in_chunks_keeps_what_one_forward_keeps(model, spec):
    context = random_tokens(T, seed=3)
    tokenizer = FRAMING if parse_policy(spec).reconstructs else None
    if tokenizer is not None:
        context = torch.cat([torch.arange(FRAMING.prefix), context[FRAMING.prefix :]])
    for positions in position_modes(spec):
        whole = compress(model, context, spec, BUDGET, positions, tokenizer)
        chunked = compress(model, context, spec, BUDGET, positions, tokenizer, chunk=CHUNK)
        assert _held(chunked.cache) == _held(whole.cache), (spec, positions)
        torch.testing.assert_close(chunked.hidden, whole.hidden, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(_continued(model, chunked), _continued(model, whole), rtol=1e-4, atol=1e-4)


def test_no_forward_of_a_chunked_prefill_reads_more_than_a_chunk(model):
    """What bounds the prefill's memory: the model never sees more than `chunk` tokens at once; the first
    forward takes the remainder, so the last is a whole chunk."""
    lengths = []
    embed = model.get_input_embeddings()
    hook = embed.register_forward_hook(lambda module, args, out: lengths.append(args[0].shape[-1]))
    try:
        compress(model, random_tokens(T, seed=3), "h2o", BUDGET, chunk=CHUNK)
    finally:
        hook.remove()
    assert lengths == [T % CHUNK] + [CHUNK] * (T // CHUNK)


def test_rows_and_continuations_take_the_chunk_too(model):
    """Several policies as rows of one batch, and the continuation NLL built on `compress`."""
    context, continuation = random_tokens(T, seed=3), random_tokens(5, seed=4)
    rows = ["h2o", "tova", "snapkv:window=4", "expected-attention:window=8"]
    whole = continuation_nll(model, context, continuation, rows, BUDGET)
    chunked = continuation_nll(model, context, continuation, rows, BUDGET, chunk=CHUNK)
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk", [0, -2, 2.5, True])
def test_a_bad_chunk_is_refused(chunk):
    with pytest.raises(KvevictError, match="chunk must be a whole number of tokens >= 1"):
        compress(make_tiny(), random_tokens(T), "h2o", BUDGET, chunk=chunk)


def test_a_chunk_as_long_as_the_context_is_one_forward(model):
    lengths = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: lengths.append(args[0].shape[-1]))
    try:
        for chunk in (T, T + 100):
            compress(model, random_tokens(T, seed=3), "h2o", BUDGET, chunk=chunk)
    finally:
        hook.remove()
    assert lengths == [T, T]


def test_needle_and_generation_answer_alike_with_a_chunked_prefill(tiny_dir):
    """The commands that compress a prompt (`needle`, `generation`: `--prefill-chunk`) read it in chunks and give
    the same answers."""
    from kvevict.eval.generation import run_generation
    from kvevict.eval.needle import run_needle
    from kvevict.loading import load_model

    model, tok = load_model(str(tiny_dir))
    lengths: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: lengths.append(args[0].shape[-1]))

    def answers(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if "seconds" not in k} for r in records]

    needle, generated = [], []
    for chunk in (None, 48):
        lengths.clear()
        needle.append(run_needle(model, tok, lengths=[150], depths=[0.5], trials=1, budgets=["40%"],
                                 policies=["full", "h2o", "snapkv:window=8"], max_new_tokens=4, progress=False,
                                 prefill_chunk=chunk).records)
        generated.append(run_generation(model, tok, ["tova", "expected-attention:window=8"], ["30%"], length=120,
                                        trials=1, max_new_tokens=6, progress=False, prefill_chunk=chunk).records)
        assert (max(lengths) <= 48) == (chunk is not None)
    assert answers(needle[1]) == answers(needle[0])
    assert answers(generated[1]) == answers(generated[0])


@pytest.mark.parametrize("spec", ["snapkv:window=4", "h2o", "expected-attention:window=4"])
def test_a_chunked_prefill_allocates_its_context_once(monkeypatch, spec):
    """Each growth of a layer used to hold the old buffers beside the new (0.8 GB beside 1 GB at 128K tokens of
    an 8B attention shape): the prefill reserves its whole context, so no buffer is ever grown by copying held
    entries into a larger one, and the kept sets are still one forward's."""
    from kvevict.cache.storage.slots import SlotStorage

    grown = []
    allocate = SlotStorage._allocate

    def watched(self, capacity, n):
        if n and capacity > self.capacity:  # held entries copied into a larger buffer
            grown.append((self.capacity, capacity, n))
        allocate(self, capacity, n)

    monkeypatch.setattr(SlotStorage, "_allocate", watched)
    model, context = make_tiny(), random_tokens(T)
    chunked = compress(model, context, spec, BUDGET, chunk=CHUNK)
    assert grown == [], f"grown by copying: {grown}"
    monkeypatch.setattr(SlotStorage, "_allocate", allocate)
    whole = compress(model, context, spec, BUDGET)
    assert [torch.equal(a, b) for a, b in zip(chunked.cache.kept_positions(), whole.cache.kept_positions())] == \
        [True] * len(whole.cache.layers)


@pytest.mark.parametrize("spec", ["kvzip", "adakv:snapkv:window=4"])
def test_a_chunked_prefill_into_per_head_layers_allocates_its_context_once(monkeypatch, spec):
    """The per-head layers' storage grew at each chunk, and for KVzip again at its first repeat forward, each
    growth copying every held entry beside the old buffer and the new one (3 GB at 128K tokens of an 8B attention
    shape): the prefill reserves the context and the longest repeat forward, so it grows once, while it holds
    nothing, and the kept sets are still one forward's."""
    from kvevict.cache.layers.per_head.storage import RaggedStorage

    grown = []
    repack = RaggedStorage.repack

    def watched(self, extra):
        before, held = self.capacity, self.most_held
        repack(self, extra)
        if held and self.capacity > before:  # held entries copied into a larger buffer
            grown.append((before, self.capacity, held))

    monkeypatch.setattr(RaggedStorage, "repack", watched)
    model, context = make_tiny(), random_tokens(T, seed=3)
    tokenizer = FRAMING if parse_policy(spec).reconstructs else None
    chunked = compress(model, context, spec, BUDGET, tokenizer=tokenizer, chunk=CHUNK)
    assert grown == [], f"grown by copying: {grown}"
    monkeypatch.setattr(RaggedStorage, "repack", repack)
    whole = compress(model, context, spec, BUDGET, tokenizer=tokenizer)
    assert _held(chunked.cache) == _held(whole.cache)
