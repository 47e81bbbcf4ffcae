"""`EnginePreset`: the base of the serving-engine presets (`llamacpp`, `ollama`, `trtllm`, `mlc`,
`hf-sinkcache`, `vllm-swa`, and the two prompt truncations).

A preset reproduces one engine's rule, read in that engine's source and cited in
`docs/engines.md`: which tokens stay (the first few and the most recent, for every engine
read so far), when and how many go (`Policy.evict_to`), and how positions move
(`position_mode`, which `check_policy` holds the run to). What stays is decided by
position alone, so a preset scores a slot by its position and pins its kept head at `+inf`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..position_modes import SHIFTED
from .base import Policy, SlotView, recency


@dataclass(eq=False)
class EnginePreset(Policy):
    """Keeps the first `head()` tokens and the most recent ones; subclasses give the schedule."""

    preset = True
    own_schedule = True
    #: the engine's position mode; a subclass whose engine has a switch overrides `position_mode`
    engine_positions = SHIFTED.name

    @property
    def position_mode(self) -> str | None:
        return self.engine_positions

    @property
    def pinned(self) -> int:
        return self.head()

    def head(self) -> int:
        """Leading tokens the engine never evicts."""
        return 0

    def scores(self, view: SlotView) -> torch.Tensor:
        return recency(view).masked_fill(view.positions < self.head(), float("inf"))
