"""`h2o`: Heavy-Hitter Oracle (Zhang et al., 2023).

Score of a cached entry = the attention it has received, summed over every query so
far and over the query heads that share its KV head. The budget is split between the
heavy hitters and a window of the most recent tokens (`recent`, default half: the
paper's 10% heavy + 10% recent). Recent tokens are protected because they have had
few queries to accumulate mass from; without the window they would be evicted first.
"""

from __future__ import annotations

import torch

from ..errors import KvevictError
from .base import AttentionRequest, Policy, SlotView, recent_mask


class H2O(Policy):
    stats = ("h2o_attention",)

    def __init__(self, recent: float = 0.5) -> None:
        if not 0.0 <= recent <= 1.0:
            raise KvevictError(f"h2o:recent must be in [0, 1] (a share of the budget), got {recent}")
        self.recent = recent

    def spec(self) -> str:
        return f"h2o:recent={self.recent:g}"

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest:
        # Every query contributes, even before the cache is full: the cumulative score
        # of a token must include the attention of the prompt's queries.
        return AttentionRequest(kind="new", stat="h2o_attention", accumulate=True)

    def recent_count(self, budget: int) -> int:
        return int(round(self.recent * budget))

    def scores(self, view: SlotView) -> torch.Tensor:
        # The recent window ranks above every heavy hitter. It never holds more than the
        # budget, so it is always kept whole and the order inside it does not matter: +inf
        # does, and keeps the scores in float32 (this runs per layer and decode step).
        recent = recent_mask(view, self.recent_count(view.budget))
        return view.stats["h2o_attention"].masked_fill(recent, float("inf"))
