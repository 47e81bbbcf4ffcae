"""Bisection in log budget: the smallest budget whose probe lies inside the tolerance.

Pure bookkeeping, no model: given what was probed so far (budget -> inside or not),
`step` replays the search from the start and says the next budget to probe, or that
the search is over. Replaying from the recorded probes is what makes a search resume:
a rerun walks the same path, finds each probe it already has, and asks only for the
first one it lacks.

The search assumes quality does not get worse as the budget grows. It probes the floor
first (inside there: the floor is the answer); otherwise it keeps a failing budget `lo`
and a passing one `hi` (at first the stream's length, where nothing is evicted) and
probes their geometric mean until `hi / lo <= resolution` or they are neighbours; if
`hi` is still the length, the last budget that evicts (`length - 1`) is probed too, so
"nothing inside" is always measured. The answer is `hi`: within a factor `resolution`
of the smallest passing budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import KvevictError


@dataclass(frozen=True)
class Bracket:
    """Where one configuration is searched: budgets in [floor, length), to a ratio `resolution` > 1."""

    floor: int
    length: int
    resolution: float

    def check(self) -> Bracket:
        if self.floor < 1:
            raise KvevictError(f"--floor must be a whole number of entries >= 1, got {self.floor}")
        if self.floor >= self.length:
            raise KvevictError(
                f"--floor {self.floor} is not below the stream's {self.length} tokens: nothing would be evicted; "
                "lower --floor or raise --tokens"
            )
        if not (self.resolution > 1) or math.isinf(self.resolution):
            raise KvevictError(
                f"--resolution must be a ratio above 1 (1.1: the answer within 10% of the smallest passing budget), "
                f"got {self.resolution}"
            )
        return self


@dataclass(frozen=True)
class Outcome:
    """Where a search stands: `next` the budget to probe (None when finished); `smallest` the smallest budget
    found inside (None: none below the length); `failing` the largest probed budget below it that was not."""

    next: int | None
    smallest: int | None
    failing: int | None


def midpoint(lo: int, hi: int) -> int:
    """The geometric mean of `lo` and `hi`, rounded, strictly between them (they are not neighbours)."""
    mid = round(math.exp((math.log(lo) + math.log(hi)) / 2))
    return min(max(mid, lo + 1), hi - 1)


def step(bracket: Bracket, probed: dict[int, bool]) -> Outcome:
    """Replay the search over `probed` (budget -> inside the tolerance) and say what comes next."""
    if bracket.floor not in probed:
        return Outcome(bracket.floor, None, None)
    if probed[bracket.floor]:
        return Outcome(None, bracket.floor, None)
    lo, hi = bracket.floor, bracket.length
    while hi - lo > 1 and hi > lo * bracket.resolution:
        mid = midpoint(lo, hi)
        if mid not in probed:
            return Outcome(mid, None if hi == bracket.length else hi, lo)
        if probed[mid]:
            hi = mid
        else:
            lo = mid
    top = bracket.length - 1  # stopped short of the length, whose "pass" was assumed: the last budget that evicts
    if hi == bracket.length and top > lo:
        if top not in probed:
            return Outcome(top, None, lo)
        hi, lo = (top, lo) if probed[top] else (hi, top)
    return Outcome(None, None if hi == bracket.length else hi, lo)
