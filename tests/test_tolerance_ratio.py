"""The accuracy-ratio rule (`Tolerance.min_accuracy_ratio`): Bonett and Price's paired interval of acc(policy) /
acc(full), checked against the published worked example, its coverage by simulation, hand-worked judgements, and
the task envelope's search against a brute-force grid under the ratio."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvevict import KvevictError
from kvevict.ab.task_envelope import TaskEnvelopeConfig, run_task_envelope
from kvevict.report.task_envelope import cells_of, smallest, task_envelope_table, task_rows, task_verdict
from kvevict.stats.paired_ratio import bonett_price, ratio_interval
from kvevict.stats.tolerance import Tolerance, judge_accuracy, judge_pair
from test_task_envelope import TOP, with_oracle  # noqa: F401 - the fixture is used by name

RATIO = Tolerance(min_accuracy_ratio=0.9)


def test_the_published_worked_example():
    """statpsych's `ci.ratio.prop.ps(.05, 12, 4, 26, 6)` (Bonett's own package; its documentation gives
    3.2 [1.766544, 5.796628]): f00 = 12 neither, f01 = 4 x alone, f10 = 26 y alone, f11 = 6 both; ratio y / x."""
    low, high = bonett_price(both=6, alone_a=26, alone_b=4, level=0.95)
    assert (low, high) == pytest.approx((1.766544, 5.796628), abs=1e-6)
    y = np.array([0] * 12 + [0] * 4 + [1] * 26 + [1] * 6, float)
    x = np.array([0] * 12 + [1] * 4 + [0] * 26 + [1] * 6, float)
    assert ratio_interval(y, x, 0.95) == pytest.approx((3.2, 1.766544, 5.796628), abs=1e-6)


def test_coverage_by_simulation():
    """Correlated paired answers with known rates (full 0.8, policy 0.72: ratio 0.9), 60 prompts, 2000 draws at a
    fixed seed: the 95% interval holds the true ratio in 93-97% of them (Bonett and Price report coverage close
    to nominal for n >= 20)."""
    rng = np.random.default_rng(3)
    # joint law of (policy, full): both 0.70, full alone 0.10, policy alone 0.02, neither 0.18
    cells = np.array([0.70, 0.10, 0.02, 0.18])
    truth = (0.70 + 0.02) / (0.70 + 0.10)
    covered = 0
    for _ in range(2000):
        both, lost, won, _ = rng.multinomial(60, cells)
        low, high = bonett_price(both, won, lost, 0.95)
        covered += low <= truth <= high
    assert 0.93 <= covered / 2000 <= 0.97


def test_a_hand_worked_interval():
    """both 8, policy alone 1, full alone 3 (n* = 12) at 95%, worked by hand from the paper's formulas:
    SE(log ratio) = sqrt(6 / (10 * 12)) = 0.22361; SE(log rate a) = sqrt((1 - 10/14) / 10) = 0.16903,
    SE(log rate b) = sqrt((1 - 12/14) / 12) = 0.10911; z = 0.22361 / 0.27814 * 1.95996 = 1.57569;
    Wilson(9/12, z) = [0.52281, 0.89148], Wilson(11/12, z) = [0.71034, 0.98014];
    ratio 9/11 in [0.52281 / 0.98014, 0.89148 / 0.71034] = [0.53340, 1.25500]."""
    low, high = bonett_price(8, 1, 3, 0.95)
    assert (low, high) == pytest.approx((0.53340, 1.25500), abs=2e-5)


def test_the_full_cache_answering_nothing_is_undecided_with_its_reason():
    found = judge_accuracy([1, 0, 0], [0, 0, 0], RATIO)
    assert found.outcome == "undecided" and found.reason and "none" in found.reason
    assert "undefined" in found.text()


def test_agreement_on_every_prompt_is_inside_only_with_enough_prompts():
    """All concordant, every answer right: 30 prompts bound the ratio from 0.938 (below 0.95), 60 from 0.968
    (the minimal n for 0.95 at 95% is 38: from the paper's formula with alone = 0, by hand)."""
    tol = Tolerance(min_accuracy_ratio=0.95)
    assert judge_accuracy([1] * 30, [1] * 30, tol).outcome == "undecided"
    assert judge_accuracy([1] * 37, [1] * 37, tol).outcome == "undecided"
    assert judge_accuracy([1] * 38, [1] * 38, tol).outcome == "inside"


def test_a_policy_that_loses_most_answers_is_outside():
    found = judge_accuracy([1] * 5 + [0] * 25, [1] * 30, RATIO)
    assert found.outcome == "outside" and found.metric == "accuracy-ratio"
    assert found.text().startswith("accuracy ratio 0.17 [") and found.text().endswith("< 0.90")


def test_one_lost_answer_worth_more_than_the_tolerance_withholds_inside():
    """The policy beats the full cache clearly (5 both, 20 alone), but the full cache answered 5: one lost
    answer would move the ratio by 1/5, past a 10% tolerance. Withheld; 25 more prompts make 5 x 50/25 hits
    times 0.1 = 1."""
    found = judge_accuracy([1] * 25 + [0] * 0, [1] * 5 + [0] * 20, RATIO)
    assert found.low < 0 and found.outcome == "undecided" and found.more_samples == 25


def test_the_ratio_judges_a_pair_of_policies_the_same_way():
    a, b = [1] * 15 + [0] * 15, [1] * 30
    assert judge_pair(a, b, RATIO).outcome == "outside"  # a keeps half of b's
    assert judge_pair(b, a, RATIO).outcome == "inside"  # b keeps all of a's 15 and more


def test_fractional_scores_use_the_paired_bootstrap_and_one_answer_bounds_nothing():
    est, low, high = ratio_interval(np.array([0.5]), np.array([0.5]), 0.95)
    assert (est, low, high) == (1.0, 0.0, 2.0)
    a = np.array([0.5, 1.0, 0.5, 1.0] * 10)
    est, low, high = ratio_interval(a, a, 0.95)
    assert est == 1.0 and low == high == 1.0  # identical scores: every resample's ratio is 1


def test_the_ratio_rule_describes_itself_and_round_trips():
    assert RATIO.describe() == "perplexity within 5% of the full cache; task accuracy at least 90% of the full cache's"
    assert Tolerance.from_dict(RATIO.as_dict()) == RATIO


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.01, math.nan])
def test_a_ratio_outside_zero_to_one_is_refused(ratio):
    with pytest.raises(KvevictError, match="--min-accuracy-ratio"):
        Tolerance(min_accuracy_ratio=ratio)


# --- the task envelope under the ratio ----------------------------------------------------------------------------


def full_80(policy: str, budget, sample: int, threshold: int = 37) -> float:
    """The full cache answers 4 samples in 5; a configuration at or above the threshold answers as it does, one
    below answers 1 in 5 of them."""
    right = float(sample % 5 != 0)
    if budget is None or budget >= threshold:
        return right
    return float(right and sample % 5 == 1)


def test_the_search_under_the_ratio_equals_a_brute_force_grid(tmp_path, with_oracle):  # noqa: F811
    """Every budget judged at the cap by the ratio rule: the smallest inside is the search's answer. The full
    cache's 80% accuracy is what the ratio is taken of."""
    with_oracle(full_80)
    cfg = TaskEnvelopeConfig(policies=["window"], floor=8, resolution=1.0001, start=40, cap=120,
                             out=str(tmp_path / "runs"), name="t", length=256, min_accuracy_ratio=0.8)
    _, records = run_task_envelope(cfg, model=None, tokenizer=None)
    full = [full_80("full", None, i) for i in range(cfg.cap)]
    grid = {b: judge_accuracy([full_80("window", b, i) for i in range(cfg.cap)], full, cfg.tolerance()).outcome
            for b in range(cfg.floor, TOP)}
    best, _ = smallest(cells_of(cfg.looks(), cfg.tolerance(), "window", records))
    assert best.budget == min(b for b, o in grid.items() if o == "inside") == 37
    rows = task_rows(["window"], {}, cfg.looks(), cfg.tolerance(), records, TOP)
    assert "ratio there [CI]" in task_envelope_table(rows).headers
    assert "at least 80% of the full cache's" in task_verdict(rows, cfg.tolerance(), cfg.task, cfg.length)


def test_a_ratio_the_cap_cannot_show_is_refused_naming_the_cap():
    """At 0.95 with looks 10, 20, 30 (98.3% each) 30 agreeing answers bound the ratio from 0.88: no cell can be
    inside. The smallest cap that can (70: its 7 looks are judged at 99.3%, where 70 agreeing answers first bound
    the ratio from 0.95) is named."""
    with pytest.raises(KvevictError, match="raise --samples-max to at least 70"):
        TaskEnvelopeConfig(min_accuracy_ratio=0.95, start=10, cap=30).check()
    assert TaskEnvelopeConfig(min_accuracy_ratio=0.8, start=10, cap=30).check()
