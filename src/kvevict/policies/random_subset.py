"""`random`: a seeded random subset. The floor an informed policy has to beat."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .base import Policy, SlotView


@dataclass(eq=False)
class Random(Policy):
    seed: int = 0
    _gens: dict[int, torch.Generator] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.reset()

    def spec(self) -> str:
        return f"random:seed={self.seed}"

    def with_seed(self, seed: int) -> Random:
        return dataclasses.replace(self, seed=seed)

    def reset(self) -> None:
        self._gens = {}

    def scores(self, view: SlotView) -> torch.Tensor:
        # One generator per layer: the draws depend only on the seed, the layer and its
        # own eviction steps, not on how layers interleave (a chunk replays one layer's
        # steps before the next layer's), so chunked and token-by-token runs agree.
        gen = self._gens.get(view.layer)
        if gen is None:
            gen = self._gens[view.layer] = torch.Generator().manual_seed(self.seed * 100_003 + view.layer)
        noise = torch.rand(view.positions.shape, generator=gen, dtype=torch.float64)
        return noise.to(view.positions.device)
