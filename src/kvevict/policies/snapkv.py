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

import torch
import torch.nn.functional as F

from ..errors import KvevictError
from .base import TIER, AttentionRequest, Policy, SlotView, recent_mask


class SnapKV(Policy):
    stats = ("snapkv_score",)

    def __init__(self, window: int = 32, kernel: int = 7, pooling: str = "max", interval: int | None = None) -> None:
        if window < 1:
            raise KvevictError(f"snapkv:window must be >= 1, got {window}")
        if kernel < 1 or kernel % 2 == 0:
            raise KvevictError(f"snapkv:kernel must be an odd integer >= 1, got {kernel}")
        if pooling not in ("max", "avg"):
            raise KvevictError(f"snapkv:pooling must be 'max' or 'avg', got '{pooling}'")
        if interval is not None and interval < 1:
            raise KvevictError(f"snapkv:interval must be >= 1, got {interval}")
        self.window = window
        self.kernel = kernel
        self.pooling = pooling
        self.interval = interval if interval is not None else window
        self.query_window = window
        self.reset()

    def spec(self) -> str:
        return f"snapkv:window={self.window},kernel={self.kernel},pooling={self.pooling},interval={self.interval}"

    def check_budget(self, budget: int) -> None:
        if self.window >= budget:
            raise KvevictError(
                f"snapkv:window={self.window} must be smaller than the budget it runs in ({budget}): "
                f"use a window in [1, {budget - 1}] or raise the budget"
            )

    def reset(self) -> None:
        self._selected_at: dict[int, int] = {}

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest | None:
        if not will_evict:
            return None
        last = self._selected_at.get(view.layer)
        if last is not None and view.seen - last < self.interval:
            return None
        self._selected_at[view.layer] = view.seen
        return AttentionRequest(kind="window", stat="snapkv_score", size=self.window, accumulate=False)

    def absorb(self, view: SlotView, request: AttentionRequest, mass: torch.Tensor) -> torch.Tensor:
        """Turn raw window attention into the pooled selection score.

        Pooling runs along the sequence, so slots are visited in position order (the
        cache does not keep them sorted). Every token of the observation window is in
        the cache (it is always kept), so the prefix is all but the last `window`.
        """
        n = mass.shape[-1]
        prefix = n - min(self.window, view.seen)
        order = view.positions.argsort(dim=-1)
        ranked = torch.zeros_like(mass)
        if prefix > 0:
            ranked[..., :prefix] = pool(mass.gather(-1, order)[..., :prefix], self.kernel, self.pooling)
        return torch.empty_like(mass).scatter_(-1, order, ranked)

    def scores(self, view: SlotView) -> torch.Tensor:
        position = view.positions.to(torch.float64)
        selected = view.stats["snapkv_score"].to(torch.float64)
        return torch.where(recent_mask(view, self.window), TIER + position, selected)


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
