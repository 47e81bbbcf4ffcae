"""`SpanPinned`: a policy that must keep the latest tokens whole, its budget spent on the rest.

Why: `multi --form aware-requests` (SCBench's query-aware case) compresses the context
with the first question read after it, so a policy ranking by attention is guided by that
question, and then serves later questions from the compressed context *without* it (a
prefix cache holds the context, not the first request). To take the question back out,
every row and KV head must hold all of its tokens: then removing them
(`EvictingCache.crop`) leaves every head the same number of context entries, which
slot storage needs. So the question's span is pinned (`+inf`, like a sink) and the inner
policy keeps its own budget among the context, exactly as it would with the span beside it.

This is the sink wrapper's arithmetic (`SinkWrapper`: the inner policy runs on
`budget - n` slots, `n` more in every layer and head) with the pinned slots at the end
instead of the start. The protocol builds it; it is not a spec users write, and its
`spec()` is the inner policy's, so records and tables keep the policy's own name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import KvevictError
from .base import Policy, SlotView
from .capabilities import Capabilities, with_fields
from .registry import parse_policy
from .sinks import SinkWrapper


@dataclass(eq=False)
class SpanPinned(SinkWrapper):
    """Pins the `n_sinks` tokens from position `start` on (a question read after the context)."""

    start: int = 0

    def __post_init__(self) -> None:
        if self.n_sinks < 1 or self.start < 0:
            raise KvevictError(f"a pinned span needs at least one token from a position >= 0, got "
                               f"{self.n_sinks} from {self.start}")
        if self.inner.preset:
            raise KvevictError(f"'{self.inner.spec()}' is an engine preset: its rule cannot pin a question")

    def wrap(self, inner: Capabilities) -> Capabilities:
        """The inner policy's pinned tokens (the span is not at the start); pinning by position keeps a slot's
        score its own: slot-local when the inner policy is."""
        return with_fields(super().wrap(inner), pinned=inner.pinned, slot_local=inner.slot_local)

    def spec(self) -> str:
        return self.inner.spec()

    def check_budget(self, budget: int) -> None:
        """The span comes on top of the inner policy's own budget, so only that budget is checked."""
        self.inner.check_budget(budget - self.n_sinks)

    def pinned_mask(self, view: SlotView) -> torch.Tensor:
        return (view.positions >= self.start) & (view.positions < self.start + self.n_sinks)


def pin_span(spec: str | Policy, count: int, start: int) -> Policy:
    """`spec` with the `count` tokens from position `start` pinned (`full` as it is: it keeps everything)."""
    policy = parse_policy(spec)
    return policy if policy.unbounded else SpanPinned(count, policy, start)
