"""`full`: keep everything. The baseline every other row is measured against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, SlotView, recency


@dataclass(eq=False)
class Full(Policy):
    """Never evicts: the cache treats it as an unbounded budget."""

    unbounded = True

    static_scores = True  # its position

    def spec(self) -> str:
        return "full"

    def scores(self, view: SlotView) -> torch.Tensor:
        return recency(view)
