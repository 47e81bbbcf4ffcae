"""The rule a verdict ships by: a tolerance the user states, and a paired interval judged against it.

A policy is safe to ship at a budget only where the data show it: its whole paired
interval for the difference from the full cache lies inside the tolerance
(non-inferiority, as in ICH E9 / CONSORT's non-inferiority extension, Piaggio et al.,
JAMA 2012). Where the interval straddles the limit, the samples cannot tell, and the
judgement is *undecided*, with an estimate of how many more samples would decide it.
"Not told apart from the full cache" is never "safe": with 2 samples almost nothing can
be told apart.

The intervals, each paired (both sides on the same blocks of tokens or the same prompts):

* PPL: the ratio policy PPL / full PPL = exp(mean NLL difference), a paired bootstrap
  over blocks of consecutive tokens (`uncertainty.paired_difference`, scipy.stats.bootstrap).
* KL(full ‖ policy): already a per-token difference from the full cache; the bootstrap
  interval of its mean over blocks (`uncertainty.mean_interval`).
* Task accuracy, answers scored 0 or 1: Bonett and Price's adjusted Wald interval of a
  difference of paired proportions (D. G. Bonett and R. M. Price, J. Educ. Behav. Stat.
  37(4):479-488, 2012; statpsych's `ci.prop.ps`). Of the n prompts, b were answered by the
  full cache alone and c by the policy alone; with p_b = (b + 1)/(n + 2) and
  p_c = (c + 1)/(n + 2), the drop's interval is p_b - p_c ± z sqrt((p_b + p_c - (p_b - p_c)²)
  / (n + 2)). Every prompt counts: 30 prompts with no discordant answer still leave room
  for a drop of about 9 points at 95%, since a loss rate of a few percent would often show
  none in 30. The exact interval conditional on b + c (the sign test behind McNemar's test)
  is [0, 0] when b + c = 0: judged by it, looks at 10, 20 and 30 prompts would call a policy
  that loses twice the tolerance "inside" about 40% of the time (a simulation at a full-cache
  accuracy of 90%; Newcombe, Stat. Med. 17:2635-2650, 1998, finds that interval "effectively
  only one-sided", with poor coverage).
* Task accuracy with fractional scores (list tasks give partial credit): a paired bootstrap
  of the mean difference (scipy.stats.bootstrap, paired=True).
* Task accuracy as a share of the full cache's (`min_accuracy_ratio`, instead of the drop):
  the paired interval of acc(policy) / acc(full) (`paired_ratio.ratio_interval`: Bonett and
  Price's 2006 interval for 0/1 scores, a paired bootstrap for fractional ones). Inside when
  its whole interval is at or above the ratio; judged on the relative loss 1 − ratio, so that
  larger is worse as for every metric. Where the full cache answered nothing the ratio is
  undefined: undecided, with that reason. Where one lost answer is worth more than the
  tolerance (full-cache hits × (1 − ratio) < 1), "inside" is withheld, as for the drop.

Pure numpy and scipy: nothing here knows a policy, a record or a table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal

import numpy as np

from ..errors import KvevictError
from .paired_ratio import ratio_interval
from .uncertainty import Blocks, bootstrap, is_binary, mean_interval, mean_of, paired_difference, z

Outcome = Literal["inside", "outside", "undecided"]
Metric = Literal["ppl-ratio", "accuracy-drop", "accuracy-ratio", "kl"]


@dataclass(frozen=True)
class Tolerance:
    """How far from the full cache a policy may be and still ship. `max_ppl_ratio`: policy PPL / full PPL;
    `max_accuracy_drop`: full minus policy accuracy, absolute (0.05 = 5 points); `max_kl`: mean KL(full ‖ policy)
    in nats per token (None: not judged); `confidence`: the two-sided level of every interval;
    `min_accuracy_ratio`: policy accuracy / full accuracy at least this (0.95: 95% of the full cache's), judged
    instead of `max_accuracy_drop` when set (one accuracy rule at a time)."""

    max_ppl_ratio: float = 1.05
    max_accuracy_drop: float = 0.05
    max_kl: float | None = None
    confidence: float = 0.95
    min_accuracy_ratio: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_ppl_ratio) and self.max_ppl_ratio > 1):
            raise KvevictError(f"--max-ppl-ratio is policy PPL over full PPL and must be above 1 (1.05: within 5%), "
                               f"got {self.max_ppl_ratio:g}")
        if not 0 <= self.max_accuracy_drop < 1:
            raise KvevictError(f"--max-accuracy-drop is absolute accuracy points in [0, 1) (0.05: 5 points), "
                               f"got {self.max_accuracy_drop:g}")
        if self.max_kl is not None and not (math.isfinite(self.max_kl) and self.max_kl > 0):
            raise KvevictError(f"--max-kl is nats per token and must be above 0 (leave it out to not judge KL), "
                               f"got {self.max_kl:g}")
        if self.min_accuracy_ratio is not None and not 0 < self.min_accuracy_ratio <= 1:
            raise KvevictError(f"--min-accuracy-ratio is policy accuracy over full accuracy in (0, 1] (0.95: 95% of "
                               f"the full cache's), got {self.min_accuracy_ratio:g}")
        if not 0.5 <= self.confidence < 1:
            raise KvevictError(f"the confidence level must be in [0.5, 1), got {self.confidence:g}")

    def describe(self) -> str:
        """The sentence the report writes: "perplexity within 5% of the full cache; task accuracy within 5 points"."""
        parts = [f"perplexity within {_share(self.max_ppl_ratio - 1)} of the full cache", self.accuracy_rule()]
        if self.max_kl is not None:
            parts.append(f"KL(full ‖ policy) at most {self.max_kl:g} nats per token")
        return "; ".join(parts)

    def accuracy_rule(self) -> str:
        """The accuracy half of `describe`: "task accuracy within 5 points" or "task accuracy at least 95% of the
        full cache's"."""
        if self.min_accuracy_ratio is not None:
            return f"task accuracy at least {_share(self.min_accuracy_ratio)} of the full cache's"
        return f"task accuracy within {_points(self.max_accuracy_drop)} point" + (
            "" if self.max_accuracy_drop * 100 == 1 else "s")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, found: dict | None) -> Tolerance:
        """The tolerance a run recorded (`run.json`'s `tolerance`); the default where it recorded none."""
        if not found:
            return cls()
        return cls(**{k: found[k] for k in ("max_ppl_ratio", "max_accuracy_drop", "max_kl", "confidence",
                                            "min_accuracy_ratio") if k in found})


def _share(x: float) -> str:
    return f"{x * 100:.4g}%"


def _points(x: float) -> str:
    return f"{x * 100:.4g}"


@dataclass(frozen=True)
class Judgement:
    """One metric of one policy against its limit. `estimate`, `low`, `high`: the observed value and its paired
    interval (larger is worse for every metric); `n`: blocks of tokens or prompts used; `more_samples`: where
    undecided, about how many more would decide it if the observed effect and spread persist (None: no number
    would, the estimate sits on the limit)."""

    outcome: Outcome
    metric: Metric
    estimate: float
    low: float
    high: float
    limit: float
    n: int
    more_samples: int | None = None
    reason: str | None = None  # why no interval could decide it (an undefined ratio)

    def text(self) -> str:
        """`PPL ratio 1.02 [0.99, 1.04] ≤ 1.05`-style: the figure, its interval, and where the limit sits. An
        accuracy ratio, held as its relative loss, is shown as the ratio: `accuracy ratio 0.97 [0.90, 1.02] ≥ 0.95`."""
        if self.reason is not None:
            return f"{_LABELS[self.metric][0]} undefined ({self.reason})"
        name, fmt = _LABELS[self.metric]
        if self.metric == "accuracy-ratio":
            sign = {"inside": "≥", "outside": "<", "undecided": "vs"}[self.outcome]
            return (f"{name} {fmt(1 - self.estimate)} [{fmt(1 - self.high)}, {fmt(1 - self.low)}] {sign} "
                    f"{fmt(1 - self.limit)}")
        sign = {"inside": "≤", "outside": ">", "undecided": "vs"}[self.outcome]
        return f"{name} {fmt(self.estimate)} [{fmt(self.low)}, {fmt(self.high)}] {sign} {fmt(self.limit)}"


_LABELS = {
    "ppl-ratio": ("PPL ratio", lambda x: f"{x:.3f}"),
    "accuracy-drop": ("accuracy drop", lambda x: f"{x:+.2f}"),
    "accuracy-ratio": ("accuracy ratio", lambda x: f"{x:.2f}"),
    "kl": ("KL", lambda x: f"{x:.3f}"),
}


def decide(metric: Metric, estimate: float, low: float, high: float, limit: float, n: int,
           scale: str = "linear") -> Judgement:
    """Inside when the whole interval is at or below `limit`, outside when it is wholly above, else undecided.

    The samples that would decide an undecided one: an interval's half-width shrinks as 1/sqrt(n), so with the
    half-width h on the side that faces the limit, n' = n (h / |estimate − limit|)². `scale` "log" judges a ratio
    on its log (the bootstrap's interval of a ratio is symmetric there)."""
    f = math.log if scale == "log" else (lambda x: x)
    e, lo, hi, lim = f(estimate), f(low), f(high), f(limit)
    if hi <= lim:
        return Judgement("inside", metric, estimate, low, high, limit, n)
    if lo > lim:
        return Judgement("outside", metric, estimate, low, high, limit, n)
    gap = abs(e - lim)
    half = (hi - e) if e < lim else (e - lo)
    more = None if gap == 0 or half <= 0 else max(1, math.ceil(n * (half / gap) ** 2) - n)
    return Judgement("undecided", metric, estimate, low, high, limit, n, more)


def judge_ppl(policy: Blocks | None, full: Blocks | None, tol: Tolerance) -> Judgement | None:
    """The paired PPL ratio policy / full over the same resampled blocks; None where either row lacks blocks or
    their blocks differ (no pairing: no judgement)."""
    if policy is None or full is None:
        return None
    found = paired_difference(policy, full, tol.confidence)
    if found is None:
        return None
    estimate = math.exp(mean_of(policy) - mean_of(full))
    return decide("ppl-ratio", estimate, math.exp(found.low), math.exp(found.high), tol.max_ppl_ratio,
                  len(policy.means), scale="log")


def judge_kl(policy: Blocks | None, tol: Tolerance) -> Judgement | None:
    """Mean KL(full ‖ policy) over blocks against `tol.max_kl`; None where KL is not judged or not recorded."""
    if tol.max_kl is None or policy is None:
        return None
    found = mean_interval(policy, level=tol.confidence)
    return decide("kl", mean_of(policy), found.low, found.high, tol.max_kl, len(policy.means))


def judge_accuracy(policy_hits: Sequence[float], full_hits: Sequence[float], tol: Tolerance) -> Judgement:
    """The accuracy drop full − policy on the same prompts (position i of both is one prompt), against
    `tol.max_accuracy_drop`."""
    return judge_pair(policy_hits, full_hits, tol)


def judge_pair(a_hits: Sequence[float], b_hits: Sequence[float], tol: Tolerance) -> Judgement:
    """How much `a` loses against `b` on the same prompts (mean of b − a, paired), against `tol.max_accuracy_drop`,
    or, with `tol.min_accuracy_ratio`, the ratio mean(a) / mean(b) against it (`judge_ratio`):
    inside = `a` is shown within the tolerance of `b` (two policies, or a policy and the full cache)."""
    a, b = np.asarray(a_hits, dtype=float), np.asarray(b_hits, dtype=float)
    if a.shape != b.shape or a.ndim != 1 or not len(a):
        raise ValueError(f"paired scores need two equal, non-empty sequences, got {a.shape} and {b.shape}")
    if tol.min_accuracy_ratio is not None:
        return judge_ratio(a, b, tol.min_accuracy_ratio, tol.confidence)
    low, high = drop_interval(a, b, tol.confidence)
    n, limit = len(a), tol.max_accuracy_drop
    found = decide("accuracy-drop", float((b - a).mean()), low, high, limit, n)
    if found.outcome != "undecided" or not is_binary(a, b):
        return found
    lost, won = _discordant(a, b)
    return replace(found, more_samples=_more_answers(lost / n, won / n, n, tol.confidence, limit))


def _more_answers(lost: float, won: float, n: int, level: float, limit: float) -> int | None:
    """How many more prompts would decide the drop if the shares answered by one side alone (`lost`, `won`)
    persist: the interval narrows as 1/(n + 2), not as 1/sqrt(n), where few or none are discordant, so the
    bootstrap's scaling in `decide` would overstate it many times. None when no number of prompts decides."""
    critical = z(level)

    def decides(m: int) -> bool:
        low, high = _wald(lost * m, won * m, m, critical)
        return high <= limit or low > limit

    if lost - won == limit:
        return None
    top = n + 1  # doubling, then bisection: the interval narrows steadily about the persisting shares
    while not decides(top):
        if top > 10**7:
            return None
        top *= 2
    bottom = max(n, top // 2)
    while top - bottom > 1:
        mid = (top + bottom) // 2
        bottom, top = (bottom, mid) if decides(mid) else (mid, top)
    return top - n


def judge_ratio(a: np.ndarray, b: np.ndarray, ratio: float, level: float) -> Judgement:
    """mean(a) / mean(b) on the same prompts against `ratio`, held as the relative loss 1 − mean(a) / mean(b)
    against 1 − `ratio` (module docstring). Undecided with a reason where `b` scored nothing."""
    n, limit = len(a), 1 - ratio
    found = ratio_interval(a, b, level)
    if found is None:
        return Judgement("undecided", "accuracy-ratio", math.nan, math.nan, math.nan, limit, n,
                         reason="the full cache answered none of the prompts")
    estimate, low, high = found
    judged = decide("accuracy-ratio", 1 - estimate, 1 - high, 1 - low, limit, n)
    hits = float(b.sum())
    if judged.outcome == "inside" and hits * limit < 1 - 1e-9:  # one lost answer is worth more than it
        need = math.ceil(n / (hits * limit) - 1e-9) - n if limit > 0 else None  # 1 - 0.9 is 0.0999...
        return replace(judged, outcome="undecided", more_samples=need)
    return judged


def drop_interval(a: np.ndarray, b: np.ndarray, level: float) -> tuple[float, float]:
    """The paired interval of mean(b − a) (module docstring): Bonett and Price's adjusted Wald for 0/1 scores,
    else a paired bootstrap."""
    if not is_binary(a, b):
        if len(a) < 2:
            return (-1.0, 1.0)  # one partial answer: anything is possible
        found = bootstrap((a, b), lambda x, y, axis: (y - x).mean(axis=axis), level)
        return (found.low, found.high)
    return adjusted_wald(*_discordant(a, b), len(a), level)


def _discordant(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """(lost, won) of 0/1 answers: the prompts `b` alone got right (`a`'s losses), and those `a` alone got right."""
    return int(((b == 1) & (a == 0)).sum()), int(((a == 1) & (b == 0)).sum())


def adjusted_wald(lost: float, won: float, n: float, level: float) -> tuple[float, float]:
    """Bonett and Price's (2012) interval of p_lost − p_won over `n` paired prompts, `lost` of them answered by the
    reference alone and `won` by the other side alone (module docstring), clipped to [−1, 1]."""
    return _wald(lost, won, n, z(level))


def _wald(lost: float, won: float, n: float, critical: float) -> tuple[float, float]:
    p_lost, p_won = (lost + 1) / (n + 2), (won + 1) / (n + 2)
    centre = p_lost - p_won
    half = critical * math.sqrt((p_lost + p_won - centre**2) / (n + 2))
    return (max(-1.0, centre - half), min(1.0, centre + half))
