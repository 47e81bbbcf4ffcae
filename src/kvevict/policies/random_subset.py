"""`random`: a seeded random subset. The floor an informed policy has to beat."""

from __future__ import annotations

import torch

from .base import Policy, SlotView


class Random(Policy):
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.reset()

    def spec(self) -> str:
        return f"random:seed={self.seed}"

    def reset(self) -> None:
        # One generator per policy instance: the draws depend only on the seed and on
        # the order of eviction calls, which is deterministic for a given run.
        self._gen = torch.Generator().manual_seed(self.seed)

    def scores(self, view: SlotView) -> torch.Tensor:
        noise = torch.rand(view.positions.shape, generator=self._gen, dtype=torch.float64)
        return noise.to(view.positions.device)
