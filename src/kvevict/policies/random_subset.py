"""`random`: a seeded random subset. The floor an informed policy has to beat."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .base import Policy, SlotView


@dataclass(eq=False)
class Random(Policy):
    seed: int = 0
    _gen: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.reset()

    def spec(self) -> str:
        return f"random:seed={self.seed}"

    def with_seed(self, seed: int) -> Random:
        return dataclasses.replace(self, seed=seed)

    def reset(self) -> None:
        # One generator per policy instance: the draws depend only on the seed and on
        # the order of eviction calls, which is deterministic for a given run.
        self._gen = torch.Generator().manual_seed(self.seed)

    def scores(self, view: SlotView) -> torch.Tensor:
        noise = torch.rand(view.positions.shape, generator=self._gen, dtype=torch.float64)
        return noise.to(view.positions.device)
