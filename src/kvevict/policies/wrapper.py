"""`Wrapper`: the base of policies that wrap another (`sinkN+P`, `sinkauto+P`, `adakv:P`).

A wrapper changes how a budget is spent (it pins sinks, or shares it across heads), not
what the inner policy needs from the cache. So its `capabilities` are the inner policy's,
derived in one place (`wrap`), and a wrapper changes only the ones it changes (`sinkauto+`
needs attention whatever its inner policy does). Not a dataclass itself: each wrapper owns
its fields, `inner` among them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .base import AttentionRequest, Policy, SlotView
from .capabilities import FIELDS, Capabilities, read, with_fields

#: what a wrapper does not take from its inner policy unless it says so (`Wrapper.wrap`): the defaults
RULE = {name: getattr(Capabilities(), name) for name in (
    "pinned", "unbounded", "slot_local", "preset", "bounds_every_layer", "fifo_after", "reconstructs", "ranks_layers"
)}


class Wrapper(Policy):
    """Derives its capabilities from `self.inner`'s (`wrap`) and forwards the per-step hooks and the
    per-layer state to it."""

    @functools.cached_property
    def capabilities(self) -> Capabilities:
        return self.wrap(self.inner.capabilities)

    def wrap(self, inner: Capabilities) -> Capabilities:
        """This wrapper's capabilities from its inner policy's: all of them, but those that belong to the
        inner policy's own rule (`RULE`: what it pins, whether it never evicts, its slot-local scores, an
        engine's rule and its schedule of layers, its first-in-first-out ring, a reconstruction). A wrapper
        subclass changes what it changes here, and nowhere else."""
        return with_fields(inner, **RULE)

    def arrival(self, keys: torch.Tensor) -> torch.Tensor:
        return self.inner.arrival(keys)

    def evict_to(self, budget: int, held: int) -> int | None:
        return self.inner.evict_to(budget, held)

    def layer_budgets(self, budget: int, layers: int) -> list[int] | None:
        return self.inner.layer_budgets(budget, layers)

    def head_floor(self, budget: int) -> int:
        return self.inner.head_floor(budget)

    def with_seed(self, seed: int) -> Wrapper:
        return dataclasses.replace(self, inner=self.inner.with_seed(seed))

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest | None:
        return self.inner.request(view, will_evict)

    def absorb(self, view: SlotView, request: AttentionRequest, mass: torch.Tensor) -> torch.Tensor:
        return self.inner.absorb(view, request, mass)

    def scores(self, view: SlotView) -> torch.Tensor:
        return self.inner.scores(view)

    def new_state(self, layer: int) -> object | None:
        return self.inner.new_state(layer)


# every field reads as an attribute of a wrapper, from its capabilities: nothing is forwarded by hand
for _name in FIELDS:
    setattr(Wrapper, _name, property(lambda self, name=_name: read(self.capabilities, name)))
del _name
