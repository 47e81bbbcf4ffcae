"""`sinkN+P`: pin the first N tokens, run policy P on the remaining `budget - N` slots.

Sink pinning is a wrapper rather than a policy because the attention-sink failure is
orthogonal to how the rest of the cache is chosen: any policy can lose token 0, and
pinning it composes with all of them (StreamingLLM = `sink4+window`).
"""

from __future__ import annotations

import torch

from ..errors import KvevictError
from .base import AttentionRequest, Policy, SlotView


class SinkPinned(Policy):
    def __init__(self, n_sinks: int, inner: Policy) -> None:
        if n_sinks < 0:
            raise KvevictError(f"sink count must be >= 0, got {n_sinks}")
        self.n_sinks = n_sinks
        self.inner = inner
        self.stats = inner.stats
        self.query_window = inner.query_window
        self.pinned = max(n_sinks, inner.pinned)
        # pinned slots tie at +inf but are never the lowest: the budget exceeds the sinks
        self.distinct_scores = inner.distinct_scores

    def spec(self) -> str:
        return f"sink{self.n_sinks}+{self.inner.spec()}"

    def check_budget(self, budget: int) -> None:
        check_sink_budget(self, budget)

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest | None:
        return self.inner.request(view.with_budget(view.budget - self.n_sinks), will_evict)

    def absorb(self, view: SlotView, request: AttentionRequest, mass: torch.Tensor) -> torch.Tensor:
        return self.inner.absorb(view.with_budget(view.budget - self.n_sinks), request, mass)

    def scores(self, view: SlotView) -> torch.Tensor:
        inner = self.inner.scores(view.with_budget(view.budget - self.n_sinks))
        return inner.masked_fill(view.positions < self.n_sinks, float("inf"))

    def reset(self) -> None:
        self.inner.reset()


def check_sink_budget(wrapper: Policy, budget: int) -> None:
    """A sink wrapper needs room beyond its pinned slots, and its inner policy must fit in the rest."""
    if budget <= wrapper.n_sinks:
        raise KvevictError(
            f"budget {budget} must be larger than the {wrapper.n_sinks} pinned sinks of "
            f"'{wrapper.spec()}': raise --budget above {wrapper.n_sinks} or pin fewer sinks"
        )
    wrapper.inner.check_budget(budget - wrapper.n_sinks)
