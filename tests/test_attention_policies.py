"""H2O and SnapKV against direct implementations written here, on the tiny GQA model."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from kvevict import EvictingCache, compare
from kvevict.cache.attention import kvevict_attention
from kvevict.cache.statistics import probabilities
from kvevict.cache.statistics.probabilities import attention_mass
from kvevict.eval.forward import body

from conftest import make_tiny, random_tokens
from support import attn, logits_through


class H2OReference:
    """Full cache + eager attention + an evicted mask per (layer, KV head); H2O's rule by hand.

    Keep the `recent` most recent tokens and the highest cumulative-attention tokens
    among the rest; pinned sinks always stay.
    """

    def __init__(self, budget: int, recent_share: float, sinks: int) -> None:
        self.budget, self.sinks = budget, sinks
        self.recent = int(round(recent_share * (budget - sinks)))
        self.acc: dict[int, torch.Tensor] = {}
        self.evicted: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        b, hq, q, d = query.shape
        hkv, total = key.shape[1], key.shape[2]
        group = hq // hkv
        acc = self.acc.setdefault(layer, torch.zeros(b, hkv, 0))
        evicted = self.evicted.setdefault(layer, torch.zeros(b, hkv, 0, dtype=torch.bool))
        acc = torch.cat([acc, torch.zeros(b, hkv, q)], dim=2)
        evicted = torch.cat([evicted, torch.zeros(b, hkv, q, dtype=torch.bool)], dim=2)
        k = key.repeat_interleave(group, dim=1)
        v = value.repeat_interleave(group, dim=1)
        logits = (query @ k.transpose(-1, -2)).float() * scaling
        qpos = torch.arange(total - q, total)[:, None]
        allowed = torch.arange(total)[None, :] <= qpos
        allowed = allowed[None, None] & ~evicted.repeat_interleave(group, dim=1)[:, :, None, :]
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        out = probs.to(value.dtype) @ v
        acc += probs.view(b, hkv, group, q, total).sum(dim=(2, 3))
        for row in range(b):
            for head in range(hkv):
                alive = (~evicted[row, head]).nonzero()[:, 0].tolist()
                if len(alive) <= self.budget:
                    continue
                pinned = [p for p in alive if p < self.sinks]
                rest = [p for p in alive if p >= self.sinks]
                recent = [p for p in rest if p >= total - self.recent]
                others = [p for p in rest if p < total - self.recent]
                heavy_slots = self.budget - len(pinned) - len(recent)
                ranked = sorted(others, key=lambda p: float(acc[row, head, p]), reverse=True)
                keep = set(pinned) | set(recent) | set(ranked[:heavy_slots])
                for p in alive:
                    if p not in keep:
                        evicted[row, head, p] = True
        self.acc[layer], self.evicted[layer] = acc, evicted
        return out.transpose(1, 2).contiguous(), probs


def run_h2o_reference(model, tokens: torch.Tensor, budget: int, recent: float, sinks: int):
    reference = H2OReference(budget, recent, sinks)
    AttentionInterface.register("h2o_reference", reference)
    nll = []
    with attn(model, "h2o_reference"), torch.inference_mode():
        cache = DynamicCache(config=model.config)
        chunks = [tokens[:budget]] + [tokens[t : t + 1] for t in range(budget, tokens.numel())]
        for chunk in chunks:
            logits = model(chunk[None], past_key_values=cache, use_cache=True).logits[0]
            nll.append(logits)
    logits = torch.cat(nll)[:-1]
    lp = torch.log_softmax(logits.float(), -1)
    return -lp.gather(-1, tokens[1:, None])[:, 0], reference


@pytest.mark.parametrize("budget,recent,sinks", [(24, 0.5, 0), (16, 0.25, 0), (20, 0.5, 4), (12, 0.0, 0)])
def test_h2o_matches_full_cache_reference_with_masked_evictions(budget, recent, sinks):
    model = make_tiny(seed=12)
    tokens = random_tokens(160, seed=budget)
    spec = f"h2o:recent={recent}" if sinks == 0 else f"sink{sinks}+h2o:recent={recent}"
    cache = EvictingCache(model, spec, budget=budget)
    ours = []
    with torch.inference_mode():
        for chunk in [tokens[:budget]] + [tokens[t : t + 1] for t in range(budget, tokens.numel())]:
            ours.append(model.get_output_embeddings()(body(model, chunk[None], cache))[0])
    our_nll = -torch.log_softmax(torch.cat(ours)[:-1].float(), -1).gather(-1, tokens[1:, None])[:, 0]
    ref_nll, reference = run_h2o_reference(model, tokens, budget, recent, sinks)
    assert ((our_nll - ref_nll).abs() / ref_nll.abs()).max() < 1e-4
    for idx, layer in enumerate(cache.layers):
        kept = layer.kept_positions()[0]
        for head in range(kept.shape[0]):
            expected = (~reference.evicted[idx][0, head]).nonzero()[:, 0]
            assert kept[head].tolist() == expected.tolist(), f"layer {idx} head {head} kept different tokens"


def test_h2o_evicts_during_decoding_not_only_after_prompt():
    model = make_tiny(seed=1)
    tokens = random_tokens(100, seed=2)
    rows, _ = compare(model, tokens, ["h2o", "window"], budget=20, reference=False, progress=False)
    assert rows[0].max_kept == 20
    # heavy hitters differ from recency: the two rows must not produce the same stream
    assert (rows[0].nll - rows[1].nll).abs().max() > 1e-3


def eager_attentions(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    with attn(model, "eager"), torch.inference_mode():
        return list(model(tokens[None], output_attentions=True).attentions)


@pytest.mark.parametrize("block_elements,prompt", [(1 << 24, 90), (4096, 90), (1 << 24, 60)])
def test_captured_attention_equals_eager_softmax(block_elements, prompt, monkeypatch):
    """Cumulative attention per key equals eager attention summed over queries and the
    heads of a group: after a prefill, and after decode steps (`prompt` < 90), where
    the probabilities come from kvevict's own decode attention instead of a second pass."""
    monkeypatch.setattr(probabilities, "BLOCK_ELEMENTS", block_elements)
    model = make_tiny(seed=3)
    tokens = random_tokens(90, seed=6)
    cache = EvictingCache(model, "h2o", budget=1000)  # large budget: statistics only, no eviction
    with torch.inference_mode():
        hidden = [body(model, tokens[None, :prompt], cache)]
        hidden += [body(model, tokens[None, t : t + 1], cache) for t in range(prompt, 90)]
    with attn(model, "sdpa"), torch.inference_mode():
        plain = model.model(tokens[None]).last_hidden_state
    torch.testing.assert_close(torch.cat(hidden, dim=1), plain, atol=1e-5, rtol=1e-4)
    for idx, weights in enumerate(eager_attentions(model, tokens)):
        b, hq, q, n = weights.shape
        expected = weights.view(b, 2, hq // 2, q, n).sum(dim=(2, 3))
        got = cache.layers[idx].stats["h2o_attention"][:, :, :n]
        assert (got - expected).abs().max() < 1e-5 * q


def test_attention_mass_per_query_equals_eager_probabilities():
    model = make_tiny(seed=4)
    tokens = random_tokens(40, seed=7)
    captured = {}

    def grab(module, query, key, value, attention_mask, scaling=None, **kwargs):
        captured[module.layer_idx] = (query.clone(), key.clone(), scaling)
        return kvevict_attention(module, query, key, value, attention_mask, scaling, **kwargs)

    AttentionInterface.register("grab", grab)
    with attn(model, "grab"), torch.inference_mode():
        model(tokens[None])
    for idx, weights in enumerate(eager_attentions(model, tokens)):
        query, key, scaling = captured[idx]
        positions = torch.arange(40)
        for i in (0, 7, 39):
            mass = attention_mass(query[:, :, i : i + 1], positions[i : i + 1], key,
                                  positions.expand(1, 2, 40), scaling)
            expected = weights[:, :, i].view(1, 2, 2, 40).sum(2)
            assert (mass - expected).abs().max() < 1e-5


def pool_direct(x: list[float], kernel: int, how: str) -> list[float]:
    half = kernel // 2
    out = []
    for i in range(len(x)):
        lo, hi = max(0, i - half), min(len(x), i + half + 1)
        window = x[lo:hi]
        out.append(max(window) if how == "max" else sum(window) / kernel)
    return out


@pytest.mark.parametrize("window,kernel,pooling,budget", [(8, 5, "max", 40), (4, 7, "avg", 30), (6, 1, "max", 20)])
def test_snapkv_selection_equals_direct_formula(window, kernel, pooling, budget):
    model = make_tiny(seed=8)
    length = 120
    tokens = random_tokens(length, seed=kernel)
    cache = EvictingCache(model, f"snapkv:window={window},kernel={kernel},pooling={pooling}", budget=budget)
    with torch.inference_mode():
        body(model, tokens[None], cache)
    for idx, weights in enumerate(eager_attentions(model, tokens)):
        w = weights[0]  # [Hq, L, L]
        hq = w.shape[0]
        per_kv = w[:, -window:, :].sum(1).view(2, hq // 2, length).sum(1)  # [Hkv, L]
        for head in range(2):
            prefix = per_kv[head, : length - window].tolist()
            pooled = pool_direct(prefix, kernel, pooling)
            # max pooling makes exact ties; kvevict's documented rule keeps the later token
            top = sorted(range(len(pooled)), key=lambda i: (pooled[i], i), reverse=True)[: budget - window]
            expected = sorted(top + list(range(length - window, length)))
            assert cache.layers[idx].kept_positions()[0, head].tolist() == expected


def test_snapkv_hard_budget_never_exceeded_and_reselects():
    model = make_tiny(seed=9)
    tokens = random_tokens(200, seed=3)
    cache = EvictingCache(model, "snapkv:window=4,interval=4", budget=16)
    with torch.inference_mode():
        body(model, tokens[None, :16], cache)
        for t in range(16, 200):
            body(model, tokens[None, t : t + 1], cache)
            assert all(layer.n <= 16 for layer in cache.layers)
    kept = cache.layers[0].kept_positions()[0, 0]
    assert kept.max() == 199 and kept.min() < 150  # recent window plus older selected tokens


class SnapKVReference:
    """Full cache + eager attention + an evicted mask per (layer, KV head); streaming
    SnapKV's rule by hand (the rule documented in policies/snapkv.py).

    At a selection step (the first overflow, then every `interval` tokens) the last
    `window` queries' attention over the alive entries, summed over the group's heads,
    pooled along the alive entries in position order, ranks the older entries; the
    window stays. Between selections the lowest stored score goes (entries that arrived
    since, or sat in the window at selection, score 0), the recent window protected.
    """

    def __init__(self, budget: int, window: int, kernel: int, pooling: str, interval: int) -> None:
        self.budget, self.window, self.kernel, self.pooling, self.interval = budget, window, kernel, pooling, interval
        self.queries: dict[int, torch.Tensor] = {}
        self.score: dict[int, torch.Tensor] = {}
        self.evicted: dict[int, torch.Tensor] = {}
        self.selected_at: dict[int, int] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        layer = module.layer_idx
        _, hq, q, _ = query.shape
        hkv, total = key.shape[1], key.shape[2]
        group = hq // hkv
        evicted = torch.cat([self.evicted.get(layer, torch.zeros(hkv, 0, dtype=torch.bool)),
                             torch.zeros(hkv, q, dtype=torch.bool)], dim=1)
        score = torch.cat([self.score.get(layer, torch.zeros(hkv, 0)), torch.zeros(hkv, q)], dim=1)
        queries = torch.cat([self.queries.get(layer, query[0, :, :0]), query[0]], dim=1)  # [Hq, total, D]
        k = key[0].repeat_interleave(group, dim=0)
        v = value[0].repeat_interleave(group, dim=0)
        causal = torch.arange(total)[None, :] <= torch.arange(total - q, total)[:, None]
        allowed = causal[None] & ~evicted.repeat_interleave(group, dim=0)[:, None, :]
        probs = torch.softmax((query[0] @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf")), -1)
        out = (probs @ v)[None]
        for head in range(hkv):
            alive = (~evicted[head]).nonzero()[:, 0].tolist()
            if len(alive) <= self.budget:
                continue
            last = self.selected_at.get((layer, head))
            if last is None or total - last >= self.interval:
                self.selected_at[(layer, head)] = total
                obs = list(range(max(0, total - self.window), total))
                heads = range(head * group, (head + 1) * group)
                mass = {p: 0.0 for p in alive}
                for h in heads:
                    for i in obs:
                        seen = [p for p in alive if p <= i]
                        w = torch.softmax(torch.stack([queries[h, i] @ k[h, p] * scaling for p in seen]), 0)
                        for p, x in zip(seen, w.tolist()):
                            mass[p] += x
                prefix = [p for p in alive if p < total - len(obs)]
                pooled = pool_direct([mass[p] for p in prefix], self.kernel, self.pooling)
                score[head] = 0.0
                for p, x in zip(prefix, pooled):
                    score[head, p] = x
            recent = set(range(total - self.window, total))
            older = [p for p in alive if p not in recent]
            # highest score first, later token first among equals; the tail goes
            ranked = sorted(older, key=lambda p: (float(score[head, p]), p), reverse=True)
            for p in ranked[self.budget - (len(alive) - len(older)) :]:
                evicted[head, p] = True
        self.evicted[layer], self.score[layer], self.queries[layer] = evicted, score, queries
        return out.transpose(1, 2).contiguous(), probs[None]


@pytest.mark.parametrize("budget,window,kernel,pooling,interval", [(16, 4, 3, "max", 4), (14, 3, 1, "avg", 5)])
def test_snapkv_streaming_matches_reference_with_masked_evictions(budget, window, kernel, pooling, interval):
    """Prefill, then token by token with re-selection every `interval`: same tokens kept
    per layer and head and the same NLL as the eager reference above."""
    model = make_tiny(seed=13)
    tokens = random_tokens(70, seed=budget)
    spec = f"snapkv:window={window},kernel={kernel},pooling={pooling},interval={interval}"
    cache = EvictingCache(model, spec, budget=budget)
    chunks = [tokens[:budget + 3]] + [tokens[t : t + 1] for t in range(budget + 3, tokens.numel())]
    ours = []
    with torch.inference_mode():
        for chunk in chunks:
            ours.append(model.get_output_embeddings()(body(model, chunk[None], cache))[0])
    our_nll = -torch.log_softmax(torch.cat(ours)[:-1].float(), -1).gather(-1, tokens[1:, None])[:, 0]

    reference = SnapKVReference(budget, window, kernel, pooling, interval)
    ref = logits_through(model, "snapkv_reference", reference, chunks)
    ref_nll = -torch.log_softmax(ref[:-1].float(), -1).gather(-1, tokens[1:, None])[:, 0]
    assert ((our_nll - ref_nll).abs() / ref_nll.abs()).max() < 1e-4
    for idx, layer in enumerate(cache.layers):
        kept = layer.kept_positions()[0]
        for head in range(kept.shape[0]):
            expected = (~reference.evicted[idx][head]).nonzero()[:, 0]
            assert kept[head].tolist() == expected.tolist(), f"layer {idx} head {head} kept different tokens"
