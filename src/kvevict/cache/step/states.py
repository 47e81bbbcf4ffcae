"""`PolicyStates`: what each policy carries from one step of a layer to the next (`Policy.new_state`).

A policy object is pure and shared by every layer; what it remembers across steps (SnapKV's
selection clock, SinkAuto's calibration, Random's generator) lives here, one per layer that
runs policies, and goes back to it as `SlotView.state`.
"""

from __future__ import annotations

from ...policies import Policy


class PolicyStates:
    """(policy, state) pairs of one layer, matched by identity (a copy of the cache copies both sides
    of each pair together, so a copied layer finds its copied policies' states)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self._pairs: list[tuple[Policy, object]] = []

    def of(self, policy: Policy) -> object | None:
        """`policy`'s state in this layer, made on first use."""
        for owner, state in self._pairs:
            if owner is policy:
                return state
        state = policy.new_state(self.layer)
        self._pairs.append((policy, state))
        return state

    def clear(self) -> None:
        """Forget every state (the layer was reset: a new sequence starts)."""
        self._pairs = []
