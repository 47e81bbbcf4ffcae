"""Policies on hand-built `SlotView`s: no model, no cache, slots deliberately out of order.

This is the policy API used as a policy author would: build the view, call the policy,
compare with the formula written out here.
"""

from __future__ import annotations

import torch

from kvevict.cache.step import selection
from kvevict.policies import SlotView, parse_policy
from kvevict.policies.h2o import H2O
from kvevict.policies.snapkv import SnapKV, pool

# one row, two KV heads, 8 slots holding positions out of order (as after hole filling)
POSITIONS = torch.tensor([[[5, 0, 7, 2, 9, 1, 3, 8], [9, 8, 7, 6, 5, 4, 3, 0]]])


def view(budget: int = 5, stats: dict | None = None, seen: int = 10, state: object | None = None) -> SlotView:
    return SlotView(positions=POSITIONS.clone(), seen=seen, budget=budget, layer=0, stats=stats or {}, state=state)


def test_in_order_and_back():
    v = view()
    values = POSITIONS.double() * 10  # a value that names its slot's position
    ordered = v.in_order(values)
    assert ordered[0, 0].tolist() == [0, 10, 20, 30, 50, 70, 80, 90]
    assert torch.equal(v.from_order(ordered), values)


def test_window_keeps_the_most_recent_tokens_whatever_the_slot_order():
    v = view(budget=5)
    keep = selection.keep_slots(parse_policy("window").scores(v), v.positions, 5, ordered=False)
    kept = v.positions.gather(-1, keep)
    assert kept[0, 0].tolist() == [3, 5, 7, 8, 9]
    assert kept[0, 1].tolist() == [5, 6, 7, 8, 9]


def test_h2o_scores_are_attention_with_the_recent_window_protected():
    attention = torch.rand(1, 2, 8)
    v = view(budget=4, stats={"h2o_attention": attention})
    scores = H2O(recent=0.5).scores(v)  # recent = 2 of 4: positions 8 and 9 (seen = 10)
    for head in range(2):
        for slot in range(8):
            recent = int(POSITIONS[0, head, slot]) >= 8
            expected = float("inf") if recent else float(attention[0, head, slot])
            assert float(scores[0, head, slot]) == expected


def test_snapkv_pooling_follows_positions_not_slots():
    """The pooled score of a slot is the pool over its positional neighbours."""
    mass = torch.rand(1, 2, 8)
    policy = SnapKV(window=2, kernel=3, pooling="max")
    request = policy.request(view(state=policy.new_state(0)), will_evict=True)
    got = policy.absorb(view(), request, mass)
    for head in range(2):
        order = POSITIONS[0, head].argsort()
        by_position = mass[0, head, order]
        pooled = torch.zeros(8)
        pooled[:6] = pool(by_position[None, None, :6], 3, "max")[0, 0]  # the last 2 are the window
        expected = torch.empty(8).scatter_(0, order, pooled)
        assert torch.equal(got[0, head], expected)


def test_sink_wrapper_pins_and_shrinks_the_inner_budget():
    seen_budgets = []

    class Recorder(H2O):
        def scores(self, v: SlotView) -> torch.Tensor:
            seen_budgets.append(v.budget)
            return super().scores(v)

    from kvevict.policies.sinks import SinkPinned

    policy = SinkPinned(2, Recorder(recent=0.0))
    scores = policy.scores(view(budget=6, stats={"h2o_attention": torch.zeros(1, 2, 8)}))
    assert seen_budgets == [4]
    assert bool(torch.isinf(scores[POSITIONS < 2]).all()) and not bool(torch.isinf(scores[POSITIONS >= 2]).any())


def test_equal_scores_evict_the_earliest_token():
    scores = torch.zeros(1, 2, 8)
    victim = selection.victim(scores, POSITIONS, ordered=False)
    assert POSITIONS.gather(-1, victim[..., None]).flatten().tolist() == [0, 0]
    keep = selection.keep_slots(scores, POSITIONS, 6, ordered=False)
    assert POSITIONS.gather(-1, keep)[0, 0].tolist() == [2, 3, 5, 7, 8, 9]
