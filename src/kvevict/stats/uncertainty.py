"""Uncertainty of every compared figure, from the data a run recorded.

* PPL and KL: a bootstrap over blocks of consecutive tokens. A record's `curve`
  (`kl_curve`) holds the mean NLL (KL) of consecutive windows of predictions; those
  windows are the blocks, so neighbouring tokens, which are not independent, are
  resampled together. Rows of one run share the stream and its windows, so two rows
  are compared *paired*: the same resampled blocks for both, and the interval is that
  of their difference.
* Hit rates (pass-key, task accuracy): Wilson's binomial score interval.

Intervals are at `LEVEL` with `DRAWS` resamples from a fixed seed, so a report redraws
to the same numbers. The statistics are scipy.stats' (`bootstrap`, `binomtest`); nothing
here knows a policy or a table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

LEVEL = 0.95
DRAWS = 2000
SEED = 0


def z(level: float = LEVEL) -> float:
    """The standard normal quantile of a two-sided `level` (1.96 at 95%): every interval written out here uses it."""
    return float(stats.norm.ppf(0.5 + level / 2))


def level_of(critical: float) -> float:
    """The two-sided level whose quantile is `critical` (the inverse of `z`), for an interval asked at a critical
    value rather than a level (Bonett and Price's shrunk one)."""
    return float(1 - 2 * stats.norm.sf(critical))


def is_binary(*scores: np.ndarray) -> bool:
    """Whether every score is 0 or 1 (answers right or wrong, no partial credit)."""
    return all(bool(np.isin(s, (0.0, 1.0)).all()) for s in scores)


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


def bootstrap(samples: tuple[np.ndarray, ...], statistic, level: float = LEVEL) -> Interval:
    """Percentile bootstrap interval of `statistic(*samples, axis)` (scipy.stats.bootstrap), `DRAWS` resamples from
    `SEED`. Several samples are resampled *paired*: the same indices for all (the same blocks, the same prompts)."""
    found = stats.bootstrap(samples, statistic, paired=len(samples) > 1, vectorized=True, n_resamples=DRAWS,
                            confidence_level=level, method="percentile", rng=np.random.default_rng(SEED))
    return Interval(float(found.confidence_interval.low), float(found.confidence_interval.high))


def weighted_mean(values: np.ndarray, weights: np.ndarray, axis: int = -1) -> np.ndarray:
    """Mean of `values` weighted by `weights` along `axis` (blocks weighted by their predictions)."""
    return (values * weights).sum(axis=axis) / weights.sum(axis=axis)


def mean_of(b: Blocks) -> float:
    """The weighted mean of one curve's blocks: the row's mean NLL (KL) over its predictions."""
    return float(weighted_mean(b.means, b.weights))


def mean_interval(b: Blocks, exp: bool = False, level: float = LEVEL) -> Interval:
    """Interval of the weighted mean over blocks (of exp(mean) with `exp`: PPL from NLL)."""
    found = bootstrap((b.means, b.weights), weighted_mean, level)
    return Interval(math.exp(found.low), math.exp(found.high)) if exp else found


def paired_difference(a: Blocks, b: Blocks, level: float = LEVEL) -> Interval | None:
    """Interval of mean(a) - mean(b) over the same resampled blocks; None if the rows' blocks differ."""
    if a.starts != b.starts:
        return None

    def difference(am, aw, bm, bw, axis=-1):
        return weighted_mean(am, aw, axis) - weighted_mean(bm, bw, axis)

    return bootstrap((a.means, a.weights, b.means, b.weights), difference, level)


def wilson(hits: float, n: int, level: float = LEVEL) -> Interval | None:
    """Wilson's score interval of a hit rate from `hits` of `n` trials at `level` (None without trials): scipy's
    (`binomtest(...).proportion_ci(method="wilson")`) for whole hits. A list task's partial answers sum to fractional
    hits, which scipy's test refuses; for those the same score interval (Wilson, JASA 1927) is written out."""
    if n <= 0:
        return None
    p = hits / n
    if float(hits).is_integer():
        found = stats.binomtest(int(hits), n).proportion_ci(confidence_level=level, method="wilson")
        low, high = float(found.low), float(found.high)
    else:
        c = z(level)
        centre = (p + c * c / (2 * n)) / (1 + c * c / n)
        half = c * math.sqrt(p * (1 - p) / n + c * c / (4 * n * n)) / (1 + c * c / n)
        low, high = centre - half, centre + half
    # The interval always holds p; at p = 0 or 1 its end is p itself, which rounding can miss by an ulp
    # (10/10 gave a high of 0.9999999999999999): a figure's error bar would then point the wrong way.
    return Interval(min(p, max(0.0, low)), max(p, min(1.0, high)))
