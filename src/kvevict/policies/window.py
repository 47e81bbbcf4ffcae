"""`window` (local / FIFO): keep the most recent `budget` tokens.

Cheap and the worst case for attention sinks: the first token goes as soon as the
cache is full, which is exactly the failure StreamingLLM documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Policy, SlotView, recency


@dataclass(eq=False)
class Window(Policy):
    static_scores = True  # its position
    fifo_after = 0  # the oldest entry goes, whatever it is

    def spec(self) -> str:
        return "window"

    def scores(self, view: SlotView) -> torch.Tensor:
        return recency(view)
