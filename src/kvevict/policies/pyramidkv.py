"""`pyramidkv`: SnapKV's scores under a budget that shrinks from the lowest layer to the
highest (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling").

The paper finds attention spread widely in low layers and concentrated on a few
tokens in high ones, so low layers get more entries. Every layer keeps SnapKV's
observation `window`; the rest, `budget - window` on average, falls linearly from
`2 * avg - avg / beta` at layer 0 to `avg / beta` at the top layer, so the layers
together hold `layers * budget` entries, as many as a uniform budget. `beta = 1` is
uniform; the paper's default is 20. Rounding is spread so the total is exact.

Selection itself is SnapKV's (this class only adds the per-layer budgets). A layer
stores one budget for all rows of a batch, so a per-layer policy runs in a batch of
its own (`varies_by_layer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..errors import KvevictError
from .snapkv import SnapKV


@dataclass(eq=False)
class PyramidKV(SnapKV):
    beta: float = 20.0

    varies_by_layer = True

    def __post_init__(self) -> None:
        if not self.beta >= 1:
            raise KvevictError(
                f"pyramidkv:beta must be >= 1 (the bottom-to-top budget ratio's slope; 1 is uniform), got {self.beta}"
            )
        super().__post_init__()

    def spec(self) -> str:
        return f"pyramidkv:beta={self.beta:g},{super().spec().partition(':')[2]}"

    def check_budget(self, budget: int) -> None:
        super().check_budget(budget)
        if (budget - self.window) / self.beta < 1:
            raise KvevictError(
                f"budget {budget} is too small for the pyramid of 'pyramidkv:beta={self.beta:g}': the top layer "
                f"would keep fewer than 1 entry beyond its {self.window}-token window; use a budget of at least "
                f"{self.window + int(-(-self.beta // 1))}, a smaller beta or a smaller window"
            )

    def layer_budgets(self, budget: int, layers: int) -> list[int]:
        """Budget of each layer, bottom first: `window` plus a linearly falling share."""
        avg = Fraction(budget - self.window)
        low = avg / Fraction(self.beta)
        high = 2 * avg - low
        shares = [high - (high - low) * Fraction(i, max(1, layers - 1)) for i in range(layers)]
        if layers == 1:
            shares = [avg]
        # floor of the running total: integers that sum to layers * avg exactly
        bounds, running = [0], Fraction(0)
        for share in shares:
            running += share
            bounds.append(running.numerator // running.denominator)
        return [self.window + b - a for a, b in zip(bounds, bounds[1:])]
