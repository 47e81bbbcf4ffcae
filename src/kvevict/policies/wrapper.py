"""`Wrapper`: the base of policies that wrap another (`sinkN+P`, `sinkauto+P`, `adakv:P`).

A wrapper changes how a budget is spent (it pins sinks, or shares it across heads), not
what the inner policy needs from the cache. So every declaration the cache, the replay
and the harness read off a policy is forwarded from `self.inner`, and a wrapper
overrides only the ones it changes (`sinkauto+` needs attention whatever its inner
policy does). Not a dataclass itself: each wrapper owns its fields, `inner` among them.
"""

from __future__ import annotations

import dataclasses

import torch

from .base import AttentionRequest, Policy, SlotView


class Wrapper(Policy):
    """Forwards every declaration, the per-step hooks and the per-layer state to `self.inner`."""

    @property
    def stats(self) -> tuple[str, ...]:
        return self.inner.stats

    @property
    def query_window(self) -> int:
        return self.inner.query_window

    @property
    def needs_attention(self) -> bool:
        return self.inner.needs_attention

    @property
    def static_scores(self) -> bool:
        return self.inner.static_scores

    @property
    def reads_keys(self) -> bool:
        return self.inner.reads_keys

    @property
    def arrival_stat(self) -> bool:
        return self.inner.arrival_stat

    def arrival(self, keys: torch.Tensor) -> torch.Tensor:
        return self.inner.arrival(keys)

    @property
    def kv_storage(self):
        return self.inner.kv_storage

    @property
    def varies_by_layer(self) -> bool:
        return self.inner.varies_by_layer

    @property
    def varies_by_head(self) -> bool:
        return self.inner.varies_by_head

    @property
    def own_schedule(self) -> bool:
        return self.inner.own_schedule

    @property
    def position_mode(self) -> str | None:
        return self.inner.position_mode

    @property
    def fifo_after(self) -> int | None:
        return None  # a wrapper changes which entry goes; one that keeps first-in-first-out says so

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
