"""TOVA, K-norm, KeyDiff and PyramidKV against their papers' formulas, written out here.

The reference runs the model with a full `DynamicCache` and an attention function that
masks, per (layer, KV head), the entries the rule evicted, deciding each eviction from
the formula in plain torch (no kvevict code). The cache must end with the same kept set
in every layer and head and give the same NLL.
"""

from __future__ import annotations

import pytest
import torch

from kvevict import EvictingCache
from kvevict.errors import KvevictError
from kvevict.eval.forward import body
from kvevict.policies import check_policy, parse_policy

from conftest import make_tiny, random_tokens
from support import attn, logits_through


def tova_victim(probs, keys, alive, candidates, head, group, per_group):
    """probs `[H_q, total]` of the newest query; drop the lowest attention averaged over heads."""
    heads = probs[head * group : (head + 1) * group] if per_group else probs
    score = heads.mean(dim=0)
    return min(candidates, key=lambda p: (float(score[p]), p))


def knorm_victim(probs, keys, alive, candidates, head, group, per_group):
    """Drop the largest key norm (compared at half precision; the earlier of equal norms goes)."""
    norm = keys[head].float().norm(dim=-1).half().float()
    return max(candidates, key=lambda p: (float(norm[p]), -p))


def keydiff_victim(probs, keys, alive, candidates, head, group, per_group):
    """Drop the key most similar (cosine) to the mean of the unit keys the cache holds (sinks included)."""
    unit = keys[head].double() / keys[head].double().norm(dim=-1, keepdim=True)
    anchor = unit[alive].mean(dim=0)
    cos = unit[candidates] @ anchor / anchor.norm()
    return candidates[int(cos.argmax())]


class Reference:
    """Full cache + eager attention + an evicted mask per (layer, KV head); one victim per overflow."""

    def __init__(self, rule, budget: int, sinks: int = 0, per_group: bool = False) -> None:
        self.rule, self.budget, self.sinks, self.per_group = rule, budget, sinks, per_group
        self.evicted: dict[int, torch.Tensor] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        b, hq, q, d = query.shape
        hkv, total = key.shape[1], key.shape[2]
        group = hq // hkv
        evicted = self.evicted.get(module.layer_idx, torch.zeros(b, hkv, 0, dtype=torch.bool))
        evicted = torch.cat([evicted, torch.zeros(b, hkv, q, dtype=torch.bool)], dim=2)
        logits = (query @ key.repeat_interleave(group, dim=1).transpose(-1, -2)).float() * scaling
        allowed = torch.arange(total)[None, :] <= torch.arange(total - q, total)[:, None]
        allowed = allowed[None, None] & ~evicted.repeat_interleave(group, dim=1)[:, :, None, :]
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        out = probs.to(value.dtype) @ value.repeat_interleave(group, dim=1)
        for row in range(b):
            for head in range(hkv):
                alive = (~evicted[row, head]).nonzero()[:, 0].tolist()
                if len(alive) > self.budget:
                    assert q == 1, "the reference evicts on decode steps only"
                    candidates = [p for p in alive if p >= self.sinks]
                    victim = self.rule(probs[row, :, -1], key[row], alive, candidates, head, group, self.per_group)
                    evicted[row, head, victim] = True
        self.evicted[module.layer_idx] = evicted
        return out.transpose(1, 2).contiguous(), probs


def stream_both(spec, rule, tokens, budget, sinks=0, per_group=False, layers=2):
    model = make_tiny(seed=21, layers=layers)
    chunks = [tokens[:budget]] + [tokens[t : t + 1] for t in range(budget, tokens.numel())]
    cache = EvictingCache(model, spec, budget=budget)
    ours = []
    with torch.inference_mode():
        for chunk in chunks:
            ours.append(model.get_output_embeddings()(body(model, chunk[None], cache))[0])
    reference = Reference(rule, budget, sinks, per_group)
    return torch.cat(ours), logits_through(model, "new_policy_reference", reference, chunks), cache, reference


CASES = [
    ("tova", tova_victim, 0, False),
    ("tova:per_group=1", tova_victim, 0, True),
    ("sink2+tova", tova_victim, 2, False),
    ("knorm", knorm_victim, 0, False),
    ("sink3+knorm", knorm_victim, 3, False),
    ("keydiff", keydiff_victim, 0, False),
    ("sink2+keydiff", keydiff_victim, 2, False),
]


@pytest.mark.parametrize("spec,rule,sinks,per_group", CASES)
def test_decode_eviction_follows_the_formula(spec, rule, sinks, per_group):
    # distinct tokens: a repeated token's first-layer keys differ only by rotation (K-norm would tie)
    tokens = torch.randperm(101, generator=torch.Generator().manual_seed(5))[:70]
    ours, theirs, cache, reference = stream_both(spec, rule, tokens, budget=14, sinks=sinks, per_group=per_group)
    assert (ours - theirs).abs().max() < 1e-3, f"{spec}: logits differ from the reference"
    for index, layer in enumerate(cache.layers):
        kept = layer.kept_positions()[0]
        for head in range(kept.shape[0]):
            expected = (~reference.evicted[index][0, head]).nonzero()[:, 0].tolist()
            assert kept[head].tolist() == expected, f"{spec}: layer {index} head {head} kept other tokens"
    if not per_group and spec.endswith("tova"):  # one kept set for the layer's KV heads, as in the paper
        assert all(bool((layer.kept_positions()[0] == layer.kept_positions()[0, :1]).all()) for layer in cache.layers)


def test_tova_per_group_lets_heads_keep_different_tokens():
    tokens = random_tokens(70, seed=9)
    _, _, cache, _ = stream_both("tova:per_group=1", tova_victim, tokens, budget=14, per_group=True)
    assert any(not bool((layer.kept_positions()[0] == layer.kept_positions()[0, :1]).all()) for layer in cache.layers)


@pytest.mark.parametrize("spec", ["tova", "tova:per_group=1"])
def test_tova_compresses_a_prompt_by_its_last_query(spec):
    """A prompt longer than the budget, one forward: keep the entries the last query attends to most."""
    model = make_tiny(seed=23, layers=2)
    tokens = random_tokens(40, seed=4)
    budget = 12
    with attn(model, "eager"), torch.inference_mode():
        attentions = model(tokens[None], output_attentions=True).attentions  # per layer [1, H_q, T, T]
    cache = EvictingCache(model, spec, budget=budget)
    with torch.inference_mode():
        body(model, tokens[None], cache)
    for index, layer in enumerate(cache.layers):
        last = attentions[index][0, :, -1].double()  # [H_q, T]
        group = last.shape[0] // layer.heads
        for head in range(layer.heads):
            score = last[head * group : (head + 1) * group].mean(0) if spec.endswith("=1") else last.mean(0)
            expected = sorted(score.topk(budget).indices.tolist())
            assert layer.kept_positions()[0, head].tolist() == expected, f"layer {index} head {head}"


def test_pyramid_budgets_fall_linearly_and_sum_to_the_uniform_total():
    # window 8, budget 64: 56 selectable on average; top 56/4 = 14, bottom 2*56 - 14 = 98, step 21
    assert parse_policy("pyramidkv:window=8,beta=4").layer_budgets(64, 5) == [106, 85, 64, 43, 22]
    assert parse_policy("pyramidkv:window=8,beta=1").layer_budgets(64, 5) == [64] * 5
    # rounding spread so the total is exact: 3 layers, 10 selectable, top 10/3
    budgets = parse_policy("pyramidkv:window=2,beta=3").layer_budgets(12, 3)
    assert sum(budgets) == 36 and budgets == sorted(budgets, reverse=True) and min(budgets) >= 3
    # sinks sit in every layer, the pyramid on the rest
    assert parse_policy("sink4+pyramidkv:window=8,beta=4").layer_budgets(68, 5) == [110, 89, 68, 47, 26]


def test_pyramidkv_layers_hold_their_budgets_and_select_like_snapkv():
    """Each layer holds its pyramid budget; within it, selection is SnapKV's at that budget."""
    model = make_tiny(seed=25, layers=3)
    tokens = random_tokens(60, seed=8)
    spec = "pyramidkv:window=4,beta=3"
    budgets = parse_policy(spec).layer_budgets(16, 3)
    assert budgets[0] > 16 > budgets[2]
    cache = EvictingCache(model, spec, budget=16)
    with torch.inference_mode():
        body(model, tokens[None], cache)  # one prefill: every layer sees the same prompt
    for index, layer in enumerate(cache.layers):
        assert layer.kept_positions().shape[-1] == budgets[index]
        alone = EvictingCache(model, "snapkv:window=4", budget=budgets[index])
        with torch.inference_mode():
            body(model, tokens[None], alone)
        assert torch.equal(layer.kept_positions(), alone.layers[index].kept_positions()), f"layer {index}"


def test_a_budget_set_mid_run_reaches_every_layer_with_its_share():
    """Compress, grow frozen, then restore a budget (lm-eval's generation: `cache.budget = entries`):
    the next forward leaves each layer its pyramid share of the new budget."""
    model = make_tiny(seed=25, layers=3)
    tokens = random_tokens(60, seed=8)
    spec = "pyramidkv:window=4,beta=3"
    first = parse_policy(spec).layer_budgets(16, 3)
    cache = EvictingCache(model, spec, budget=16)
    with torch.inference_mode():
        body(model, tokens[None, :30], cache)
        cache.freeze()
        body(model, tokens[None, 30:40], cache)  # frozen: every layer keeps what it had and grows
        assert [layer.n for layer in cache.layers] == [min(30, b) + 10 for b in first]
        cache.budget = 12
        body(model, tokens[None, 40:41], cache)
    shares = parse_policy(spec).layer_budgets(12, 3)
    assert [layer.n for layer in cache.layers] == shares and cache.layer_budgets() == shares


@pytest.mark.parametrize(
    "spec,budget,needle",
    [
        ("pyramidkv:beta=0.5", 64, "beta must be >= 1"),
        ("pyramidkv:window=32,beta=20", 40, "too small for the pyramid"),
        ("sink4+pyramidkv:window=32,beta=20", 50, "too small for the pyramid"),
    ],
)
def test_bad_pyramid_settings_are_refused(spec, budget, needle):
    with pytest.raises(KvevictError, match=needle):
        check_policy(spec, budget, "original")


def test_a_per_layer_policy_cannot_share_a_batch():
    model = make_tiny(seed=2, layers=2)
    with pytest.raises(KvevictError, match="own batch"):
        EvictingCache(model, ["pyramidkv:window=2,beta=2", "window"], budget=12)
