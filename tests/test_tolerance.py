"""The tolerance rule (`report.tolerance`): paired intervals against independent computations, and the judgements.

The paired accuracy interval is checked against the published worked example of Bonett and Price's adjusted Wald
interval, its coverage and the envelope's false "inside" rate by simulation; the bootstrap intervals against the
exact bootstrap distribution, enumerated over every resample of a few blocks or prompts."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from kvevict import KvevictError
from kvevict.stats.tolerance import Tolerance, decide, drop_interval, judge_accuracy, judge_pair, judge_ppl
from kvevict.stats.uncertainty import Blocks, mean_interval, paired_difference, wilson

TOL = Tolerance()


def _pairs(lost: int, won: int, both: int, neither: int) -> tuple[list[int], list[int]]:
    """(policy, full) 0/1 answers on the same prompts: `lost` full alone right, `won` policy alone right."""
    policy = [0] * lost + [1] * won + [1] * both + [0] * neither
    full = [1] * lost + [0] * won + [1] * both + [0] * neither
    return policy, full


def test_adjusted_wald_matches_the_published_worked_example():
    """statpsych's `ci.prop.ps(.05, 12, 4, 26, 6)` (Bonett's own package; its documentation gives 0.44
    [0.2548067, 0.6251933]): f00 = 12 neither, f01 = 4 with x alone, f10 = 26 with y alone, f11 = 6 both; the
    difference p_y - p_x. Here y is the full cache and x the policy: the drop."""
    policy, full = _pairs(lost=26, won=4, both=6, neither=12)
    low, high = drop_interval(np.array(policy, float), np.array(full, float), 0.95)
    assert (low, high) == pytest.approx((0.2548067, 0.6251933), abs=1e-7)


def test_coverage_by_simulation():
    """Correlated paired answers with known rates (full 0.8, policy 0.74: drop 0.06), 60 prompts, 2000 draws at a
    fixed seed: the 95% interval holds the true drop in 93-97% of them."""
    rng = np.random.default_rng(5)
    cells = np.array([0.70, 0.10, 0.04, 0.16])  # both, full alone, policy alone, neither
    truth = 0.10 - 0.04
    covered = 0
    for _ in range(2000):
        counts = rng.multinomial(60, cells)
        policy, full = _pairs(lost=counts[1], won=counts[2], both=counts[0], neither=counts[3])
        low, high = drop_interval(np.array(policy, float), np.array(full, float), 0.95)
        covered += low <= truth <= high
    assert 0.93 <= covered / 2000 <= 0.97


def test_the_envelope_looks_rarely_call_a_loss_at_the_limit_inside():
    """The rule's promise under sequential sampling: a policy that truly loses 5 points (it misses each answer the
    full cache gets with probability 0.05 / 0.9, never gains one) is called inside 5 points at the looks
    (20, 40, 60, 80; 98.75% each) in at most 2.5% of 1000 seeded runs; one losing 10 points, in none. The
    interval conditional on the discordant answers ([0, 0] when there are none) called the 10-point loser
    inside in about 40% of runs at looks of 10, 20 and 30."""
    rng = np.random.default_rng(11)
    looks = (20, 40, 60, 80)
    tol = Tolerance(max_accuracy_drop=0.05, confidence=1 - 0.05 / len(looks))

    def inside_rate(drop: float) -> float:
        inside = 0
        for _ in range(1000):
            full = (rng.random(80) < 0.9).astype(float)
            policy = full * (rng.random(80) >= drop / 0.9)
            for n in looks:
                found = judge_accuracy(policy[:n], full[:n], tol)
                if found.outcome != "undecided":
                    inside += found.outcome == "inside"
                    break
        return inside / 1000

    assert inside_rate(0.05) <= 0.025
    assert inside_rate(0.10) == 0.0


def test_agreeing_answers_ship_only_once_they_bound_the_loss():
    """No discordant answer at all: the interval is ±z sqrt(2) / (n + 2), so 5 points at 95% need n + 2 >= 1.96
    sqrt(2) / 0.05, 54 prompts; 53 are undecided, and 30 (one answer under 5 points) are far from it."""
    least = math.ceil(stats.norm.ppf(0.975) * math.sqrt(2) / 0.05) - 2
    assert least == 54
    for n, outcome in ((30, "undecided"), (least - 1, "undecided"), (least, "inside")):
        policy, full = _pairs(0, 0, (n * 2) // 3, n - (n * 2) // 3)
        assert judge_accuracy(policy, full, TOL).outcome == outcome, n
    found = judge_accuracy([1, 1], [1, 1], TOL)
    assert found.outcome == "undecided" and found.more_samples == least - 2  # the agreement persisting


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
