"""The cache against independent computations on a tiny random GQA Llama."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvevict import EvictingCache, compare
from kvevict.errors import KvevictError
from kvevict.eval.forward import body

from conftest import make_tiny, random_tokens
from support import band_sink_nll, plain_nll


def rel_close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> None:
    err = ((a - b).abs() / b.abs().clamp_min(1e-6)).max().item()
    assert err <= tol, f"max relative error {err}"


def test_full_cache_equals_plain_forward(tiny):
    tokens = random_tokens(200)
    rows, full = compare(tiny, tokens, ["full"], budget=None, reference=False, progress=False)
    rel_close(rows[0].nll, plain_nll(tiny, tokens))


def test_top1_hits_equal_the_plain_forward(tiny):
    """`hit` (the policy's top-1 is the next token) against a plain forward: on a stream the model wrote
    greedily every prediction after the prompt is a hit; on a random one, exactly where the plain argmax hits."""
    tokens = random_tokens(6, seed=4)
    with torch.inference_mode():
        for _ in range(40):
            tokens = torch.cat([tokens, tiny(tokens[None]).logits[0, -1].argmax()[None]])
        plain = tiny(tokens[None]).logits[0, :-1].argmax(-1) == tokens[1:]
    rows, _ = compare(tiny, tokens, ["full"], budget=None, reference=False, progress=False)
    assert rows[0].hit[5:].all() and torch.equal(rows[0].hit, plain)
    noise = random_tokens(150, seed=5)
    with torch.inference_mode():
        plain = tiny(noise[None]).logits[0, :-1].argmax(-1) == noise[1:]
    rows, _ = compare(tiny, noise, ["full"], budget=None, reference=False, progress=False)
    assert torch.equal(rows[0].hit, plain)


def test_full_cache_token_by_token_equals_plain_forward(tiny):
    # a window whose budget exceeds the stream never evicts, fed one token at a time after 1
    tokens = random_tokens(120, seed=3)
    rows, _ = compare(tiny, tokens, ["window"], budget=1, reference=False, progress=False)
    assert rows[0].max_kept == 1
    rows, _ = compare(tiny, tokens, ["window"], budget=10_000, reference=False, progress=False)
    rel_close(rows[0].nll, plain_nll(tiny, tokens))


@pytest.mark.parametrize("budget,sinks", [(16, 0), (16, 1), (16, 4), (40, 8), (7, 2)])
def test_window_with_sinks_equals_band_mask_forward(tiny, budget, sinks):
    tokens = random_tokens(300, seed=budget + sinks)
    spec = "window" if sinks == 0 else f"sink{sinks}+window"
    rows, _ = compare(tiny, tokens, [spec], budget=budget, reference=False, progress=False)
    rel_close(rows[0].nll, band_sink_nll(tiny, tokens, budget, sinks))


@pytest.mark.parametrize("specs", [["window", "sink4+window", "sink2+window"], ["window", "h2o", "sink2+h2o"]])
def test_rows_of_one_batch_equal_separate_runs(tiny, specs):
    """Alone, an H2O decode step keeps the probabilities of its own attention; next to a
    window row it measures them in a separate pass: both must give the same run."""
    tokens = random_tokens(150, seed=9)
    together, _ = compare(tiny, tokens, specs, budget=24, reference=False, progress=False)
    for spec, row in zip(specs, together):
        alone, _ = compare(tiny, tokens, [spec], budget=24, reference=False, progress=False)
        rel_close(row.nll, alone[0].nll, 1e-5)


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_one_row_prefill_stands_for_every_row(tiny, positions):
    """A shared prefill (one row fed for all, evicting inside it) leaves every row exactly
    as a prefill of all rows would, and decoding on from there gives the same logits."""
    tokens = random_tokens(70, seed=4)
    specs = ["window", "sink4+h2o", "snapkv:window=8", "random:seed=3"]
    outputs, kept = [], []
    with torch.inference_mode():
        for rows in (1, len(specs)):
            cache = EvictingCache(tiny, specs, budget=24, positions=positions)
            body(tiny, tokens[None, :40].expand(rows, -1), cache)
            assert not cache.shares_rows  # the prefill overflowed the budget: rows diverged
            hidden = [body(tiny, tokens[None, t : t + 1].expand(len(specs), -1), cache) for t in range(40, 70)]
            outputs.append(torch.cat(hidden, dim=1))
            kept.append([layer.kept_positions() for layer in cache.layers])
    rel_close(outputs[0], outputs[1], 1e-5)
    for shared, separate in zip(*kept):
        assert torch.equal(shared, separate)


def test_one_row_forward_is_refused_once_rows_diverged(tiny):
    cache = EvictingCache(tiny, ["window", "h2o"], budget=8)
    with torch.inference_mode():
        body(tiny, random_tokens(6)[None], cache)  # shared: nothing evicted yet
        assert cache.shares_rows
        body(tiny, random_tokens(6)[None, :4], cache)  # 10 > 8: evicts inside this forward
        with pytest.raises(KvevictError, match=r"diverged at the first eviction.*feed 2 rows"):
            body(tiny, random_tokens(6)[None, :1], cache)


def test_reference_fidelity_is_zero_before_the_cache_fills(tiny):
    tokens = random_tokens(80, seed=5)
    rows, full = compare(tiny, tokens, ["window"], budget=40, progress=False)
    # predictions 1..40 come from an unevicted cache: identical to the full cache
    assert rows[0].kl[:40].abs().max() < 1e-4
    assert bool(rows[0].agree[:40].all())
    assert rows[0].kl[45:].mean() > 1e-3


def _raw_key_recorder(model):
    """Forward hooks on k_proj: the un-rotated keys of every token, per layer."""
    store: dict[int, list[torch.Tensor]] = {}
    handles = []
    for idx, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def hook(module, args, output, idx=idx, attn=attn):
            b, q, _ = output.shape
            store.setdefault(idx, []).append(output.view(b, q, -1, attn.head_dim).transpose(1, 2).clone())

        handles.append(attn.k_proj.register_forward_hook(hook))
    return store, handles


@pytest.mark.parametrize("spec", ["sink4+window", "window", "sink2+random"])
def test_cache_positions_do_not_drift(spec):
    model = make_tiny(seed=2)
    tokens = random_tokens(1300, seed=4)  # ~1,280 single-token steps, each re-rotating the kept keys
    budget = 24
    cache = EvictingCache(model, spec, budget=budget, positions="cache")
    store, handles = _raw_key_recorder(model)
    try:
        with torch.inference_mode():
            body(model, tokens[None, :budget], cache)
            for t in range(budget, tokens.numel()):
                body(model, tokens[None, t : t + 1], cache)
    finally:
        for h in handles:
            h.remove()
    assert cache.get_seq_length() == budget
    rotary = model.model.rotary_emb
    for idx, layer in enumerate(cache.layers):
        raw = torch.cat(store[idx], dim=2)  # [1, H, T, D] un-rotated keys by stream position
        pos = layer.kept_positions()  # [1, H, n]
        n = pos.shape[-1]
        gathered = raw.gather(2, pos.unsqueeze(-1).expand(-1, -1, -1, raw.shape[-1]))
        cos, sin = rotary(gathered, torch.arange(n)[None])
        expected, _ = apply_rotary_pos_emb(gathered, gathered, cos, sin)
        held = layer.storage.keys[:, :, :n]
        assert (held - expected).abs().max().item() < 1e-5
        assert bool((pos.diff(dim=-1) > 0).all())  # slots in original order


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_remembered_queries_are_rotated_to_where_their_tokens_sit(positions):
    """SnapKV's observation window: the queries the cache hands back equal q_proj's
    outputs rotated (by transformers' own RoPE) to the token's position now — its stream
    position, or in position-shift mode its current slot, which moves at every eviction."""
    model = make_tiny(seed=3)
    tokens = random_tokens(60, seed=2)
    budget, window = 16, 5
    cache = EvictingCache(model, f"snapkv:window={window}", budget=budget, positions=positions)
    store: dict[int, list[torch.Tensor]] = {}
    handles = []
    for idx, block in enumerate(model.model.layers):
        def hook(module, args, output, idx=idx, head_dim=block.self_attn.head_dim):
            b, q, _ = output.shape
            store.setdefault(idx, []).append(output.view(b, q, -1, head_dim).transpose(1, 2).clone())

        handles.append(block.self_attn.q_proj.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            body(model, tokens[None, :20], cache)
            for t in range(20, tokens.numel()):
                body(model, tokens[None, t : t + 1], cache)
    finally:
        for h in handles:
            h.remove()
    seen = tokens.numel()
    for idx, layer in enumerate(cache.layers):
        queries, stream = layer.statistics.window_queries(layer.settings.mode, window, layer.seen, layer.n)
        order = stream.argsort()
        queries, stream = queries[:, :, order], stream[order]
        assert stream.tolist() == list(range(seen - window, seen))
        raw = torch.cat(store[idx], dim=2)[:, :, stream]  # [1, Hq, window, D]
        now = stream if positions == "original" else layer.n - (seen - stream)
        cos, sin = model.model.rotary_emb(raw, now[None])
        expected, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
        assert (queries - expected).abs().max().item() < 1e-5


def test_cache_mode_window_matches_original_mode():
    # a pure window keeps contiguous tokens: relative distances are identical in both modes
    model = make_tiny(seed=6)
    tokens = random_tokens(200, seed=8)
    a, _ = compare(model, tokens, ["window"], budget=20, positions="original", reference=False, progress=False)
    b, _ = compare(model, tokens, ["window"], budget=20, positions="cache", reference=False, progress=False)
    rel_close(a[0].nll, b[0].nll, 1e-4)


def _greedy(model, prompt: torch.Tensor, cache, steps: int) -> list[int]:
    out = []
    with torch.inference_mode():
        hidden = body(model, prompt[None], cache)
        for _ in range(steps):
            nxt = model.get_output_embeddings()(hidden[:, -1]).argmax(-1)
            out.append(int(nxt))
            hidden = body(model, nxt[:, None], cache)
    return out


#: before 5.24, generate() picked its next inputs by `cache.get_seq_length()`, which the position
#: shift keeps at the budget: generate with positions="cache" needs 5.24 (README, supported releases)
OLD_GENERATE = tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24)


@pytest.mark.parametrize("positions", ["original", "cache"])
def test_generate_with_cache_matches_manual_greedy(positions):
    if positions == "cache" and OLD_GENERATE:
        pytest.skip("generate() with positions='cache' needs transformers >= 5.24")
    model = make_tiny(seed=7)
    prompt = random_tokens(30, seed=11)
    manual = _greedy(model, prompt, EvictingCache(model, "sink2+window", budget=12, positions=positions), 25)
    cache = EvictingCache(model, "sink2+window", budget=12, positions=positions)
    model.generation_config.eos_token_id = None  # no early stop: compare all 25 tokens
    with torch.inference_mode():
        generated = model.generate(
            prompt[None], attention_mask=torch.ones(1, 30, dtype=torch.long), past_key_values=cache,
            max_new_tokens=25, do_sample=False, pad_token_id=0,
        )
    assert generated[0, 30:].tolist() == manual
    assert cache.max_kept() == 12
