"""The policy contract, checked for every registered policy and both sink wrappers.

Driven by the registry (`policy_matrix.py`): a new policy is covered by registering it.
The invariants: the cache holds exactly `min(seen, budget)` distinct past tokens per
(layer, KV head) after every forward; the tokens a policy declares pinned are held; a
run is deterministic; a row's result does not depend on the rows beside it; and a
policy that declares no need for attention never asks for it.
"""

from __future__ import annotations

import pytest
import torch

from kvevict import EvictingCache, KvevictError, parse_policy
from kvevict.eval.forward import body
from kvevict.policies import AttentionRequest, SlotView
from kvevict.policies.adakv import AdaKV
from kvevict.policies.h2o import H2O
from kvevict.policies.sinkauto import SinkAuto

from conftest import make_tiny, random_tokens
from policy_matrix import bounded_specs, held_after, neighbours, position_modes

MODEL = make_tiny(seed=11, layers=2)
TOKENS = random_tokens(64, seed=12)
CHUNKS = [9, 1, 1, 5, 1, 1, 1, 12, 1, 2, 1, 1, 20]  # prefills, decode steps and mid-size forwards
BUDGET = 10


def run(specs: list[str], positions: str) -> tuple[list[torch.Tensor], list[list[torch.Tensor]], EvictingCache]:
    """Feed TOKENS in CHUNKS; per forward: hidden states `[rows, q, H]` and each layer's kept positions."""
    cache = EvictingCache(MODEL, specs, budget=BUDGET, positions=positions)
    hidden, kept, seen = [], [], 0
    with torch.inference_mode():
        for q in CHUNKS:
            ids = TOKENS[None, seen : seen + q].expand(len(specs), -1)
            hidden.append(body(MODEL, ids, cache))
            seen += q
            kept.append([layer.kept_positions() for layer in cache.layers])
    return hidden, kept, cache


@pytest.mark.parametrize("spec,positions", [(s, p) for s in bounded_specs() for p in position_modes(s)])
def test_budget_and_pinned_tokens_hold(spec, positions):
    _, kept, cache = run([spec], positions)
    policy = cache.row_policies()[0]
    seen = 0
    schedule = held_after(spec, BUDGET, CHUNKS)
    for q, layers, scheduled in zip(CHUNKS, kept, schedule):
        seen += q
        for index, pos in enumerate(layers):  # [1, H, n], ascending (per-head budgets: padded with -1 at the end)
            budget = cache.layers[index].budget  # BUDGET, or the layer's share of it (pyramidkv)
            heads = [head[head >= 0] for head in pos[0]]
            if policy.varies_by_head:  # the heads share H x budget; each keeps at least its floor
                assert sum(h.numel() for h in heads) == len(heads) * min(seen, budget), f"{spec}: layer over budget"
                assert all(h.numel() >= min(seen, policy.head_floor(budget)) for h in heads), f"{spec}: below floor"
            elif policy.own_schedule:  # an engine's schedule: what it says, never over the budget
                assert pos.shape[-1] == scheduled <= budget, f"{spec}: holds {pos.shape[-1]} after {seen} tokens"
            else:
                assert pos.shape[-1] == min(seen, budget), f"{spec}: holds {pos.shape[-1]} after {seen} tokens"
            assert all(bool((h.diff() > 0).all()) and bool((h < seen).all()) for h in heads)
            held = [set(head.tolist()) for head in heads]
            assert all(set(range(min(policy.pinned, seen))) <= h for h in held), f"{spec}: pinned token evicted"
            measured = cache.layers[index].state_of(policy).sinks if isinstance(policy, SinkAuto) else None
            if measured is not None:
                for h, sinks in zip(held, measured[0]):
                    assert set(sinks.tolist()) <= h, f"{spec}: a measured sink was evicted"
    assert not cache.pinned_sink_evicted()


@pytest.mark.parametrize("spec", bounded_specs())
def test_runs_are_deterministic_and_rows_independent(spec):
    mode = position_modes(spec)[0]
    alone_hidden, alone_kept, _ = run([spec], mode)
    again_hidden, again_kept, _ = run([spec], mode)
    for a, b in zip(alone_hidden, again_hidden):
        assert torch.equal(a, b), f"{spec}: two runs differ"
    for a, b in zip(alone_kept, again_kept):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # the same policy as the middle row of a batch, between two others
    first, last = neighbours(spec, ["window", "h2o:recent=0.5"])
    mixed_hidden, mixed_kept, _ = run([first, spec, last], mode)
    for a, b in zip(alone_hidden, mixed_hidden):
        # rounding only (SDPA beside other rows vs attention by hand alone): the kept sets must be equal
        assert torch.allclose(a[0], b[1], atol=5e-5, rtol=1e-4), f"{spec}: result depends on its neighbours"
    for a, b in zip(alone_kept, mixed_kept):
        assert all(torch.equal(x[0], y[1]) for x, y in zip(a, b)), f"{spec}: kept set depends on its neighbours"


@pytest.mark.parametrize("spec", bounded_specs())
def test_declared_flags_are_honest(spec):
    """What a policy declares is what it does: a policy that says it needs no attention
    never asks for it and carries no statistic; one that says it reads no keys scores
    without them, and one that says it does reads them."""
    policy = parse_policy(spec)
    view = SlotView(positions=torch.arange(12).view(1, 1, 12), seen=12, budget=BUDGET, layer=0,
                    state=policy.new_state(0))
    if not policy.needs_attention:
        assert policy.stats == ()
        assert policy.request(view, will_evict=True) is None
    else:
        assert policy.request(view, will_evict=True) is not None
    read = []
    keyed = SlotView(
        positions=torch.arange(12).view(1, 1, 12), seen=12, budget=BUDGET, layer=0,
        stats={name: torch.rand(1, 1, 12) for name in policy.stats},
        keys=lambda: read.append(True) or torch.randn(1, 1, 12, 4),
        values=lambda: torch.randn(1, 1, 12, 4), state=policy.new_state(0),
    )
    policy.scores(keyed)
    assert bool(read) == policy.reads_keys, f"{spec}: reads_keys={policy.reads_keys} but keys read: {bool(read)}"


class _AsksForNothingKnown(H2O):
    """A policy whose request names a kind of attention no measurement exists for."""

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest | None:
        return AttentionRequest(kind="everything", stat=self.stats[0])


@pytest.mark.parametrize(
    "spec,per_token,chunk",
    [
        ("plain", False, 1),  # a decode step: Statistics.feed
        ("plain", True, 6),  # a chunk replayed step by step: replay's stepping
        ("adakv", False, 1),  # per-head budgets: the ragged layer
    ],
)
def test_an_unknown_attention_request_is_refused_on_every_path(spec, per_token, chunk):
    """One dispatch from a request's kind to its measurement: an unknown kind raises, never reads as a window."""
    policy = _AsksForNothingKnown() if spec == "plain" else AdaKV(_AsksForNothingKnown())
    cache = EvictingCache(MODEL, [policy], budget=5, per_token=per_token)
    with torch.inference_mode(), pytest.raises(KvevictError, match="'everything'.*must be one of new, last, window"):
        body(MODEL, TOKENS[None, :3], cache)
        for start in range(3, 30, chunk):
            body(MODEL, TOKENS[None, start : start + chunk], cache)
