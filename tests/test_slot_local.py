"""`Policy.slot_local` is true of every policy that declares it: scoring a view that holds more
slots gives every other slot the same score (the chunk replay in original positions relies on
it, `by_slot.steps_by_slot`), and so does absorbing a "new" request when the policy makes one.

Checked against a direct computation on the smaller view, for every registered policy that
declares it, bare and under the sink wrappers (wrappers that declare it too).
"""

from __future__ import annotations

import pytest
import torch

from kvevict.policies import SlotView, parse_policy

from policy_matrix import bounded_specs

LOCAL = [spec for spec in bounded_specs() if parse_policy(spec).slot_local]


def test_the_declaration_is_made():
    assert LOCAL, "no registered policy declares slot_local: the replay's slot-local path is untested"


@pytest.mark.parametrize("spec", LOCAL)
def test_extra_slots_do_not_change_the_others(spec):
    policy = parse_policy(spec)
    gen = torch.Generator().manual_seed(5)
    b, h, n, extra, seen, budget = 2, 3, 12, 7, 40, 11
    positions = torch.stack([torch.randperm(seen, generator=gen)[: n + extra] for _ in range(b * h)]).view(b, h, -1)
    stats = {name: torch.rand(b, h, n + extra, generator=gen) for name in policy.stats}
    keys = torch.randn(b, h, n + extra, 4, generator=gen)
    wide = SlotView(positions, seen, budget, 0, stats=stats, keys=lambda: keys, state=policy.new_state(0))
    narrow_stats = {name: stat[..., :n] for name, stat in stats.items()}
    narrow = SlotView(positions[..., :n], seen, budget, 0, stats=narrow_stats, keys=lambda: keys[:, :, :n],
                      state=policy.new_state(0))
    assert torch.equal(policy.scores(wide)[..., :n], policy.scores(narrow)), f"{spec}: scores depend on other slots"
    request = policy.request(narrow, True)
    if request is not None and request.kind == "new":  # a "window" request is absorbed on the alive slots only
        mass = torch.rand(b, h, n + extra, generator=gen)
        absorbed = policy.absorb(narrow, request, mass[..., :n])
        assert torch.equal(policy.absorb(wide, request, mass)[..., :n], absorbed), f"{spec}: absorb mixes slots"
