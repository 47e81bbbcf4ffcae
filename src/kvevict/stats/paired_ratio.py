"""The paired interval of an accuracy ratio: acc(policy) / acc(full cache) on the same prompts.

Answers scored 0 or 1 form a paired 2x2 table: `both` prompts answered by the two sides,
`alone_a` by the policy alone, `alone_b` by the full cache alone (the prompts neither
answered do not enter the ratio). The ratio is (both + alone_a) / (both + alone_b), and its
interval is Bonett and Price's hybrid Wilson score interval (D. G. Bonett and R. M. Price,
"Confidence intervals for a ratio of binomial proportions based on paired data", Statistics
in Medicine 25(17):3039-3047, 2006): a Wilson score interval for each of the two marginal
rates over the n* = both + alone_a + alone_b prompts that someone answered, at a critical
value shrunk by k = SE(log ratio) / (SE(log rate a) + SE(log rate b)) so the pairing's
correlation is accounted for, the ratio's limits being low_a / high_b and high_a / low_b.
The same formula is implemented in statpsych's `ci.ratio.prop.ps` and contingencytables'
`BonettPrice_hybrid_Wilson_score_CI_paired_2x2` (Fagerland, Lydersen & Laake, "Statistical
Analysis of Contingency Tables", 2017, ch. 8), where it is among the recommended intervals.
As in the difference's interval (`tolerance.adjusted_wald`), the concordant pairs count: 30 prompts both
answered bound the ratio near 1 more tightly than 3 do.

Fractional scores (partial credit): a paired percentile bootstrap of mean(a) / mean(b)
(scipy.stats.bootstrap over prompts); a resample whose full-cache mean is 0 counts as ratio
0, the worst case, so the interval errs towards "not inside".

Undefined where the full cache scored nothing: there is no accuracy to hold a share of.
"""

from __future__ import annotations

import math

import numpy as np

from .uncertainty import bootstrap, is_binary, level_of, wilson, z


def ratio_interval(a: np.ndarray, b: np.ndarray, level: float) -> tuple[float, float, float] | None:
    """(estimate, low, high) of mean(a) / mean(b), paired by position (shape (n,) each, scores in [0, 1]);
    None where mean(b) is 0 (the ratio is undefined)."""
    if not b.sum() > 0:
        return None
    estimate = float(a.sum() / b.sum())
    if is_binary(a, b):
        both = int(((a == 1) & (b == 1)).sum())
        alone_a, alone_b = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
        return (estimate, *bonett_price(both, alone_a, alone_b, level))
    if len(a) < 2:  # one partial answer: anything from 0 to all of a's possible credit
        return estimate, 0.0, float(1 / b.mean())

    def ratio(x, y, axis):
        top, bottom = x.mean(axis=axis), y.mean(axis=axis)
        return np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1.0), 0.0)

    found = bootstrap((a, b), ratio, level)
    return estimate, found.low, found.high


def bonett_price(both: int, alone_a: int, alone_b: int, level: float) -> tuple[float, float]:
    """Bonett and Price's (2006) hybrid Wilson score interval of (both + alone_a) / (both + alone_b)
    (module docstring); `both + alone_b` must be at least 1."""
    hits_a, hits_b = both + alone_a, both + alone_b
    n = both + alone_a + alone_b
    se_ratio = math.sqrt((alone_a + alone_b + 2) / ((hits_a + 1) * (hits_b + 1)))
    se_a = math.sqrt((1 - (hits_a + 1) / (n + 2)) / (hits_a + 1))
    se_b = math.sqrt((1 - (hits_b + 1) / (n + 2)) / (hits_b + 1))
    shrunk = level_of(se_ratio / (se_a + se_b) * z(level))
    rate_a, rate_b = wilson(hits_a, n, shrunk), wilson(hits_b, n, shrunk)
    return rate_a.low / rate_b.high, rate_a.high / rate_b.low
