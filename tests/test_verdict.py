"""The verdict at the top of the report, fed hand-made records: every branch checked against facts written by hand."""

from __future__ import annotations

from kvevict.report.html import render
from kvevict.report.records import PplRecord, TaskRecord
from kvevict.report.sections import SECTIONS
from kvevict.report.store import ResultStore
from kvevict.report.verdict import markdown, verdict

from helpers import cli

FULL = PplRecord("full|full|None", "full", "full", None, 20.0, label="full")


def row(name: str, budget: int, ppl: float, kl: float | None, lost: int = 0, kind: str = "policy") -> PplRecord:
    """A policy row on a 2-layer x 2-head model; `lost` of its 4 (layer, head) pairs evicted token 0."""
    flat = [7] * lost + [-1] * (4 - lost)
    return PplRecord(f"{kind}|{name}|{budget}", kind, name, budget, ppl, label=name, kl_to_full=kl,
                     sink_lost_at=[flat[:2], flat[2:]])


def needle(policy: str, budget: str, hits: list[int]) -> list[TaskRecord]:
    return [TaskRecord(f"needle|{policy}|{budget}|{i}", "needle", 0,
                       {"policy": policy, "budget": budget, "hit": h, "length": 100, "depth": 0.5, "trial": i})
            for i, h in enumerate(hits)]


def by_budget(records) -> dict:
    return {v.budget: v for v in verdict(records)}


def test_closest_is_lowest_kl_not_lowest_ppl():
    # b has the lower PPL but the higher KL: the verdict ranks by KL and shows PPL beside it
    v = by_budget([FULL, row("a", 8, 25.0, 0.10), row("b", 8, 24.0, 0.30)])[8]
    assert v.closest.name == "a"
    assert v.collapsed == [] and v.lost_sink == []
    assert v.sentence == "At budget 8 ship a (KL 0.100, PPL 25.00 vs 20.00 full)."


def test_without_kl_the_closest_is_the_lowest_ppl():
    v = by_budget([FULL, row("a", 8, 25.0, None), row("b", 8, 24.0, None)])[8]
    assert v.closest.name == "b"
    assert v.sentence == "At budget 8 ship b (PPL 24.00 vs 20.00 full)."


def test_collapse_by_ppl_starts_at_twice_the_full_cache():
    v = by_budget([FULL, row("ok", 8, 39.9, 0.2), row("edge", 8, 40.0, 0.3), row("bad", 8, 90.0, 0.9)])[8]
    assert [(c.name, why) for c, why in v.collapsed] == [("edge", "PPL 2.0× full"), ("bad", "PPL 4.5× full")]
    assert v.sentence == "At budget 8 ship ok (KL 0.200, PPL 39.90 vs 20.00 full); avoid bad, edge (collapsed)."


def test_collapse_by_needle_below_half_of_full_and_the_next_safe_policy_is_recommended():
    # "close" is nearest by KL but finds the pass key in 1 of 4 trials where full finds 4 of 4
    records = [FULL, row("close", 8, 21.0, 0.01), row("far", 8, 22.0, 0.05),
               *needle("full", "full", [1, 1, 1, 1]), *needle("close", "8", [1, 0, 0, 0]),
               *needle("far", "8", [1, 1, 0, 0])]  # exactly half: not collapsed
    v = by_budget(records)[8]
    assert v.closest.name == "close"
    assert [(c.name, why) for c, why in v.collapsed] == [("close", "pass-key 25% vs full 100%")]
    assert v.sentence.startswith("At budget 8 ship far (KL 0.050")
    assert v.sentence.endswith("; avoid close (collapsed).")


def test_lost_sink_lists_every_policy_and_how_many_heads():
    v = by_budget([FULL, row("h2o", 8, 22.0, 0.05, lost=1), row("window", 8, 30.0, 0.4, lost=4),
                   row("sink4+window", 8, 23.0, 0.08)])[8]
    assert [(c.name, c.heads_lost, c.heads) for c in v.lost_sink] == [("h2o", 1, 4), ("window", 4, 4)]
    assert v.sentence == ("At budget 8 ship h2o (KL 0.050, PPL 22.00 vs 20.00 full), but it lost token 0 on 1 of 4 "
                          "heads; the closest policy that kept it on every head is sink4+window (KL 0.080, PPL 23.00).")
    # with no policy that kept token 0 everywhere (a collapsed one does not count), the advice is to pin sinks
    v = by_budget([FULL, row("h2o", 8, 22.0, 0.05, lost=1), row("window", 8, 30.0, 0.4, lost=4),
                   row("sink4+random", 8, 45.0, 0.9)])[8]
    assert v.sentence == ("At budget 8 ship h2o (KL 0.050, PPL 22.00 vs 20.00 full), but it lost token 0 on 1 of 4 "
                          "heads: pin sinks (sinkN+h2o); avoid sink4+random (collapsed).")


def test_every_policy_collapsed_says_raise_the_budget():
    v = by_budget([FULL, row("window", 4, 80.0, 1.0, lost=4), row("random", 4, 95.0, 1.2, lost=4)])[4]
    assert v.sentence == ("At budget 4 every policy collapsed (window, random): raise the budget before shipping "
                          "any of them.")


def test_budget_with_only_the_oracle_has_nothing_to_recommend():
    oracle = PplRecord("oracle|oracle|8", "oracle", "oracle", 8, 21.0)
    v = by_budget([FULL, oracle])[8]
    assert v.closest is None
    assert v.sentence == "At budget 8 the run holds no policy rows: nothing to recommend."


def test_one_verdict_per_budget_smallest_first_and_sink_rows_counted_once():
    records = [FULL, row("b", 16, 21.0, 0.02), row("a", 8, 25.0, 0.1),
               row("a", 8, 25.0, 0.1, kind="sinks")]
    found = verdict(records)
    assert [v.budget for v in found] == [8, 16]
    assert len(found[0].candidates) == 1


def test_verdict_tops_the_html_report_and_the_markdown(tmp_path):
    records = [FULL, row("window", 8, 50.0, 0.9, lost=4), row("sink4+window", 8, 22.0, 0.04)]
    assert SECTIONS[0].__name__ == "decision"
    page = render(records, {"name": "v"}, tmp_path / "report.html").read_text()
    assert page.index("<h2>Verdict</h2>") < page.index("<h2>Streaming perplexity")
    assert "At budget 8 ship sink4+window" in page
    text = markdown(verdict(records))
    assert text.splitlines()[:3] == [
        "## Verdict", "",
        "**Budget 8.** At budget 8 ship sink4+window (KL 0.040, PPL 22.00 vs 20.00 full); avoid window (collapsed).",
    ]
    assert "- lost token 0: window on 4 of 4 heads" in text
    # `kvevict report --markdown` prints the verdict before the tables
    folder = tmp_path / "run"
    folder.mkdir()
    ResultStore(folder / "results.jsonl").append([r.to_dict() for r in records])
    result = cli("report", str(folder), "--markdown")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("## Verdict\n")
    assert result.stdout.index("## Verdict") < result.stdout.index("| policy |")
