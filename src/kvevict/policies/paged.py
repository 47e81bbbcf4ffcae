"""`P:page=N`: page-granular eviction of any scoring policy, as a paged KV cache must do it.

A paged engine (vLLM's blocks, TensorRT-LLM's, MLC's pages) stores entries in pages of
`page` consecutive tokens and can only free a whole page: an H2O inside such an engine
(vllm-project/vllm#3532) evicts pages, not tokens. `Paged` runs the inner policy as it is
and turns its per-token scores into per-page scores (`pagescore=mean`, or `max`), so only
whole pages go. The page holding the inner policy's pinned sinks never goes (a page with a
`+inf` entry pools to `+inf`, mean or max), nor does the last page while it is partly filled.

When the budget is exceeded it evicts the fewest whole pages that bring the layer back
within it (`evict_to`), so it holds between `budget - page + 1` and `budget` entries once
full; the cache's selection keeps whole pages because every entry of a page scores the same
and equal scores are ranked by position (a page is a run of positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KvevictError
from .base import Policy, SlotView
from .capabilities import Capabilities, with_fields
from .wrapper import Wrapper

POOLING = ("mean", "max")


@dataclass(eq=False)
class Paged(Wrapper):
    inner: Policy
    page: int
    pagescore: str = "mean"

    def __post_init__(self) -> None:
        name = self.inner.spec()
        if self.page < 1:
            raise KvevictError(f"page must be a number of tokens >= 1, got page={self.page} in '{self.spec()}'")
        if self.pagescore not in POOLING:
            raise KvevictError(f"pagescore must be mean or max, got '{self.pagescore}' in '{self.spec()}'")
        if self.inner.preset:
            raise KvevictError(
                f"'{name}' is an engine preset: it already evicts the engine's way, so run it without page="
            )
        if self.inner.unbounded or self.inner.varies_by_head or self.inner.varies_by_layer:
            raise KvevictError(
                f"page= needs a policy that scores entries at one budget per layer, not '{name}': e.g. h2o:page=16, "
                "sink4+snapkv:page=32, window:page=16"
            )

    def wrap(self, inner: Capabilities) -> Capabilities:
        """Whole pages at a time, whatever the inner policy does (its own schedule); a page's score exists only
        once the page is full (not static); the inner policy's pinned tokens."""
        return with_fields(super().wrap(inner), own_schedule=True, static_scores=False, pinned=inner.pinned)

    def spec(self) -> str:
        suffix = f"page={self.page}" + ("" if self.pagescore == "mean" else f",pagescore={self.pagescore}")
        inner = self.inner.spec()
        return f"{inner},{suffix}" if ":" in inner.rpartition("+")[2] else f"{inner}:{suffix}"

    def sink_pages(self) -> int:
        """Leading pages that hold the inner policy's pinned tokens."""
        return -(-self.inner.pinned // self.page)

    def check_budget(self, budget: int) -> None:
        # a step beyond the budget must find a whole page to evict beside the sink pages and the last,
        # partly filled one (at most page - 1 entries): budget + 1 >= (sink pages + 2) * page - 1
        least = (self.sink_pages() + 2) * self.page - 2
        if budget < least:
            raise KvevictError(
                f"'{self.spec()}' at budget {budget} leaves no whole page to evict beside its {self.sink_pages()} "
                f"sink page(s) and the partly filled last page: use a budget of at least {least} or a page of at "
                f"most {max(1, (budget + 2) // (self.sink_pages() + 2))}"
            )
        self.inner.check_budget(budget)

    def evict_to(self, budget: int, held: int) -> int | None:
        if held <= budget:
            return None
        return held - -(-(held - budget) // self.page) * self.page

    def scores(self, view: SlotView) -> torch.Tensor:
        """Each entry gets its page's score, `[b, H_kv, n]`; a partly filled last page `+inf`."""
        inner = self.inner.scores(view).to(torch.float64)
        page = view.positions // self.page
        last = (view.seen - 1) // self.page
        pages = last + 1
        index = page.clamp(max=pages - 1)
        if self.pagescore == "max":
            pooled = torch.full((*inner.shape[:-1], pages), float("-inf"), dtype=inner.dtype, device=inner.device)
            pooled.scatter_reduce_(-1, index, inner, reduce="amax")
        else:
            pooled = torch.zeros((*inner.shape[:-1], pages), dtype=inner.dtype, device=inner.device)
            pooled.scatter_reduce_(-1, index, inner, reduce="mean", include_self=False)
        out = pooled.gather(-1, index)
        return out.masked_fill((page == last) & (view.seen % self.page != 0), float("inf"))
