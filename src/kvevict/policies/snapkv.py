"""`snapkv`: SnapKV (Li et al., 2024).

At selection time, each earlier entry is scored by the attention the last `window`
queries pay to it (summed over those queries and over the query heads of its KV
group), smoothed along the sequence with a `kernel`-wide pooling so that neighbours of
important tokens survive with them. The top entries plus the window itself are kept.

The paper selects once after the prompt and lets the cache grow while generating (the
cache's compress mode does that). Under a hard budget (streaming perplexity) this
policy re-selects every `interval` tokens from the most recent window of queries; in
between, newly arrived tokens are protected by the window and the oldest scores are
reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import KvevictError
from .base import AttentionRequest, Policy, SlotView, recent_mask

STAT = "snapkv_score"


@dataclass
class Selection:
    """One layer's selection clock: the tokens seen at its last selection (None: none yet)."""

    at: int | None = None


@dataclass(eq=False)
class SnapKV(Policy):
    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    interval: int | None = None

    stats = (STAT,)
    needs_attention = True
    requests = ("window",)
    slot_local = True  # its scores mark the window on its own; it asks only for "window" (pooled on the alive slots)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise KvevictError(f"snapkv:window must be >= 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise KvevictError(f"snapkv:kernel must be an odd integer >= 1, got {self.kernel}")
        if self.pooling not in ("max", "avg"):
            raise KvevictError(f"snapkv:pooling must be 'max' or 'avg', got '{self.pooling}'")
        if self.interval is not None and self.interval < 1:
            raise KvevictError(f"snapkv:interval must be >= 1, got {self.interval}")
        if self.interval is None:
            self.interval = self.window

    @property
    def query_window(self) -> int:  # the cache remembers the observation window's queries
        return self.window

    def spec(self) -> str:
        return f"snapkv:window={self.window},kernel={self.kernel},pooling={self.pooling},interval={self.interval}"

    def check_budget(self, budget: int) -> None:
        if self.window >= budget:
            raise KvevictError(
                f"snapkv:window={self.window} must be smaller than the budget it runs in ({budget}): "
                f"use a window in [1, {budget - 1}] or raise the budget"
            )

    def new_state(self, layer: int) -> Selection:
        return Selection()

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest | None:
        if not will_evict:
            return None
        state = view.state
        if state.at is not None and view.seen - state.at < self.interval:
            return None
        state.at = view.seen
        return AttentionRequest(kind="window", stat=STAT, size=self.window, accumulate=False)

    def absorb(self, view: SlotView, request: AttentionRequest, mass: torch.Tensor) -> torch.Tensor:
        """Turn raw window attention into the pooled selection score.

        Pooling runs along the sequence, so it works on the slots in position order.
        Every token of the observation window is in the cache (it is always kept), so
        the prefix is all but the last `window`.
        """
        n = mass.shape[-1]
        prefix = n - min(self.window, view.seen)
        ranked = torch.zeros_like(mass)
        if prefix > 0:
            ranked[..., :prefix] = pool(view.in_order(mass)[..., :prefix], self.kernel, self.pooling)
        return view.from_order(ranked)

    def scores(self, view: SlotView) -> torch.Tensor:
        # The observation window (fewer slots than the budget) is always kept.
        return view.stats[STAT].masked_fill(recent_mask(view, self.window), float("inf"))


def pool(x: torch.Tensor, kernel: int, how: str) -> torch.Tensor:
    """Stride-1 pooling along the last axis, same length out."""
    if kernel == 1:
        return x
    flat = x.reshape(-1, 1, x.shape[-1])
    if how == "max":
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    return out.reshape(x.shape)
