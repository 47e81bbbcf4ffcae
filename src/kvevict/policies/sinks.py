"""Sink wrappers: pin the attention sinks, run an inner policy on the rest of the budget.

Sink pinning is a wrapper rather than a policy because the attention-sink failure is
orthogonal to how the rest of the cache is chosen: any policy can lose token 0, and
pinning it composes with all of them (StreamingLLM = `sink4+window`).

`SinkWrapper` does the part every wrapper shares: the inner policy runs on
`budget - n_sinks` slots, sees every statistic it asked for, and the pinned slots score
`+inf`. A wrapper only says which slots it pins. `sinkN+P` (`SinkPinned`, here) pins
the first N tokens; `sinkauto+P` (`sinkauto.py`) pins the measured sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KvevictError
from .base import AttentionRequest, Policy, SlotView
from .capabilities import Capabilities, with_fields
from .wrapper import Wrapper


@dataclass(eq=False)
class SinkWrapper(Wrapper):
    n_sinks: int
    inner: Policy

    def __post_init__(self) -> None:
        if self.inner.preset:
            raise KvevictError(
                f"'{self.prefix()}+{self.inner.spec()}' wraps an engine preset: a preset is that engine's whole rule, "
                "so set its own sink option instead (llamacpp:keep=N, trtllm:sink=N, mlc:sinks=N, ...)"
            )
        if isinstance(self.inner, SinkWrapper):
            raise KvevictError(
                f"'{self.prefix()}+{self.inner.spec()}' nests sink wrappers: pin sinks once, "
                f"e.g. {self.prefix()}+{self.inner.inner.spec()}"
            )

    def head_floor(self, budget: int) -> int:
        """The inner policy's floor on the unpinned part, plus the sinks every head keeps."""
        return self.n_sinks + self.inner.head_floor(budget - self.n_sinks)

    def layer_budgets(self, budget: int, layers: int) -> list[int] | None:
        """The inner policy's per-layer budgets on the unpinned part, plus the sinks in every layer."""
        inner = self.inner.layer_budgets(budget - self.n_sinks, layers)
        return None if inner is None else [self.n_sinks + b for b in inner]

    def prefix(self) -> str:
        """The wrapper's part of the spec, e.g. `sink4`."""
        raise NotImplementedError

    def spec(self) -> str:
        return f"{self.prefix()}+{self.inner.spec()}"

    def pinned_mask(self, view: SlotView) -> torch.Tensor:
        """`[b, H_kv, n]` True for the slots this wrapper pins."""
        raise NotImplementedError

    def inner_view(self, view: SlotView) -> SlotView:
        return view.with_budget(view.budget - self.n_sinks)

    def check_budget(self, budget: int) -> None:
        """The wrapper needs room beyond its pinned slots, and its inner policy must fit in the rest."""
        if budget <= self.n_sinks:
            raise KvevictError(
                f"budget {budget} must be larger than the {self.n_sinks} pinned sinks of "
                f"'{self.spec()}': raise --budget above {self.n_sinks} or pin fewer sinks"
            )
        try:
            self.inner.check_budget(budget - self.n_sinks)
        except KvevictError as exc:
            raise KvevictError(
                f"'{self.spec()}' at budget {budget} runs its inner policy on the {budget - self.n_sinks} entries "
                f"beside its {self.n_sinks} sinks: {exc}"
            ) from None

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest | None:
        return self.inner.request(self.inner_view(view), will_evict)

    def absorb(self, view: SlotView, request: AttentionRequest, mass: torch.Tensor) -> torch.Tensor:
        return self.inner.absorb(self.inner_view(view), request, mass)

    def scores(self, view: SlotView) -> torch.Tensor:
        # pinned slots tie at +inf but are never the lowest: the budget exceeds the sinks
        return self.inner.scores(self.inner_view(view)).masked_fill(self.pinned_mask(view), float("inf"))


@dataclass(eq=False)
class SinkPinned(SinkWrapper):
    """`sinkN+P`: the first N tokens are never evicted."""

    def __post_init__(self) -> None:
        if self.n_sinks < 0:
            raise KvevictError(f"sink count must be >= 0, got {self.n_sinks}")
        super().__post_init__()

    def wrap(self, inner: Capabilities) -> Capabilities:
        """It pins its N sinks; pinning by position keeps a slot's score its own (slot-local when the inner
        policy is); a window behind N pinned sinks evicts the oldest entry after the first N."""
        return with_fields(super().wrap(inner), pinned=max(self.n_sinks, inner.pinned), slot_local=inner.slot_local,
                           fifo_after=None if inner.fifo_after != 0 else self.n_sinks)

    def prefix(self) -> str:
        return f"sink{self.n_sinks}"

    def pinned_mask(self, view: SlotView) -> torch.Tensor:
        return view.positions < self.n_sinks
