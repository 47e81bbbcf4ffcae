"""`random`: a seeded random subset. The floor an informed policy has to beat."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .base import Policy, SlotView


@dataclass(eq=False)
class Random(Policy):
    seed: int = 0

    def spec(self) -> str:
        return f"random:seed={self.seed}"

    def with_seed(self, seed: int) -> Random:
        return dataclasses.replace(self, seed=seed)

    def new_state(self, layer: int) -> torch.Generator:
        # One generator per layer: the draws depend only on the seed, the layer and its
        # own eviction steps, not on how layers interleave (a chunk replays one layer's
        # steps before the next layer's), so chunked and token-by-token runs agree.
        return torch.Generator().manual_seed(self.seed * 100_003 + layer)

    def scores(self, view: SlotView) -> torch.Tensor:
        noise = torch.rand(view.positions.shape, generator=view.state, dtype=torch.float64)
        return noise.to(view.positions.device)
