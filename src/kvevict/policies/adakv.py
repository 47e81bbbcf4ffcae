"""`adakv:P`: Ada-KV head-wise budgets over any scoring policy P (Feng et al., 2024,
"Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM
Inference").

A uniform policy keeps `budget` entries in every KV head. Heads differ, though: some
spread their attention widely, others park it on a few tokens. Ada-KV gives the layer's
whole allowance, `KV heads x budget` entries per row, to the heads jointly: the
entries with the highest scores of P across all heads of the layer stay, wherever they
sit. Its safeguard keeps every head at least `alpha x budget` entries (rounded down:
`alpha = 1` is exactly the uniform policy; the paper's default 0.2), so a head whose
scores are uniformly low is never emptied.

This class only scores (P's scores, unchanged) and declares the allocation
(`varies_by_head`, `head_floor`); the joint selection is `cache/layers/per_head/allocation.py`,
and the memory is real: the layer stores ragged per-head segments
(`cache/layers/per_head/storage.py`), not every head padded to the longest. P's scores must be
comparable across heads for the joint top-k to mean something: attention mass (h2o,
snapkv, tova) is; `window`'s positions tie across heads (so the allocation stays
uniform up to ties); key-based scores (knorm, keydiff) are taken as they come.

Spec: `adakv:P` or `adakv:alpha=0.1:P` (P any scoring policy with its own options,
e.g. `adakv:alpha=0.1:snapkv:window=16`); sinks pin in every head: `sink4+adakv:snapkv`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import KvevictError
from .base import Policy
from .capabilities import Capabilities, with_fields
from .sinks import SinkWrapper
from .wrapper import Wrapper


@dataclass(eq=False)
class AdaKV(Wrapper):
    inner: Policy
    alpha: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise KvevictError(
                f"adakv:alpha must be in [0, 1] (the share of the budget every head keeps at least), got {self.alpha}"
            )
        name = self.inner.spec()
        if self.inner.preset:
            raise KvevictError(
                f"'adakv:{name}' wraps an engine preset: the engine gives every head the same entries, so run "
                f"'{name}' bare"
            )
        if isinstance(self.inner, AdaKV):
            raise KvevictError(f"'adakv:{name}' nests adakv in adakv: allocate across heads once, e.g. adakv:snapkv")
        if isinstance(self.inner, SinkWrapper):
            raise KvevictError(
                f"'adakv:{name}' puts sink pinning inside adakv: write the sinks outside, "
                f"e.g. {name.partition('+')[0]}+adakv:{name.partition('+')[2]}"
            )
        inner = self.inner
        if inner.unbounded or not (inner.needs_attention or inner.reads_keys or inner.static_scores):
            raise KvevictError(
                f"adakv needs a policy that scores entries, not '{name}' (its scores carry no ranking to share "
                "across heads): use adakv:snapkv, adakv:h2o, adakv:tova, adakv:knorm, adakv:keydiff or adakv:window"
            )

    # the declarations, hooks and state are the inner policy's (`Wrapper`); what adakv adds is the
    # allocation across heads, done by the layer (`cache/layers/per_head/allocation.py`), and the floor
    def wrap(self, inner: Capabilities) -> Capabilities:
        """Heads hold different numbers of entries; the ragged layer steps every forward itself: no
        closed-form replay."""
        return with_fields(super().wrap(inner), varies_by_head=True, static_scores=False)

    def spec(self) -> str:
        return f"adakv:alpha={self.alpha:g}:{self.inner.spec()}"

    def head_floor(self, budget: int) -> int:
        """`floor(alpha x budget)`: rounded down, so `alpha=1` keeps exactly `budget` per head."""
        return int(self.alpha * budget + 1e-9)

    def check_budget(self, budget: int) -> None:
        if self.alpha > 0 and self.head_floor(budget) < 1:
            raise KvevictError(
                f"budget {budget} gives each head of 'adakv:alpha={self.alpha:g}' a floor of 0 entries "
                f"(alpha x budget < 1): use a budget of at least {int(-(-1 // self.alpha))} or alpha=0"
            )
        self.inner.check_budget(budget)

