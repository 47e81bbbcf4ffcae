"""One prefill for every budget: a held-back eviction equals evicting in the forward.

`EvictingCache.defer` makes the next forward measure every statistic and evict nothing;
`evict_deferred` then evicts at whatever budget the cache has by then. The reference is
the plain path, a cache built at that budget that evicts at the end of its forward. Both
are compared on what a layer holds (positions, keys, values) and on the next forward's
logits, for every registered policy, in both position modes, on tiny Llama and tiny
Gemma 3; then the RULER protocols that use it are compared answer for answer.
"""

from __future__ import annotations

import pytest
import torch

from kvevict.cache import EvictingCache
from kvevict.errors import KvevictError
from kvevict.eval.forward import body, logits
from kvevict.eval.ruler import protocols
from kvevict.eval.ruler.protocols import answer, answer_budgets
from kvevict.policies import parse_policy
from test_ruler_protocols import SPECS, Words, _prompt

from conftest import random_tokens
from policy_matrix import bounded_specs, position_modes

BUDGETS = [40, 23, 12]
T = 60


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tiny):
    if request.param == "llama":
        return tiny
    from architectures import Arch

    return Arch("gemma3", ("original",)).build().eval()


def _held(cache: EvictingCache) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Per layer: positions, keys and values held, every (row, head) in positional order (one
    triple for a uniform layer's whole storage, one per (row, head) of a ragged layer)."""
    out = []
    for layer in cache.layers:
        if layer.heads_differ:  # ragged segments: each head's own entries, read through its mask
            out.append(_held_ragged(layer.storage))
            continue
        n = layer.n
        pos = layer.storage.pos[:, :, :n]
        order = pos.argsort(dim=-1)
        idx = order[..., None].expand(-1, -1, -1, layer.storage.keys.shape[-1])
        out.append([(pos.gather(-1, order), layer.storage.keys[:, :, :n].gather(2, idx),
                     layer.storage.values[:, :, :n].gather(2, idx))])
    return out


def _held_ragged(storage) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per (row, KV head) of a ragged layer: its held positions, keys and values, in positional order."""
    members = storage.members()
    out = []
    for b in range(members.shape[0]):
        for h in range(members.shape[1]):
            slots = members[b, h].nonzero().squeeze(-1)
            slots = slots[storage.pos[b, slots].argsort()]
            out.append((storage.pos[b, slots], storage.keys[b, slots], storage.values[b, slots]))
    return out


def _next_logits(model, cache: EvictingCache, rows: int) -> torch.Tensor:
    cache.freeze()
    ids = random_tokens(3, seed=9)[None].expand(rows, -1)
    return logits(model, body(model, ids, cache)[:, -1]).float()


@pytest.mark.parametrize("spec", bounded_specs())
def test_a_held_back_eviction_keeps_what_the_forward_would_have_kept(model, spec):
    context = random_tokens(T, seed=3)
    policy = parse_policy(spec)
    for positions in position_modes(spec):
        rows = [spec] if policy.own_batch else [spec, "window", "h2o:recent=0.25"]
        with torch.inference_mode():
            held = EvictingCache(model, rows, budget=BUDGETS[0], positions=positions)
            held.defer()
            body(model, context[None].long(), held)
            assert held.deferred and max(layer.n for layer in held.layers) == T
            for budget in BUDGETS:
                ref = EvictingCache(model, rows, budget=budget, positions=positions)
                body(model, context[None].long(), ref)
                state = held.copy()
                state.budget = budget
                state.evict_deferred()
                assert not state.deferred
                for got, want in zip(_held(state), _held(ref), strict=True):
                    for (p, k, v), (rp, rk, rv) in zip(got, want, strict=True):
                        assert torch.equal(p, rp), (spec, positions, budget)
                        torch.testing.assert_close(k, rk, rtol=0, atol=0)
                        torch.testing.assert_close(v, rv, rtol=0, atol=0)
                # a ragged layer lays its segments out for its budget: the held-back one must too
                assert [la.storage.allocated() for la in state.layers if la.heads_differ] == \
                    [la.storage.allocated() for la in ref.layers if la.heads_differ], "laid out for another budget"
                torch.testing.assert_close(_next_logits(model, state, len(rows)),
                                           _next_logits(model, ref, len(rows)), rtol=1e-5, atol=1e-5)


def test_a_streaming_cache_refuses_to_hold_back(tiny):
    with pytest.raises(KvevictError, match="compress each budget in a prefill of its own"):
        EvictingCache(tiny, ["h2o"], budget=20, per_token=True).defer()


@pytest.mark.parametrize("protocol, form, questions", [
    ("agnostic", "requests", 0), ("aware", "requests", 0), ("multi", "requests", 3),
    ("multi", "aware-requests", 3), ("stream", "requests", 0), ("multi", "turns", 3),
])
def test_one_prefill_for_every_budget_answers_as_a_prefill_per_budget(model, protocol, form, questions, monkeypatch):
    prompt = _prompt(questions)
    specs = ["h2o", "snapkv:window=8", "tova"] if protocol == "aware" or form == "aware-requests" else SPECS
    if form == "aware-requests" and "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
        with pytest.raises(KvevictError, match="sliding-window layers"):  # test_ruler_protocols: refused
            answer_budgets(model, Words(), prompt, specs, [None, 40], protocol, form)
        return
    reads = []
    real_read = protocols._read
    monkeypatch.setattr(protocols, "_read", lambda *a, **k: reads.append(a[2]) or real_read(*a, **k))
    budgets = [None, 60, 40, 20]  # the full cache first, as the grid asks
    got = answer_budgets(model, Words(), prompt, specs, budgets, protocol, form)
    monkeypatch.undo()
    for budget, answers in zip(budgets, got, strict=True):
        ref = answer(model, Words(), prompt, ["full"] if budget is None else specs, budget, protocol, form)
        assert [(a.policy, a.question, a.tokens, a.kept) for a in answers] == \
            [(a.policy, a.question, a.tokens, a.kept) for a in ref], budget
    # how often the context was read: once for all where the protocol shares it, the full cache included
    # where it reads the same context; once per budget where the rows evict as they read
    shared = protocols.shares_prefill(protocol, form)
    full_alike = protocols.full_shares_prefill(protocol, form, specs)
    assert len(reads) == (1 if full_alike else 2 if shared else len(budgets)), reads


@pytest.mark.parametrize("protocol", ["agnostic", "aware"])
def test_per_head_budgets_share_the_prefill_too(model, protocol):
    prompt = _prompt()
    spec = ["adakv:snapkv:window=8", "adakv:h2o"]
    got = answer_budgets(model, Words(), prompt, spec, [None, 60, 40, 20], protocol)
    assert [[(a.policy, a.tokens, a.kept) for a in answers] for answers in got] == \
        [[(a.policy, a.tokens, a.kept) for a in answer(model, Words(), prompt, ["full"] if b is None else spec, b,
                                                          protocol)] for b in (None, 60, 40, 20)]
