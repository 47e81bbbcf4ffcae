"""Invariants that must hold for any budget, sink count, length and feeding pattern."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvevict import EvictingCache
from kvevict.errors import KvevictError
from kvevict.eval.forward import body
from kvevict.policies import Policy, SlotView, check_policy, parse_policy

from conftest import make_tiny
from policy_matrix import base_specs

MODEL = make_tiny(seed=5, layers=2)
VOCAB = MODEL.config.vocab_size


def feed_and_check(spec: str, budget: int, sinks: int, length: int, chunks: list[int], positions: str) -> None:
    """`sinks`: the leading tokens `spec` pins (0 for `sinkauto`, whose sinks are measured)."""
    cache = EvictingCache(MODEL, spec, budget=budget, positions=positions)
    policy = parse_policy(spec)
    tokens = torch.arange(length) % VOCAB
    seen = 0
    # tokens seen when token 0 left each (layer, head), from the kept positions alone
    lost_at = torch.full((len(MODEL.model.layers), MODEL.config.num_key_value_heads), -1)
    with torch.inference_mode():
        chunk_iter = iter(chunks)
        while seen < length:
            q = min(next(chunk_iter, 1), length - seen)
            body(MODEL, tokens[None, seen : seen + q], cache)
            seen += q
            for i, layer in enumerate(cache.layers):
                kept = layer.kept_positions()[0]  # [H, n] (adakv: padded with -1 after each head's entries)
                gone = (kept != 0).all(dim=-1) & (lost_at[i] < 0)
                lost_at[i] = torch.where(gone, seen, lost_at[i])
                held = layer.budget  # the cache's budget, or this layer's share of it (pyramidkv)
                lengths = layer.head_lengths()[0]  # [H]
                if policy.varies_by_head:  # the heads share H x budget; each keeps at least its floor
                    assert int(lengths.sum()) == len(lengths) * min(seen, held), "layer allowance not kept"
                    assert bool((lengths >= min(seen, policy.head_floor(held))).all()), "a head fell below its floor"
                else:
                    assert kept.shape[-1] <= held, "cache holds more than the budget"
                    assert kept.shape[-1] == min(seen, held), "cache did not fill up to the budget"
                for head, n in zip(kept, lengths.tolist()):
                    head = head[:n]
                    assert bool((head < seen).all()) and bool((head.diff() > 0).all())
                    present = set(head.tolist())
                    assert set(range(min(sinks, seen))) <= present, f"pinned sink evicted at {seen} tokens"
                    if spec.endswith("window") and not spec.startswith("sinkauto"):
                        recent = set(range(seen - (min(seen, budget) - min(sinks, seen)), seen))
                        assert present == recent | set(range(min(sinks, seen))), "window is not the most recent tokens"
    assert not cache.pinned_sink_evicted()
    assert torch.equal(cache.sink_lost_at()[:, 0], lost_at), "sink_lost_at disagrees with the kept positions"


# the papers' policies: engine presets and pages keep their own schedule (not "fill to the budget"), checked by
# test_policy_contract.py, test_chunked_exact.py and the hand-worked traces of test_engine_presets.py
policies = st.sampled_from(
    [s for s in base_specs() if s != "full" and not parse_policy(s).own_schedule and not parse_policy(s).preset]
    + ["h2o:recent=0.2", "snapkv:window=1,kernel=3", "snapkv:window=2"]
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    inner=policies,
    budget=st.integers(3, 20),
    length=st.integers(2, 70),
    positions=st.sampled_from(["original", "cache"]),
    wrapper=st.sampled_from(["sink", "sinkauto"]),
)
def test_budget_sinks_and_window_invariants(data, inner, budget, length, positions, wrapper):
    sinks = data.draw(st.integers(0, budget - 3), label="sinks")
    if "window=" in inner:
        window = int(inner.split("window=")[1].split(",")[0])
        # SnapKV needs a slot beyond its window; the pyramid (beta=2) needs 2 for its top layer
        room = window + (2 if inner.startswith("pyramidkv") else 1)
        if room > budget - sinks:
            sinks = max(0, budget - room)
        assume(budget - sinks >= room)
    if wrapper == "sinkauto" and sinks > 0:
        spec, sinks = f"sinkauto{sinks}+{inner}", 0
    else:
        spec = inner if sinks == 0 else f"sink{sinks}+{inner}"
    if parse_policy(spec).varies_by_head:  # adakv: original positions only, and a floor of at least 1
        assume(positions == "original")
        try:
            check_policy(spec, budget, "original")
        except KvevictError:
            assume(False)
    chunks = data.draw(st.lists(st.integers(1, 2 * budget), min_size=0, max_size=4), label="chunks")
    feed_and_check(spec, budget, sinks, length, chunks, positions)


class _Indifferent(Policy):
    """Every slot scores the same: only the cache's tie-break decides."""

    def spec(self) -> str:
        return "indifferent"

    def scores(self, view: SlotView) -> torch.Tensor:
        return torch.zeros(view.positions.shape, dtype=torch.float64)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=st.integers(2, 12),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    positions=st.sampled_from(["original", "cache"]),
)
def test_equal_scores_evict_the_earliest_token(budget, chunks, positions):
    """With all scores tied the earliest token goes (the later one stays), whether a step
    fills the victim's slot in place or compacts: the cache then behaves as `window`."""
    tokens = torch.arange(40) % VOCAB
    caches = [EvictingCache(MODEL, p, budget=budget, positions=positions) for p in (_Indifferent(), "window")]
    with torch.inference_mode():
        seen, chunk_iter = 0, iter(chunks)
        while seen < tokens.numel():
            q = min(next(chunk_iter, 1), tokens.numel() - seen)
            for cache in caches:
                body(MODEL, tokens[None, seen : seen + q], cache)
            seen += q
            for tied, window in zip(caches[0].layers, caches[1].layers):
                assert torch.equal(tied.kept_positions(), window.kept_positions())


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=st.integers(2, 12),
    sinks=st.integers(0, 4),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    positions=st.sampled_from(["original", "cache"]),
)
def test_window_behind_sinks_holds_the_sinks_and_the_latest(budget, sinks, chunks, positions):
    """A window behind N sinks holds tokens 0..N-1 and the latest `budget - N`, after every forward:
    written out from the count of tokens seen, whatever ring of slots the cache turns (the decode
    steps find their victim without scores) and however chunks interrupt it."""
    assume(sinks < budget)
    spec = f"sink{sinks}+window" if sinks else "window"
    cache = EvictingCache(MODEL, spec, budget=budget, positions=positions)
    tokens = torch.arange(45) % VOCAB
    with torch.inference_mode():
        seen, chunk_iter = 0, iter(chunks)
        while seen < tokens.numel():
            q = min(next(chunk_iter, 1), tokens.numel() - seen)
            body(MODEL, tokens[None, seen : seen + q], cache)
            seen += q
            latest = range(max(sinks, seen - (budget - sinks)), seen) if seen > budget else range(seen)
            expected = sorted({*range(min(sinks, seen)), *latest})
            for layer in cache.layers:
                kept = layer.kept_positions()[0]  # [H, n]
                assert kept.tolist() == [expected] * kept.shape[0], (seen, layer.index)
