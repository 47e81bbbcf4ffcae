"""The verdict with RULER answers, fed hand-made records: which policies the tasks cannot tell from the full cache,
which score below it or collapse on them, tasks beyond the model left out, and the sentence when perplexity and the
tasks point at different policies. Every expected figure is computed by hand in the comments (Wilson's 95% interval
of k/10 from its formula: 2/10 [0.0567, 0.5098], 3/10 [0.1078, 0.6032], 9/10 [0.5958, 0.9821],
10/10 [0.7225, 1.0], 0/10 [0, 0.2775])."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvevict.records.schema import RulerRecord
from kvevict.report.markdown import run_markdown
from kvevict.report.sections import decision
from kvevict.report.verdict import verdict
from kvevict.report.verdict_text import sentence
from kvevict.stats.tolerance import Tolerance
from test_verdict import FULL, row


def answers(policy: str, budget: str, hits: int, task: str = "niah_single_1", n: int = 10,
            protocol: str = "agnostic") -> list[RulerRecord]:
    """`n` answers of one policy at one budget, the first `hits` right."""
    return [RulerRecord(f"ruler|{protocol}|{task}|1000|{i}|{policy}|{budget}|0", task, protocol, 1000, i, policy,
                        budget, 1.0 if i < hits else 0.0) for i in range(n)]


def by_budget(records, tolerance: Tolerance | None = None) -> dict:
    return {v.budget: v for v in verdict(records, tolerance)}


def ab_run(window_hits: int, with_snapkv: bool = True) -> list:
    """A sweep at budget 64: window and h2o tied on KL (same KL, opposite wobble), window the cheaper; snapkv
    separated behind them on KL and PPL. Tasks: the full cache 10/10 on niah_single_1; vt is beyond the model
    (full 2/10 < 50%), where window scores 10/10, which must not count."""
    records = [FULL, row("window", 64, 25.0, 0.5, wobble=0.1), row("h2o", 64, 25.0, 0.5, wobble=-0.1)]
    records += answers("full", "full", 10) + answers("full", "full", 2, task="vt")
    records += answers("window", "64", window_hits) + answers("window", "64", 10, task="vt")
    records += answers("h2o", "64", 9) + answers("h2o", "64", 0, task="vt")
    if with_snapkv:
        records += [row("snapkv", 64, 30.0, 1.0)] + answers("snapkv", "64", 10)
    return records


#: wide enough for the hand-made PPL rows (25 and 30 against 20) to be inside, and a task drop of 1 in 10: on 10
#: answers Bonett and Price's interval (p_lost = (lost + 1)/12, p_won = (won + 1)/12, ± 1.96 sqrt((p_lost + p_won -
#: (p_lost - p_won)²)/12)) of 1 lost is [-0.20, 0.36]
LOOSE = Tolerance(max_ppl_ratio=1.6, max_accuracy_drop=0.4)


def _wald_low(lost: int, n: int) -> float:
    """The lower end of Bonett and Price's 95% interval for `lost` answers lost and none won on `n`, by formula."""
    p_lost, p_won = (lost + 1) / (n + 2), 1 / (n + 2)
    return p_lost - p_won - 1.959963984540054 * ((p_lost + p_won - (p_lost - p_won) ** 2) / (n + 2)) ** 0.5


def test_tasks_outside_the_tolerance_overturn_the_perplexity_pick_and_the_sentence_says_so():
    v = by_budget(ab_run(window_hits=1), LOOSE)[64]
    scores = {c.name: c.task for c in v.candidates}
    # vt left out: window 1 of the 10 niah answers, not 11 of 20
    assert (scores["window"].hits, scores["window"].full_hits, scores["window"].n) == (1, 10, 10)
    assert v.beyond == ["vt@1000 (agnostic)"]
    # window lost 9 answers the full cache got, won none: 10/12 - 1/12 = 0.75 ± 0.34, so the drop is [0.41, 1.00]:
    # wholly past 0.4, but not past half of full's 100%
    judged = dict(next(c for c in v.candidates if c.name == "window").judgements)
    assert judged["tasks"].outcome == "outside" and judged["tasks"].low == pytest.approx(_wald_low(9, 10), abs=1e-9)
    assert 0.4 < judged["tasks"].low < 0.5
    assert [c.name for c in v.outside] == ["window"] and not v.collapsed
    # PPL alone would take window (the cheapest); the tasks refuse it: h2o is the cheapest inside on both
    assert v.recommended.name == "h2o" and sentence(v).startswith("At budget 64 ship h2o")
    assert "avoid window (outside the tolerance)" in sentence(v)
    # Spearman over window, h2o, snapkv: -PPL ranks (2.5, 2.5, 1), task rates (0.1, 0.9, 1.0) rank (1, 2, 3):
    # cov = 0.5 x (-1) + 0.5 x 0 + (-1) x 1 = -1.5, var 1.5 and 2: rho = -1.5 / sqrt(3) = -0.866
    [agreement] = v.agreement
    assert agreement["rho"] == pytest.approx(-1.5 / 3 ** 0.5)
    # with PPL held to 10%, PPL shows window ahead of snapkv (30 / 25 = 1.2) and the tasks snapkv ahead of window
    v = by_budget(ab_run(window_hits=1), Tolerance(max_ppl_ratio=1.1, max_accuracy_drop=0.4))[64]
    assert [(a.name, b.name) for a, b in v.opposed] == [("window", "snapkv")]


def test_tasks_inside_the_tolerance_keep_the_perplexity_pick():
    v = by_budget(ab_run(window_hits=9, with_snapkv=False), LOOSE)[64]
    assert v.recommended.name == "window" and [c.name for c in v.inside] == ["window", "h2o"]
    assert sentence(v).startswith("At budget 64 ship window (KL 0.500")
    assert "tasks: accuracy drop +0.10" in sentence(v) and "also inside: h2o" in sentence(v)


def test_perplexity_inside_and_tasks_straddling_is_undecided_not_shipped():
    # window: PPL 25 / 20 inside 1.6; 3 of 10 against 10 of 10: 7 losses, 8/12 - 1/12 = 0.58 ± 0.36 -> drop
    # [0.22, 0.95] straddles 0.4. h2o: PPL 30 / 20 = 1.5 inside, tasks 10/10 (±0.23): inside. So h2o ships, window
    # is undecided, not "tied".
    records = [FULL, row("window", 64, 25.0, 0.5), row("h2o", 64, 30.0, 1.0)]
    records += answers("full", "full", 10) + answers("window", "64", 3) + answers("h2o", "64", 10)
    v = by_budget(records, LOOSE)[64]
    assert v.recommended.name == "h2o" and [c.name for c in v.undecided] == ["window"]
    # at 20% on PPL h2o is outside: nothing inside, window undecided with the answers that would decide it
    v = by_budget(records, Tolerance(max_ppl_ratio=1.3, max_accuracy_drop=0.4))[64]
    assert v.recommended is None
    assert sentence(v).startswith("At budget 64 nothing is shown inside the tolerance yet; undecided: window")
    assert "more task answers would decide its tasks" in sentence(v) and "avoid h2o" in sentence(v)


def test_a_run_of_tasks_alone_gets_a_verdict_per_budget():
    records = answers("full", "full", 10)
    records += answers("window", "50%", 9) + answers("h2o", "50%", 10) + answers("snapkv", "50%", 0)
    records += answers("window", "25%", 3) + answers("h2o", "25%", 3)
    found = by_budget(records, LOOSE)
    half, quarter = found["50%"], found["25%"]
    # 50%: window lost 1 ([-0.20, 0.36]) and h2o none ([-0.23, 0.23]): inside 0.4; snapkv lost 10: 11/12 - 1/12
    # = 0.83 ± 0.31, the drop [0.52, 1.00], wholly past half of full's 100%: collapsed
    assert {c.name for c in half.inside} == {"window", "h2o"} and [c.name for c in half.outside] == ["snapkv"]
    assert [c.name for c in half.tied] == ["h2o"]
    assert half.recommended.name == "window"  # the cheapest: no attention statistics
    assert sentence(half).startswith("At budget 50% ship window (tasks: accuracy drop +0.10")
    assert "avoid snapkv (collapsed) (outside the tolerance)" in sentence(half)
    # 25%: both 3/10 against 10/10: [0.22, 0.95] straddles 0.4
    assert quarter.recommended is None and not quarter.collapsed
    assert sentence(quarter).startswith("At budget 25% nothing is shown inside the tolerance yet; undecided: window")
    # the HTML section and the Markdown render the same sentence, computed once (default tolerance: nothing ships)
    title, body = decision(records)
    assert title == "Verdict" and "At budget 50% nothing is shown inside the tolerance" in body
    assert sentence(found["50%"]) in run_markdown(records, tolerance=LOOSE)


def _niah(policy: str, budget: str, scores: list[float]) -> list[RulerRecord]:
    return [RulerRecord(f"ruler|agnostic|niah_multikey_1|2000|{i}|{policy}|{budget}|0", "niah_multikey_1",
                        "agnostic", 2000, i, policy, budget, s) for i, s in enumerate(scores)]


def test_a_policy_that_lost_five_of_nine_answers_is_not_shipped():
    """`kvevict ruler ... --samples 3 --protocol multi --policies streamingllm,tova`: streamingllm 4/12 against the
    full cache's 9/12 was shipped as "the only policy the tasks cannot tell from the full cache"."""
    full = [1.0] * 9 + [0.0] * 3
    records = _niah("full", "full", full) + _niah("streamingllm", "50%", [1.0] * 4 + [0.0] * 8)
    records += _niah("tova", "50%", [0.0] * 12)
    [v] = verdict(records)
    assert v.recommended is None and "ship" not in sentence(v)
    # 5 lost, none won, of 12: 6/14 - 1/14 = 0.36 ± 0.32, the drop [0.04, 0.68] straddles 0.05
    assert sentence(v).startswith("At budget 50% nothing is shown inside the tolerance yet; undecided: streamingllm")
    assert [c.name for c in v.outside] == ["tova"]


def test_a_policy_that_found_neither_needle_is_not_shipped():
    """`kvevict ab ... --policies window,h2o --ruler niah_single_1 --ruler-samples 2`: h2o, close on PPL, found
    neither needle, and was shipped because 0/2 and 2/2 cannot be told apart."""
    records = [FULL, row("h2o", 64, 20.5, 0.02), row("window", 64, 40.0, 0.8)]
    records += answers("full", "full", 2, n=2) + answers("h2o", "64", 0, n=2) + answers("window", "64", 0, n=2)
    [v] = verdict(records)
    assert v.recommended is None and "ship" not in sentence(v)
    assert sentence(v).startswith("At budget 64 nothing is shown inside the tolerance yet; undecided: h2o")
    assert "more task answers would decide its tasks" in sentence(v)


def test_one_lost_answer_ships_within_five_points_only_on_enough_answers():
    """One answer lost, the rest alike: on 30 the interval is [-0.08, 0.14] (a loss rate of several points would
    often show one loss in 30), undecided; on 100 it is [-0.02, 0.04], inside 5 points."""
    for n, ships in ((30, False), (100, True)):
        full = [1.0] * (n - 5) + [0.0] * 5
        policy = [1.0] * (n - 6) + [0.0] * 6  # lost answer n - 6
        [v] = verdict(_niah("full", "full", full) + _niah("h2o", "50%", policy))
        assert (v.recommended is not None) == ships, n
        assert sentence(v).startswith("At budget 50% ship h2o" if ships else
                                      "At budget 50% nothing is shown inside the tolerance yet; undecided: h2o")


def test_a_run_of_tasks_alone_prints_no_empty_perplexity_table():
    records = answers("full", "full", 10) + answers("h2o", "50%", 9)
    text = run_markdown(records)
    assert "| ppl |" not in text and "| policy | budget |" not in text
    assert "| agnostic | niah_single_1@1000 | 50% | 10 |" in text  # the task table is there
    assert "| ppl |" in run_markdown(records + [FULL, row("h2o", 64, 25.0, 0.5)])


def test_several_protocols_pool_on_the_same_answers():
    """An answer counts beside the full cache's answer to the same question under the same protocol."""
    records = answers("full", "full", 10) + answers("full", "full", 0, protocol="stream")
    records += answers("h2o", "50%", 9) + answers("h2o", "50%", 1, protocol="stream")
    v = by_budget(records)["50%"]
    [h2o] = v.candidates
    # stream's full cache scores 0/10 < 50%: beyond the model under stream, its answers left out
    assert (h2o.task.hits, h2o.task.n) == (9, 10) and v.beyond == ["niah_single_1@1000 (stream)"]


def test_the_tasks_are_judged_agnostic_and_a_policy_told_the_question_is_not_ranked_on_it():
    """A policy run only under `aware` (its flattering protocol) must not be shipped over the ones judged question-
    agnostic: the verdict judges agnostic answers, and names the other policy with 0 of them."""
    records = answers("full", "full", 10) + answers("full", "full", 10, protocol="aware")
    records += answers("h2o", "50%", 9) + answers("snapkv", "50%", 0)
    records += answers("snapkv", "50%", 10, protocol="aware") + answers("adakv:alpha=1:snapkv", "50%", 10,
                                                                        protocol="aware")
    v = by_budget(records, LOOSE)["50%"]
    assert v.protocol == "agnostic"
    assert {c.name: (c.task.hits, c.task.n) for c in v.candidates} == {"h2o": (9, 10), "snapkv": (0, 10)}
    assert v.partial == [("adakv:alpha=1:snapkv", 0, 10)]
    assert v.recommended.name == "h2o" and "adakv" not in sentence(v).partition("avoid")[0]
    assert ("not ranked on the tasks (fewer agnostic answers than the other policies at this budget; a run of the same "
            "tasks and samples fills them): adakv:alpha=1:snapkv 0/10") in run_markdown(records)


def test_a_policy_with_fewer_answers_is_named_with_its_count_not_ranked_on_other_answers():
    """tova added later with 5 of the 10 samples, all right: 5/5 must not outrank window's 9/10 on different
    answers; the others keep their 10."""
    records = answers("full", "full", 10) + answers("window", "50%", 9) + answers("tova", "50%", 5, n=5)
    v = by_budget(records, LOOSE)["50%"]
    assert [(c.name, c.task.n) for c in v.candidates] == [("window", 10)]
    assert v.partial == [("tova", 5, 10)] and v.recommended.name == "window"


def test_policies_that_answered_different_samples_are_not_ranked_against_each_other():
    records = answers("full", "full", 10) + answers("h2o", "50%", 5, n=5)
    records += [r for r in answers("tova", "50%", 0) if r.sample >= 5]  # samples 5-9 only
    [v] = verdict(records)
    assert not v.candidates and v.partial == [("h2o", 5, 10), ("tova", 5, 10)]
    assert sentence(v) == ("At budget 50% no policy answered every agnostic answer the budget asks (h2o 5/10, tova "
                           "5/10): run the same tasks and samples for each.")


def test_a_run_without_agnostic_answers_is_judged_on_its_first_protocol_in_order():
    records = answers("full", "full", 10, protocol="aware") + answers("full", "full", 10, protocol="stream")
    records += answers("h2o", "50%", 2, protocol="stream") + answers("h2o", "50%", 10, protocol="aware")
    v = by_budget(records)["50%"]
    assert v.protocol == "stream" and v.candidates[0].task.hits == 2


def test_a_budget_whose_every_task_is_beyond_the_model_says_so():
    records = answers("full", "full", 1) + answers("window", "50%", 10)
    [v] = verdict(records)
    assert v.recommended is None and not v.candidates
    assert sentence(v) == ("At budget 50% every task the run holds is beyond this model at its length (the full cache "
                           "scores below 50%: niah_single_1@1000 (agnostic)): the tasks cannot judge the policies.")


def test_a_list_tasks_partial_scores_are_counted_to_one_decimal():
    """A list task scores the share of its items found: six answers scoring 1/3 each sum to 2 hits (written 2,
    though the float sum is 2.0000000000000004), and 2/3 + 1/3 + 1/3 = 4/3, written 1.3 (not 1.33333). The
    interval is Wilson's on the unrounded sum (hits 4/3 of n 10), computed here from its formula."""
    import math

    def listed(policy: str, scores: list[float], budget: str = "50%") -> list[RulerRecord]:
        return [RulerRecord(f"ruler|agnostic|niah_multivalue|1000|{i}|{policy}|{budget}|0", "niah_multivalue",
                            "agnostic", 1000, i, policy, budget, s) for i, s in enumerate(scores)]

    records = listed("full", [1.0] * 10, "full") + listed("window", [2 / 3, 1 / 3, 1 / 3] + [0.0] * 7)
    records += listed("h2o", [1 / 3] * 6 + [0.0] * 4)
    facts = run_markdown(records)
    p, n, z = (4 / 3) / 10, 10, 1.959963984540054
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (
        1 + z * z / n)
    assert f"window 1.3/10 [{centre - half:.2f}, {centre + half:.2f}]" in facts
    assert "h2o 2/10 " in facts and "full 10/10 " in facts
    assert "1.33333" not in facts and "1.3333" not in facts


def qa_answers(policy: str, budget: str, hits: int, lengths: tuple[int, ...]) -> list[RulerRecord]:
    """`answers` of a QA file: one per line, each line at its own prompt length (as `ruler --qa` records them)."""
    return [replace(r, length=length) for r, length in zip(answers(policy, budget, hits, "qa", len(lengths)), lengths,
                                                             strict=True)]


def test_the_lines_of_a_qa_file_are_one_task_whatever_their_lengths():
    """Twelve lines at twelve lengths: one cell of 12 answers per policy, judged as one task. Grouped by length,
    each line would be a cell of one answer, and the full cache's misses would leave a third of them out as
    beyond the model (full 0/1 < 50%) while keeping the rest: 8 answers judged, not 12."""
    from kvevict.report.ruler import cells

    lengths = tuple(1700 + 13 * i for i in range(12))
    records = qa_answers("full", "full", 8, lengths) + qa_answers("window", "50%", 8, lengths)
    found = [c for c in cells(records) if c.policy == "window"]
    assert [(c.n, c.accuracy, c.beyond) for c in found] == [(12, 8 / 12, False)]
    assert found[0].where == "qa at each line's length"
    (v,) = verdict(records, LOOSE)
    score = {c.name: c.task for c in v.candidates}["window"]
    assert (score.hits, score.full_hits, score.n) == (8, 8, 12) and v.beyond == []
    # the full cache below half on the file: the whole file is beyond the model, named once
    weak = qa_answers("full", "full", 5, lengths) + qa_answers("window", "50%", 5, lengths)
    (v,) = verdict(weak, LOOSE)
    assert v.beyond == ["qa at each line's length (agnostic)"]
