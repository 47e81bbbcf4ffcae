"""The one Wilson interval, the one normal quantile, Bonett and Price's ratio interval and `judge`, each against an
independent computation (Python's `statistics.NormalDist`, the published formulas written out here)."""

import math
from statistics import NormalDist

import numpy as np
import pytest

from kvevict.stats.judge import Judged, Measured, judge
from kvevict.stats.paired_ratio import bonett_price
from kvevict.stats.tolerance import Judgement, Tolerance, judge_kl, judge_pair, judge_ppl
from kvevict.stats.uncertainty import Blocks, level_of, wilson, z


def _quantile(level: float) -> float:
    return NormalDist().inv_cdf(0.5 + level / 2)


def _wilson(hits: float, n: int, c: float) -> tuple[float, float]:
    """Wilson's score interval (JASA 1927) at critical value c, written out."""
    p = hits / n
    centre = (p + c * c / (2 * n)) / (1 + c * c / n)
    half = c * math.sqrt(p * (1 - p) / n + c * c / (4 * n * n)) / (1 + c * c / n)
    return centre - half, centre + half


@pytest.mark.parametrize("level", [0.5, 0.9, 0.95, 0.99])
def test_the_quantile_and_its_inverse(level):
    assert z(level) == pytest.approx(_quantile(level), rel=1e-12)
    assert level_of(z(level)) == pytest.approx(level, rel=1e-12)


@pytest.mark.parametrize("level", [0.9, 0.95, 0.99])
@pytest.mark.parametrize("hits,n", [(1, 10), (3, 10), (2.5, 10), (17, 40), (7.25, 40), (29, 31)])
def test_wilson_at_any_level_whole_or_fractional_hits(hits, n, level):
    """scipy's interval for whole hits and the written-out one for fractional hits are the same interval."""
    found = wilson(hits, n, level)
    low, high = _wilson(hits, n, _quantile(level))
    assert (found.low, found.high) == pytest.approx((low, high), abs=1e-12)


def test_wilson_keeps_the_observed_rate_at_the_ends():
    assert wilson(0, 10).low == 0.0 and wilson(10, 10).high == 1.0
    assert wilson(0, 0) is None


@pytest.mark.parametrize("both,alone_a,alone_b", [(20, 0, 0), (20, 3, 1), (5, 0, 4), (0, 2, 3), (30, 1, 6)])
@pytest.mark.parametrize("level", [0.9, 0.95])
def test_bonett_price_against_the_published_formula(both, alone_a, alone_b, level):
    """Bonett and Price (Stat. Med. 25:3039, 2006), eqs. for the hybrid Wilson score interval, written out."""
    hits_a, hits_b, n = both + alone_a, both + alone_b, both + alone_a + alone_b
    se_ratio = math.sqrt((alone_a + alone_b + 2) / ((hits_a + 1) * (hits_b + 1)))
    se_a = math.sqrt((1 - (hits_a + 1) / (n + 2)) / (hits_a + 1))
    se_b = math.sqrt((1 - (hits_b + 1) / (n + 2)) / (hits_b + 1))
    c = se_ratio / (se_a + se_b) * _quantile(level)
    (low_a, high_a), (low_b, high_b) = _wilson(hits_a, n, c), _wilson(hits_b, n, c)
    assert bonett_price(both, alone_a, alone_b, level) == pytest.approx((low_a / high_b, high_a / low_b), rel=1e-10)


def _blocks(means, seed=0) -> Blocks:
    rng = np.random.default_rng(seed)
    means = np.asarray(means, dtype=float) + rng.normal(0, 0.01, len(means))
    return Blocks(tuple(range(0, 64 * len(means), 64)), means, np.full(len(means), 64.0))


def _j(outcome: str) -> Judgement:
    return Judgement(outcome, "ppl-ratio", 1.0, 0.9, 1.1, 1.05, 10)


def test_the_outcome_rule():
    assert Judged(()).outcome == "undecided"
    assert Judged((("PPL", _j("inside")), ("tasks", _j("inside")))).outcome == "inside"
    assert Judged((("PPL", _j("inside")),), missing=("tasks",)).outcome == "undecided"
    assert Judged((("PPL", _j("undecided")), ("tasks", _j("outside")))).outcome == "outside"
    mixed = Judged((("PPL", _j("inside")), ("KL", _j("undecided")), ("tasks", _j("outside"))))
    assert mixed.deciding is mixed.judgements[2][1]
    assert Judged((("PPL", _j("inside")), ("KL", _j("undecided")))).deciding.outcome == "undecided"


def test_judge_reads_every_metric_the_tolerance_bounds():
    full, near = _blocks([2.0] * 20, 1), _blocks([2.01] * 20, 2)
    kl = _blocks([0.01] * 20, 3)
    tol = Tolerance(max_kl=0.05)
    a, b = [1.0] * 18 + [0.0] * 2, [1.0] * 20
    found = judge(Measured(near, kl, {"tasks": a}, stream=True), Measured(full, answers={"tasks": b}), tol)
    assert [label for label, _ in found.judgements] == ["PPL", "KL", "tasks"]
    assert found.judgements[0][1] == judge_ppl(near, full, tol)
    assert found.judgements[1][1] == judge_kl(kl, tol)
    assert found.judgements[2][1] == judge_pair(a, b, tol)
    assert found.missing == ()


def test_judge_names_what_a_candidate_owes():
    """A stream without blocks, KL bounded but unrecorded, tasks due but not answered: missing, never inside."""
    found = judge(Measured(stream=True), Measured(_blocks([2.0] * 10)), Tolerance(max_kl=0.1), due=("tasks",))
    assert found.judgements == () and found.missing == ("PPL", "KL", "tasks")
    assert found.outcome == "undecided"
    # a candidate that is no stream owes no PPL: only the answers both sides gave are judged
    answers = judge(Measured(answers={"tasks": [1.0] * 100}), Measured(answers={"tasks": [1.0] * 100}), Tolerance())
    assert [label for label, _ in answers.judgements] == ["tasks"] and answers.outcome == "inside"
