"""The verdict at the top of the report, fed hand-made records: every branch checked against facts written by hand,
and its uncertainty against independent computations (Wilson's interval from its formula's published values,
paired differences built to be separated or tied by construction)."""

from __future__ import annotations

import math

import pytest

from kvevict.errors import KvevictError
from kvevict.records.schema import PplRecord, TaskRecord
from kvevict.records.store import ResultStore
from kvevict.report.html import render
from kvevict.report.sections import SECTIONS
from kvevict.report.verdict import verdict
from kvevict.report.verdict_text import HOW, markdown, sentence, unsound_text
from kvevict.stats.tolerance import Tolerance
from kvevict.stats.uncertainty import blocks, mean_interval, paired_difference, wilson

from support import cli

WINDOWS = 20  # blocks of 10 predictions each


def curve(ppl: float, wobble: float = 0.0, key: str = "ppl") -> list[dict]:
    """Per-window values whose weighted mean is `ppl`'s NLL (or the KL `ppl` with key "kl"); `wobble` alternates
    +/- around it, so two curves with different wobble signs differ per block but not on average."""
    centre = math.log(ppl) if key == "ppl" else ppl
    out = []
    for i in range(WINDOWS):
        value = centre + (wobble if i % 2 else -wobble)
        out.append({"start": 1 + 10 * i, "end": 10 * (i + 1), "n": 10,
                    key: math.exp(value) if key == "ppl" else value})
    return out


#: the full cache at PPL 20, its blocks flat: a row flat at PPL p has the paired PPL ratio p / 20 exactly
FULL = PplRecord("full|full|None", "full", "full", None, 20.0, label="full", curve=curve(20.0))
#: a tolerance wide enough for the hand-made rows at PPL 24-26 to be inside
WIDE = Tolerance(max_ppl_ratio=1.3)


def row(name: str, budget: int, ppl: float, kl: float | None, lost: int = 0, kind: str = "policy",
        wobble: float = 0.0, kl_wobble: float | None = None) -> PplRecord:
    """A policy row on a 2-layer x 2-head model; `lost` of its 4 (layer, head) pairs evicted token 0. Its curves
    are flat at its PPL and KL (plus `wobble`): rows with flat curves at different values are separated."""
    flat = [7] * lost + [-1] * (4 - lost)
    return PplRecord(f"{kind}|{name}|{budget}", kind, name, budget, ppl, label=name, kl_to_full=kl,
                     sink_lost_at=[flat[:2], flat[2:]], curve=curve(ppl, wobble),
                     kl_curve=None if kl is None else curve(kl, wobble if kl_wobble is None else kl_wobble, "kl"))


def needle(policy: str, budget: str, hits: list[int]) -> list[TaskRecord]:
    return [TaskRecord(f"needle|{policy}|{budget}|{i}", "needle", 0,
                       {"policy": policy, "budget": budget, "hit": h, "length": 100, "depth": 0.5, "trial": i})
            for i, h in enumerate(hits)]


def by_budget(records, tolerance: Tolerance | None = None) -> dict:
    return {v.budget: v for v in verdict(records, tolerance)}


def test_wilson_matches_the_published_values():
    # Wilson's 95% score interval, computed by hand from p=0.8, n=10, z=1.96: centre (0.8+0.192)/1.384
    low, high = wilson(8, 10).low, wilson(8, 10).high
    centre = (0.8 + 1.96**2 / 20) / (1 + 1.96**2 / 10)
    half = 1.96 * math.sqrt(0.8 * 0.2 / 10 + 1.96**2 / 400) / (1 + 1.96**2 / 10)
    assert (low, high) == pytest.approx((centre - half, centre + half), abs=1e-4)
    assert (low, high) == pytest.approx((0.490, 0.943), abs=1e-3)
    assert wilson(0, 5).low == 0.0 and wilson(5, 5).high == 1.0
    assert wilson(0, 0) is None


def test_a_wilson_interval_holds_its_rate_at_every_count():
    # 10/10 once gave a high end of 0.9999999999999999 (rounding), and the report's error bar below the
    # point made matplotlib refuse the figure: every interval must hold hits / n, ends included
    for n in range(1, 121):
        for hits in range(n + 1):
            interval = wilson(hits, n)
            assert interval.low <= hits / n <= interval.high, (hits, n)
    assert wilson(10, 10).high == 1.0 and wilson(0, 3).low == 0.0


def test_block_bootstrap_of_flat_and_paired_curves():
    flat = blocks(curve(30.0), "ppl")
    assert mean_interval(flat, exp=True).low == pytest.approx(30.0)
    assert mean_interval(flat, exp=True).high == pytest.approx(30.0)
    # a constant per-block offset is exactly that offset in every resample: separated
    gap = paired_difference(blocks(curve(33.0), "ppl"), flat)
    assert gap.low == pytest.approx(math.log(33 / 30)) and gap.high == pytest.approx(math.log(33 / 30))
    # the same mean with opposite wobbles: per block they differ, on average not; the interval straddles 0
    tied = paired_difference(blocks(curve(30.0, 0.2), "ppl"), blocks(curve(30.0, -0.2), "ppl"))
    assert tied.low < 0 < tied.high
    noisy = mean_interval(blocks(curve(30.0, 0.2), "ppl"), exp=True)
    assert noisy.low < 30.0 < noisy.high


def test_closest_is_lowest_kl_not_lowest_ppl():
    # snapkv has the lower PPL but the higher KL: the verdict ranks by KL; both inside a 30% tolerance (flat curves:
    # the paired PPL ratios are exactly 25/20 = 1.25 and 24/20 = 1.2), same cost, so the closest ships
    v = by_budget([FULL, row("h2o", 8, 25.0, 0.10), row("snapkv", 8, 24.0, 0.30)], WIDE)[8]
    assert v.closest.name == "h2o" and v.recommended.name == "h2o"
    assert [c.name for c in v.inside] == ["h2o", "snapkv"]
    assert [c.name for c in v.tied] == ["snapkv"]  # 25/24 and 24/25 both within 1.3
    assert v.collapsed == [] and v.lost_sink == []
    assert sentence(v) == ("At budget 8 ship h2o (KL 0.100 [0.100, 0.100], PPL 25.00 [25.00, 25.00] vs 20.00 full; "
                           "PPL: PPL ratio 1.250 [1.250, 1.250] ≤ 1.300): inside the tolerance; also inside: snapkv, "
                           "and it is the cheapest (no pinned slots, attention statistics).")


def test_not_told_apart_is_not_inside_the_default_tolerance():
    # the same rows at the default 5%: nothing is shown inside, the closest is named with its interval
    v = by_budget([FULL, row("h2o", 8, 25.0, 0.10), row("snapkv", 8, 24.0, 0.30)])[8]
    assert v.recommended is None and not v.inside
    assert sentence(v) == ("At budget 8 nothing is shown inside the tolerance; closest is h2o (PPL: PPL ratio 1.250 "
                           "[1.250, 1.250] > 1.050): raise the budget; avoid snapkv (outside the tolerance).")


def test_without_kl_the_closest_is_the_lowest_ppl():
    v = by_budget([FULL, row("h2o", 8, 25.0, None), row("snapkv", 8, 24.0, None)], WIDE)[8]
    assert v.closest.name == "snapkv" and v.recommended.name == "snapkv"
    assert sentence(v).startswith("At budget 8 ship snapkv (PPL 24.00 [24.00, 24.00] vs 20.00 full; PPL: PPL ratio "
                                  "1.200 [1.200, 1.200] ≤ 1.300)")


def test_the_cheapest_policy_inside_the_tolerance_is_recommended():
    # h2o is closest on the point estimates; all three lie inside 20%: the cheapest ships (no attention statistics
    # first, then the fewest pinned slots)
    records = [FULL, row("h2o", 8, 21.10, 0.050, wobble=0.04), row("sink8+window", 8, 21.16, 0.051, wobble=-0.04),
               row("sink1+window", 8, 21.20, 0.052, wobble=-0.04)]
    v = by_budget(records, Tolerance(max_ppl_ratio=1.2))[8]
    assert v.closest.name == "h2o"
    assert [c.name for c in v.inside] == ["h2o", "sink8+window", "sink1+window"]
    assert v.recommended.name == "sink1+window"
    assert sentence(v).startswith("At budget 8 ship sink1+window (KL 0.052")
    assert ("also inside: h2o, sink8+window, and it is the cheapest (1 pinned slot, no attention statistics)"
            in sentence(v))


def test_an_interval_that_straddles_the_limit_is_undecided_with_the_samples_that_would_decide_it():
    # PPL ratio 1.04 on the point estimate, but blocks alternating ±0.3 in NLL: the interval reaches past 1.05
    v = by_budget([FULL, row("h2o", 8, 20.8, 0.05, wobble=0.3)])[8]
    [h2o] = v.undecided
    [(label, j)] = h2o.judgements
    assert label == "PPL" and j.outcome == "undecided" and j.low < 1.05 < j.high and j.more_samples > 0
    assert v.recommended is None
    assert sentence(v).startswith("At budget 8 nothing is shown inside the tolerance yet; undecided: h2o (PPL: PPL "
                                  "ratio 1.040")
    assert f"about {j.more_samples} more blocks of tokens ({j.more_samples * 10:,} tokens) would decide its PPL" \
        in sentence(v)
    assert "ship" not in sentence(v)


def test_a_row_without_per_block_data_cannot_be_judged_inside():
    old = PplRecord("policy|h2o|8", "policy", "h2o", 8, 20.0, label="h2o", kl_to_full=0.0)  # no curve recorded
    v = by_budget([FULL, old])[8]
    assert v.recommended is None and v.undecided[0].missing == ("PPL",)
    assert "it has no paired PPL data to judge" in sentence(v)


def test_a_full_cache_worse_than_the_policies_is_no_reference_to_be_close_to():
    # SmolLM2 at 20,000 tokens: the full cache runs past its trained positions (PPL 79), the sinkless window
    # (36.8) and the sink-keeping one (21.5) are both far better: both inside, but only the best and those within the
    # tolerance of it are shipped (36.8 / 21.5 = 1.71)
    def full(ppl: float) -> PplRecord:
        return PplRecord("full|full|None", "full", "full", None, ppl, label="full", curve=curve(ppl))

    rows = [row("window", 8, 36.8, 1.672, kl_wobble=0.5), row("sink4+window", 8, 21.5, 1.572, kl_wobble=-0.5)]
    v = by_budget([full(79.1), *rows])[8]
    assert v.closest.name == "sink4+window" and v.recommended.name == "sink4+window"
    assert {c.name for c in v.inside} == {"window", "sink4+window"} and v.tied == []
    assert unsound_text(v.unsound) == ("ranked by PPL, not by closeness to the full cache, which is worse than "
                                       "every policy here (PPL 79.10 [79.10, 79.10]: a stream past the positions the "
                                       "model was trained on degrades the full cache itself)")
    assert unsound_text(v.unsound) in sentence(v)
    assert "lowest PPL (the full cache is worse)" in markdown([v])
    # only the policy whose PPL is below the full cache's beyond the noise is named
    v = by_budget([full(30.0), row("window", 8, 36.8, 1.672, kl_wobble=0.5), rows[1]])[8]
    assert "which is worse than sink4+window here (PPL 30.00" in unsound_text(v.unsound)
    # the same rows beside a full cache better than both: both outside 5%
    v = by_budget([full(20.0), *rows])[8]
    assert v.unsound is None and v.recommended is None


def test_collapse_needs_the_whole_paired_interval_at_twice_the_full_cache():
    records = [FULL, row("h2o", 8, 39.9, 0.2), row("window", 8, 40.0, 0.3), row("random", 8, 90.0, 0.9),
               # point estimate 2.05x, but the interval reaches below 2x: outside, not collapsed
               row("knorm", 8, 41.0, 0.35, wobble=0.3, kl_wobble=0.0)]
    v = by_budget(records)[8]
    assert [(c.name, why) for c, why in v.collapsed] == [("window", "PPL ratio [2.00, 2.00] ≥ 2"),
                                                         ("random", "PPL ratio [4.50, 4.50] ≥ 2")]
    assert [c.name for c in v.outside] == ["h2o", "window", "knorm", "random"]
    assert sentence(v).startswith("At budget 8 nothing is shown inside the tolerance; closest is h2o (PPL: PPL ratio "
                                  "1.995 [1.995, 1.995] > 1.050)")
    assert sentence(v).endswith("; avoid window (collapsed), knorm, random (collapsed) (outside the tolerance).")


def test_pass_key_trials_are_judged_paired_with_the_full_cache():
    # "h2o" is nearest by KL but finds the pass key in 0 of 20 trials where full finds 20 of 20. Bonett and Price's
    # adjusted Wald: p_lost = 21/22, p_won = 1/22, 0.909 ± 1.96 x 0.0888, so the drop is [0.74, 1.00] (clipped):
    # outside, and wholly past half of 100%
    records = [FULL, row("h2o", 8, 21.0, 0.01), row("snapkv", 8, 22.0, 0.05),
               *needle("full", "full", [1] * 20), *needle("h2o", "8", [0] * 20),
               *needle("snapkv", "8", [1] * 5 + [0] * 15)]
    v = by_budget(records, Tolerance(max_ppl_ratio=1.2))[8]
    assert [(c.name, why) for c, why in v.collapsed] == [
        ("h2o", "pass-key below half of the full cache's 100% (drop [0.74, 1.00])")]
    # snapkv lost 15 of 20: 16/22 - 1/22 = 0.682 ± 1.96 x 0.118, a drop of [0.45, 0.91]: outside, not past half
    assert [c.name for c in v.outside] == ["h2o", "snapkv"]
    # 1 of 4 against 4 of 4: 4/6 - 1/6 = 0.5 ± 1.96 x 0.312 -> drop [-0.11, 1.00]: undecided
    records = [FULL, row("h2o", 8, 21.0, 0.01), *needle("full", "full", [1] * 4), *needle("h2o", "8", [1, 0, 0, 0])]
    v = by_budget(records, Tolerance(max_ppl_ratio=1.2))[8]
    assert v.collapsed == [] and [c.name for c in v.undecided] == ["h2o"]
    assert "pass-key hits (95% Wilson interval): h2o 1/4 [0.05, 0.70]" in markdown([v])


def test_lost_sink_lists_every_policy_and_how_many_heads():
    v = by_budget([FULL, row("h2o", 8, 22.0, 0.05, lost=1), row("window", 8, 30.0, 0.4, lost=4),
                   row("snapkv", 8, 23.0, 0.08)], Tolerance(max_ppl_ratio=1.2))[8]
    assert [(c.name, c.heads_lost, c.heads) for c in v.lost_sink] == [("h2o", 1, 4), ("window", 4, 4)]
    assert sentence(v).startswith("At budget 8 ship h2o (KL 0.050")
    assert sentence(v).endswith("but it lost token 0 on 1 of 4 heads; the closest policy inside the tolerance that "
                                "kept it on every head is snapkv; avoid window (outside the tolerance).")
    # with no policy inside that kept token 0 everywhere, the advice is to pin sinks
    v = by_budget([FULL, row("h2o", 8, 22.0, 0.05, lost=1), row("window", 8, 30.0, 0.4, lost=4),
                   row("sink4+random", 8, 45.0, 0.9)], Tolerance(max_ppl_ratio=1.2))[8]
    assert sentence(v).endswith("but it lost token 0 on 1 of 4 heads: pin sinks (sinkN+h2o); "
                                "avoid window, sink4+random (collapsed) (outside the tolerance).")
    # a serving engine's preset refuses sink wrappers: the advice names the engine's own option instead
    v = by_budget([FULL, row("trtllm:sink=0", 8, 22.0, 0.05, lost=4), row("vllm-swa", 8, 22.0, 0.05, lost=4)],
                  Tolerance(max_ppl_ratio=1.2))[8]
    assert sentence(v).endswith("but it lost token 0 on 4 of 4 heads: keep sinks with the engine's own option "
                                "(the preset's keep or sink count, e.g. 4).")


def test_every_policy_outside_says_raise_the_budget():
    v = by_budget([FULL, row("window", 4, 80.0, 1.0, lost=4), row("random", 4, 95.0, 1.2, lost=4)])[4]
    assert sentence(v) == ("At budget 4 nothing is shown inside the tolerance; closest is window (PPL: PPL ratio 4.000 "
                           "[4.000, 4.000] > 1.050): raise the budget; avoid random (collapsed) (outside the "
                           "tolerance).")


def test_budget_with_only_the_oracle_has_no_verdict():
    oracle = PplRecord("oracle|oracle|8", "oracle", "oracle", 8, 21.0)
    assert verdict([FULL, oracle]) == []


def test_a_policy_the_report_cannot_read_is_an_error_not_pins_zero():
    foreign = PplRecord("policy|mine:x=1|8", "policy", "mine:x=1", 8, 21.0, kl_to_full=0.1)
    with pytest.raises(KvevictError, match="policy 'mine:x=1'.*kvevict.register"):
        verdict([FULL, foreign])


def test_one_verdict_per_budget_smallest_first_and_sink_rows_counted_once():
    records = [FULL, row("h2o", 16, 21.0, 0.02), row("window", 8, 25.0, 0.1),
               row("window", 8, 25.0, 0.1, kind="sinks")]
    found = verdict(records)
    assert [v.budget for v in found] == [8, 16]
    assert len(found[0].candidates) == 1


def test_verdict_tops_the_html_report_and_the_markdown(tmp_path):
    records = [FULL, row("window", 8, 50.0, 0.9, lost=4), row("sink4+window", 8, 22.0, 0.04)]
    assert SECTIONS[0].__name__ == "decision"
    page = render(records, {"name": "v", "tolerance": {"max_ppl_ratio": 1.2}},
                  tmp_path / "report.html").read_text()
    assert page.index("<h2>Verdict</h2>") < page.index("<h2>Streaming perplexity")
    assert page.count("<h2>Verdict</h2>") == 1
    assert "tolerance: perplexity within 20% of the full cache; task accuracy within 5 points" in page
    assert "At budget 8 ship sink4+window" in page and "How the verdict decides" in page
    text = markdown(verdict(records, Tolerance(max_ppl_ratio=1.2)))
    assert text.splitlines()[:5] == [
        "## Verdict", "", "Tolerance: perplexity within 20% of the full cache; task accuracy within 5 points.", "",
        "**Budget 8.** At budget 8 ship sink4+window (KL 0.040 [0.040, 0.040], PPL 22.00 [22.00, 22.00] vs 20.00 "
        "full; PPL: PPL ratio 1.100 [1.100, 1.100] ≤ 1.200): inside the tolerance; avoid window (collapsed) (outside "
        "the tolerance).",
    ]
    assert "- lost token 0: window on 4 of 4 heads" in text
    assert text.endswith(HOW)
    # `kvevict report --markdown` prints the verdict before the tables, judged by the options given
    folder = tmp_path / "run"
    folder.mkdir()
    ResultStore(folder / "results.jsonl").append([r.to_dict() for r in records])
    result = cli("report", str(folder), "--markdown")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("## Verdict\n")
    assert result.stdout.index("## Verdict") < result.stdout.index("| policy |")
    assert "At budget 8 nothing is shown inside the tolerance" in result.stdout  # the default 5%
    result = cli("report", str(folder), "--markdown", "--max-ppl-ratio", "1.2")
    assert result.exit_code == 0 and "At budget 8 ship sink4+window" in result.stdout


@pytest.mark.parametrize("option, value", [("--max-ppl-ratio", "1"), ("--max-ppl-ratio", "0.9"),
                                           ("--max-accuracy-drop", "1"), ("--max-accuracy-drop", "-0.1"),
                                           ("--max-kl", "0")])
def test_an_impossible_tolerance_is_one_line_and_exit_2(tmp_path, option, value):
    folder = tmp_path / "run"
    folder.mkdir()
    ResultStore(folder / "results.jsonl").append([FULL.to_dict()])
    result = cli("report", str(folder), option, value)
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {option} ")
    assert len(result.stderr.strip().splitlines()) == 1
