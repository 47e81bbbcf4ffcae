"""The prompt truncations of two engines, as the kept set they leave (`docs/engines.md`).

* `vllm-truncate`: vLLM's `truncate_prompt_tokens=k` keeps the last `k` tokens of a prompt
  and numbers them from 0. Which tokens survive and where they sit is reproduced here
  (the budget is `k`, positions within the cache); vLLM also computes their keys without
  the dropped prefix, which no cache can: that figure is the recompute oracle's.
* `sglang-truncate`: SGLang's `--allow-auto-truncate` keeps the head of an over-long input
  (the first `context_len` tokens) and drops the rest. In a stream every token after the
  head attends to the head and itself and is then dropped; stream positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..position_modes import ORIGINAL, SHIFTED
from .base import Policy, SlotView, recency


@dataclass(eq=False)
class KeepTail(Policy):
    preset = True
    static_scores = True  # its position

    @property
    def position_mode(self) -> str | None:
        return SHIFTED.name

    def spec(self) -> str:
        return "vllm-truncate"

    def scores(self, view: SlotView) -> torch.Tensor:
        return recency(view)


@dataclass(eq=False)
class KeepHead(Policy):
    preset = True
    static_scores = True  # its position

    @property
    def position_mode(self) -> str | None:
        return ORIGINAL.name

    def spec(self) -> str:
        return "sglang-truncate"

    def scores(self, view: SlotView) -> torch.Tensor:
        return -recency(view)
