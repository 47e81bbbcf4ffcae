"""The verdict with RULER answers, fed hand-made records: which policies the tasks cannot tell from the full cache,
which score below it or collapse on them, tasks beyond the model left out, and the sentence when perplexity and the
tasks point at different policies. Every expected figure is computed by hand in the comments (Wilson's 95% interval
of k/10 from its formula: 2/10 [0.0567, 0.5098], 3/10 [0.1078, 0.6032], 9/10 [0.5958, 0.9821],
10/10 [0.7225, 1.0], 0/10 [0, 0.2775])."""

from __future__ import annotations

import pytest

from kvevict.report.markdown import run_markdown
from kvevict.report.records import RulerRecord
from kvevict.report.sections import decision
from kvevict.report.verdict import verdict
from test_verdict import FULL, row


def answers(policy: str, budget: str, hits: int, task: str = "niah_single_1", n: int = 10,
            protocol: str = "agnostic") -> list[RulerRecord]:
    """`n` answers of one policy at one budget, the first `hits` right."""
    return [RulerRecord(f"ruler|{protocol}|{task}|1000|{i}|{policy}|{budget}|0", task, protocol, 1000, i, policy,
                        budget, 1.0 if i < hits else 0.0) for i in range(n)]


def by_budget(records) -> dict:
    return {v.budget: v for v in verdict(records)}


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


def test_tasks_overturn_the_perplexity_pick_and_the_sentence_says_so():
    v = by_budget(ab_run(window_hits=2))[64]
    scores = {c.name: c.task for c in v.candidates}
    # vt left out: window 2 of the 10 niah answers, not 12 of 20
    assert (scores["window"].hits, scores["window"].full_hits, scores["window"].n) == (2, 10, 10)
    assert v.beyond == ["vt@1000 (agnostic)"]
    # window [0.0567, 0.5098] lies below full's [0.7225, 1]: below, but not collapsed (0.5098 >= 0.5 x 1.0)
    assert [c.name for c in v.task_below] == ["window"]
    assert {c.name for c in v.task_tied} == {"h2o", "snapkv"}
    assert not v.collapsed
    # PPL alone: window and h2o tied, window cheaper (no attention statistics); the tasks refuse window
    assert v.ppl_pick.name == "window" and v.recommended.name == "h2o"
    assert "PPL and the tasks point at different policies: PPL alone would pick window" in v.sentence
    assert "tasks 2/10 [0.06, 0.51] vs full 10/10 [0.72, 1.00]" in v.sentence
    assert v.sentence.startswith("At budget 64 ship h2o")
    # PPL separates window ahead of snapkv; the tasks separate snapkv ([0.72, 1]) ahead of window ([0.06, 0.51])
    assert [(a.name, b.name) for a, b in v.opposed] == [("window", "snapkv")]
    # Spearman over window, h2o, snapkv: -PPL ranks (2.5, 2.5, 1), task rates (0.2, 0.9, 1.0) rank (1, 2, 3):
    # cov = 0.5 x (-1) + 0.5 x 0 + (-1) x 1 = -1.5, var 1.5 and 2: rho = -1.5 / sqrt(3) = -0.866
    [agreement] = v.agreement
    assert agreement["rho"] == pytest.approx(-1.5 / 3 ** 0.5)


def test_tasks_that_agree_with_perplexity_keep_its_pick():
    v = by_budget(ab_run(window_hits=9, with_snapkv=False))[64]
    assert v.ppl_pick.name == v.recommended.name == "window"
    assert ("the tasks do not tell it apart from the full cache (tasks 9/10 [0.60, 0.98] vs full 10/10 [0.72, 1.00]"
            in v.sentence)
    assert "point at different policies" not in v.sentence


def test_no_policy_tied_on_both_measures_is_said_not_hidden():
    # only window is tied on PPL (h2o separated behind it), and window is below the full cache on the tasks
    records = [FULL, row("window", 64, 25.0, 0.5), row("h2o", 64, 30.0, 1.0)]
    records += answers("full", "full", 10) + answers("window", "64", 3) + answers("h2o", "64", 10)
    v = by_budget(records)[64]
    assert v.recommended is None and v.ppl_pick.name == "window"
    assert v.sentence.startswith("At budget 64 PPL and the tasks point at different policies: PPL alone would "
                                 "ship window")
    assert "the tasks cannot tell h2o from the full cache, though PPL separates them from window" in v.sentence


def test_a_run_of_tasks_alone_gets_a_verdict_per_budget():
    records = answers("full", "full", 10)
    records += answers("window", "50%", 9) + answers("h2o", "50%", 10) + answers("snapkv", "50%", 0)
    records += answers("window", "25%", 3) + answers("h2o", "25%", 3)
    found = by_budget(records)
    half, quarter = found["50%"], found["25%"]
    # 50%: window 9/10 and h2o 10/10 overlap full's interval; snapkv's whole [0, 0.2775] < 0.5: collapsed
    assert {c.name for c in half.tied} == {"window", "h2o"}
    assert [(c.name, why) for c, why in half.collapsed] == [("snapkv", "tasks 0% vs full 100%")]
    assert half.recommended.name == "window"  # the cheapest: no attention statistics
    assert half.sentence.startswith("At budget 50% ship window (tasks 9/10 [0.60, 0.98] vs full 10/10")
    assert "avoid snapkv (collapsed)" in half.sentence
    # 25%: both 3/10, [0.1078, 0.6032] below [0.7225, 1], neither collapsed (0.6032 >= 0.5)
    assert quarter.recommended is None and not quarter.collapsed
    assert quarter.sentence == ("At budget 25% every policy scored below the full cache on the tasks "
                                "(window, h2o): raise the budget before shipping any of them.")
    # the HTML section and the Markdown render the same sentence, computed once
    title, body = decision(records)
    assert title == "Verdict" and "At budget 50% ship window" in body
    assert half.sentence in run_markdown(records)


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
    v = by_budget(records)["50%"]
    assert v.protocol == "agnostic"
    assert {c.name: (c.task.hits, c.task.n) for c in v.candidates} == {"h2o": (9, 10), "snapkv": (0, 10)}
    assert v.partial == [("adakv:alpha=1:snapkv", 0, 10)]
    assert v.recommended.name == "h2o" and "adakv" not in v.sentence.partition("avoid")[0]
    assert ("not ranked on the tasks (fewer agnostic answers than the other policies at this budget; a run of the same "
            "tasks and samples fills them): adakv:alpha=1:snapkv 0/10") in run_markdown(records)


def test_a_policy_with_fewer_answers_is_named_with_its_count_not_ranked_on_other_answers():
    """tova added later with 5 of the 10 samples, all right: 5/5 must not outrank window's 9/10 on different
    answers; the others keep their 10."""
    records = answers("full", "full", 10) + answers("window", "50%", 9) + answers("tova", "50%", 5, n=5)
    v = by_budget(records)["50%"]
    assert [(c.name, c.task.n) for c in v.candidates] == [("window", 10)]
    assert v.partial == [("tova", 5, 10)] and v.recommended.name == "window"


def test_policies_that_answered_different_samples_are_not_ranked_against_each_other():
    records = answers("full", "full", 10) + answers("h2o", "50%", 5, n=5)
    records += [r for r in answers("tova", "50%", 0) if r.sample >= 5]  # samples 5-9 only
    [v] = verdict(records)
    assert not v.candidates and v.partial == [("h2o", 5, 10), ("tova", 5, 10)]
    assert v.sentence == ("At budget 50% no policy answered every agnostic answer the budget asks (h2o 5/10, tova "
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
    assert v.sentence == ("At budget 50% every task the run holds is beyond this model at its length (the full cache "
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
