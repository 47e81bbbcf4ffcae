"""Uncertainty of every compared figure, from the data a run recorded.

* PPL and KL: a bootstrap over blocks of consecutive tokens. A record's `curve`
  (`kl_curve`) holds the mean NLL (KL) of consecutive windows of predictions; those
  windows are the blocks, so neighbouring tokens, which are not independent, are
  resampled together. Rows of one run share the stream and its windows, so two rows
  are compared *paired*: the same resampled blocks for both, and the interval is that
  of their difference.
* Hit rates (pass-key, task accuracy): Wilson's binomial score interval.

Intervals are at `LEVEL` with `DRAWS` resamples from a fixed seed, so a report redraws
to the same numbers. Pure numpy: nothing here knows a policy or a table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
DRAWS = 2000
SEED = 0
#: the normal quantile of LEVEL (two-sided 95%)
Z = 1.959963984540054


@dataclass(frozen=True)
class Interval:
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def text(self, digits: int = 2) -> str:
        return f"[{self.low:.{digits}f}, {self.high:.{digits}f}]"


@dataclass(frozen=True)
class Blocks:
    """Per-block means and weights (predictions per block) of one recorded curve, `[n]` each."""

    starts: tuple[int, ...]
    means: np.ndarray
    weights: np.ndarray


def blocks(curve: Sequence[dict] | None, key: str) -> Blocks | None:
    """The blocks of a recorded curve: `key` "ppl" gives NLL means (log of each window's PPL), "kl" KL means.

    A window's weight is its scored predictions (`n`), or its span for older records."""
    if not curve or len(curve) < 2:
        return None
    means = [math.log(w["ppl"]) if key == "ppl" else float(w[key]) for w in curve]
    weights = [float(w.get("n", w["end"] - w["start"] + 1)) for w in curve]
    return Blocks(tuple(int(w["start"]) for w in curve), np.array(means), np.array(weights))


def _draws(n: int) -> np.ndarray:
    """`[DRAWS, n]` block indices, the same for every figure of a report (fixed seed)."""
    return np.random.default_rng(SEED).integers(0, n, size=(DRAWS, n))


def _weighted(values: np.ndarray, weights: np.ndarray, index: np.ndarray) -> np.ndarray:
    return (values[index] * weights[index]).sum(-1) / weights[index].sum(-1)


def _percentiles(samples: np.ndarray) -> Interval:
    tail = (1 - LEVEL) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return Interval(float(low), float(high))


def mean_interval(b: Blocks, exp: bool = False) -> Interval:
    """Interval of the weighted mean over blocks (of exp(mean) with `exp`: PPL from NLL)."""
    samples = _weighted(b.means, b.weights, _draws(len(b.means)))
    return _percentiles(np.exp(samples) if exp else samples)


def paired_difference(a: Blocks, b: Blocks) -> Interval | None:
    """Interval of mean(a) - mean(b) over the same resampled blocks; None if the rows' blocks differ."""
    if a.starts != b.starts:
        return None
    index = _draws(len(a.means))
    return _percentiles(_weighted(a.means, a.weights, index) - _weighted(b.means, b.weights, index))


def wilson(hits: float, n: int) -> Interval | None:
    """Wilson's score interval of a hit rate from `hits` of `n` trials (None without trials)."""
    if n <= 0:
        return None
    p = hits / n
    centre = (p + Z * Z / (2 * n)) / (1 + Z * Z / n)
    half = Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n)) / (1 + Z * Z / n)
    # The interval always holds p; at p = 0 or 1 its end is p itself, which rounding can miss by an ulp
    # (10/10 gave a high of 0.9999999999999999): a figure's error bar would then point the wrong way.
    return Interval(min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half)))
