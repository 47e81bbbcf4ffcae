"""The contract between the cache and an eviction policy.

A policy never touches transformers or the cache buffers. The cache hands it a
`SlotView` of one layer (the rows of the batch that run this policy) and asks for a
score per cached slot; the cache keeps the `budget` highest-scoring slots and does the
gather. Keeping policies as pure functions of small tensors is what lets one batch
run a different policy in each row, and lets tests check a policy against a formula.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Scores live in float64 so that tiers ("always keep the recent window") can be
# expressed as a large offset without destroying the ordering inside a tier.
TIER = 1e15


@dataclass
class AttentionRequest:
    """Which queries' attention over the cache a policy needs at this step.

    `kind="new"` asks for every query of the current forward (H2O's cumulative score);
    `kind="window"` asks for the last `size` queries seen so far, even if they arrived in
    earlier forwards (SnapKV's observation window). `stat` names the per-slot
    accumulator that receives the attention mass; `accumulate=False` overwrites it.
    """

    kind: str
    stat: str
    size: int = 0
    accumulate: bool = True


@dataclass
class SlotView:
    """What one policy sees of one layer: its rows only.

    positions: `[b, H_kv, n]` original token positions of the slots (all slots are
    valid; slots are NOT necessarily ordered by position: a policy that needs sequence
    order, like SnapKV's pooling, sorts by `positions`). `stats` holds the per-slot
    accumulators the policy declared. `keys` is a callable so that policies that do not
    need keys never pay for slicing them out of the batch.
    """

    positions: torch.Tensor
    seen: int
    budget: int
    layer: int
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    keys: Callable[[], torch.Tensor] | None = None

    def with_budget(self, budget: int) -> SlotView:
        return SlotView(self.positions, self.seen, budget, self.layer, self.stats, self.keys)


class Policy:
    """Base class: subclasses override `scores` and, if they need attention, `request`."""

    #: per-slot float accumulators the cache must carry (and gather) for this policy
    stats: tuple[str, ...] = ()
    #: the number of leading tokens this policy guarantees to keep (sink pinning)
    pinned: int = 0
    #: most recent queries the cache must remember for this policy (SnapKV)
    query_window: int = 0
    #: scores never tie among evictable slots, so the cache may skip its tie-break
    distinct_scores: bool = False

    def spec(self) -> str:
        raise NotImplementedError

    def check_budget(self, budget: int) -> None:
        """Raise `KvevictError` if this policy cannot run at `budget`."""

    def request(self, view: SlotView, will_evict: bool) -> AttentionRequest | None:
        """The attention statistics this policy wants at this step, if any."""
        return None

    def absorb(self, view: SlotView, request: AttentionRequest, mass: torch.Tensor) -> torch.Tensor:
        """New value of `request.stat` given the attention `mass` `[b, H_kv, n]` just measured."""
        if request.accumulate:
            return view.stats[request.stat] + mass
        return mass

    def scores(self, view: SlotView) -> torch.Tensor:
        """`[b, H_kv, n]` floats (float64 where tiers need `TIER`): higher means keep.

        Among equal scores the cache keeps the later token.
        """
        raise NotImplementedError

    def reset(self) -> None:
        """Forget per-run state (random generators, selection clocks)."""

    def __repr__(self) -> str:
        return f"<policy {self.spec()}>"


def recency(view: SlotView) -> torch.Tensor:
    """Position as a float64 score: the most recent slots score highest."""
    return view.positions.to(torch.float64)


def recent_mask(view: SlotView, count: int) -> torch.Tensor:
    """Slots among the `count` most recent tokens seen (by original position)."""
    return view.positions >= view.seen - count
