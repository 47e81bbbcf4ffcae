"""`--min-accuracy-ratio` through the commands and the verdict: bad input as one line, the verdict judged by the
ratio on hand-made answers, and `kvevict envelope --tasks` on a tiny model with its records resumed."""

from __future__ import annotations

import json

import pytest

from kvevict.report.verdict import verdict
from kvevict.stats.tolerance import Tolerance
from test_verdict_tasks import answers

from support import cli, cli_error


# each case also holds a later mistake (no samples, `--policies full`, a bad budget), so that without the check
# under test the command stops at once on that one rather than running a model
@pytest.mark.parametrize("args, needle", [
    (["ruler", "--min-accuracy-ratio", "1.2", "--samples", "0"],
     "--min-accuracy-ratio is policy accuracy over full accuracy in (0, 1]"),
    (["ab", "--min-accuracy-ratio", "0", "--budgets", "x"], "got 0"),
    (["ruler", "--min-accuracy-ratio", "0.9", "--max-accuracy-drop", "0.05", "--samples", "0"],
     "two accuracy rules, one at a time"),
    (["envelope", "--tasks", "niah_single_1", "--policies", "full", "--min-accuracy-ratio", "0.95",
      "--samples-start", "10", "--samples-max", "30"],
     "raise --samples-max to at least 70"),
    (["envelope", "--tasks", "niah_single_1", "--min-accuracy-ratio", "0.9", "--max-accuracy-drop", "0.1",
      "--samples-start", "0"], "two accuracy rules"),
])
def test_bad_ratio_input_is_one_line(tmp_path, args, needle):
    cli_error(*args, "--out", str(tmp_path), needles=(needle,))


def test_the_verdict_judges_tasks_by_the_ratio():
    """40 prompts, the full cache right on all: h2o right on all 40 is inside 0.9 (40 agreeing answers bound the
    ratio from 0.95 at 95%, statpsych's formula by hand: n = 19 is the least for 0.9); window right on 10 has the
    ratio 0.25 with its interval wholly below half: collapsed. Under a 5-point drop instead, the same h2o is
    inside too, and window is outside."""
    records = answers("full", "full", 40, n=40) + answers("h2o", "50%", 40, n=40) + answers("window", "50%", 10, n=40)
    [found] = verdict(records, Tolerance(min_accuracy_ratio=0.9))
    assert found.recommended.name == "h2o"
    judged = dict(next(c for c in found.candidates if c.name == "h2o").judgements)["tasks"]
    assert judged.metric == "accuracy-ratio" and judged.text().startswith("accuracy ratio 1.00 [")
    assert [c.name for c, _ in found.collapsed] == ["window"]


def test_envelope_tasks_on_a_tiny_model_under_the_ratio_resumes(tmp_path, tiny_dir):
    """The real grid runner under `--min-accuracy-ratio 0.5` (4 samples: 4 agreeing answers bound the ratio from
    0.57 at the Bonferroni-corrected 97.5%): the table heads the ratio, run.json keeps the rule, and a rerun
    answers nothing new."""
    args = ["envelope", "--model", str(tiny_dir), "--tasks", "niah_single_1", "--lengths", "400", "--policies",
            "window", "--floor", "16", "--resolution", "2", "--samples-start", "2", "--samples-max", "4",
            "--min-accuracy-ratio", "0.5", "--max-new-tokens", "4", "--out", str(tmp_path / "runs"), "--name", "t"]
    result = cli(*args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.stderr
    folder = tmp_path / "runs" / "t"
    assert json.loads((folder / "run.json").read_text())["config"]["min_accuracy_ratio"] == 0.5
    before = (folder / "results.jsonl").read_text()
    again = cli(*args, env={"COLUMNS": "200"})
    assert again.exit_code == 0 and (folder / "results.jsonl").read_text() == before
    assert "at least 50% of the full cache's" in again.stdout
