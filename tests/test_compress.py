"""Context compression against independent masked forwards of plain transformers."""

from __future__ import annotations

import pytest
import torch

from kvevict import KvevictError
from kvevict.eval.compress import (
    compress,
    compress_prompt,
    continuation_nll,
    greedy,
)
from kvevict.policies.budget import parse_budget, resolve_budget

from conftest import random_tokens
from support import attn, nll_from_logits


def kept_mask_nll(model, tokens: torch.Tensor, context: int, kept: set[int]) -> torch.Tensor:
    """NLL of tokens[context:] from one plain forward in which the context queries are causal and every
    later query sees only the kept context positions and the tokens after the context up to itself."""
    n = tokens.numel()
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    keep = torch.zeros(n, dtype=torch.bool)
    keep[sorted(kept)] = True
    visible = (j <= i) & ((i < context) | (j >= context) | keep[None, :])
    with attn(model, "sdpa"), torch.inference_mode():
        logits = model(tokens[None], attention_mask=visible[None, None]).logits[0]
    return nll_from_logits(logits, tokens)[context - 1 :]


def test_budget_forms():
    assert parse_budget("25%") == "25%" and parse_budget("256") == 256 and parse_budget("full") is None
    assert resolve_budget("25%", 1000) == 250
    assert resolve_budget("10%", 1045) == 104  # round(104.5) is banker's 104
    assert resolve_budget(64, 1000) == 64 and resolve_budget(None, 1000) is None
    assert resolve_budget("0.5%", 10) == 1  # never below one entry
    for bad in ("0%", "120%", "abc", "-3", 0):
        with pytest.raises(KvevictError):
            parse_budget(bad)


@pytest.mark.parametrize("spec,budget,kept", [
    ("window", 24, lambda t, b: set(range(t - b, t))),
    ("sink4+window", 24, lambda t, b: set(range(4)) | set(range(t - b + 4, t))),
    ("streamingllm", "25%", lambda t, b: set(range(4)) | set(range(t - b + 4, t))),
])
def test_continuation_reads_only_what_was_kept(tiny, spec, budget, kept):
    tokens = random_tokens(130, seed=4)
    context, continuation = tokens[:100], tokens[100:]
    entries = resolve_budget(budget, 100)
    ours = continuation_nll(tiny, context, continuation, spec, budget)[0]
    reference = kept_mask_nll(tiny, tokens, 100, kept(100, entries))
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    # and it differs from the uncompressed continuation: something was really evicted
    full = kept_mask_nll(tiny, tokens, 100, set(range(100)))
    assert (ours - full).abs().max() > 1e-3


def test_compression_keeps_budget_entries_and_original_positions(tiny):
    context = random_tokens(90, seed=6)
    state = compress(tiny, context, ["window", "sink4+window"], 30)
    assert state.kept == 30 and state.budget == 30 and state.context_length == 90
    for layer in state.cache.layers:
        kept = layer.kept_positions()
        assert kept[0].unique().tolist() == list(range(60, 90))
        assert kept[1].unique().tolist() == [0, 1, 2, 3] + list(range(64, 90))
    # original positions: the next token is position 90, the cache grows from now on
    assert state.cache.get_seq_length() == 90
    state.feed(tiny, random_tokens(5, seed=7))
    assert all(layer.n == 35 for layer in state.cache.layers)


def test_cache_positions_continue_from_kept_count(tiny):
    state = compress(tiny, random_tokens(90, seed=6), "streamingllm", 30, positions="cache")
    assert state.cache.get_seq_length() == 30


def test_greedy_equals_masked_reference_loop(tiny):
    context = random_tokens(80, seed=8)
    kept = set(range(4)) | set(range(80 - 20 + 4, 80))
    state = compress(tiny, context, "sink4+window", 20)
    ours = greedy(tiny, state, 6)[0]
    sequence = context.clone()
    expected = []
    for _ in range(6):
        n = sequence.numel()
        i = torch.arange(n)[:, None]
        j = torch.arange(n)[None, :]
        keep = torch.zeros(n, dtype=torch.bool)
        keep[sorted(kept)] = True
        visible = (j <= i) & ((i < 80) | (j >= 80) | keep[None, :])
        with attn(tiny, "sdpa"), torch.inference_mode():
            logits = tiny(sequence[None], attention_mask=visible[None, None]).logits[0, -1]
        expected.append(int(logits.argmax()))
        sequence = torch.cat([sequence, torch.tensor([expected[-1]])])
    assert ours == expected


def masked_last_logits(model, tokens: torch.Tensor, context: int, kept: set[int]) -> torch.Tensor:
    n = tokens.numel()
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    keep = torch.zeros(n, dtype=torch.bool)
    keep[sorted(kept)] = True
    visible = (j <= i) & ((i < context) | (j >= context) | keep[None, :])
    with attn(model, "sdpa"), torch.inference_mode():
        return model(tokens[None], attention_mask=visible[None, None]).logits[0, -1].float()


def test_compress_prompt_reads_its_tail_through_the_compressed_cache(tiny):
    prompt = random_tokens(60, seed=13)
    # default split: all but the last token compressed, so even the first answer token is bounded
    state = compress_prompt(tiny, prompt, "window", 16)
    assert state.context_length == 59 and all(layer.n == 17 for layer in state.cache.layers)
    expected = masked_last_logits(tiny, prompt, 59, set(range(59 - 16, 59)))
    torch.testing.assert_close(state.next_logits(tiny)[0], expected, rtol=1e-4, atol=1e-4)
    # a split after a "document": the question (last 10 tokens) reads the compressed document
    state = compress_prompt(tiny, prompt, "sink2+window", 12, split=50)
    expected = masked_last_logits(tiny, prompt, 50, set(range(2)) | set(range(50 - 10, 50)))
    torch.testing.assert_close(state.next_logits(tiny)[0], expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(KvevictError, match="split"):
        compress_prompt(tiny, prompt, "window", 16, split=60)


def test_greedy_stops_each_row_at_its_stop_token(tiny):
    context = random_tokens(40, seed=2)
    free = greedy(tiny, compress(tiny, context, ["window", "sink2+window"], 16), 10)
    stop = free[1][3]
    stopped = greedy(tiny, compress(tiny, context, ["window", "sink2+window"], 16), 10, [stop])
    for row in range(2):
        cut = free[row].index(stop) if stop in free[row] else len(free[row])
        assert stopped[row] == free[row][:cut]
    # a row is also done once `finished` says its text is complete (lm-eval's `until`); the other runs on
    asked = []

    def finished(row: int, ids: list[int]) -> bool:
        asked.append(row)
        return row == 0 and len(ids) == 4

    early = greedy(tiny, compress(tiny, context, ["window", "sink2+window"], 16), 10, (), finished)
    assert early == [free[0][:4], free[1]]
    assert asked.count(0) == 4  # not asked again once done


def test_rows_equal_separate_runs(tiny):
    tokens = random_tokens(100, seed=11)
    together = continuation_nll(tiny, tokens[:80], tokens[80:], ["window", "h2o", "snapkv:window=8"], 32)
    for row, spec in enumerate(["window", "h2o", "snapkv:window=8"]):
        alone = continuation_nll(tiny, tokens[:80], tokens[80:], spec, 32)[0]
        torch.testing.assert_close(together[row], alone, rtol=1e-5, atol=1e-5)


def test_full_cache_compression_is_the_plain_forward(tiny):
    tokens = random_tokens(70, seed=12)
    ours = continuation_nll(tiny, tokens[:50], tokens[50:], "full", "25%")[0]
    reference = kept_mask_nll(tiny, tokens, 50, set(range(50)))
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)


def test_bad_inputs(tiny):
    with pytest.raises(KvevictError, match=r"token ids \[T\], or \[B, T\]"):
        compress(tiny, random_tokens(10)[None, None], "window", 4)
    with pytest.raises(KvevictError, match="non-empty context"):
        compress(tiny, random_tokens(10)[:0], "window", 4)
    with pytest.raises(KvevictError, match="pinned sinks"):
        compress(tiny, random_tokens(40), "sink4+window", "10%")
    with pytest.raises(KvevictError, match="own batch"):
        compress(tiny, random_tokens(40), ["full", "window"], 8)
