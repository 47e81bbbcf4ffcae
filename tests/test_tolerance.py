"""The tolerance rule (`report.tolerance`): paired intervals against independent computations, and the judgements.

The exact conditional interval is checked against a brute-force Clopper-Pearson written from the binomial sum
(math.comb and bisection, no scipy); the bootstrap intervals against the exact bootstrap distribution, enumerated
over every resample of a few blocks or prompts."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
from scipy import stats

from kvevict import KvevictError
from kvevict.report.tolerance import Tolerance, decide, drop_interval, judge_accuracy, judge_pair, judge_ppl
from kvevict.report.uncertainty import Blocks, mean_interval, paired_difference, wilson

TOL = Tolerance()


def _tail(k: int, n: int, p: float, upper: bool) -> float:
    """P(X >= k) (upper) or P(X <= k) for X ~ Binomial(n, p), summed term by term."""
    ks = range(k, n + 1) if upper else range(0, k + 1)
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in ks)


def _root(f, lo: float = 0.0, hi: float = 1.0) -> float:
    """The p where the monotone f crosses 0, by bisection."""
    flo = f(lo)
    for _ in range(200):
        mid = (lo + hi) / 2
        if (f(mid) > 0) == (flo > 0):
            lo, flo = mid, f(mid)
        else:
            hi = mid
    return (lo + hi) / 2


def _clopper_pearson(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    low = 0.0 if k == 0 else _root(lambda p: _tail(k, n, p, True) - alpha / 2)
    high = 1.0 if k == n else _root(lambda p: _tail(k, n, p, False) - alpha / 2)
    return low, high


def _pairs(lost: int, won: int, both: int, neither: int) -> tuple[list[int], list[int]]:
    """(policy, full) 0/1 answers on the same prompts: `lost` full alone right, `won` policy alone right."""
    policy = [0] * lost + [1] * won + [1] * both + [0] * neither
    full = [1] * lost + [0] * won + [1] * both + [0] * neither
    return policy, full


def test_exact_paired_interval_matches_a_brute_force_clopper_pearson_on_random_tables():
    rng = random.Random(7)
    for _ in range(40):
        lost, won, both, neither = (rng.randint(0, 12) for _ in range(4))
        if lost + won + both + neither == 0:
            continue
        policy, full = _pairs(lost, won, both, neither)
        n, d = len(policy), lost + won
        low, high = drop_interval(np.array(policy, float), np.array(full, float), 0.95)
        if d == 0:
            assert (low, high) == (0.0, 0.0)
            continue
        t_low, t_high = _clopper_pearson(lost, d)
        assert low == pytest.approx(d / n * (2 * t_low - 1), abs=1e-9)
        assert high == pytest.approx(d / n * (2 * t_high - 1), abs=1e-9)


def test_the_exact_interval_excludes_no_loss_exactly_where_the_one_sided_sign_test_rejects():
    """The interval's lower end is above 0 iff the exact binomial test of the discordant pairs (McNemar's exact test)
    rejects "no loss" at one-sided 2.5%: the two are one test (scipy.stats.binomtest)."""
    for lost in range(0, 15):
        for won in range(0, 6):
            if lost + won == 0:
                continue
            policy, full = _pairs(lost, won, 10, 3)
            low, _ = drop_interval(np.array(policy, float), np.array(full, float), 0.95)
            p = stats.binomtest(lost, lost + won, 0.5, alternative="greater").pvalue
            assert (low > 0) == (p < 0.025), (lost, won)


def test_thirty_paired_prompts_with_one_discordant_answer_ship():
    for policy, full in (_pairs(1, 0, 20, 9), _pairs(0, 1, 20, 9)):
        found = judge_accuracy(policy, full, TOL)
        assert found.outcome == "inside" and found.n == 30
        assert found.high <= 1 / 30 + 1e-12


def test_a_policy_that_lost_every_answer_is_never_inside():
    """Two prompts, the full cache right on both, the policy on neither: undecided, with samples to decide."""
    found = judge_accuracy([0, 0], [1, 1], TOL)
    assert found.outcome == "undecided" and found.more_samples is not None and found.more_samples > 0
    # and 5 losses of 9 on 12 prompts (the streamingllm case): not inside either
    policy, full = _pairs(5, 0, 4, 3)
    assert judge_accuracy(policy, full, TOL).outcome != "inside"
    # twenty such prompts decide it: outside
    policy, full = _pairs(20, 0, 0, 0)
    assert judge_accuracy(policy, full, TOL).outcome == "outside"


def test_agreement_on_too_few_prompts_to_resolve_the_tolerance_is_undecided():
    """Two prompts answered alike are no evidence of a loss under 5 points: one answer is 50 points."""
    found = judge_accuracy([1, 1], [1, 1], TOL)
    assert found.outcome == "undecided" and found.more_samples == 18  # 20 prompts make one answer 5 points


def test_judge_pair_is_the_loss_of_the_first_against_the_second():
    a, b = _pairs(20, 0, 5, 5)  # a lost 20 of b's answers
    assert judge_pair(a, b, TOL).outcome == "outside"
    assert judge_pair(b, a, TOL).outcome == "inside"  # b loses nothing against a


def _exact_bootstrap(samples: tuple[np.ndarray, ...], statistic, level: float = 0.95) -> tuple[float, float]:
    """The percentile interval of the bootstrap distribution itself: every one of the n**n paired resamples."""
    n = len(samples[0])
    index = np.array(list(itertools.product(range(n), repeat=n)))
    values = statistic(*(s[index] for s in samples), axis=-1)
    tail = (1 - level) / 2 * 100
    return tuple(np.percentile(values, [tail, 100 - tail]))


def test_paired_block_bootstrap_matches_the_enumerated_bootstrap_distribution():
    rng = np.random.default_rng(3)
    for _ in range(3):
        a = Blocks((0, 1, 2, 3, 4, 5), rng.normal(3.4, 0.3, 6), rng.integers(10, 30, 6).astype(float))
        b = Blocks(a.starts, a.means - rng.normal(0.05, 0.05, 6), a.weights)
        found = paired_difference(a, b)

        def diff(am, aw, bm, bw, axis=-1):
            return (am * aw).sum(axis) / aw.sum(axis) - (bm * bw).sum(axis) / bw.sum(axis)

        low, high = _exact_bootstrap((a.means, a.weights, b.means, b.weights), diff)
        width = high - low
        assert abs(found.low - low) < 0.15 * width and abs(found.high - high) < 0.15 * width
        single = mean_interval(a)
        low, high = _exact_bootstrap((a.means, a.weights), lambda m, w, axis=-1: (m * w).sum(axis) / w.sum(axis))
        assert abs(single.low - low) < 0.15 * (high - low) and abs(single.high - high) < 0.15 * (high - low)


def test_fractional_scores_get_the_paired_bootstrap_of_the_mean_difference():
    policy = np.array([0.5, 1.0, 0.25, 0.0, 1.0])
    full = np.array([1.0, 1.0, 0.75, 0.5, 1.0])
    low, high = drop_interval(policy, full, 0.95)
    e_low, e_high = _exact_bootstrap((policy, full), lambda x, y, axis=-1: (y - x).mean(axis))
    assert abs(low - e_low) < 0.05 and abs(high - e_high) < 0.05


def test_ppl_ratio_is_the_exponent_of_the_paired_nll_difference():
    rng = np.random.default_rng(1)
    full = Blocks(tuple(range(20)), rng.normal(3.4, 0.3, 20), np.full(20, 19.0))
    same = judge_ppl(full, full, TOL)
    assert same.outcome == "inside" and same.low == pytest.approx(1.0) and same.high == pytest.approx(1.0)
    worse = Blocks(full.starts, full.means + math.log(1.3) + rng.normal(0, 0.01, 20), full.weights)
    found = judge_ppl(worse, full, TOL)
    assert found.outcome == "outside" and 1.25 < found.low < found.estimate < found.high < 1.35
    assert judge_ppl(worse, Blocks(tuple(range(1, 21)), full.means, full.weights), TOL) is None  # unpaired


def test_more_samples_scale_the_interval_by_one_over_root_n():
    """Hand-worked: estimate 0.03, upper end 0.07 at n = 100, limit 0.05: half-width 0.04 must shrink to the gap
    0.02, a factor 2, so 4 × 100 samples: 300 more."""
    found = decide("accuracy-drop", 0.03, -0.01, 0.07, 0.05, 100)
    assert found.outcome == "undecided" and found.more_samples == 300
    assert decide("accuracy-drop", 0.05, 0.0, 0.1, 0.05, 100).more_samples is None  # on the limit: no n decides
    assert decide("accuracy-drop", 0.0, -0.01, 0.04, 0.05, 10).outcome == "inside"
    assert decide("accuracy-drop", 0.2, 0.06, 0.3, 0.05, 10).outcome == "outside"


def test_the_default_tolerance_describes_itself():
    assert TOL.describe() == "perplexity within 5% of the full cache; task accuracy within 5 points"
    assert "KL" in Tolerance(max_kl=0.1).describe()
    assert Tolerance.from_dict(Tolerance(1.1, 0.02).as_dict()) == Tolerance(1.1, 0.02)


@pytest.mark.parametrize("settings, words", [
    (dict(max_ppl_ratio=1.0), "--max-ppl-ratio"), (dict(max_ppl_ratio=0.95), "--max-ppl-ratio"),
    (dict(max_accuracy_drop=1.0), "--max-accuracy-drop"), (dict(max_accuracy_drop=-0.1), "--max-accuracy-drop"),
    (dict(max_kl=0.0), "--max-kl"), (dict(confidence=1.0), "confidence"),
])
def test_a_tolerance_that_cannot_hold_is_refused(settings, words):
    with pytest.raises(KvevictError, match=words):
        Tolerance(**settings)


def test_wilson_is_scipys_for_whole_hits_and_the_score_formula_for_partial_ones():
    # Wilson 3/10 at 95%, hand-computed from the score formula: [0.1078, 0.6032]
    assert wilson(3, 10).low == pytest.approx(0.10779, abs=1e-5)
    assert wilson(3, 10).high == pytest.approx(0.60322, abs=1e-5)
    # partial hits lie between their whole neighbours
    assert wilson(3, 10).low < wilson(3.5, 10).low < wilson(4, 10).low
