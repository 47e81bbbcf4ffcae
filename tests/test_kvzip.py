"""KVzip (`kvzip`) against a reconstruction computed by hand on plain transformers.

The reference prefills the context into a `DynamicCache`, runs each chunk's repeat forward on a copy of
it with an attention function that records the rotated queries and the keys it was handed, and computes
per (layer, KV head) the window softmax kvpress computes (NVIDIA/kvpress 0.5.5,
`kvpress/presses/kvzip_press.py`): over the sinks, the chunk and the repeat tokens (causally), the
maximum over the group's queries; then kvpress's selection (the model's best `layers x heads x budget`
counted per layer, each layer's best that many over its heads; or `heads x budget` per layer). kvevict's
kept sets must equal it, and the compressed cache must decode as a plain forward masked to those sets.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from kvevict import KvevictError
from kvevict.cache import EvictingCache
from kvevict.eval.compress import compress
from kvevict.eval.forward import body, logits
from kvevict.eval.reconstruction import KeptScores, RepeatFraming, repeat_framing
from kvevict.eval.ruler.protocols import compress_at, prefill, snapshot
from kvevict.policies import check_policy

from conftest import make_tiny, random_tokens
from support import attn, count_repeat_forwards

FRAMING = RepeatFraming(6, torch.tensor([5, 6, 7]), torch.tensor([8, 9]), torch.tensor([10, 11]))
T, CHUNK, SINKS = 70, 24, 4


def causal_attention(module, query, key, value, visible: torch.Tensor, scaling: float):
    """Eager attention of `query` `[1, H_q, m, D]` over `key`/`value` `[1, H_kv, n, D]` where `visible`
    `[H_kv or 1, m, n]` says which keys each query sees; returns `[1, m, H_q, D]`, the probabilities."""
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    mask = visible.repeat_interleave(group, dim=0) if visible.shape[0] > 1 else visible
    logit = (query @ k.transpose(-1, -2)).float() * scaling
    probs = torch.softmax(logit.masked_fill(~mask[None], float("-inf")), dim=-1)
    return (probs.to(value.dtype) @ v).transpose(1, 2).contiguous(), probs


def causal(m: int, n: int) -> torch.Tensor:
    """`[1, m, n]` the last `m` of `n` tokens each seeing the tokens up to itself."""
    return (torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None])[None]


class Recorder:
    """Plain causal attention, and per layer the last call's rotated queries `[1, H_q, m, D]`, keys
    `[1, H_kv, n, D]` and scaling."""

    def __init__(self) -> None:
        self.calls: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        self.calls[module.layer_idx] = (query.clone(), key.clone(), scaling)
        return causal_attention(module, query, key, value, causal(query.shape[2], key.shape[2]), scaling)


def chunks_by_hand(context: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    out, start = [], FRAMING.prefix
    pieces = [context[a : a + CHUNK] for a in range(FRAMING.prefix, context.numel(), CHUNK)]
    for i, piece in enumerate(pieces):
        ask = FRAMING.first if i == 0 else torch.cat([FRAMING.later, pieces[i - 1][-8:]])
        out.append((start, start + piece.numel(), torch.cat([ask, FRAMING.suffix, piece])))
        start += piece.numel()
    return out


def scores_by_hand(model, context: torch.Tensor, recorder: Recorder | None = None,
                   layers: list[int] | None = None) -> torch.Tensor:
    """`[layers, H_kv, T]` KVzip's scores, the sinks +inf, computed from plain transformers forwards: of
    `layers` (default: all), whose calls `recorder` (default: `Recorder`, plain causal attention) records."""
    cfg = model.config
    layers = list(range(cfg.num_hidden_layers)) if layers is None else layers
    heads = cfg.num_key_value_heads
    group = cfg.num_attention_heads // heads
    score = torch.zeros(len(layers), heads, T)
    recorder = Recorder() if recorder is None else recorder
    name = f"kvzip_{type(recorder).__name__.lower()}"
    AttentionInterface.register(name, recorder)
    with torch.inference_mode():
        base = DynamicCache(config=cfg)
        model(context[None], past_key_values=base)
        with attn(model, name):
            for start, end, ids in chunks_by_hand(context):
                model(ids[None], past_key_values=copy.deepcopy(base))
                m = ids.numel()
                window = list(range(min(SINKS, start))) + list(range(start, end)) + list(range(T, T + m))
                first_chunk = min(SINKS, start)
                for row, layer in enumerate(layers):
                    query, key, scaling = recorder.calls[layer]
                    assert key.shape[2] == T + m  # the layer holds the whole context and the repeat forward
                    for h in range(heads):
                        k = key[0, h, window]  # [W, D]
                        causal = torch.ones(m, len(window), dtype=torch.bool)
                        causal[:, -m:] = torch.tril(torch.ones(m, m, dtype=torch.bool))
                        for g in range(group):
                            logit = (query[0, h * group + g] @ k.T).float() * scaling
                            probs = torch.softmax(logit.masked_fill(~causal, float("-inf")), dim=-1)
                            best = probs[:, first_chunk : first_chunk + end - start].amax(dim=0)
                            score[row, h, start:end] = torch.maximum(score[row, h, start:end], best)
    score[:, :, :SINKS] = float("inf")
    return score


def keep_by_hand(score: torch.Tensor, budget: int, layerwise: bool) -> torch.Tensor:
    """`[layers, H_kv, T]` bool: kvpress's `compress_post` selection."""
    layers, heads, total = score.shape
    if layerwise:
        counts = [heads * budget] * layers
    else:
        best = score.reshape(-1).topk(layers * heads * budget).indices
        counts = torch.bincount(best // (heads * total), minlength=layers).tolist()
    keep = torch.zeros(layers, heads * total, dtype=torch.bool)
    for layer, count in enumerate(counts):
        keep[layer, score[layer].reshape(-1).topk(count).indices] = True
    return keep.view(layers, heads, total)


def kept_sets(cache: EvictingCache) -> torch.Tensor:
    out = []
    for positions in cache.kept_positions():
        held = positions[0]
        mask = torch.zeros(held.shape[0], T + 1, dtype=torch.bool)
        mask.scatter_(1, torch.where(held < 0, T, held), True)
        out.append(mask[:, :T])
    return torch.stack(out)


@pytest.fixture(scope="module")
def model():
    return make_tiny(seed=21, layers=3)


@pytest.fixture(scope="module")
def context():
    return random_tokens(T, seed=22)


@pytest.fixture(scope="module")
def by_hand(model, context):
    return scores_by_hand(model, context)


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("budget", [20, 9])
def test_kept_sets_are_the_best_reconstruction_scores(model, context, by_hand, layerwise, budget):
    spec = f"kvzip:layerwise={str(layerwise).lower()},chunk_size={CHUNK}"
    state = compress(model, context, spec, budget, tokenizer=FRAMING)
    ours = kept_sets(state.cache)
    expected = keep_by_hand(by_hand, budget, layerwise)
    assert torch.equal(ours, expected), f"{(ours != expected).sum()} entries differ"
    per_layer = ours.sum(dim=(1, 2))
    heads = model.config.num_key_value_heads
    assert int(per_layer.sum()) == 3 * heads * budget
    assert len(set(ours.sum(dim=2).reshape(-1).tolist())) > 1  # the heads keep different numbers
    if not layerwise:
        assert len(set(per_layer.tolist())) > 1  # and so do the layers
    # memory held for real: the bytes counted are the entries kept
    memory = state.cache.memory()
    assert sum(sum(sum(r) for r in layer) for layer in memory.per_head) == int(ours.sum())


class KeptMask:
    """Plain attention in which the queries after the context see, per (layer, KV head), only the kept
    context entries (and the later tokens, causally)."""

    def __init__(self, keep: torch.Tensor) -> None:
        self.keep = keep  # [layers, H_kv, T]

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        m, n = query.shape[2], key.shape[2]
        i = torch.arange(n - m, n)[:, None]
        keep = torch.ones(key.shape[1], n, dtype=torch.bool)
        keep[:, :T] = self.keep[module.layer_idx]
        visible = causal(m, n) & ((i < T)[None] | keep[:, None, :])  # [H_kv, m, n]
        return causal_attention(module, query, key, value, visible, scaling)


def test_compressed_cache_decodes_as_a_masked_forward(model, context, by_hand):
    budget, tail = 12, random_tokens(8, seed=23)
    state = compress(model, context, f"kvzip:chunk_size={CHUNK}", budget, tokenizer=FRAMING)
    with torch.inference_mode():
        ours = logits(model, state.feed(model, tail))[0]
    AttentionInterface.register("kvzip_kept", KeptMask(keep_by_hand(by_hand, budget, False)))
    with attn(model, "kvzip_kept"), torch.inference_mode():
        theirs = model(torch.cat([context, tail])[None]).logits[0, T:]
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-4, atol=1e-4)


def test_a_held_back_prefill_compressed_at_each_budget_keeps_what_compress_keeps(model, context):
    spec = f"kvzip:chunk_size={CHUNK}"
    state = prefill(model, context, [spec], 20, "original", defer=True, tokenizer=FRAMING)
    for budget in (20, 9):
        copy_state = compress_at(snapshot(state), budget)
        alone = compress(model, context, spec, budget, tokenizer=FRAMING)
        assert torch.equal(kept_sets(copy_state.cache), kept_sets(alone.cache))


@pytest.mark.parametrize("layerwise", [False, True])
def test_kept_scores_compress_a_context_read_again_as_its_own_pass_does(model, context, tmp_path, monkeypatch,
                                                                         layerwise):
    """The second prefill of a context, at another budget, takes the scores the first one's pass kept and runs no
    repeat forward; what it keeps is what `compress` keeps after a pass of its own (held to the hand reference
    above). A context that differs by one token gets a pass of its own."""
    spec = f"kvzip:chunk_size={CHUNK},layerwise={str(layerwise).lower()}"
    kept = KeptScores(tmp_path)
    calls = count_repeat_forwards(monkeypatch)
    prefill(model, context, [spec], 20, "original", defer=True, tokenizer=FRAMING, kept=kept)
    passes = len(calls)
    assert passes == len(range(FRAMING.prefix, T, CHUNK)) and len(list(tmp_path.glob("*.pt"))) == 1
    for budget in (9, 20):
        before = len(calls)
        again = compress_at(prefill(model, context, [spec], budget, "original", defer=True, tokenizer=FRAMING,
                                    kept=kept), budget)
        assert len(calls) == before  # scored from the folder
        alone = compress(model, context, spec, budget, tokenizer=FRAMING)  # a pass of its own
        assert torch.equal(kept_sets(again.cache), kept_sets(alone.cache))
    other = context.clone()
    other[-1] = (other[-1] + 1) % model.config.vocab_size
    before = len(calls)
    moved = compress_at(prefill(model, other, [spec], 9, "original", defer=True, tokenizer=FRAMING, kept=kept), 9)
    assert len(calls) == before + passes and len(list(tmp_path.glob("*.pt"))) == 2
    assert torch.equal(kept_sets(moved.cache), kept_sets(compress(model, other, spec, 9, tokenizer=FRAMING).cache))


def test_kept_scores_that_do_not_fit_are_scored_again(model, context, tmp_path, monkeypatch):
    """A file cut short, or scores of another shape under the same name, are not used: the pass runs again, and
    the context is compressed as `compress` compresses it."""
    spec = f"kvzip:chunk_size={CHUNK}"
    kept = KeptScores(tmp_path)
    calls = count_repeat_forwards(monkeypatch)
    state = prefill(model, context, [spec], 9, "original", defer=True, tokenizer=FRAMING, kept=kept)
    [path] = tmp_path.glob("*.pt")
    passes = len(calls)
    alone = kept_sets(compress(model, context, spec, 9, tokenizer=FRAMING).cache)
    scores = state.cache.reconstruction_scores()
    for broken in (b"cut sh", [{k: v[..., :-1] for k, v in layer.items()} for layer in scores]):
        if isinstance(broken, bytes):
            path.write_bytes(broken)
        else:
            torch.save(broken, path)
        before = len(calls)
        again = compress_at(prefill(model, context, [spec], 9, "original", defer=True, tokenizer=FRAMING,
                                    kept=kept), 9)
        assert len(calls) == before + passes  # scored again
        assert torch.equal(kept_sets(again.cache), alone)


def test_the_framing_is_the_chat_template_split_around_the_user_turn():
    from kvevict.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    framing = repeat_framing(tokenizer)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "XYZ"}], add_generation_prompt=True,
                                             tokenize=False)
    opening, closing = rendered.split("XYZ")
    assert tokenizer.decode(tokenizer.encode(opening, add_special_tokens=False)[: framing.prefix]) == opening
    assert tokenizer.decode(framing.suffix) == closing
    assert tokenizer.decode(framing.first) == "\n\nRepeat the previous context exactly."


# --- refusals -------------------------------------------------------------------------------------


def test_a_stream_that_evicts_as_it_reads_is_refused(model, context):
    cache = EvictingCache(model, "kvzip", budget=20)
    with pytest.raises(KvevictError, match="reconstructing it after the prefill"), torch.inference_mode():
        body(model, context[None], cache)


def test_compress_without_a_tokenizer_is_refused(model, context):
    with pytest.raises(KvevictError, match="pass the model's tokenizer"):
        compress(model, context, "kvzip", 20)


def test_an_eviction_before_reconstruction_is_refused(model, context):
    cache = EvictingCache(model, "kvzip", budget=20)
    cache.defer()
    with torch.inference_mode():
        body(model, context[None], cache)
    with pytest.raises(KvevictError, match="no scores yet"):
        cache.evict_deferred()


@pytest.mark.parametrize("spec,needle", [("sink4+kvzip", "run 'kvzip' bare"), ("adakv:kvzip", "run 'kvzip' bare"),
                                         ("q4+kvzip", "no quantized storage form"),
                                         ("kvzip:page=4", "one budget per layer")])
def test_wrappers_are_refused(spec, needle):
    with pytest.raises(KvevictError, match=needle):
        check_policy(spec, 32, "original")


@pytest.mark.parametrize("spec,needle", [("kvzip:n_sink=-1", "n_sink"), ("kvzip:chunk_size=0", "chunk_size")])
def test_bad_options_are_refused(spec, needle):
    with pytest.raises(KvevictError, match=needle):
        check_policy(spec, 32, "original")


def test_a_budget_within_the_sinks_is_refused():
    with pytest.raises(KvevictError, match="at least 5"):
        check_policy("kvzip", 4, "original")


def test_an_ab_sweep_refuses_it_before_any_model_work(tmp_path):
    from kvevict.ab.plan import plan

    from test_ab import TEXT, config

    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    with pytest.raises(KvevictError, match="run it with kvevict ruler"):
        plan(config(tmp_path, text, policies=["window", "kvzip"]))


def test_the_stream_protocol_refuses_it(model, context):
    with pytest.raises(KvevictError, match="run it under agnostic, aware or multi --form requests"):
        prefill(model, context, [f"kvzip:chunk_size={CHUNK}"], 20, "original", stream=True, tokenizer=FRAMING)
