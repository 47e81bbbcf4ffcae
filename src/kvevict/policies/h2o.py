"""`h2o`: Heavy-Hitter Oracle (Zhang et al., 2023).

Score of a cached entry = the attention it has received, summed over every query so
far and over the query heads that share its KV head. The budget is split between the
heavy hitters and a window of the most recent tokens (`recent`, default half: the
paper's 10% heavy + 10% recent). Recent tokens are protected because they have had
few queries to accumulate mass from; without the window they would be evicted first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KvevictError
from .base import AttentionRequest, Policy, SlotView, recent_mask

STAT = "h2o_attention"


@dataclass(eq=False)
class H2O(Policy):
    recent: float = 0.5

    stats = (STAT,)
    needs_attention = True
    requests = ("new",)
    slot_local = True  # a slot's sum and its recent-window mark are its own

    def __post_init__(self) -> None:
        if not 0.0 <= self.recent <= 1.0:
            raise KvevictError(f"h2o:recent must be in [0, 1] (a share of the budget), got {self.recent}")

    def spec(self) -> str:
        return f"h2o:recent={self.recent:g}"

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest:
        # Every query contributes, even before the cache is full: the cumulative score
        # of a token must include the attention of the prompt's queries.
        return AttentionRequest(kind="new", stat=STAT, accumulate=True)

    def recent_count(self, budget: int) -> int:
        return int(round(self.recent * budget))

    def scores(self, view: SlotView) -> torch.Tensor:
        # The recent window (never more than the budget) is +inf: always kept whole.
        # Scores stay float32 (this runs per layer and decode step).
        recent = recent_mask(view, self.recent_count(view.budget))
        return view.stats[STAT].masked_fill(recent, float("inf"))
